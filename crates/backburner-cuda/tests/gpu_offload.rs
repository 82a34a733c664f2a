//! KV offload on the CUDA backend against the CPU backend: the oldest pages copied off the device hold the CPU
//! cache's stored values exactly (f16 and f32), the movable-page count follows the CPU's rule, the partial over the
//! pages left on the device folded after the partial over the pages moved (as a worker computes it) matches the CPU
//! cache's continued fold within 1e-4 of the output's scale, and truncation refuses the positions held elsewhere.
//! Without a CUDA device (or the emulation's stand-in libraries) the test prints one `skipped:` line.

mod common;

use backburner_kernels::attention::attend_pages;
use backburner_kernels::kv::KvDtype;
use backburner_model::device::{Backend, CpuBackend};
use common::{both, close_scaled, gpu, host, rand_vec};

#[test]
fn pages_moved_off_the_gpu_and_the_folded_partial_match_the_cpu() {
    let Some(g) = gpu("pages_moved_off_the_gpu_and_the_folded_partial_match_the_cpu") else {
        return;
    };
    let c = CpuBackend;
    let (hq, hkv, hd, ps) = (4, 2, 64, 16);
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let mut kv = g.kv_new(ps, hkv, hd, dtype).unwrap();
        let mut kvc = c.kv_new(ps, hkv, hd, dtype).unwrap();
        let t = 3 * ps + 5;
        let (k, kc) = both(&g, &rand_vec(t * hkv * hd, 200, 1.0));
        let (v, vc) = both(&g, &rand_vec(t * hkv * hd, 201, 1.0));
        g.kv_append(&mut kv, &k, &v, t).unwrap();
        c.kv_append(&mut kvc, &kc, &vc, t).unwrap();
        assert_eq!(g.kv_movable_pages(&kv), 3);
        assert_eq!(c.kv_movable_pages(&kvc), 3);
        assert!(
            g.kv_take_oldest(&mut kv, 4).is_err(),
            "the newest page stays"
        );
        let copied = g.kv_copy_oldest(&kv, 2).unwrap();
        let moved = g.kv_take_oldest(&mut kv, 2).unwrap();
        let moved_c = c.kv_take_oldest(&mut kvc, 2).unwrap();
        assert_eq!(
            (g.kv_offloaded(&kv), c.kv_offloaded(&kvc)),
            (2 * ps, 2 * ps)
        );
        for ((a, b), cp) in moved.iter().zip(&moved_c).zip(&copied) {
            assert_eq!((a.start(), a.len()), (b.start(), b.len()));
            let n = ps * hkv * hd;
            let read = |p: &backburner_kernels::kv::KvPage| {
                let (mut k, mut v) = (vec![0.0; n], vec![0.0; n]);
                p.read_rows(0, ps, &mut k, &mut v);
                (k, v)
            };
            assert_eq!(read(a), read(b), "{dtype:?}: a page's stored values");
            assert_eq!(read(cp), read(b), "{dtype:?}: the copy");
        }
        // decode and a 3-token step after the move: the worker's partial over the moved pages, then the fold
        let mut pos0 = t;
        for (call, n) in [(0u64, 1usize), (1, 3)] {
            let (k, kc) = both(&g, &rand_vec(n * hkv * hd, 210 + call, 1.0));
            let (v, vc) = both(&g, &rand_vec(n * hkv * hd, 220 + call, 1.0));
            g.kv_append(&mut kv, &k, &v, n).unwrap();
            c.kv_append(&mut kvc, &kc, &vc, n).unwrap();
            let qh = rand_vec(n * hq * hd, 230 + call, 1.0);
            let (q, qc) = both(&g, &qh);
            let scale = 1.0 / (hd as f32).sqrt();
            let prefix = attend_pages(&qh, n, hq, pos0, &moved_c, scale, None);
            let (mut o, mut l) = (g.zeros(0).unwrap(), g.zeros(0).unwrap());
            let (mut oc, mut lc) = (c.zeros(0).unwrap(), c.zeros(0).unwrap());
            let p2 = prefix.clone();
            g.attend_after(&kv, prefix, &q, n, hq, pos0, scale, &mut o, &mut l)
                .unwrap();
            c.attend_after(&kvc, p2, &qc, n, hq, pos0, scale, &mut oc, &mut lc)
                .unwrap();
            let what = format!("{dtype:?}, {n} tokens after the move");
            close_scaled(
                &format!("{what}: o"),
                &host(g.as_ref(), &o),
                &host(&c, &oc),
                1e-4,
            );
            close_scaled(
                &format!("{what}: lse"),
                &host(g.as_ref(), &l),
                &host(&c, &lc),
                1e-4,
            );
            pos0 += n;
        }
        // going back: not below the positions held elsewhere, except to a page boundary inside them
        assert!(g.kv_truncate(&mut kv, ps).is_err());
        g.kv_truncate(&mut kv, 2 * ps + 3).unwrap();
        assert_eq!(kv.len, 2 * ps + 3);
        assert!(g.kv_truncate_offloaded(&mut kv, ps + 1).is_err());
        g.kv_truncate_offloaded(&mut kv, ps).unwrap();
        assert_eq!((kv.len, g.kv_offloaded(&kv)), (ps, ps));
    }
}

/// A fork's copy of a cache (`kv_clone`): the same positions and offloaded count, attention over it equal to the
/// source's bit for bit (the same kernel on a copy of the same rows), and the source's later appends not in it.
#[test]
fn a_cloned_cache_attends_as_its_source_and_stays_apart() {
    let Some(g) = gpu("a_cloned_cache_attends_as_its_source_and_stays_apart") else {
        return;
    };
    let (hq, hkv, hd, ps) = (4, 2, 64, 16);
    for dtype in [KvDtype::F16, KvDtype::F32] {
        let mut kv = g.kv_new(ps, hkv, hd, dtype).unwrap();
        let t = 2 * ps + 3;
        let (k, _) = both(&g, &rand_vec(t * hkv * hd, 300, 1.0));
        let (v, _) = both(&g, &rand_vec(t * hkv * hd, 301, 1.0));
        g.kv_append(&mut kv, &k, &v, t).unwrap();
        let clone = g.kv_clone(&kv).unwrap();
        assert_eq!((clone.len, g.kv_offloaded(&clone)), (t, 0));
        let attend = |kv: &backburner_model::device::DeviceKv| {
            let (q, _) = both(&g, &rand_vec(hq * hd, 302, 1.0));
            let (mut o, mut l) = (g.zeros(0).unwrap(), g.zeros(0).unwrap());
            g.attend(kv, &q, 1, hq, t - 1, 0.125, &mut o, &mut l)
                .unwrap();
            (host(g.as_ref(), &o), host(g.as_ref(), &l))
        };
        let want = attend(&kv);
        // the source grows past the clone: the clone keeps its t positions
        let (k1, _) = both(&g, &rand_vec(hkv * hd, 303, 1.0));
        g.kv_append(&mut kv, &k1, &k1, 1).unwrap();
        assert_eq!((kv.len, clone.len), (t + 1, t));
        let got = attend(&clone);
        let b = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        assert_eq!(
            (b(&got.0), b(&got.1)),
            (b(&want.0), b(&want.1)),
            "{dtype:?}"
        );
    }
}
