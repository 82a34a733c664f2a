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

    assert_eq!(hello, hex("42 42 4c 4b 06 00 01 00 20 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f"));
    assert_eq!(challenge, hex("42 42 4c 4b 06 00 02 00 2f 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 20 21 22 23 24 25 26 27 28 29 2a 2b 2c 2d 2e 2f 30 31 32 33 34 35 36 37 38 39 3a 3b 3c 3d 3e 3f 08 00 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(th2.to_vec(), hex("2a 93 3f 78 7f 54 9c 04 3c c6 9e e0 10 c2 e1 bc 98 0f f4 33 ae 45 3d ed c0 b0 4c 88 ea 23 d5 96"));
    assert_eq!(mac_h.to_vec(), hex("81 4a 21 f7 13 50 4f 71 2b b5 fd 82 e6 11 c0 de 5a d6 a0 b4 28 4f a8 17 a8 1b 61 8f da 56 a6 6f"));
    assert_eq!(auth_frame, hex("42 42 4c 4b 06 00 03 00 4b 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 81 4a 21 f7 13 50 4f 71 2b b5 fd 82 e6 11 c0 de 5a d6 a0 b4 28 4f a8 17 a8 1b 61 8f da 56 a6 6f aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa 40 28 40 80 28 00 80 20 80 04 00"));
    assert_eq!(th3.to_vec(), hex("9a cf 0e ed 7f 91 20 48 c5 7b 21 4e 44 d9 c1 89 4e 27 f8 c9 16 74 8f da 9f 9b 24 dc 5e b4 f6 14"));
    assert_eq!(mac_w.to_vec(), hex("dc 46 ab 70 4d 37 b3 a8 ee 1d 50 b6 40 37 ff a8 3a 92 2c 15 13 98 fc 82 3e 99 99 b1 68 0f 99 9a"));
    assert_eq!(welcome, hex("42 42 4c 4b 06 00 04 00 37 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 dc 46 ab 70 4d 37 b3 a8 ee 1d 50 b6 40 37 ff a8 3a 92 2c 15 13 98 fc 82 3e 99 99 b1 68 0f 99 9a ef 9b af cd f8 ac d1 91 01 08 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(t.hash().to_vec(), hex("e5 7e da 3b ea a7 a0 a3 b9 19 c1 95 54 bc 53 a9 00 e5 b8 ca c4 18 27 c1 73 69 3d 70 46 01 54 ac"));

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
    assert_eq!(out, hex("42 42 4c 4b 06 00 06 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | b7 95 b0 1e | e0 9b 8d 47 e9 5d 97 98 a3 75 9d 8e bc ae 03 b9"));
    encode_frame(
        &mut out,
        Kind::Pong,
        &[],
        b"ping",
        session,
        Some(&mut worker.send),
    )
    .unwrap();
    assert_eq!(out, hex("42 42 4c 4b 06 00 07 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | 97 6c 88 fd | fa 06 b6 fb 51 5a 58 34 35 18 37 8a cc 8e 55 14"));
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
    assert_eq!(out, hex("42 42 4c 4b 06 00 0c 00 03 00 00 00 00 00 00 00 ef cd ab 89 67 45 23 01 | e4 bc 4a | 97 53 1a cc 6c 4d 0a 83 b3 ee c9 fa 48 fd 64 0c"));
}
