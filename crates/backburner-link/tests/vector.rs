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

    assert_eq!(hello, hex("42 42 4c 4b 04 00 01 00 20 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f"));
    assert_eq!(challenge, hex("42 42 4c 4b 04 00 02 00 2f 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 20 21 22 23 24 25 26 27 28 29 2a 2b 2c 2d 2e 2f 30 31 32 33 34 35 36 37 38 39 3a 3b 3c 3d 3e 3f 08 00 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(th2.to_vec(), hex("f9 e3 8d 46 96 cb 31 7a bf 4c a4 a6 76 96 7b 1f 2d 69 e8 8b 51 5a 30 a2 83 0b f2 62 4a bf af a9"));
    assert_eq!(mac_h.to_vec(), hex("b7 95 24 d1 c7 ad f4 24 0f 9a fb 61 db a1 4a 22 c2 b6 09 51 85 38 55 a5 59 25 fe b4 86 f0 b7 bb"));
    assert_eq!(auth_frame, hex("42 42 4c 4b 04 00 03 00 4b 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 b7 95 24 d1 c7 ad f4 24 0f 9a fb 61 db a1 4a 22 c2 b6 09 51 85 38 55 a5 59 25 fe b4 86 f0 b7 bb aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa 40 28 40 80 28 00 80 20 80 04 00"));
    assert_eq!(th3.to_vec(), hex("1b de 7d b9 05 b6 dd 35 24 5c cb ff 64 ac d9 46 8a 56 d4 7f a1 4f d9 11 94 c6 fb 26 55 8a af 3e"));
    assert_eq!(mac_w.to_vec(), hex("fe e2 c7 65 fd 33 f0 39 05 87 69 3d fa 0e dd f7 3b c3 25 6e e6 cc fd 25 01 f0 18 d2 12 0c 90 ea"));
    assert_eq!(welcome, hex("42 42 4c 4b 04 00 04 00 37 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 fe e2 c7 65 fd 33 f0 39 05 87 69 3d fa 0e dd f7 3b c3 25 6e e6 cc fd 25 01 f0 18 d2 12 0c 90 ea ef 9b af cd f8 ac d1 91 01 08 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(t.hash().to_vec(), hex("73 89 c0 f2 04 9e 74 c4 a8 72 72 09 6a 8d e0 42 a2 8e 6d b9 09 f9 22 a5 0a 61 cd 1e ea bf 0d 78"));

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
    assert_eq!(out, hex("42 42 4c 4b 04 00 06 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | 13 84 52 3f | 15 9f 4d 29 d7 ef 10 c9 f2 20 f5 4d 9d d8 2a 4f"));
    encode_frame(
        &mut out,
        Kind::Pong,
        &[],
        b"ping",
        session,
        Some(&mut worker.send),
    )
    .unwrap();
    assert_eq!(out, hex("42 42 4c 4b 04 00 07 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | 15 d0 df c8 | 25 de 38 38 64 1b ad 2e 52 fb 98 9e ab 26 4f 71"));
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
    assert_eq!(out, hex("42 42 4c 4b 04 00 0c 00 03 00 00 00 00 00 00 00 ef cd ab 89 67 45 23 01 | 96 af ef | 48 b4 4c 2d fe 56 2d c8 6d d0 a9 b7 d6 85 cd 36"));
}
