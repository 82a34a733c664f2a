//! A worker with a secret under attack, for a bounded time (`BB_FUZZ_SECS`, default 4 s in CI; the release check
//! runs 900 s): random bytes, forged handshakes and a relay that corrupts, drops or cuts a real host's session at a
//! random place. The worker must never crash, hang or accept a forgery: no forger gets a `Welcome`, and every host
//! run gives the local logits bit for bit. Also the host-side regressions: a page size past 32 bits and a model
//! with no split point.

use crate::worker_common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use backburner_engine::{Session, WorkerClient, WorkerSettings};
use backburner_kernels::kv::KvDtype;
use backburner_link::relay::{Dir, Fault, Relay};
use backburner_model::{synthetic, KvOptions, Model};
use rand::{Rng, SeedableRng};
use worker_common::*;

const SECRET: &[u8] = b"fuzz-secret";

/// Sends `bytes`, then reads what comes back for up to 300 ms; true if a `Welcome` (kind 4) header came back.
fn got_welcome(addr: &str, bytes: &[u8]) -> bool {
    let Ok(mut s) = TcpStream::connect(addr) else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(300)));
    let _ = s.write_all(bytes);
    let mut back = Vec::new();
    let mut buf = [0u8; 4096];
    while let Ok(n) = s.read(&mut buf) {
        if n == 0 {
            break;
        }
        back.extend_from_slice(&buf[..n]);
    }
    // frames back to back: walk the headers
    let mut at = 0;
    while back.len() >= at + 24 {
        let kind = u16::from_le_bytes([back[at + 6], back[at + 7]]);
        if kind == 4 {
            return true;
        }
        let c = u32::from_le_bytes(back[at + 8..at + 12].try_into().unwrap()) as usize;
        let t = u32::from_le_bytes(back[at + 12..at + 16].try_into().unwrap()) as usize;
        at += 24 + c + t;
    }
    false
}

/// A Hello, then an Auth carrying a random MAC over plausible parameters, as a forger without the secret would.
fn forged_handshake(rng: &mut impl Rng) -> Vec<u8> {
    let mut v = Vec::new();
    let frame = |v: &mut Vec<u8>, kind: u16, control: &[u8]| {
        v.extend_from_slice(b"BBLK");
        v.extend_from_slice(&backburner_link::PROTOCOL_VERSION.to_le_bytes());
        v.extend_from_slice(&kind.to_le_bytes());
        v.extend_from_slice(&(control.len() as u32).to_le_bytes());
        v.extend_from_slice(&0u32.to_le_bytes());
        v.extend_from_slice(&0u64.to_le_bytes());
        v.extend_from_slice(control);
    };
    let nonce: [u8; 32] = rng.random();
    frame(&mut v, 1, &nonce);
    let mut auth: Vec<u8> = (0..32).map(|_| rng.random()).collect(); // the MAC
    auth.extend_from_slice(&[0u8; 32]); // fingerprint
    auth.extend_from_slice(&[8, 4, 8, 64, 0, 64, 16]);
    if rng.random_bool(0.3) {
        let i = rng.random_range(0..auth.len());
        auth[i] = rng.random();
    }
    frame(&mut v, 3, &auth);
    v
}

#[test]
fn a_worker_with_a_secret_survives_forgeries_and_corruption() {
    let secs: u64 = std::env::var("BB_FUZZ_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(4);
    let seed: u64 = std::env::var("BB_FUZZ_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(7);
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let f = model_with_layers(8, 11);
    let w = start_worker_with(f.dir.path(), |o| o.secret = Some(SECRET.to_vec()));
    let p = prompt(5 * UBATCH + 3, 3);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 2);
    let upstream = w.addr.parse().unwrap();
    let until = Instant::now() + Duration::from_secs(secs);
    let (mut forgeries, mut sessions, mut fallbacks) = (0, 0, 0);
    while Instant::now() < until {
        match rng.random_range(0..3) {
            0 => {
                let n = rng.random_range(0..200);
                let junk: Vec<u8> = (0..n).map(|_| rng.random()).collect();
                assert!(!got_welcome(&w.addr, &junk), "random bytes got a Welcome");
                forgeries += 1;
            }
            1 => {
                assert!(
                    !got_welcome(&w.addr, &forged_handshake(&mut rng)),
                    "a forged Auth got a Welcome"
                );
                forgeries += 1;
            }
            _ => {
                let dir = if rng.random_bool(0.5) {
                    Dir::ToWorker
                } else {
                    Dir::ToHost
                };
                let at = rng.random_range(0..12_000);
                let fault = match rng.random_range(0..3) {
                    0 => Fault::FlipByte { dir, at },
                    1 => Fault::DropBytes {
                        dir,
                        at,
                        len: rng.random_range(1..64),
                    },
                    _ => Fault::CloseAfter { dir, after: at },
                };
                let relay = Relay::start(upstream, fault, 1).unwrap();
                let mut s = Session::new(f.model.clone(), opts()).unwrap();
                let mut st = WorkerSettings::new(relay.addr().to_string(), 1);
                st.split_layer = Some(4);
                st.split_min_tokens = 32;
                st.secret = SECRET.to_vec();
                st.timeout = Duration::from_secs(2);
                let fp = backburner_engine::split::dir_fingerprint(f.dir.path().to_path_buf());
                s.attach_worker(WorkerClient::new(st, fp));
                let got = run(&mut s, &p, 2);
                assert!(got == want, "{fault:?}: the output changed");
                sessions += 1;
                fallbacks += s.link_stats().fallbacks;
            }
        }
    }
    // still serving, exactly
    let mut s = Session::new(f.model.clone(), opts()).unwrap();
    s.attach_worker(client(f.dir.path(), &w.addr, Some(4), SECRET));
    assert!(run(&mut s, &p, 2) == want);
    assert_eq!(s.link_stats().fallbacks, 0);
    eprintln!("fuzz: {secs} s, {forgeries} forgeries refused, {sessions} corrupted sessions ({fallbacks} fell back)");
}

#[test]
fn a_page_size_past_32_bits_stays_exact_on_the_worker() {
    let f = model_with_layers(8, 12);
    let w = start_worker(f.dir.path(), None, None);
    let mut o = opts();
    o.kv = KvOptions {
        page_size: (1usize << 32) + 64,
        dtype: KvDtype::F16,
    };
    let p = prompt(5 * UBATCH, 4);
    let mut local = Session::new(f.model.clone(), o.clone()).unwrap();
    let want = run(&mut local, &p, 3);
    let mut s = Session::new(f.model.clone(), o).unwrap();
    s.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    assert!(run(&mut s, &p, 3) == want);
    assert_eq!(s.link_stats().fallbacks, 0);
    assert!(s.link_stats().worker_tokens > 0);
}

#[test]
fn a_model_without_a_split_point_runs_locally_instead_of_panicking() {
    let dir = tempfile::tempdir().unwrap();
    let mut cfg = synthetic::tiny_config(4);
    cfg["full_attention_interval"] = 4.into();
    synthetic::write_random_checkpoint(dir.path(), &cfg, 5).unwrap();
    let m = std::sync::Arc::new(Model::load(dir.path()).unwrap());
    let p = prompt(4 * UBATCH, 5);
    let mut local = Session::new(m.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 2);
    let mut s = Session::new(m, opts()).unwrap();
    s.attach_worker(client(dir.path(), "127.0.0.1:9", None, b""));
    assert!(run(&mut s, &p, 2) == want);
    // split prefill is not even tried (nothing to split): no fallback, no warning
    assert_eq!(s.link_stats().fallbacks, 0);
}
