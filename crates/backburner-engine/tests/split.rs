//! Split prefill against a worker over a real socket (in-process worker thread on loopback): bit-identical logits
//! and tokens to local for every allowed split layer and prompt shape, mirror reuse across turns, regenerate below
//! the watermark, fallback when the worker fails, and handshake/frame errors that leave the worker serving.

use crate::worker_common;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::path::Path;
use std::time::Duration;

use backburner_engine::{Logits, Session};
use backburner_kernels::kv::KvDtype;
use backburner_link::{Conn, ErrorCode, LinkError};
use backburner_model::Model;
use worker_common::*;

#[test]
fn split_prefill_is_bit_identical_to_local_for_every_split_layer_and_prompt_shape() {
    let f = model_with_layers(12, 1);
    let w = start_worker(f.dir.path(), None, None);
    // shorter than the minimum, exactly one ubatch, many ubatches, not a multiple of the ubatch
    let lens = [20usize, UBATCH, 5 * UBATCH, 7 * UBATCH + 5];
    for l in backburner_engine::valid_split_layers(f.model.config()) {
        assert!(l == 4 || l == 8);
        for (pi, &n) in lens.iter().enumerate() {
            let p = prompt(n, pi as u32);
            let mut local = Session::new(f.model.clone(), opts()).unwrap();
            let want = run(&mut local, &p, 6);
            let mut split = Session::new(f.model.clone(), opts()).unwrap();
            split.attach_worker(client(f.dir.path(), &w.addr, Some(l), b""));
            let got = run(&mut split, &p, 6);
            assert_eq!(got.1, want.1, "L={l} n={n}: tokens");
            assert!(got.0 == want.0, "L={l} n={n}: logits differ in bits");
            let st = split.link_stats();
            assert_eq!(st.fallbacks, 0, "L={l} n={n}");
            let expect_worker = if n >= 32 {
                // (32 > UBATCH: such a prompt has ≥ 2 ubatches)
                (n - (n - 1) % UBATCH - 1) as u64
            } else {
                0
            };
            assert_eq!(
                st.worker_tokens, expect_worker,
                "L={l} n={n}: tokens through the worker"
            );
        }
    }
}

#[test]
fn a_second_turn_reuses_the_mirror_and_a_regenerate_below_the_watermark_stays_exact() {
    let f = model_with_layers(8, 2);
    let w = start_worker(f.dir.path(), None, None);
    let turn1 = prompt(4 * UBATCH + 3, 1);
    let turn2 = prompt(3 * UBATCH + 9, 2);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let mut split = Session::new(f.model.clone(), opts()).unwrap();
    split.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    for s in [&mut local, &mut split] {
        s.prefill(&turn1, Logits::Last, |_, _| {}).unwrap();
        for t in [5, 6, 7] {
            s.decode(t).unwrap();
        }
    }
    let after1 = split.link_stats();
    let wm = split.workers()[0].watermark();
    assert_eq!(
        wm,
        4 * UBATCH,
        "watermark = start of the last ubatch of turn 1"
    );
    // turn 2: the sync sends only rows past the watermark (3 + 3 positions) and the linear states
    let snap_local = local.snapshot();
    let snap_split = split.snapshot();
    let a = run(&mut local, &turn2, 4);
    let b = run(&mut split, &turn2, 4);
    assert!(a == b, "turn 2 differs");
    let after2 = split.link_stats();
    let cfg = f.model.config();
    let row = cfg.num_key_value_heads * cfg.head_dim * 2; // f16
    let lin = 4
        * (cfg.conv_dim() * 3
            + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim);
    let sync_payload = (split.tokens().len() - turn2.len() - 4 - wm) * row * 2 + 3 * lin; // K,V of 1 attention + 3 linear layers in 4..8
                                                                                          // ubatches end at absolute multiples: the worker runs every one of turn 2's but the last (which ends the prefill)
    let pre_end = split.tokens().len() - 4;
    let residuals = (turn2.len() - pre_end % UBATCH) * cfg.hidden_size * 4;
    let sent = (after2.bytes_sent - after1.bytes_sent) as usize;
    assert!(
        sent >= sync_payload + residuals && sent < sync_payload + residuals + 1024,
        "sent {sent}, payload {}",
        sync_payload + residuals
    );
    // regenerate: rewind both below the watermark (to the end of turn 1's decode) and run turn 2 differently
    local.rewind(&snap_local);
    split.rewind(&snap_split);
    let alt = prompt(2 * UBATCH + 1, 9);
    let a = run(&mut local, &alt, 4);
    let b = run(&mut split, &alt, 4);
    assert!(a == b, "regenerate differs");
    // rewind far below the watermark, into turn 1
    let mut l2 = Session::new(f.model.clone(), opts()).unwrap();
    let mut s2 = Session::new(f.model.clone(), opts()).unwrap();
    s2.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    // (a new session on the same worker after the previous one disconnects)
    drop(split);
    std::thread::sleep(Duration::from_millis(100));
    let base = prompt(UBATCH, 3);
    for s in [&mut l2, &mut s2] {
        s.prefill(&base, Logits::Last, |_, _| {}).unwrap();
    }
    let sl = l2.snapshot();
    let ss = s2.snapshot();
    let x = run(&mut l2, &turn1, 2);
    let y = run(&mut s2, &turn1, 2);
    assert!(x == y);
    l2.rewind(&sl);
    s2.rewind(&ss);
    let x = run(&mut l2, &turn2, 3);
    let y = run(&mut s2, &turn2, 3);
    assert!(x == y, "after rewinding below the watermark");
    assert_eq!(s2.link_stats().fallbacks, 0);
}

#[test]
fn long_row_ranges_travel_in_several_frames_with_the_same_bits() {
    // A frame budget of a few rows forces every Sync and Fetch to be split into many frames.
    let f = model_with_layers(8, 4);
    let w = start_worker(f.dir.path(), None, None);
    let cfg = f.model.config();
    let lin = 4
        * 3
        * (cfg.conv_dim() * 3
            + cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim);
    let row = 2 * cfg.num_key_value_heads * cfg.head_dim * 2;
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let mut split = Session::new(f.model.clone(), opts()).unwrap();
    split.attach_worker(client_with(
        f.dir.path(),
        &w.addr,
        Some(4),
        b"",
        lin + 5 * row,
    ));
    let (t1, t2) = (prompt(4 * UBATCH + 7, 11), prompt(3 * UBATCH, 12));
    for p in [&t1, &t2] {
        let a = run(&mut local, p, 3);
        let b = run(&mut split, p, 3);
        assert!(a == b);
    }
    assert_eq!(split.link_stats().fallbacks, 0);
    assert_eq!(split.link_stats().split_calls, 2);
}

#[test]
fn a_dead_or_absent_worker_falls_back_to_identical_local_results() {
    let f = model_with_layers(8, 3);
    let p = prompt(6 * UBATCH, 4);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 4);
    // nothing listening
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    };
    let mut s = Session::new(f.model.clone(), opts()).unwrap();
    s.attach_worker(client(
        f.dir.path(),
        &format!("127.0.0.1:{port}"),
        Some(4),
        b"",
    ));
    assert!(run(&mut s, &p, 4) == want);
    assert_eq!(s.link_stats().fallbacks, 1);
    assert_eq!(s.link_stats().worker_tokens, 0);
    // a worker that dies mid-pipeline: accepts the handshake, takes two ubatches, then drops the connection
    let fake = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = fake.local_addr().unwrap().to_string();
    let real = start_worker(f.dir.path(), None, None);
    let real_addr = real.addr.clone();
    let proxy = std::thread::spawn(move || {
        let (mut host, _) = fake.accept().unwrap();
        let mut up = TcpStream::connect(&real_addr).unwrap();
        // forward the handshake and the first ~2 residual frames, then cut both sides
        let mut buf = vec![0u8; 1 << 16];
        let mut forwarded = 0usize;
        let mut up_r = up.try_clone().unwrap();
        let mut host_w = host.try_clone().unwrap();
        let back = std::thread::spawn(move || {
            let mut b = vec![0u8; 1 << 16];
            while let Ok(n) = up_r.read(&mut b) {
                if n == 0 || host_w.write_all(&b[..n]).is_err() {
                    break;
                }
            }
        });
        while forwarded < 300 + 2 * UBATCH * 64 * 4 {
            let n = host.read(&mut buf).unwrap_or(0);
            if n == 0 {
                break;
            }
            up.write_all(&buf[..n]).unwrap();
            forwarded += n;
        }
        let _ = host.shutdown(std::net::Shutdown::Both);
        let _ = up.shutdown(std::net::Shutdown::Both);
        let _ = back.join();
    });
    let mut s = Session::new(f.model.clone(), opts()).unwrap();
    s.attach_worker(client(f.dir.path(), &addr, Some(4), b""));
    assert!(
        run(&mut s, &p, 4) == want,
        "mid-pipeline failure changed the result"
    );
    assert_eq!(s.link_stats().fallbacks, 1);
    proxy.join().unwrap();
}

fn handshake_error(addr: &str, dir: &Path, split: usize, secret: &[u8]) -> LinkError {
    let f = Model::load(dir).unwrap();
    let mut c = client(dir, addr, Some(split), secret);
    let kv = KvDtype::F16;
    c.ping(f.config(), kv, 64, UBATCH, b"x").unwrap_err()
}

#[test]
fn bad_hosts_get_typed_errors_and_the_worker_keeps_serving() {
    let f = model_with_layers(8, 5);
    let w = start_worker(f.dir.path(), Some(4..8), Some(b"s3cret"));
    // wrong key, and no key
    for key in [&b"wrong"[..], b""] {
        match handshake_error(&w.addr, f.dir.path(), 4, key) {
            LinkError::Remote {
                code: ErrorCode::AuthFailed,
                ..
            } => {}
            e => panic!("{e:?}"),
        }
    }
    // wrong model (same shape, other weights)
    let other = model_with_layers(8, 6);
    match handshake_error(&w.addr, other.dir.path(), 4, b"s3cret") {
        LinkError::Remote {
            code: ErrorCode::ModelMismatch,
            message,
        } => assert!(message.contains("fingerprint"), "{message}"),
        e => panic!("{e:?}"),
    }
    // a model with another layer count
    let deeper = model_with_layers(12, 5);
    match handshake_error(&w.addr, deeper.dir.path(), 4, b"s3cret") {
        LinkError::Remote {
            code: ErrorCode::ModelMismatch,
            ..
        } => {}
        e => panic!("{e:?}"),
    }
    // a worker started with --layers 4..12 refuses a host that asks for 8..12
    let deep = model_with_layers(12, 9);
    let fixed = start_worker(deep.dir.path(), Some(4..12), None);
    match handshake_error(&fixed.addr, deep.dir.path(), 8, b"") {
        LinkError::Remote {
            code: ErrorCode::LayerRangeMismatch,
            message,
        } => assert!(message.contains("4..12"), "{message}"),
        e => panic!("{e:?}"),
    }
    // an invalid split layer is refused by the host before it asks
    match handshake_error(&w.addr, f.dir.path(), 3, b"s3cret") {
        LinkError::Refused(m) => assert!(m.contains("cycle boundary"), "{m}"),
        e => panic!("{e:?}"),
    }
    // garbage bytes
    let mut g = TcpStream::connect(&w.addr).unwrap();
    g.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    let mut rest = Vec::new();
    let _ = g.read_to_end(&mut rest);
    // an oversized frame: a valid header announcing a 4 GiB tensor section
    let mut o = TcpStream::connect(&w.addr).unwrap();
    let mut h = Vec::new();
    h.extend_from_slice(b"BBLK");
    h.extend_from_slice(&backburner_link::PROTOCOL_VERSION.to_le_bytes());
    h.extend_from_slice(&1u16.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h.extend_from_slice(&u32::MAX.to_le_bytes());
    h.extend_from_slice(&0u64.to_le_bytes());
    o.write_all(&h).unwrap();
    let mut rest = Vec::new();
    let _ = o.read_to_end(&mut rest); // the worker closes the connection
                                      // a wrong protocol version
    let mut v = TcpStream::connect(&w.addr).unwrap();
    let mut h2 = h.clone();
    h2[4..6].copy_from_slice(&99u16.to_le_bytes());
    h2[12..16].copy_from_slice(&0u32.to_le_bytes());
    v.write_all(&h2).unwrap();
    let _ = v.read_to_end(&mut Vec::new());
    // still serving: a correct host gets exact results
    std::thread::sleep(Duration::from_millis(50));
    let p = prompt(5 * UBATCH, 8);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 3);
    let mut s = Session::new(f.model.clone(), opts()).unwrap();
    s.attach_worker(client(f.dir.path(), &w.addr, None, b"s3cret"));
    assert!(run(&mut s, &p, 3) == want);
    assert_eq!(s.link_stats().fallbacks, 0);
    assert!(s.link_stats().worker_tokens > 0);
    assert_eq!(
        s.workers()[0].split_layer(),
        4,
        "the host adopts the worker's --layers"
    );
}

#[test]
fn hosts_share_a_worker_up_to_max_sessions_and_a_late_one_gets_busy() {
    let f = model_with_layers(8, 7);
    let w = start_worker_with(f.dir.path(), |o| o.max_sessions = 2);
    let cfg = f.model.config();
    let mut first = client(f.dir.path(), &w.addr, Some(4), b"");
    first.ping(cfg, KvDtype::F16, 64, UBATCH, b"hello").unwrap();
    let mut second = client(f.dir.path(), &w.addr, Some(4), b"");
    second
        .ping(cfg, KvDtype::F16, 64, UBATCH, b"again")
        .unwrap();
    match handshake_error(&w.addr, f.dir.path(), 4, b"") {
        LinkError::Remote {
            code: ErrorCode::Busy,
            message,
        } => assert!(message.contains("max-sessions"), "{message}"),
        e => panic!("{e:?}"),
    }
    // both sessions keep working side by side
    first
        .ping(cfg, KvDtype::F16, 64, UBATCH, &[1u8; 1000])
        .unwrap();
    second
        .ping(cfg, KvDtype::F16, 64, UBATCH, &[2u8; 1000])
        .unwrap();
    drop(first);
    std::thread::sleep(Duration::from_millis(100));
    let mut again = client(f.dir.path(), &w.addr, Some(4), b"");
    let rtt = again
        .ping(cfg, KvDtype::F16, 64, UBATCH, &[7u8; 16])
        .unwrap();
    assert!(rtt < Duration::from_secs(5));
    let _ = Conn::connect; // the client owns its connection; dropping it frees its slot
}

#[test]
fn an_idle_session_is_evicted_for_a_busy_one_and_its_host_falls_back_exactly() {
    let f = model_with_layers(8, 13);
    // Worker layers 4..8: one attention layer (a row is K,V × 2 heads × 32 dims × f16 = 256 bytes) and three linear
    // layers (24 192 bytes of state). After a 20-ubatch prompt a mirror holds 304 rows: 102 016 bytes. Fetching
    // them reserves the payload twice (buffer and sealed frame) and one layer's rows as f32 (304 × 512 bytes):
    // a session peaks at 461 696 bytes. 512 KiB holds one peak, not a peak beside an idle mirror.
    let w = start_worker_with(f.dir.path(), |o| {
        o.max_memory = (512 << 10) + tail_weights(f.dir.path(), 4)
    });
    let (p1, p2, more) = (
        prompt(20 * UBATCH, 1),
        prompt(20 * UBATCH, 2),
        prompt(2 * UBATCH + 3, 3),
    );
    let mut la = Session::new(f.model.clone(), opts()).unwrap();
    let want_a = run(&mut la, &p1, 2);
    let want_more = bits(&la.prefill(&more, Logits::Last, |_, _| {}).unwrap());
    let mut lb = Session::new(f.model.clone(), opts()).unwrap();
    let want_b = run(&mut lb, &p2, 2);

    let mut a = Session::new(f.model.clone(), opts()).unwrap();
    a.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    assert!(run(&mut a, &p1, 2) == want_a);
    assert_eq!(a.link_stats().fallbacks, 0);
    // b needs a's memory: a (idle) is evicted and b runs split
    let mut b = Session::new(f.model.clone(), opts()).unwrap();
    b.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    assert!(run(&mut b, &p2, 2) == want_b);
    assert_eq!(b.link_stats().fallbacks, 0, "b should have made room");
    assert_eq!(b.link_stats().worker_tokens, 19 * UBATCH as u64);
    // a's next split call meets Error{Evicted} and reruns locally with the same bits
    let got = bits(&a.prefill(&more, Logits::Last, |_, _| {}).unwrap());
    assert!(got == want_more);
    assert_eq!(a.link_stats().fallbacks, 1);
}

#[test]
fn page_sizes_off_the_64_position_block_are_refused_by_the_worker() {
    let f = model_with_layers(8, 14);
    let w = start_worker(f.dir.path(), None, None);
    for page in [1usize, 63, 100] {
        let mut c = client(f.dir.path(), &w.addr, Some(4), b"");
        match c.ping(f.model.config(), KvDtype::F16, page, UBATCH, b"x") {
            Err(LinkError::Remote {
                code: ErrorCode::ParamMismatch,
                message,
            }) => assert!(message.contains("multiple of 64"), "{message}"),
            other => panic!("page {page}: {other:?}"),
        }
    }
}

#[test]
fn a_fake_worker_cannot_make_the_host_read_a_frame_before_the_handshake() {
    let f = model_with_layers(8, 15);
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let fake = std::thread::spawn(move || {
        let (mut s, _) = l.accept().unwrap();
        let mut hello = [0u8; 56];
        s.read_exact(&mut hello).unwrap();
        // a FetchDone announcing a 1 GiB tensor instead of a Challenge
        let mut h = Vec::new();
        h.extend_from_slice(b"BBLK");
        h.extend_from_slice(&backburner_link::PROTOCOL_VERSION.to_le_bytes());
        h.extend_from_slice(&13u16.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&(1u32 << 30).to_le_bytes());
        h.extend_from_slice(&0u64.to_le_bytes());
        s.write_all(&h).unwrap();
        std::thread::sleep(Duration::from_millis(500));
    });
    let mut c = client(f.dir.path(), &addr, Some(4), b"");
    let t = std::time::Instant::now();
    match c.ping(f.model.config(), KvDtype::F16, 64, UBATCH, b"x") {
        Err(LinkError::FrameTooLarge { len, max: 0 }) => assert_eq!(len, 1 << 30),
        other => panic!("{other:?}"),
    }
    assert!(
        t.elapsed() < Duration::from_millis(400),
        "refused at the header"
    );
    fake.join().unwrap();
}

#[test]
fn a_request_that_cannot_fit_evicts_nobody() {
    let f = model_with_layers(8, 16);
    let w = start_worker_with(f.dir.path(), |o| {
        o.max_memory = (8 << 20) + tail_weights(f.dir.path(), 4)
    });
    let p = prompt(6 * UBATCH, 5);
    let mut local = Session::new(f.model.clone(), opts()).unwrap();
    let want = run(&mut local, &p, 1);
    let more = prompt(3 * UBATCH, 6);
    let want_more = bits(&local.prefill(&more, Logits::Last, |_, _| {}).unwrap());
    let mut a = Session::new(f.model.clone(), opts()).unwrap();
    a.attach_worker(client(f.dir.path(), &w.addr, Some(4), b""));
    assert!(run(&mut a, &p, 1) == want);
    // another host asks for 2 × 5 MiB of request buffers on an 8 MiB worker: refused, and the idle session stays
    let mut b = client(f.dir.path(), &w.addr, Some(4), b"");
    match b.ping(
        f.model.config(),
        KvDtype::F16,
        64,
        UBATCH,
        &vec![0u8; 5 << 20],
    ) {
        Err(LinkError::Remote {
            code: ErrorCode::OutOfMemory,
            ..
        }) => {}
        other => panic!("{other:?}"),
    }
    assert!(bits(&a.prefill(&more, Logits::Last, |_, _| {}).unwrap()) == want_more);
    assert_eq!(a.link_stats().fallbacks, 0, "a was evicted");
    assert_eq!(a.link_stats().split_calls, 2);
}
