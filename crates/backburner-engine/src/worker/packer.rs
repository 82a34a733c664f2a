//! Frozen pages re-laid for the attention kernel in the background (KV offload, docs/KV_OFFLOAD.md): a page a worker
//! stores never changes, so a per-session thread copies each new page into the head-major layout
//! ([`PackedPage`]) and swaps it in place of the block-major copy when done. Attention requests read whichever
//! copy a page has when they start (the same bits either way) and never wait for the packer.

use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};

use backburner_kernels::kv::{KvDtype, PackedPage, PageView, RowsRef};
use half::{bf16, f16};

use super::pages::PageShape;

/// A stored page's elements: block-major as received, or packed.
#[derive(Debug)]
pub(super) enum PageData {
    /// K and V storage in the block layout, f16.
    F16(Vec<f16>, Vec<f16>),
    /// K and V storage in the block layout, f32.
    F32(Vec<f32>, Vec<f32>),
    /// K and V storage in the block layout (pairs side by side), bf16.
    Bf16(Vec<bf16>, Vec<bf16>),
    /// The head-major copy.
    Packed(PackedPage),
}

impl PageData {
    /// The kernel's view of the page at `start` of `shape`.
    pub(super) fn view(&self, start: usize, shape: &PageShape) -> PageView<'_> {
        let (k, v) = match self {
            PageData::Packed(p) => return p.view(),
            PageData::F16(k, v) => (RowsRef::F16(k), RowsRef::F16(v)),
            PageData::F32(k, v) => (RowsRef::F32(k), RowsRef::F32(v)),
            PageData::Bf16(k, v) => (RowsRef::Bf16(k), RowsRef::Bf16(v)),
        };
        PageView::new(
            start,
            shape.page_size,
            shape.n_kv_heads,
            shape.head_dim,
            k,
            v,
        )
        .expect("stored pages have whole blocks of the session's shape")
    }

    /// Whether this is the packed copy.
    pub(super) fn is_packed(&self) -> bool {
        matches!(self, PageData::Packed(_))
    }

    /// Block-major data of `elems` elements per K and V from `k`, `v` little-endian bytes of `dtype`.
    pub(super) fn decode(dtype: KvDtype, k: &[u8], v: &[u8]) -> PageData {
        fn f16s(b: &[u8]) -> Vec<f16> {
            b.chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]))
                .collect()
        }
        fn bf16s(b: &[u8]) -> Vec<bf16> {
            b.chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]))
                .collect()
        }
        fn f32s(b: &[u8]) -> Vec<f32> {
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        }
        match dtype {
            KvDtype::F16 => PageData::F16(f16s(k), f16s(v)),
            KvDtype::F32 => PageData::F32(f32s(k), f32s(v)),
            KvDtype::Bf16 => PageData::Bf16(bf16s(k), bf16s(v)),
        }
    }
}

/// A page's current data, replaced once by the packer.
pub(super) type Slot = Arc<Mutex<Arc<PageData>>>;

/// Reads a slot's current data (a cheap `Arc` clone under a short lock).
pub(super) fn current(slot: &Slot) -> Arc<PageData> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).clone()
}

/// A session's packing thread, fed the slots of new pages; it stops when the session's store is dropped.
#[derive(Debug)]
pub(super) struct Packer {
    tx: Sender<(Slot, usize)>,
}

impl Packer {
    /// Starts the thread for pages of `shape`. `None` when no thread can be started (pages then stay block-major).
    pub(super) fn start(shape: PageShape) -> Option<Packer> {
        let (tx, rx) = channel::<(Slot, usize)>();
        std::thread::Builder::new()
            .name("bb-page-packer".into())
            .spawn(move || {
                for (slot, start) in rx {
                    if Arc::strong_count(&slot) == 1 {
                        continue; // dropped before its turn
                    }
                    let data = current(&slot);
                    if data.is_packed() {
                        continue;
                    }
                    let packed = PageData::Packed(PackedPage::pack(data.view(start, &shape)));
                    drop(data);
                    *slot.lock().unwrap_or_else(|p| p.into_inner()) = Arc::new(packed);
                }
            })
            .ok()?;
        Some(Packer { tx })
    }

    /// Queues a new page (at position `start`) for packing.
    pub(super) fn submit(&self, slot: &Slot, start: usize) {
        let _ = self.tx.send((slot.clone(), start));
    }
}
