//! The test vector of docs/PROTOCOL.md §10, rebuilt from the crate's own pieces (control encoding, headers, the
//! transcript, the MACs, the key schedule and the frame sealer): the specification and the code agree byte for byte.

use backburner_link::auth;
use backburner_link::codec::{encode_control, encode_frame};
use backburner_link::crypto::{derive, Role, Transcript};
use backburner_link::frame::{Header, Kind};
use backburner_link::message::{
    Auth, Challenge, Fetch, Hello, SessionParams, Welcome, WorkerLimits,
};
use backburner_link::WireKvDtype;

fn hex(s: &str) -> Vec<u8> {
    s.split_whitespace()
        .filter(|t| *t != "|")
        .map(|t| u8::from_str_radix(t, 16).unwrap())
        .collect()
}

/// Header ‖ control of a handshake frame, absorbed into the transcript.
fn handshake_frame(t: &mut Transcript, kind: Kind, control: &[u8]) -> Vec<u8> {
    let h = Header {
        kind,
        control_len: control.len() as u32,
        tensor_len: 0,
        session: 0,
    }
    .encode();
    t.absorb(&h, control);
    [&h[..], control].concat()
}

#[test]
fn the_documented_handshake_and_sealed_frames() {
    let secret = b"s3cret";
    let host_nonce: [u8; 32] = std::array::from_fn(|i| i as u8);
    let worker_nonce: [u8; 32] = std::array::from_fn(|i| 0x20 + i as u8);
    let limits = WorkerLimits {
        max_ubatch: 4096,
        max_frame: 1 << 30,
        max_memory: 1 << 35,
    };
    let params = SessionParams {
        fingerprint: [0xaa; 32],
        n_layers: 64,
        layer_start: 40,
        layer_end: 64,
        hidden: 5120,
        kv_dtype: WireKvDtype::F16,
        kv_page_size: 4096,
        ubatch: 512,
        layer_split: false,
        experts: Vec::new(),
    };
    let session = 0x0123_4567_89ab_cdefu64;
    let mut t = Transcript::default();
    let hello = handshake_frame(
        &mut t,
        Kind::Hello,
        &encode_control(&Hello { host_nonce }).unwrap(),
    );
    let ch = Challenge {
        worker_nonce,
        threads: 8,
        layers: None,
        limits,
    };
    let challenge = handshake_frame(&mut t, Kind::Challenge, &encode_control(&ch).unwrap());
    let th2 = t.hash();
    let mac_h = auth::mac(
        secret,
        b"bb2-host",
        &[&th2, &encode_control(&params).unwrap()],
    );
    let auth_frame = handshake_frame(
        &mut t,
        Kind::Auth,
        &encode_control(&Auth { mac: mac_h, params }).unwrap(),
    );
    let th3 = t.hash();
    let ints = [
        &session.to_le_bytes()[..],
        &8u32.to_le_bytes(),
        &limits.max_ubatch.to_le_bytes(),
        &limits.max_frame.to_le_bytes(),
        &limits.max_memory.to_le_bytes(),
    ]
    .concat();
    let mac_w = auth::mac(secret, b"bb2-worker", &[&th3, &ints]);
    let w = Welcome {
        mac: mac_w,
        session,
        threads: 8,
        limits,
    };
    let welcome = handshake_frame(&mut t, Kind::Welcome, &encode_control(&w).unwrap());

    assert_eq!(hello, hex("42 42 4c 4b 07 00 01 00 20 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f"));
    assert_eq!(challenge, hex("42 42 4c 4b 07 00 02 00 2f 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 20 21 22 23 24 25 26 27 28 29 2a 2b 2c 2d 2e 2f 30 31 32 33 34 35 36 37 38 39 3a 3b 3c 3d 3e 3f 08 00 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(th2.to_vec(), hex("06 fa a5 eb 61 cb 2e 5c 65 37 52 9d 4a 97 e6 dd 97 1d 25 f2 dc 93 d0 fc 35 4f 1c 93 d7 b1 1e 9f"));
    assert_eq!(mac_h.to_vec(), hex("82 46 5a 19 60 ce ce 91 00 ab 42 56 53 e0 d1 81 6a 42 3f 24 f4 92 dc 18 40 b3 dc b2 7a ac a4 0d"));
    assert_eq!(auth_frame, hex("42 42 4c 4b 07 00 03 00 4c 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 82 46 5a 19 60 ce ce 91 00 ab 42 56 53 e0 d1 81 6a 42 3f 24 f4 92 dc 18 40 b3 dc b2 7a ac a4 0d aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa 40 28 40 80 28 00 80 20 80 04 00 00"));
    assert_eq!(th3.to_vec(), hex("e6 be 3a 06 5f bc ec 79 41 b5 c8 7b 40 37 03 96 40 5e 45 c4 01 8d 75 57 c0 29 b1 27 82 6d 7a fd"));
    assert_eq!(mac_w.to_vec(), hex("26 e4 b2 ad 40 59 7b 61 e5 54 96 83 a2 be 05 96 90 5b bc ed ef bb bf ed 1a 38 fa a6 e2 95 1b d3"));
    assert_eq!(welcome, hex("42 42 4c 4b 07 00 04 00 37 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 26 e4 b2 ad 40 59 7b 61 e5 54 96 83 a2 be 05 96 90 5b bc ed ef bb bf ed 1a 38 fa a6 e2 95 1b d3 ef 9b af cd f8 ac d1 91 01 08 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(t.hash().to_vec(), hex("89 7e d9 94 aa f0 f4 fa f8 2a db 49 71 3b 1d 6b 5c 7e 5d 77 86 20 cc e0 0f 6b cb 6c 3f 21 0f bb"));

    let th4 = t.hash();
    let mut host = derive(secret, &th4, Role::Host);
    let mut worker = derive(secret, &th4, Role::Worker);
    let mut out = Vec::new();
    encode_frame(
        &mut out,
        Kind::Ping,
        &[],
        b"ping",
        session,
        Some(&mut host.send),
    )
    .unwrap();
    assert_eq!(out, hex("42 42 4c 4b 07 00 06 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | e9 cf 1d 67 | 15 2b 2a b1 b1 be 0e 7c c6 23 86 c1 99 94 04 68"));
    encode_frame(
        &mut out,
        Kind::Pong,
        &[],
        b"ping",
        session,
        Some(&mut worker.send),
    )
    .unwrap();
    assert_eq!(out, hex("42 42 4c 4b 07 00 07 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | 5a b8 c6 5c | e9 75 ce d9 70 4f fc 28 78 bb 62 90 7c 66 53 d3"));
    let fetch = encode_control(&Fetch {
        from_pos: 0,
        to_pos: 3,
        linear: true,
    })
    .unwrap();
    assert_eq!(fetch, [0, 3, 1]);
    encode_frame(
        &mut out,
        Kind::Fetch,
        &fetch,
        &[],
        session,
        Some(&mut host.send),
    )
    .unwrap();
    assert_eq!(out, hex("42 42 4c 4b 07 00 0c 00 03 00 00 00 00 00 00 00 ef cd ab 89 67 45 23 01 | f2 ab 4d | 33 21 77 62 28 86 70 69 2a ee e4 79 65 83 7e 0e"));
}
