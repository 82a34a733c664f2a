//! The worker's page store for KV offload: pages taken from a host cache cross as bytes, are attended in place, and
//! the host continues the fold with the bits of the whole local cache; positions, truncation, the memory budget and
//! malformed puts and queries get typed errors.

use backburner_engine::worker::pages::{page_bytes, PageShape, SessionPages};
use backburner_engine::worker::MemoryBudget;
use backburner_kernels::kv::{KvDtype, PagedKvCache};
use backburner_link::ErrorCode;

const HKV: usize = 2;
const D: usize = 32;

fn values(n: usize, seed: u32) -> Vec<f32> {
    (0..n as u32)
        .map(|i| {
            (((i.wrapping_mul(2654435761) ^ seed.wrapping_mul(40503)) % 2001) as f32 / 1000.0) - 1.0
        })
        .collect()
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

#[test]
fn pages_attended_on_the_worker_continue_into_the_hosts_fold_bit_for_bit() {
    for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Bf16] {
        let shape = PageShape {
            page_size: 64,
            n_kv_heads: HKV,
            head_dim: D,
            dtype,
        };
        let budget = MemoryBudget::new(1 << 30);
        let mut store = SessionPages::new(shape, &budget).unwrap();
        let mut host = PagedKvCache::new(64, HKV, D, dtype);
        let n = 64 * 3 + 10;
        host.append(&values(n * HKV * D, 1), &values(n * HKV * D, 2), n);
        let whole = host.clone();
        let taken = host.take_oldest(2).unwrap();
        let bytes: Vec<u8> = taken
            .iter()
            .flat_map(|p| page_bytes(p.view(), &shape))
            .collect();
        // two layers' worth: layer 3 gets both pages in one put, layer 7 one at a time
        store.put(3, 0, 2, &bytes).unwrap();
        let half = bytes.len() / 2;
        store.put(7, 0, 1, &bytes[..half]).unwrap();
        store.put(7, 64, 1, &bytes[half..]).unwrap();
        assert_eq!(
            (store.positions(3), store.positions(7), store.pages()),
            (128, 128, 4)
        );
        assert_eq!(store.bytes(), 2 * bytes.len() as u64);
        assert_eq!(budget.used(), store.bytes());
        let scale = (D as f32).powf(-0.5);
        for (t, pos0) in [(1usize, n - 1), (9, n - 9)] {
            let q = values(t * 4 * D, 3 + t as u32);
            let want = whole.attend(&q, t, 4, pos0, scale);
            for layer in [3, 7] {
                let prefix = store.attend(layer, &q, t, 4, pos0, scale).unwrap();
                let got = host.attend_after(prefix, &q, t, 4, pos0, scale);
                assert_eq!(bits(&got.o), bits(&want.o), "{dtype:?} t={t} layer {layer}");
                assert_eq!(bits(&got.lse), bits(&want.lse));
            }
        }
        // truncation on page boundaries gives the bytes back
        assert_eq!(store.truncate(100).unwrap_err().code, ErrorCode::BadState);
        store.truncate(64).unwrap();
        assert_eq!((store.positions(3), store.pages()), (64, 2));
        assert_eq!(budget.used(), bytes.len() as u64);
        store.truncate(0).unwrap();
        assert_eq!((store.pages(), budget.used()), (0, 0));
    }
}

#[test]
fn malformed_puts_and_queries_and_a_full_budget_change_nothing() {
    let shape = PageShape {
        page_size: 64,
        n_kv_heads: HKV,
        head_dim: D,
        dtype: KvDtype::F16,
    };
    let per = shape.page_bytes().unwrap();
    assert_eq!(per, 2 * 64 * HKV * D * 2);
    let budget = MemoryBudget::new(per as u64 + 10);
    let mut s = SessionPages::new(shape, &budget).unwrap();
    let code = |r: Result<(), backburner_engine::worker::Fault>| r.unwrap_err().code;
    assert_eq!(
        code(s.put(0, 32, 1, &vec![0; per])),
        ErrorCode::BadState,
        "a run starts on a page boundary"
    );
    assert_eq!(
        code(s.put(0, 0, 1, &vec![0; per - 1])),
        ErrorCode::Malformed
    );
    assert_eq!(code(s.put(0, 0, 0, &[])), ErrorCode::Malformed);
    assert_eq!(
        code(s.put(0, 0, usize::MAX, &vec![0; per])),
        ErrorCode::Malformed
    );
    assert_eq!(
        code(s.put(0, 0, 2, &vec![0; 2 * per])),
        ErrorCode::OutOfMemory
    );
    assert_eq!((s.pages(), budget.used()), (0, 0));
    s.put(0, 0, 1, &vec![0; per]).unwrap();
    assert_eq!(
        code(s.put(0, 0, 1, &vec![0; per])),
        ErrorCode::BadState,
        "not the end of the run"
    );
    assert_eq!(code(s.put(0, 64, 1, &vec![0; per])), ErrorCode::OutOfMemory);
    assert_eq!(s.pages(), 1);
    let bad_q = |q: &[f32], t: usize, h: usize| s.attend(0, q, t, h, 70, 0.1).unwrap_err().code;
    assert_eq!(bad_q(&[0.0; 10], 1, 4), ErrorCode::Malformed);
    assert_eq!(
        bad_q(&[0.0; 3 * D], 1, 3),
        ErrorCode::Malformed,
        "heads not a multiple of the kv heads"
    );
    assert_eq!(bad_q(&[], usize::MAX, 4), ErrorCode::Malformed);
    // a layer with no pages gives the empty partial
    let p = s.attend(5, &[0.0; 4 * D], 1, 4, 70, 0.1).unwrap();
    assert!(p.lse.iter().all(|l| *l == f32::NEG_INFINITY));
    // pages whose size overflows are refused up front
    let huge = PageShape {
        page_size: usize::MAX,
        ..shape
    };
    assert!(SessionPages::new(huge, &budget).is_err());
    // bf16 pages pair dimensions: an odd head_dim is refused up front, not a panic at the first put
    let odd = PageShape {
        head_dim: 15,
        dtype: KvDtype::Bf16,
        ..shape
    };
    assert_eq!(
        SessionPages::new(odd, &budget).unwrap_err().code,
        ErrorCode::Malformed
    );
    let odd_f16 = PageShape {
        dtype: KvDtype::F16,
        ..odd
    };
    assert!(SessionPages::new(odd_f16, &budget).is_ok());
}

#[test]
fn bf16_pages_cross_as_their_raw_bits_in_the_block_layout() {
    // What `PagesPut` carries for a bf16 session: each element's u16 bits, little-endian, K then V, in the page's
    // block layout (pairs side by side): the same bytes as the page's storage, and 2 bytes an element.
    let shape = PageShape {
        page_size: 64,
        n_kv_heads: HKV,
        head_dim: D,
        dtype: KvDtype::Bf16,
    };
    let mut host = PagedKvCache::new(64, HKV, D, KvDtype::Bf16);
    host.append(&values(64 * HKV * D, 6), &values(64 * HKV * D, 7), 64);
    let page = &host.pages()[0];
    let bytes = page_bytes(page.view(), &shape);
    assert_eq!(bytes.len(), shape.page_bytes().unwrap());
    assert_eq!(bytes.len(), 2 * 64 * HKV * D * 2);
    let (backburner_kernels::kv::RowsRef::Bf16(k), backburner_kernels::kv::RowsRef::Bf16(v)) =
        (page.view().k(), page.view().v())
    else {
        panic!("bf16 storage");
    };
    let raw: Vec<u8> = k
        .iter()
        .chain(v.iter())
        .flat_map(|x| x.to_bits().to_le_bytes())
        .collect();
    assert_eq!(bytes, raw);
    // the first two K elements are dimensions 0 and 1 of position 0, head 0 (a pair)
    let k0 = values(64 * HKV * D, 6);
    let want: Vec<u8> = [k0[0], k0[1]]
        .iter()
        .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
        .collect();
    assert_eq!(&bytes[..4], &want[..]);
    // a store takes them as they are
    let budget = MemoryBudget::new(1 << 20);
    let mut store = SessionPages::new(shape, &budget).unwrap();
    store.put(3, 0, 1, &bytes).unwrap();
    assert_eq!((store.pages(), budget.used()), (1, bytes.len() as u64));
}

#[test]
fn pages_packed_in_the_background_give_the_same_bits_and_per_page_partials_too() {
    for dtype in [KvDtype::F16, KvDtype::F32, KvDtype::Bf16] {
        let shape = PageShape {
            page_size: 128,
            n_kv_heads: HKV,
            head_dim: D,
            dtype,
        };
        let budget = MemoryBudget::new(1 << 30);
        let mut plain = SessionPages::new(shape, &budget).unwrap();
        let mut packed = SessionPages::new(shape, &budget)
            .unwrap()
            .pack_in_background();
        let mut host = PagedKvCache::new(128, HKV, D, dtype);
        let n = 128 * 4 + 3;
        host.append(&values(n * HKV * D, 4), &values(n * HKV * D, 5), n);
        let taken = host.take_oldest(3).unwrap();
        let bytes: Vec<u8> = taken
            .iter()
            .flat_map(|p| page_bytes(p.view(), &shape))
            .collect();
        plain.put(3, 0, 3, &bytes).unwrap();
        packed.put(3, 0, 3, &bytes).unwrap();
        let t0 = std::time::Instant::now();
        while packed.packed_pages() < 3 {
            assert!(t0.elapsed().as_secs() < 20, "the pages were not packed");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        assert_eq!((plain.packed_pages(), plain.bytes()), (0, packed.bytes()));
        let scale = (D as f32).powf(-0.5);
        for (t, pos0) in [(1usize, n - 1), (7, n - 7)] {
            let q = values(t * 4 * D, 9 + t as u32);
            let a = plain.attend(3, &q, t, 4, pos0, scale).unwrap();
            let b = packed.attend(3, &q, t, 4, pos0, scale).unwrap();
            assert_eq!(
                (bits(&a.o), bits(&a.lse)),
                (bits(&b.o), bits(&b.lse)),
                "{dtype:?} t={t}"
            );
            let pa = plain.attend_each(3, &q, t, 4, pos0, scale).unwrap();
            let pb = packed.attend_each(3, &q, t, 4, pos0, scale).unwrap();
            assert_eq!(pa.len(), 3);
            assert!(pa == pb, "{dtype:?} t={t}: per-page partials differ");
        }
        // dropping pages drops their packed copies
        packed.truncate(128).unwrap();
        assert_eq!((packed.pages(), packed.packed_pages()), (1, 1));
    }
}
