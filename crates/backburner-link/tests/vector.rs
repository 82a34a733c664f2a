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

    assert_eq!(hello, hex("42 42 4c 4b 05 00 01 00 20 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 01 02 03 04 05 06 07 08 09 0a 0b 0c 0d 0e 0f 10 11 12 13 14 15 16 17 18 19 1a 1b 1c 1d 1e 1f"));
    assert_eq!(challenge, hex("42 42 4c 4b 05 00 02 00 2f 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 20 21 22 23 24 25 26 27 28 29 2a 2b 2c 2d 2e 2f 30 31 32 33 34 35 36 37 38 39 3a 3b 3c 3d 3e 3f 08 00 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(th2.to_vec(), hex("f5 3c e7 99 74 2f ba 9c 98 d6 47 8a ce 3a b5 8f dc 57 ae a8 ce 3e af ca cf a0 0e af 9e e7 8f 33"));
    assert_eq!(mac_h.to_vec(), hex("f5 60 95 b6 fb 72 27 94 98 c3 82 44 8a 01 4e 9e e7 03 b8 7c 41 c4 e4 25 33 80 2c f5 49 c5 db db"));
    assert_eq!(auth_frame, hex("42 42 4c 4b 05 00 03 00 4b 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 f5 60 95 b6 fb 72 27 94 98 c3 82 44 8a 01 4e 9e e7 03 b8 7c 41 c4 e4 25 33 80 2c f5 49 c5 db db aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa aa 40 28 40 80 28 00 80 20 80 04 00"));
    assert_eq!(th3.to_vec(), hex("89 14 60 d0 c6 13 53 c8 7b 0d da a5 fb 4d 72 fd f9 ca 58 36 51 76 7c e7 8c ee 2a 2b 25 2d bd 27"));
    assert_eq!(mac_w.to_vec(), hex("68 1b 42 e7 ee 16 69 55 d1 cf 42 cc 7d 6f cd f5 e8 48 69 d4 43 6e 8c af 2b 64 d7 33 a7 db 2d f1"));
    assert_eq!(welcome, hex("42 42 4c 4b 05 00 04 00 37 00 00 00 00 00 00 00 00 00 00 00 00 00 00 00 68 1b 42 e7 ee 16 69 55 d1 cf 42 cc 7d 6f cd f5 e8 48 69 d4 43 6e 8c af 2b 64 d7 33 a7 db 2d f1 ef 9b af cd f8 ac d1 91 01 08 80 20 80 80 80 80 04 80 80 80 80 80 01"));
    assert_eq!(t.hash().to_vec(), hex("d8 0f 6e 1a 14 5b c2 f4 46 21 ec 2c b5 40 ad a6 5e 8e 3a 14 be bf 83 a7 f1 b0 fa 62 ed cd be f0"));

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
    assert_eq!(out, hex("42 42 4c 4b 05 00 06 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | 12 2c a6 57 | 8a 23 c2 8e ab 09 2c 38 7c 11 76 b4 68 e3 7d be"));
    encode_frame(
        &mut out,
        Kind::Pong,
        &[],
        b"ping",
        session,
        Some(&mut worker.send),
    )
    .unwrap();
    assert_eq!(out, hex("42 42 4c 4b 05 00 07 00 00 00 00 00 04 00 00 00 ef cd ab 89 67 45 23 01 | 79 f1 3d d6 | 01 e8 e7 44 6d b5 94 f0 e6 93 bd 92 eb 7b 4d 5b"));
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
    assert_eq!(out, hex("42 42 4c 4b 05 00 0c 00 03 00 00 00 00 00 00 00 ef cd ab 89 67 45 23 01 | 5c fa ac | 8a 33 53 9b 83 9c 98 27 29 60 74 e3 89 bd 22 8a"));
}
