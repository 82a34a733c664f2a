//! Zeroed storage for the weights that decode streams, carved from huge-page-backed slabs where the platform gives
//! them.
//!
//! A decode step reads every weight once, front to back, each thread a contiguous range: ~90 MB per token on the
//! bench model's IQ4_XS file. In 4 KiB pages that is a TLB miss every 4 KiB, and the hardware stream prefetchers stop
//! at every page boundary. Linux backs anonymous memory with 2 MiB pages only where it is asked to
//! (`madvise(MADV_HUGEPAGE)` under `transparent_hugepage=madvise`, the default of most distributions), and decides a
//! page's size when the page is first touched. So weights do not come from the global allocator (whose memory may be
//! touched already, and is not 2 MiB aligned): [`HugeBuf::zeroed`] carves them, 64-byte aligned, one after the
//! other from slabs of [`SLAB`] bytes, each a fresh anonymous mapping on a 2 MiB boundary advised so before any
//! write (the first of a few open slabs with room takes a buffer), and a buffer larger than half a slab gets a
//! mapping of its own. A small matrix then shares huge pages with its neighbours instead of sitting in base pages.
//!
//! A slab is unmapped when the last buffer carved from it is dropped; until then the bytes of its dropped buffers
//! stay mapped (they are not handed out again), which matters only to a process that loads and drops weights again
//! and again (a worker's sessions). The other cost in resident memory is the unused part of each slab's last touched
//! huge page, which is resident whole: on the bench model, +12 MB (+3.7 %) for the bf16 safetensors weights and
//! +2.6 MB (+2 %) for the IQ4_XS file; a matrix of its own mapping keeps its last partial huge page in base pages and
//! costs nothing. Off Linux, or when a mapping fails, buffers come from the global allocator: the advice is a hint,
//! never an error (the kernel may still decline it and use base pages).

use std::alloc::{alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ptr::NonNull;
use std::sync::{Arc, Mutex, Weak};

/// Bytes of a huge page (x86-64 and aarch64 with 4 KiB base pages).
pub const HUGE_PAGE: usize = 2 << 20;

/// Bytes of a shared slab (16 huge pages).
pub const SLAB: usize = 16 * HUGE_PAGE;

/// Alignment of every buffer: one cache line.
const LINE: usize = 64;

/// Element types a [`HugeBuf`] can be viewed as: plain numbers whose every bit pattern is valid, aligned to at
/// most 64 bytes.
pub trait Plain: Copy + sealed::Sealed {}
impl Plain for u8 {}
impl Plain for u16 {}
impl Plain for u32 {}
impl Plain for f32 {}

mod sealed {
    pub trait Sealed {}
    impl Sealed for u8 {}
    impl Sealed for u16 {}
    impl Sealed for u32 {}
    impl Sealed for f32 {}
}

/// One anonymous mapping, unmapped on drop.
struct Slab {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: a Slab is only an owner of memory; the buffers carved from it are disjoint and accessed through `HugeBuf`.
unsafe impl Send for Slab {}
// SAFETY: as above.
unsafe impl Sync for Slab {}

impl Drop for Slab {
    fn drop(&mut self) {
        unmap(self.ptr, self.len);
    }
}

/// Where a buffer's bytes live.
enum Backing {
    /// Carved from (or the whole of) a slab, which stays mapped while the `Arc` lives.
    Slab(#[allow(dead_code)] Arc<Slab>),
    /// The global allocator, with this layout.
    Heap(Layout),
}

/// The slabs open for carving, each with the bytes of it already handed out, oldest first (weak: a slab whose
/// buffers are all dropped is unmapped and leaves the list; carved bytes are never handed out twice, so they are
/// still zero). A buffer goes to the first slab with room, so a large one that starts a new slab does not end the
/// carving of the last: smaller ones fill its rest (the resident waste is the unused part of each open slab's last
/// touched huge page).
static OPEN: Mutex<Vec<(Weak<Slab>, usize)>> = Mutex::new(Vec::new());

/// Most slabs kept open for carving; past this the fullest one is closed.
const MAX_OPEN: usize = 4;

/// An owned, zero-initialised byte buffer, 64-byte aligned, in huge-page-backed memory where the platform gives it
/// (see the [module docs](self)).
pub struct HugeBuf {
    ptr: NonNull<u8>,
    len: usize,
    backing: Backing,
}

// SAFETY: HugeBuf owns its bytes exclusively (like `Vec<u8>`).
unsafe impl Send for HugeBuf {}
// SAFETY: shared access only reads.
unsafe impl Sync for HugeBuf {}

impl HugeBuf {
    /// `len` zero bytes. Panics (as `Vec` does) when `len` overflows a layout; aborts when out of memory.
    pub fn zeroed(len: usize) -> Self {
        if let Some(b) = Self::from_slabs(len) {
            return b;
        }
        let layout =
            Layout::from_size_align(len.max(1), LINE).expect("HugeBuf: size overflows a layout");
        // SAFETY: the layout has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            handle_alloc_error(layout)
        };
        HugeBuf {
            ptr,
            len,
            backing: Backing::Heap(layout),
        }
    }

    /// `len` bytes of a slab (a shared one, or one of its own past `SLAB / 2`), never touched before; `None` for
    /// `len == 0` or when no mapping can be made.
    fn from_slabs(len: usize) -> Option<Self> {
        if len == 0 {
            return None;
        }
        if len > SLAB / 2 {
            let slab = Arc::new(map_huge(len)?);
            return Some(HugeBuf {
                ptr: slab.ptr,
                len,
                backing: Backing::Slab(slab),
            });
        }
        let mut open = OPEN.lock().unwrap_or_else(|e| e.into_inner());
        open.retain(|(w, _)| w.strong_count() > 0);
        let fit = open.iter().enumerate().find_map(|(i, (w, used))| {
            let slab = w.upgrade()?;
            let at = used.next_multiple_of(LINE);
            (at.checked_add(len)? <= slab.len).then_some((i, slab, at))
        });
        let (slab, at) = match fit {
            Some((i, slab, at)) => {
                open[i].1 = at + len;
                (slab, at)
            }
            None => {
                let slab = Arc::new(map_huge(SLAB)?);
                if open.len() == MAX_OPEN {
                    let fullest = (0..open.len())
                        .max_by_key(|&i| open[i].1)
                        .expect("MAX_OPEN > 0");
                    open.remove(fullest);
                }
                open.push((Arc::downgrade(&slab), len));
                (slab, 0)
            }
        };
        // SAFETY: `at + len <= slab.len`: inside the mapping.
        let ptr = unsafe { NonNull::new_unchecked(slab.ptr.as_ptr().add(at)) };
        Some(HugeBuf {
            ptr,
            len,
            backing: Backing::Slab(slab),
        })
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `len` initialised bytes owned by self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, uniquely borrowed; no other buffer covers these bytes.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes as elements of `T` (`len / size_of::<T>()` of them; a trailing part of one is left out).
    pub fn view<T: Plain>(&self) -> &[T] {
        // SAFETY: the buffer is 64-byte aligned (≥ align_of::<T>() for every `Plain` type), initialised, and every bit
        // pattern is a valid `T`; the slice stays within `len` bytes.
        unsafe {
            std::slice::from_raw_parts(self.ptr.as_ptr().cast::<T>(), self.len / size_of::<T>())
        }
    }

    /// The bytes as elements of `T`, mutably (see [`HugeBuf::view`]).
    pub fn view_mut<T: Plain>(&mut self) -> &mut [T] {
        // SAFETY: as `view`, uniquely borrowed.
        unsafe {
            std::slice::from_raw_parts_mut(self.ptr.as_ptr().cast::<T>(), self.len / size_of::<T>())
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for HugeBuf {
    fn drop(&mut self) {
        if let Backing::Heap(layout) = self.backing {
            // SAFETY: allocated in `zeroed` with this layout.
            unsafe { dealloc(self.ptr.as_ptr(), layout) }
        }
    }
}

impl Clone for HugeBuf {
    fn clone(&self) -> Self {
        let mut b = HugeBuf::zeroed(self.len);
        b.as_mut_slice().copy_from_slice(self.as_slice());
        b
    }
}

impl PartialEq for HugeBuf {
    fn eq(&self, other: &Self) -> bool {
        self.as_slice() == other.as_slice()
    }
}

impl Eq for HugeBuf {}

impl std::fmt::Debug for HugeBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("HugeBuf").field("len", &self.len).finish()
    }
}

/// A fresh anonymous mapping of `len > 0` bytes (zero pages, none touched yet) starting on a huge-page boundary,
/// its whole huge pages advised `MADV_HUGEPAGE`; `None` off Linux or when the mapping fails.
#[cfg(target_os = "linux")]
fn map_huge(len: usize) -> Option<Slab> {
    let span = len.checked_add(HUGE_PAGE)?;
    // SAFETY: a private anonymous mapping at an address of the kernel's choice; nothing else refers to it.
    let raw = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            span,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if raw == libc::MAP_FAILED {
        return None;
    }
    let base = raw as usize;
    let start = base.next_multiple_of(HUGE_PAGE);
    let end = (start + len).next_multiple_of(page_size());
    // SAFETY: the head `[base, start)` and the tail `[end, base + span)` are page-aligned parts of the mapping just
    // made, unused; the advised range lies inside `[start, end)`. A failure leaves memory mapped or base pages: waste
    // or speed, never unsoundness.
    unsafe {
        if start > base {
            libc::munmap(raw, start - base);
        }
        if base + span > end {
            libc::munmap(end as *mut libc::c_void, base + span - end);
        }
        libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE);
    }
    Some(Slab {
        ptr: NonNull::new(start as *mut u8)?,
        len,
    })
}

#[cfg(not(target_os = "linux"))]
fn map_huge(_len: usize) -> Option<Slab> {
    None
}

/// Unmaps a mapping of [`map_huge`].
fn unmap(ptr: NonNull<u8>, len: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: `[ptr, ptr + len rounded up to a page)` is the mapping `map_huge` kept, unmapped once (by its Slab).
    unsafe {
        libc::munmap(ptr.as_ptr().cast(), len.next_multiple_of(page_size()));
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// The base page size (bytes).
#[cfg(target_os = "linux")]
fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|&p| p > 0).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_are_zero_aligned_and_disjoint() {
        let lens = [0, 1, 63, 64, 65, 4096, 1 << 20, 3 << 20, 5 << 20, 1];
        let mut bufs: Vec<HugeBuf> = lens.iter().map(|&l| HugeBuf::zeroed(l)).collect();
        for (b, &l) in bufs.iter().zip(&lens) {
            assert_eq!(b.len(), l);
            assert_eq!(b.as_slice().as_ptr() as usize % LINE, 0, "len {l}");
            assert!(b.as_slice().iter().all(|&x| x == 0), "len {l} not zero");
        }
        for (i, b) in bufs.iter_mut().enumerate() {
            b.as_mut_slice().fill(i as u8 + 1);
        }
        for (i, b) in bufs.iter().enumerate() {
            assert!(
                b.as_slice().iter().all(|&x| x == i as u8 + 1),
                "buffer {i} overwritten"
            );
        }
        let c = bufs[6].clone();
        assert_eq!(c, bufs[6]);
        assert_ne!(c.as_slice().as_ptr(), bufs[6].as_slice().as_ptr());
        assert_ne!(bufs[7], bufs[8]);
    }

    #[test]
    fn a_slab_fills_then_a_new_one_starts_and_dropped_slabs_give_zero_bytes_again() {
        // 5 MiB buffers: 6 of them pass one slab (32 MiB)
        for _ in 0..3 {
            let mut bufs: Vec<HugeBuf> = (0..8).map(|_| HugeBuf::zeroed(5 << 20)).collect();
            for (i, b) in bufs.iter_mut().enumerate() {
                assert!(b.as_slice().iter().all(|&x| x == 0));
                b.as_mut_slice().fill(0xa0 + i as u8);
            }
            for (i, b) in bufs.iter().enumerate() {
                assert!(b.as_slice().iter().all(|&x| x == 0xa0 + i as u8));
            }
        }
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_buffer_past_half_a_slab_is_its_own_mapping_on_a_huge_page_boundary() {
        let b = HugeBuf::zeroed(SLAB / 2 + 4096 + 7);
        assert_eq!(b.as_slice().as_ptr() as usize % HUGE_PAGE, 0);
        assert!(matches!(b.backing, Backing::Slab(_)));
        assert_eq!(b.as_slice()[SLAB / 2 + 4096 + 6], 0);
    }
}
