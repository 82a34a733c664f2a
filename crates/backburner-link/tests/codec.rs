//! The frame codec: round trips, every truncation, every bit flip of a sealed frame, reordering and replay, and
//! every header and control field at 0, its maximum and past it.

use backburner_link::codec::{decode_control, encode_control, encode_frame, FrameDecoder};
use backburner_link::crypto::{derive, Role, SessionKeys};
use backburner_link::frame::{Header, Kind, HEADER_LEN, MAX_CONTROL, PROTOCOL_VERSION};
use backburner_link::message::{
    Challenge, Fetch, FetchDone, LayersDone, Rewind, RewindDone, RunLayers, SessionParams, Sync,
    Welcome, WorkerLimits,
};
use backburner_link::{LinkError, Request, WireKvDtype};
use proptest::prelude::*;

const KINDS: [Kind; 25] = [
    Kind::Hello,
    Kind::Challenge,
    Kind::Auth,
    Kind::Welcome,
    Kind::Error,
    Kind::Ping,
    Kind::Pong,
    Kind::Sync,
    Kind::SyncDone,
    Kind::RunLayers,
    Kind::LayersDone,
    Kind::Fetch,
    Kind::FetchDone,
    Kind::Reset,
    Kind::ResetDone,
    Kind::PagesPut,
    Kind::PagesDone,
    Kind::PagesFull,
    Kind::PagesDrop,
    Kind::Attend,
    Kind::Partials,
    Kind::Rewind,
    Kind::RewindDone,
    Kind::Experts,
    Kind::ExpertsDone,
];

fn keys() -> (SessionKeys, SessionKeys) {
    let th = [3u8; 32];
    (
        derive(b"k", &th, Role::Host),
        derive(b"k", &th, Role::Worker),
    )
}

fn decoder(key: Option<SessionKeys>) -> FrameDecoder {
    FrameDecoder {
        max_tensor: 1 << 20,
        key: key.map(|k| k.recv),
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(256))]

    #[test]
    fn frames_round_trip_sealed_or_not(
        k in 0usize..15,
        control in proptest::collection::vec(any::<u8>(), 0..200),
        tensor in proptest::collection::vec(any::<u8>(), 0..3000),
        session in any::<u64>(),
        sealed in any::<bool>(),
    ) {
        let kind = KINDS[k];
        let tensor = if kind.has_tensor() { tensor } else { Vec::new() };
        let (mut host, worker) = keys();
        let mut wire = Vec::new();
        encode_frame(&mut wire, kind, &control, &tensor, session, sealed.then_some(&mut host.send)).unwrap();
        let mut dec = decoder(sealed.then_some(worker));
        // every strict prefix asks for more bytes, without an error
        for cut in 0..wire.len() {
            let mut part = wire[..cut].to_vec();
            prop_assert!(dec.decode(&mut part).unwrap().is_none());
        }
        let mut buf = wire.clone();
        buf.extend_from_slice(b"next");
        let f = dec.decode(&mut buf).unwrap().unwrap();
        prop_assert_eq!(f.header.kind, kind);
        prop_assert_eq!(f.header.session, session);
        prop_assert_eq!(&f.control, &control);
        prop_assert_eq!(&f.tensor, &tensor);
        prop_assert_eq!(&buf, b"next");
    }

    #[test]
    fn random_bytes_never_panic_the_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..600), sealed in any::<bool>()) {
        let (_, worker) = keys();
        let mut dec = decoder(sealed.then_some(worker));
        let mut b = bytes;
        while let Ok(Some(_)) = dec.decode(&mut b) {}
    }
}

#[test]
fn every_bit_flip_of_a_sealed_frame_is_refused() {
    let (mut host, _) = keys();
    let mut wire = Vec::new();
    encode_frame(
        &mut wire,
        Kind::RunLayers,
        &[1, 2, 3],
        &[9; 12],
        77,
        Some(&mut host.send),
    )
    .unwrap();
    for byte in 0..wire.len() {
        for bit in 0..8 {
            let (_, worker) = keys();
            let mut dec = decoder(Some(worker));
            let mut b = wire.clone();
            b[byte] ^= 1 << bit;
            match dec.decode(&mut b) {
                Err(_) => {}
                // a flip in a length field may make the frame look longer: it then waits for bytes that never
                // come (the deadline ends it); it is never accepted
                Ok(None) => assert!(
                    (8..16).contains(&byte),
                    "byte {byte} bit {bit} left pending"
                ),
                Ok(Some(f)) => panic!("byte {byte} bit {bit} accepted: {f:?}"),
            }
        }
    }
}

#[test]
fn reordered_replayed_and_dropped_frames_fail_the_tag() {
    let (mut host, _) = keys();
    let frames: Vec<Vec<u8>> = (0..3u8)
        .map(|i| {
            let mut w = Vec::new();
            encode_frame(&mut w, Kind::Ping, &[], &[i; 8], 5, Some(&mut host.send)).unwrap();
            w
        })
        .collect();
    let first_failure = |order: &[usize]| {
        let (_, worker) = keys();
        let mut dec = decoder(Some(worker));
        for (n, i) in order.iter().enumerate() {
            let mut b = frames[*i].clone();
            match dec.decode(&mut b) {
                Ok(Some(_)) => {}
                Err(LinkError::Integrity(_)) => return n,
                other => panic!("{other:?}"),
            }
        }
        usize::MAX
    };
    assert_eq!(first_failure(&[0, 1, 2]), usize::MAX);
    assert_eq!(first_failure(&[1, 0, 2]), 0, "reordered");
    assert_eq!(first_failure(&[0, 0, 1]), 1, "replayed");
    assert_eq!(first_failure(&[0, 2]), 1, "dropped");
    // the other direction's key opens nothing
    let (_, worker) = keys();
    let mut dec = FrameDecoder {
        max_tensor: 1 << 20,
        key: Some(worker.send),
    };
    assert!(matches!(
        dec.decode(&mut frames[0].clone()),
        Err(LinkError::Integrity(_))
    ));
}

fn header(kind: u16, version: u16, control: u32, tensor: u32) -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..4].copy_from_slice(b"BBLK");
    h[4..6].copy_from_slice(&version.to_le_bytes());
    h[6..8].copy_from_slice(&kind.to_le_bytes());
    h[8..12].copy_from_slice(&control.to_le_bytes());
    h[12..16].copy_from_slice(&tensor.to_le_bytes());
    h[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    h
}

#[test]
fn header_fields_at_zero_max_and_past_max() {
    let max_c = MAX_CONTROL as u32;
    let ok = Header::decode(&header(10, PROTOCOL_VERSION, max_c, 1000), 1000).unwrap();
    assert_eq!(
        (ok.kind, ok.control_len, ok.tensor_len, ok.session),
        (Kind::RunLayers, max_c, 1000, u64::MAX)
    );
    assert_eq!(Header::decode(&ok.encode(), 1000).unwrap(), ok);
    let err = |h: [u8; HEADER_LEN]| Header::decode(&h, 1000).unwrap_err();
    let too_large = |e: LinkError| matches!(e, LinkError::FrameTooLarge { .. });
    assert!(too_large(err(header(10, PROTOCOL_VERSION, max_c + 1, 0))));
    assert!(too_large(err(header(10, PROTOCOL_VERSION, u32::MAX, 0))));
    assert!(too_large(err(header(10, PROTOCOL_VERSION, 0, 1001))));
    assert!(too_large(err(header(10, PROTOCOL_VERSION, 0, u32::MAX))));
    for k in [0u16, 26, u16::MAX] {
        assert!(
            matches!(err(header(k, PROTOCOL_VERSION, 0, 0)), LinkError::UnknownKind(v) if v == k)
        );
    }
    for v in [0u16, 1, 3, 4, 5, 6, 7, 9, u16::MAX] {
        assert!(
            matches!(err(header(1, v, 0, 0)), LinkError::VersionMismatch { theirs, .. } if theirs == v)
        );
    }
    // kinds without a tensor section refuse tensor bytes
    for k in KINDS.iter().filter(|k| !k.has_tensor()) {
        let e = err(header(*k as u16, PROTOCOL_VERSION, 0, 1));
        assert!(matches!(e, LinkError::Malformed(_)), "{k:?}");
    }
    let mut bad = header(1, PROTOCOL_VERSION, 0, 0);
    bad[0] = b'X';
    assert!(matches!(err(bad), LinkError::BadMagic(_)));
}

/// Encodes, checks the round trip, and that every truncation and one trailing byte are refused.
fn control_round_trip<T>(kind: Kind, v: &T)
where
    T: serde::Serialize + serde::de::DeserializeOwned + PartialEq + std::fmt::Debug,
{
    let b = encode_control(v).unwrap();
    assert_eq!(&decode_control::<T>(kind, &b).unwrap(), v);
    for cut in 0..b.len() {
        assert!(
            decode_control::<T>(kind, &b[..cut]).is_err(),
            "{kind:?} cut at {cut}"
        );
    }
    let mut longer = b.clone();
    longer.push(0);
    assert!(matches!(
        decode_control::<T>(kind, &longer),
        Err(LinkError::Malformed(_))
    ));
}

#[test]
fn control_fields_at_zero_and_max_round_trip_and_truncations_fail() {
    for x in [0u64, 1, u32::MAX as u64, u64::MAX] {
        let y = u32::try_from(x).unwrap_or(u32::MAX);
        let sync = Sync {
            truncate_to: x,
            pos_after: x,
            linear: x % 2 == 1,
        };
        control_round_trip(Kind::Sync, &sync);
        control_round_trip(
            Kind::RunLayers,
            &RunLayers {
                pos: x,
                n_tokens: y,
                keep: vec![x; usize::from(x % 3 == 0) * 2],
                verify: x % 2 == 1,
            },
        );
        control_round_trip(Kind::Rewind, &Rewind { to_pos: x });
        let rd = RewindDone {
            pos: x,
            restored: x % 2 == 0,
        };
        control_round_trip(Kind::RewindDone, &rd);
        let done = LayersDone {
            pos_after: x,
            compute_us: x,
            idle_us: x,
        };
        control_round_trip(Kind::LayersDone, &done);
        let fetch = Fetch {
            from_pos: x,
            to_pos: x,
            linear: true,
        };
        control_round_trip(Kind::Fetch, &fetch);
        control_round_trip(
            Kind::FetchDone,
            &FetchDone {
                from_pos: x,
                to_pos: x,
            },
        );
        let limits = WorkerLimits {
            max_ubatch: y,
            max_frame: x,
            max_memory: x,
        };
        let welcome = Welcome {
            mac: [7; 32],
            session: x,
            threads: y,
            limits,
        };
        control_round_trip(Kind::Welcome, &welcome);
        let ch = Challenge {
            worker_nonce: [1; 32],
            threads: y,
            layers: Some((y, y)),
            limits,
        };
        control_round_trip(Kind::Challenge, &ch);
        for (kv_dtype, layer_split) in [
            (WireKvDtype::F16, false),
            (WireKvDtype::F32, true),
            (WireKvDtype::Bf16, false),
        ] {
            let p = SessionParams {
                fingerprint: [2; 32],
                n_layers: y,
                layer_start: y,
                layer_end: y,
                hidden: y,
                kv_dtype,
                kv_page_size: x,
                ubatch: y,
                layer_split,
                experts: if layer_split {
                    vec![]
                } else {
                    vec![0, y, u32::MAX]
                },
            };
            control_round_trip(Kind::Auth, &p);
        }
    }
    // a value past u32 in a u32 field, a bool other than 0/1 and an unknown dtype index are refused
    let big = encode_control(&(0u64, u64::from(u32::MAX) + 1, Vec::<u64>::new())).unwrap();
    assert!(decode_control::<RunLayers>(Kind::RunLayers, &big).is_err());
    // a RunLayers of version 5 (no `keep`) is refused, not read with defaults
    let v5 = encode_control(&(64u64, 2u32)).unwrap();
    assert!(decode_control::<RunLayers>(Kind::RunLayers, &v5).is_err());
    assert!(decode_control::<Fetch>(Kind::Fetch, &[0, 0, 2]).is_err());
    assert!(decode_control::<WireKvDtype>(Kind::Auth, &[3]).is_err());
}

#[test]
fn kv_dtypes_keep_their_indices_and_bf16_is_appended() {
    // postcard writes an enum's variant index as a varint: the old dtypes keep 0 and 1, bf16 is 2
    for (d, byte) in [
        (WireKvDtype::F16, 0u8),
        (WireKvDtype::F32, 1),
        (WireKvDtype::Bf16, 2),
    ] {
        assert_eq!(encode_control(&d).unwrap(), [byte], "{d:?}");
        assert_eq!(
            decode_control::<WireKvDtype>(Kind::Auth, &[byte]).unwrap(),
            d
        );
    }
    for unknown in [3u8, 4, 0x7f] {
        assert!(
            decode_control::<WireKvDtype>(Kind::Auth, &[unknown]).is_err(),
            "index {unknown}"
        );
    }
    // inside SessionParams the dtype is the byte after hidden: the same params with bf16 differ only there
    let p = |kv_dtype| SessionParams {
        fingerprint: [0xaa; 32],
        n_layers: 64,
        layer_start: 40,
        layer_end: 64,
        hidden: 5120,
        kv_dtype,
        kv_page_size: 4096,
        ubatch: 512,
        layer_split: false,
        experts: vec![],
    };
    let f16 = encode_control(&p(WireKvDtype::F16)).unwrap();
    let bf16 = encode_control(&p(WireKvDtype::Bf16)).unwrap();
    assert_eq!(
        &f16[32..],
        [0x40, 0x28, 0x40, 0x80, 0x28, 0x00, 0x80, 0x20, 0x80, 0x04, 0x00, 0x00]
    );
    let diff: Vec<usize> = (0..f16.len()).filter(|&i| f16[i] != bf16[i]).collect();
    assert_eq!(
        (f16.len(), bf16.len(), diff),
        (f16.len(), f16.len(), vec![32 + 5])
    );
    assert_eq!(bf16[32 + 5], 2);
    let mut bad = bf16.clone();
    bad[32 + 5] = 3;
    assert!(decode_control::<SessionParams>(Kind::Auth, &bad).is_err());
    assert_eq!(
        decode_control::<SessionParams>(Kind::Auth, &bf16).unwrap(),
        p(WireKvDtype::Bf16)
    );
}

#[test]
fn requests_decode_to_typed_values_and_replies_are_not_requests() {
    let (mut host, worker) = keys();
    let mut dec = decoder(Some(worker));
    let mut wire = Vec::new();
    let c = encode_control(&RunLayers {
        pos: 64,
        n_tokens: 2,
        keep: vec![66],
        verify: false,
    })
    .unwrap();
    encode_frame(
        &mut wire,
        Kind::RunLayers,
        &c,
        &[0; 8],
        9,
        Some(&mut host.send),
    )
    .unwrap();
    let f = dec.decode(&mut wire).unwrap().unwrap();
    assert_eq!(
        Request::decode(f).unwrap(),
        Request::RunLayers(
            RunLayers {
                pos: 64,
                n_tokens: 2,
                keep: vec![66],
                verify: false,
            },
            vec![0; 8]
        )
    );
    encode_frame(
        &mut wire,
        Kind::LayersDone,
        &[0, 0, 0],
        &[],
        9,
        Some(&mut host.send),
    )
    .unwrap();
    let f = dec.decode(&mut wire).unwrap().unwrap();
    assert!(matches!(
        Request::decode(f),
        Err(LinkError::Unexpected { .. })
    ));
    // a Ping whose control section is not empty
    encode_frame(&mut wire, Kind::Ping, &[1], &[], 9, Some(&mut host.send)).unwrap();
    let f = dec.decode(&mut wire).unwrap().unwrap();
    assert!(matches!(Request::decode(f), Err(LinkError::Malformed(_))));
}

#[test]
fn page_messages_decode_to_typed_requests_and_malformed_controls_are_refused() {
    use backburner_link::message::{Attend, PagesDrop, PagesPut};
    let (mut host, worker) = keys();
    let mut dec = decoder(Some(worker));
    let mut wire = Vec::new();
    let mut roundtrip = |kind: Kind, control: Vec<u8>, tensor: &[u8]| {
        encode_frame(&mut wire, kind, &control, tensor, 9, Some(&mut host.send)).unwrap();
        Request::decode(dec.decode(&mut wire).unwrap().unwrap())
    };
    let put = PagesPut {
        first_pos: 4096,
        n_pages: u32::MAX,
    };
    assert_eq!(
        roundtrip(Kind::PagesPut, encode_control(&put).unwrap(), &[7; 5]).unwrap(),
        Request::PagesPut(put, vec![7; 5])
    );
    let drop = PagesDrop { to_pos: u64::MAX };
    assert_eq!(
        roundtrip(Kind::PagesDrop, encode_control(&drop).unwrap(), &[]).unwrap(),
        Request::PagesDrop(drop)
    );
    let a = Attend {
        layer: 3,
        q_pos0: 1 << 40,
        n_tokens: 1,
        n_heads: 8,
        scale: 0.0625,
        per_page: true,
    };
    assert_eq!(
        roundtrip(Kind::Attend, encode_control(&a).unwrap(), &[0; 4]).unwrap(),
        Request::Attend(a.clone(), vec![0; 4])
    );
    // trailing bytes, a bool other than 0/1, a u32 field past u32, a truncated f32
    let mut trailing = encode_control(&a).unwrap();
    trailing.push(0);
    assert!(matches!(
        roundtrip(Kind::Attend, trailing, &[]),
        Err(LinkError::Malformed(_))
    ));
    let mut bad_bool = encode_control(&a).unwrap();
    *bad_bool.last_mut().unwrap() = 2;
    assert!(matches!(
        roundtrip(Kind::Attend, bad_bool, &[]),
        Err(LinkError::Malformed(_))
    ));
    let big = encode_control(&(0u64, u64::from(u32::MAX) + 1)).unwrap();
    assert!(matches!(
        roundtrip(Kind::PagesPut, big, &[]),
        Err(LinkError::Malformed(_))
    ));
    let short = encode_control(&a).unwrap();
    assert!(matches!(
        roundtrip(Kind::Attend, short[..short.len() - 3].to_vec(), &[]),
        Err(LinkError::Malformed(_))
    ));
    // replies are not requests
    for k in [
        Kind::PagesDone,
        Kind::PagesFull,
        Kind::Partials,
        Kind::RewindDone,
    ] {
        assert!(matches!(
            roundtrip(k, vec![0, 0, 0], &[]),
            Err(LinkError::Unexpected { .. })
        ));
    }
}
