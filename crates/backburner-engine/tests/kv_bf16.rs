//! The bf16 KV cache (`--kv-dtype bf16`) in every mode: state payloads carry its rows as their raw bits; split
//! prefill, KV offload (packed pages on the worker), layer split and the prompt cache give the bits of a local bf16
//! run; a model with an odd head_dim is refused with a typed error on the host and in the worker's handshake.

use crate::{cache_exact, worker_common};

use std::sync::Arc;
use std::time::Duration;

use backburner_engine::chain::LayerSplit;
use backburner_engine::connection::Connection;
use backburner_engine::offload::KvBudget;
use backburner_engine::serve::{CacheLimits, Engine, ServeOptions};
use backburner_engine::{
    generate, wire, EngineError, GenerateParams, Session, SessionOptions, WorkerSettings,
};
use backburner_kernels::kv::KvDtype;
use backburner_link::{Conn, ErrorCode, LinkError, SessionParams, WireKvDtype};
use backburner_model::{
    synthetic, Checkpoint, KvOptions, LoadOptions, Model, ModelConfig, ModelState,
};
use half::bf16;
use worker_common::*;

/// [`worker_common::opts`] (ubatch 16, pages of 64) with bf16 pages.
fn bf16_opts() -> SessionOptions {
    SessionOptions {
        kv: KvOptions {
            page_size: 64,
            dtype: KvDtype::Bf16,
        },
        ..opts()
    }
}

/// [`synthetic::tiny_config`] with head_dim 33 (8 rotary dims: still a valid config).
fn odd_head_dim_config(n_layers: usize) -> serde_json::Value {
    let mut c = synthetic::tiny_config(n_layers);
    c["head_dim"] = 33.into();
    c
}

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            (((i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 2001) as f32 / 1000.0) - 1.0
        })
        .collect()
}

#[test]
fn state_payloads_carry_kv_rows_in_their_dtype_bit_for_bit() {
    // `Sync` / `FetchDone` (docs/PROTOCOL.md §3.2): K rows then V rows of each attention layer, `e` bytes an element
    // (bf16: its u16 bits, little-endian), then the linear states; applied to a fresh state they read back the
    // same bits. Rows appended directly: no attention runs.
    let f = model_with_layers(8, 41);
    let cfg = f.model.config().clone();
    let n = cfg.num_hidden_layers;
    let (hkv, d) = (cfg.num_key_value_heads, cfg.head_dim);
    let rows = 70;
    let attn: Vec<usize> = (0..n)
        .filter(|&i| cfg.layer_types[i] == backburner_model::LayerKind::FullAttention)
        .collect();
    let mut payloads = Vec::new();
    for (dtype, e) in [(KvDtype::F16, 2), (KvDtype::F32, 4), (KvDtype::Bf16, 2)] {
        let kv = KvOptions {
            page_size: 64,
            dtype,
        };
        let mut a = ModelState::new(&cfg, 0..n, kv);
        for (j, &i) in attn.iter().enumerate() {
            let k = values(rows * hkv * d, 2 * j as u32);
            let v = values(rows * hkv * d, 2 * j as u32 + 1);
            assert!(a.append_kv_rows(i, &k, &v, rows));
        }
        a.set_position(rows);
        let (p0, p1) = (10, rows);
        let bytes = wire::encode(&a, &cfg, 4..n, p0, p1, false);
        let per_layer = 2 * (p1 - p0) * hkv * d * e;
        assert_eq!(
            bytes.len(),
            per_layer,
            "{dtype}: one attention layer in 4..8"
        );
        assert_eq!(
            wire::payload_len(&cfg, 4..n, p1 - p0, dtype, false),
            Some(bytes.len())
        );
        // the first K element of layer 7 at position 10, as stored
        let (k7, v7) = a.read_kv_rows(7, p0, p1).unwrap();
        let first: Vec<u8> = match dtype {
            KvDtype::F16 => half::f16::from_f32(k7[0]).to_le_bytes().to_vec(),
            KvDtype::F32 => k7[0].to_le_bytes().to_vec(),
            KvDtype::Bf16 => bf16::from_f32(k7[0]).to_le_bytes().to_vec(),
        };
        assert_eq!(&bytes[..e], &first[..], "{dtype}");
        if dtype == KvDtype::Bf16 {
            // every element is the bf16 of the appended value (read back as f32 exactly)
            let src = values(rows * hkv * d, 2);
            let want: Vec<u8> = src[p0 * hkv * d..]
                .iter()
                .flat_map(|x| bf16::from_f32(*x).to_le_bytes())
                .collect();
            assert_eq!(&bytes[..per_layer / 2], &want[..]);
        }
        // adopted by a mirror of 4..8 that holds the rows below p0: the same bits
        let mut b = ModelState::new(&cfg, 4..n, kv);
        let (k_lo, v_lo) = a.read_kv_rows(7, 0, p0).unwrap();
        assert!(b.append_kv_rows(7, &k_lo, &v_lo, p0));
        wire::apply(&mut b, &cfg, 4..n, p1 - p0, false, &bytes).unwrap();
        let (kb, vb) = b.read_kv_rows(7, p0, p1).unwrap();
        let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        assert_eq!((bits(&kb), bits(&vb)), (bits(&k7), bits(&v7)), "{dtype}");
        // a payload sized for another dtype is refused whole
        let mut c = ModelState::new(&cfg, 4..n, kv);
        let wrong = vec![0u8; if e == 2 { 2 * per_layer } else { per_layer / 2 }];
        assert!(wire::apply(&mut c, &cfg, 4..n, p1 - p0, false, &wrong).is_err());
        payloads.push(bytes);
    }
    // the same rows as f16 and as bf16: same length, other bytes
    assert_eq!(payloads[0].len(), payloads[2].len());
    assert_ne!(payloads[0], payloads[2]);
}

#[test]
fn an_odd_head_dim_refuses_bf16_kv_with_a_typed_error() {
    let f = with_config(&odd_head_dim_config(8), 43);
    assert_eq!(f.model.config().head_dim, 33);
    let err = Session::new(f.model.clone(), bf16_opts()).unwrap_err();
    match &err {
        EngineError::InvalidSetting(m) => {
            assert!(m.contains("even head_dim") && m.contains("33"), "{m}")
        }
        e => panic!("{e:?}"),
    }
    // f16 and f32 pages take any head_dim
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let o = SessionOptions {
            kv: KvOptions {
                page_size: 64,
                dtype,
            },
            ..opts()
        };
        assert!(Session::new(f.model.clone(), o).is_ok(), "{dtype}");
    }
    // and the check itself, for callers that build states directly
    let kv = |dtype| KvOptions {
        page_size: 64,
        dtype,
    };
    assert!(kv(KvDtype::Bf16).check(f.model.config()).is_err());
    assert!(kv(KvDtype::F16).check(f.model.config()).is_ok());
    let even = model_with_layers(8, 44);
    assert!(kv(KvDtype::Bf16).check(even.model.config()).is_ok());
}

#[test]
fn a_worker_refuses_bf16_pages_of_an_odd_head_dim_in_the_handshake() {
    let f = with_config(&odd_head_dim_config(8), 45);
    let w = start_worker(f.dir.path(), None, None);
    let fp = backburner_engine::split::dir_fingerprint(f.dir.path().to_path_buf());
    let hello = |kv_dtype| -> Result<(), LinkError> {
        let mut c = Conn::connect(&w.addr, Duration::from_secs(10), None).unwrap();
        backburner_link::handshake::host_handshake(&mut c, b"", |_ch| {
            Ok(SessionParams {
                fingerprint: fp(4..8).unwrap(),
                n_layers: 8,
                layer_start: 4,
                layer_end: 8,
                hidden: 64,
                kv_dtype,
                kv_page_size: 64,
                ubatch: 16,
                layer_split: false,
                experts: vec![],
            })
        })
        .map(|_| ())
    };
    match hello(WireKvDtype::Bf16) {
        Err(LinkError::Remote {
            code: ErrorCode::ParamMismatch,
            message,
        }) => assert!(message.contains("even head_dim"), "{message}"),
        r => panic!("{r:?}"),
    }
    // the worker keeps serving: f16 is welcome
    hello(WireKvDtype::F16).unwrap();
}

// Everything below runs attention over bf16 pages (the pair kernel).

#[test]
fn bf16_kv_runs_are_reproducible_and_close_to_f16_but_not_its_bits() {
    let f = model_with_layers(8, 46);
    let p = prompt(150, 1);
    let mut a = Session::new(f.model.clone(), bf16_opts()).unwrap();
    let mut b = Session::new(f.model.clone(), bf16_opts()).unwrap();
    let (la, ta) = run(&mut a, &p, 12);
    let (lb, tb) = run(&mut b, &p, 12);
    assert!(la == lb && ta == tb, "two bf16 runs differ");
    assert_eq!(a.state().kv_options().dtype, KvDtype::Bf16);
    // bf16 pages round K and V (and the kernel the queries and weights) to 8 bits: other bits than f16's
    let mut h = Session::new(f.model.clone(), opts()).unwrap();
    let (lh, _) = run(&mut h, &p, 12);
    assert!(la != lh, "bf16 and f16 KV gave the same bits");
    for (x, y) in la[0].iter().zip(&lh[0]) {
        let (x, y) = (f32::from_bits(*x), f32::from_bits(*y));
        assert!(
            (x - y).abs() < 0.05 * (1.0 + y.abs()),
            "first logits {x} vs {y}"
        );
    }
}

#[test]
fn split_prefill_with_bf16_kv_gives_the_local_bits() {
    // the mirror's rows come back in `FetchDone` as bf16 bits, and `Sync` sends the host's
    let f = model_with_layers(8, 47);
    let w = start_worker(f.dir.path(), None, None);
    for n in [5 * UBATCH + 3, 9 * UBATCH] {
        let p = prompt(n, n as u32);
        let mut local = Session::new(f.model.clone(), bf16_opts()).unwrap();
        let want = run(&mut local, &p, 6);
        let mut split = Session::new(f.model.clone(), bf16_opts()).unwrap();
        split.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
        let got = run(&mut split, &p, 6);
        assert_eq!(got.1, want.1, "n={n}: tokens");
        assert!(got.0 == want.0, "n={n}: logits differ in bits");
        let st = split.link_stats();
        assert_eq!(st.fallbacks, 0, "n={n}");
        assert!(st.worker_tokens > 0, "n={n}: nothing ran on the worker");
    }
}

#[test]
fn kv_offload_with_bf16_pages_gives_the_local_bits_packed_or_not() {
    let f = model_with_layers(8, 48);
    let p = prompt(7 * 64 + 5, 3);
    let mut local = Session::new(f.model.clone(), bf16_opts()).unwrap();
    let want = run(&mut local, &p, 40);
    for pack in [false, true] {
        let w = start_worker_with(f.dir.path(), |o| o.pack_pages = pack);
        let o = SessionOptions {
            kv_budget: Some(KvBudget::Positions(128)),
            ..bf16_opts()
        };
        let mut off = Session::new(f.model.clone(), o).unwrap();
        off.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
        let got = run(&mut off, &p, 40);
        assert_eq!(got.1, want.1, "pack {pack}: tokens");
        assert!(got.0 == want.0, "pack {pack}: logits differ in bits");
        let st = off.link_stats();
        assert!(st.pages_on_workers > 0, "pack {pack}: no page moved");
        assert_eq!((st.fallbacks, st.offload_failures), (0, 0), "pack {pack}");
    }
}

#[test]
fn layer_split_with_bf16_kv_gives_the_local_bits() {
    let f = model_with_layers(8, 49);
    let p = prompt(100, 5);
    let mut local = Session::new(f.model.clone(), bf16_opts()).unwrap();
    let want = run(&mut local, &p, 10);
    let w = start_worker(f.dir.path(), None, None);
    let cfg = ModelConfig::from_dir(f.dir.path()).unwrap();
    let host = Arc::new(
        Model::from_checkpoint(
            cfg,
            &Checkpoint::open(f.dir.path()).unwrap(),
            &LoadOptions {
                layers: 0..4,
                ends: true,
            },
            |_, _| {},
        )
        .unwrap(),
    );
    let mut s = WorkerSettings::new(&w.addr, 1);
    s.timeout = Duration::from_secs(5);
    let conn = Connection::new(
        s,
        backburner_engine::split::dir_fingerprint(f.dir.path().to_path_buf()),
    );
    let chain = LayerSplit::from_parts(host.config(), vec![(conn, 4..8)]).unwrap();
    let mut split = Session::with_layer_split(host, bf16_opts(), chain).unwrap();
    let got = run(&mut split, &p, 10);
    assert_eq!(got.1, want.1, "tokens");
    assert!(got.0 == want.0, "logits differ in bits");
}

#[test]
fn the_prompt_cache_with_bf16_kv_answers_with_the_bits_of_cold_runs() {
    let f = model_with_layers(8, 50);
    let model = f.model.clone();
    let o = |ubatch| SessionOptions {
        ubatch,
        kv: KvOptions {
            page_size: 16,
            dtype: KvDtype::Bf16,
        },
        ..SessionOptions::default()
    };
    for ubatch in [32, 96] {
        let sessions = vec![Session::new(model.clone(), o(ubatch)).unwrap()];
        let serve = ServeOptions {
            queue: 4,
            cache: CacheLimits::default(),
            ..Default::default()
        };
        let e = Engine::start(sessions, None, serve).unwrap();
        let m = model.clone();
        let cold = move |p: &[u32], params: &GenerateParams| {
            let mut s = Session::new(m.clone(), o(ubatch)).unwrap();
            generate(&mut s, p, params, None, |_, _| {}, |_| {}, |_| {}).unwrap()
        };
        let what = format!("bf16 KV, ubatch {ubatch}");
        let reused = cache_exact::converse(&e, &cold, 500, 60 + ubatch as u64, 6, &what);
        assert!(reused > 0, "{what}: nothing came from the cache");
    }
}
