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

    assert_eq!(hello, hex("42 42 4c 4b 03 00 01 00 20 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f"));
    assert_eq!(challenge, hex("42 42 4c 4b 03 00 02 00 2f 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 20 21 22 23 24 25 26 27 28 29 2a 2b 2c 2d 2e 2f 30 31 32 33 34 35 36 37 38 39 3a 3b 3c 3d 3e 3f 08 00 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(th2.to_vec(), hex("af 0b 1f 7b f2 57 06 14 0a ac ce 65 01 7c df b1 27 78 b4 1b 62 65 4d e8 a3 d5 38 43 b1 a5 c9 82"));
    assert_eq!(mac_h.to_vec(), hex("e5 04 1c 3c 58 b8 64 dc 51 21 2b cb 5a 8c 37 de 86 b0 09 96 ad f4 f1 8e 15 d4 34 31 2b dc 16 47"));
    assert_eq!(auth_frame, hex("42 42 4c 4b 03 00 03 00 4a 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 e5 04 1c 3c 58 b8 64 dc 51 21 2b cb 5a 8c 37 de 86 b0 09 96 ad f4 f1 8e 15 d4 34 31 2b dc 16 47 aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa 40 28 40 80 28 00 80 20 80 04"));
    assert_eq!(th3.to_vec(), hex("f8 27 5d 31 8a b9 ae cd 50 c7 b7 20 c1 a3 38 ec 09 a8 15 90 cd a7 54 09 89 02 d9 31 5b d9 59 73"));
    assert_eq!(mac_w.to_vec(), hex("e0 1d 3d 7b 25 fc 6d fa 2c 95 30 85 b8 73 f8 0a 22 8b b7 7d d7 e5 b1 a8 df 4b 99 6d a3 72 49 0b"));
    assert_eq!(welcome, hex("42 42 4c 4b 03 00 04 00 37 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 e0 1d 3d 7b 25 fc 6d fa 2c 95 30 85 b8 73 f8 0a 22 8b b7 7d d7 e5 b1 a8 df 4b 99 6d a3 72 49 0b ef 9b af cd f8 ac d1 91 01 08 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(t.hash().to_vec(), hex("f3 7a 19 15 8b 50 01 4f fc b6 4d f8 c6 64 ac e1 f5 93 db 9f 50 ac 40 45 01 b3 b3 b9 a0 92 66 36"));

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
    assert_eq!(out, hex("42 42 4c 4b 03 00 06 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | 63 25 b5 fc | b9 f9 40 e9 3f e3 83 32 82 ed 1f b6 55 df 5d 17"));
    encode_frame(
        &mut out,
        Kind::Pong,
        &[],
        b"ping",
        session,
        Some(&mut worker.send),
    )
    .unwrap();
    assert_eq!(out, hex("42 42 4c 4b 03 00 07 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | de fa 4b bc | 59 14 c8 55 d6 0d 63 8e a4 9f 22 76 e5 e6 7b d2"));
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
    assert_eq!(out, hex("42 42 4c 4b 03 00 0c 00 03 00 00 00 00 00 00 00 ef cd ab 89 67 45 23 01 | cc 53 51 | 1b 6e d5 2b 92 e1 d0 58 b8 7e 66 b6 e3 ec 3d 23"));
}
