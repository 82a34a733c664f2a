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

    assert_eq!(hello, hex("42 42 4c 4b 08 00 01 00 20 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f"));
    assert_eq!(challenge, hex("42 42 4c 4b 08 00 02 00 2f 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 20 21 22 23 24 25 26 27 28 29 2a 2b 2c 2d 2e 2f 30 31 32 33 34 35 36 37 38 39 3a 3b 3c 3d 3e 3f 08 00 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(th2.to_vec(), hex("e9 2b fc 68 e6 57 4f 9d 8b fb 8f 53 f9 f8 f9 fd 27 5f c6 23 0a 18 54 59 61 ae 16 c4 f7 aa db 5b"));
    assert_eq!(mac_h.to_vec(), hex("dc 23 52 c4 9c e6 d3 b1 32 40 85 46 6d d3 93 15 5b 6b d8 1e c4 25 b7 8d 4a fb 5b e2 b5 97 d6 7d"));
    assert_eq!(auth_frame, hex("42 42 4c 4b 08 00 03 00 4c 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 dc 23 52 c4 9c e6 d3 b1 32 40 85 46 6d d3 93 15 5b 6b d8 1e c4 25 b7 8d 4a fb 5b e2 b5 97 d6 7d aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa 40 28 40 80 28 00 80 20 80 04 00 00"));
    assert_eq!(th3.to_vec(), hex("56 eb a5 e8 fd 2a de 6b ce fe 20 80 ef cd b5 7b 4c cf 69 5a e6 8c 37 c7 e9 30 61 33 d8 10 58 fd"));
    assert_eq!(mac_w.to_vec(), hex("20 e9 5d ec 07 83 2f b0 2c 08 67 32 a4 f7 02 b8 5a d5 6f 34 e5 02 87 a5 4a 75 9a 67 3f bf 5f a3"));
    assert_eq!(welcome, hex("42 42 4c 4b 08 00 04 00 37 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 20 e9 5d ec 07 83 2f b0 2c 08 67 32 a4 f7 02 b8 5a d5 6f 34 e5 02 87 a5 4a 75 9a 67 3f bf 5f a3 ef 9b af cd f8 ac d1 91 01 08 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(t.hash().to_vec(), hex("c8 2a 4e dd 1a 20 a4 e0 12 7a 53 8c a2 41 9f ea 87 fd d2 0f 15 a1 16 cf 1e 41 c3 1e d4 e3 3f fd"));

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
    assert_eq!(out, hex("42 42 4c 4b 08 00 06 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | 59 5e cc 0a | 88 4d 6d ba ff d3 bc 9d 43 aa 12 d9 8f ba 39 bf"));
    encode_frame(
        &mut out,
        Kind::Pong,
        &[],
        b"ping",
        session,
        Some(&mut worker.send),
    )
    .unwrap();
    assert_eq!(out, hex("42 42 4c 4b 08 00 07 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | 59 bd fc 9b | 6c 2f 86 30 26 0b e7 ef 08 6b 46 c0 a7 af a6 63"));
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
    assert_eq!(out, hex("42 42 4c 4b 08 00 0c 00 03 00 00 00 00 00 00 00 ef cd ab 89 67 45 23 01 | 4a a3 5b | 46 5f 05 f2 27 f9 6c ce 65 c9 66 4c 59 a7 16 c7"));
}
