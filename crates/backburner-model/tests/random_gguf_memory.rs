//! The random GGUF generator's memory, measured with a counting allocator (a process of its own, so that no other
//! test allocates meanwhile): writing a file of ~80 MB through a 1 MiB buffer holds little more than the buffer.

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

use backburner_model::gguf::random::{Generator, TypeRule, Vocab};
use backburner_model::gguf::GgmlType;
use backburner_model::{synthetic, ModelConfig};

/// The system allocator, counting the bytes held and their peak.
struct Counting;

static HELD: AtomicUsize = AtomicUsize::new(0);
static PEAK: AtomicUsize = AtomicUsize::new(0);

fn grew(n: usize) {
    let now = HELD.fetch_add(n, Ordering::SeqCst) + n;
    PEAK.fetch_max(now, Ordering::SeqCst);
}

// SAFETY: every call is forwarded to the system allocator unchanged; the counters only observe sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        // SAFETY: the caller's contract for `alloc` is passed on.
        unsafe { System.alloc(l) }
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        HELD.fetch_sub(l.size(), Ordering::SeqCst);
        // SAFETY: as above.
        unsafe { System.dealloc(p, l) }
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        grew(l.size());
        // SAFETY: as above.
        unsafe { System.alloc_zeroed(l) }
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, new: usize) -> *mut u8 {
        if new > l.size() {
            grew(new - l.size());
        } else {
            HELD.fetch_sub(l.size() - new, Ordering::SeqCst);
        }
        // SAFETY: as above.
        unsafe { System.realloc(p, l, new) }
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Counts the bytes written and drops them.
struct Sink(u64);

impl std::io::Write for Sink {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0 += b.len() as u64;
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn writing_a_large_file_holds_little_more_than_its_buffer() {
    let mut cfg = synthetic::tiny_config(4);
    cfg["hidden_size"] = 256.into();
    cfg["vocab_size"] = 32768.into();
    let c = ModelConfig::from_json_str(&cfg.to_string()).unwrap();
    let rule = TypeRule::parse("F32", &["ffn=Q4_K".into(), "attn_qkv=IQ2_XS".into()]).unwrap();
    let g = Generator::new(&c, &rule, &Vocab::ByteLevel, 1).unwrap();
    for t in [GgmlType::F32, GgmlType::Q4K, GgmlType::Iq2Xs] {
        assert!(g.tensors().iter().any(|p| p.ggml_type == t), "{t}");
    }
    // the thread pool's own allocations are not the generator's
    rayon::broadcast(|_| ());
    let buffer = 1 << 20;
    let before = HELD.load(Ordering::SeqCst);
    PEAK.store(before, Ordering::SeqCst);
    let mut sink = Sink(0);
    let stats = g.write_to(&mut sink, buffer, &mut |_| {}).unwrap();
    let extra = PEAK.load(Ordering::SeqCst) - before;
    assert_eq!(sink.0, g.file_bytes());
    assert!(g.file_bytes() > 64 * buffer as u64, "{}", g.file_bytes());
    assert!(stats.largest_write <= buffer);
    assert!(
        extra < buffer + (256 << 10),
        "{extra} bytes held at the peak for a 1 MiB buffer"
    );
}
