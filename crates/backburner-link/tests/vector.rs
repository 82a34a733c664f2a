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

    assert_eq!(hello, hex("42 42 4c 4b 02 00 01 00 20 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f"));
    assert_eq!(challenge, hex("42 42 4c 4b 02 00 02 00 2f 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 20 21 22 23 24 25 26 27 28 29 2a 2b 2c 2d 2e 2f 30 31 32 33 34 35 36 37 38 39 3a 3b 3c 3d 3e 3f 08 00 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(th2.to_vec(), hex("8c 97 f4 2a 4c 04 13 d2 71 2a 61 d2 7a 71 d9 81 23 7b c1 fd 68 17 ec 61 44 c9 b8 c6 88 d3 55 d9"));
    assert_eq!(mac_h.to_vec(), hex("73 fd a2 24 55 ac 1c df c1 79 6f bf 04 0f d8 c0 a8 8b 51 42 a5 08 cc 8c 7f 8c 43 6e cc e5 45 da"));
    assert_eq!(auth_frame, hex("42 42 4c 4b 02 00 03 00 4a 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 73 fd a2 24 55 ac 1c df c1 79 6f bf 04 0f d8 c0 a8 8b 51 42 a5 08 cc 8c 7f 8c 43 6e cc e5 45 da aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa 40 28 40 80 28 00 80 20 80 04"));
    assert_eq!(th3.to_vec(), hex("09 c6 29 ee f1 a9 3d da e6 9e f3 3e fd 99 a5 6f b1 6d e7 55 a4 23 1d 44 bd cc d7 d3 d6 18 73 53"));
    assert_eq!(mac_w.to_vec(), hex("66 f2 95 ac 12 7a 5f 72 a6 72 e6 48 cb 09 ea 99 bb 5c b9 07 f5 61 dd c5 13 ed 66 bf 7e f1 68 99"));
    assert_eq!(welcome, hex("42 42 4c 4b 02 00 04 00 37 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 66 f2 95 ac 12 7a 5f 72 a6 72 e6 48 cb 09 ea 99 bb 5c b9 07 f5 61 dd c5 13 ed 66 bf 7e f1 68 99 ef 9b af cd f8 ac d1 91 01 08 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(t.hash().to_vec(), hex("ef 10 8f 7b 0d 49 4b bb 2f d2 2b c0 aa 1e 25 8a 83 56 0e b9 3b ea 14 e5 8d 34 29 5a 81 23 73 cf"));

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
    assert_eq!(out, hex("42 42 4c 4b 02 00 06 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | 1d 04 55 63 | c3 b1 54 ef 2e de c9 f5 22 94 21 b6 e8 26 0a f5"));
    encode_frame(
        &mut out,
        Kind::Pong,
        &[],
        b"ping",
        session,
        Some(&mut worker.send),
    )
    .unwrap();
    assert_eq!(out, hex("42 42 4c 4b 02 00 07 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | bc 2e 97 08 | f7 90 e4 12 1a e0 8e 62 b1 56 f0 8e a6 94 f0 6d"));
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
    assert_eq!(out, hex("42 42 4c 4b 02 00 0c 00 03 00 00 00 00 00 00 00 ef cd ab 89 67 45 23 01 | 67 be d9 | 4e 9f 8a 39 07 65 03 73 bb f4 5b f7 22 bb 03 9a"));
}
