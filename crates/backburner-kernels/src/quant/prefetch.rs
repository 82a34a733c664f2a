//! How the decode kernel prefetches the panels it streams from memory ([`Prefetch`]), chosen per format
//! ([`super::fmt::Fmt::prefetch`]), instruction set and CPU vendor, as measured.

use super::isa::QIsa;

/// How the decode kernel prefetches a panel in software while it streams it from memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Prefetch {
    /// Every 64-byte line of each 32-block, 12 KiB ahead: the formats' default, and the choice of every format where
    /// [`Prefetch::Hardware`] was not measured better (Intel's cores, the AVX2 and plain-Rust kernels, the 2-bit
    /// planes). Tuned on an Intel Xeon VM, where one line per block gave the K-quants a 25–30 % lower share of the
    /// read bandwidth (docs/BENCHMARKS.md).
    EveryLine,
    /// One 64-byte line per 32-block (for Q8_0: per 544-byte unit), 16 KiB (four 4 KiB pages) ahead: for units read
    /// line by line upwards (Q8_0 where [`QIsa::ORDERED_LOAD8`]), which the hardware prefetcher follows within a
    /// page; the hint starts each next page early. Measured with `bench local` on a Q8_0 file, alternating: 6–13 %
    /// more decode tokens/s at 1 thread than every line, and no hint at all slower than either (docs/BENCHMARKS.md).
    /// Only while one thread streams: with two, Q8_0 goes without hints ([`Prefetch::Hardware`]; an earlier
    /// whole-model alternation had found every line better, 83 → 87 %, before the other formats dropped their
    /// hints). And only on AMD cores,
    /// where those figures were measured: on an Intel Xeon one line per unit left a lone Q8_0 stream 23 % slower than
    /// every line (decode 102.9 against 133.5 tok/s, 5 alternating rounds; [`lone_stream_prefetcher`]).
    OneLine,
    /// Every 64-byte line of each 32-block, 6 KiB ahead, with a hint for one use (`prefetchnta`): the formats read
    /// in address order on AMD cores of family 0x1A or later (Zen 5) running the AVX-512 kernels
    /// ([`near_streams`]). On the 2-vCPU AMD EPYC (Zen 5) VM, 27B MLP shapes, `qdecode_27b` (share of a read of the
    /// same bytes, which live in huge pages), 1 thread, alternating runs of 3 rounds: [`Prefetch::EveryLine`]
    /// (12 KiB, `prefetcht1`) Q4_K 83–84 %, Q5_K 73–78 %, Q6_K 73 %, IQ4_XS 81–82 %; every line at other distances
    /// with `prefetcht1` at best 90–92 / 82–84 / 84 / 90–91 % (6 KiB); with `prefetchnta` (or `prefetcht0`, a
    /// little behind) at 6 KiB 94–97 / 93 / 93–94 / 97–101 %, at 8 KiB 99–100 / 90–92 / 93–94 / 101–103 %, at 12 KiB
    /// 94–96 / 88–91 / 86 / 97 %, at 4 KiB 93–94 / 83–84 / 86–88 / 88–94 %. At 2 threads (2 runs, the second
    /// vCPU's share of the memory moving between runs): 88–99 % against 70–88 %. Hardware prefetch alone was far
    /// behind on this core ([`hardware_streams_suffice`]).
    Near,
    /// No software prefetch: the core's hardware prefetchers alone, for units read in address order with few
    /// instructions per byte (the K-quants, Q4_0, IQ4_XS, and the generic formats with 4- to 8-bit codes) where
    /// [`hardware_streams_suffice`]. On the AMD EPYC (Zen 4) VM, at the 27B's MLP shapes, 1 thread, alternating
    /// (`cargo bench -p backburner-kernels --bench qdecode_27b`): Q4_K 70–75 → 92–98 % of a read of the same bytes,
    /// Q5_K 73–75 → 87–90 %, Q6_K 72–76 → 81–94 %, IQ4_XS (with its scales first) 72–75 → 79–86 % (89–91 % in its
    /// later reading-order layout, see the module docs), Q3_K, IQ3_S, Q4_0, Q4_1, Q5_0, Q5_1, IQ3_XXS, IQ4_NL,
    /// MXFP4 from 68–76 % to 83–102 %: the software prefetches of every line took fill buffers from the demand
    /// stream. Not for the 2-bit planes (Q2_K, TQ*, IQ2_*, IQ1_*: 62–85 % without against 70–95 % with), which keep
    /// [`Prefetch::EveryLine`]. Q8_0 with two or more tasks streaming at once (27B MLP shapes, 2 threads, 6
    /// alternations of the three policies): 85 % of a 61 GB/s read and 99–100 % of a 33–37 GB/s one, against every
    /// line's 67 % and 90–94 %, and one line per unit's 98–99 % of the slower read; whole-model decode (8 rounds) a
    /// median 9.49 tok/s against every line's 7.23.
    Hardware,
}

/// Whether the formats of [`Prefetch::Hardware`] should go without software prefetches on this core with ISA `I`:
/// an AMD core ([`lone_stream_prefetcher`]) of family 0x19 or older ([`amd_zen4_or_older`]: Zen 4, the one with
/// AVX-512) running the AVX-512 kernels ([`QIsa::ORDERED_LOAD8`]), where it was measured; Zen 5 takes
/// [`Prefetch::Near`] ([`near_streams`]); elsewhere (the Intel Xeon VM the 12 KiB distance was tuned on, the AVX2
/// and plain-Rust kernels) they keep [`Prefetch::EveryLine`].
///
/// Zen 5 (family 0x1A), 2 vCPUs of an AMD EPYC VM, 27B MLP shapes, 1 thread, 1 row, alternating runs of
/// `qverify_27b` (3 pairs): Q4_K 5.1 → 4.0–4.5 ms, Q5_K 8.0–9.7 → 5.5–5.9 ms, Q6_K 9.5–11.6 → 6.4–6.8 ms, IQ4_XS
/// 4.7–5.1 → 3.8–4.0 ms from hardware prefetch alone to every line; `qdecode_27b` (3 pairs, share of a read of the
/// same bytes): Q5_K 47–49 → 81 %, Q6_K 41–47 → 65–75 %, Q4_K 80–83 → 84–89 %, IQ4_XS 64–83 → 89–94 %.
#[inline(always)]
pub(crate) fn hardware_streams_suffice<I: QIsa>() -> bool {
    I::ORDERED_LOAD8 && lone_stream_prefetcher() && amd_zen4_or_older()
}

/// Whether the CPU's family (CPUID leaf 1, base plus extended family) is at most 0x19 (AMD's Zen 3 and Zen 4; Zen
/// 5 is 0x1A).
pub(crate) fn amd_zen4_or_older() -> bool {
    static OLD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OLD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            #[allow(unused_unsafe)]
            // SAFETY: CPUID leaf 1 exists on every x86-64 CPU.
            let eax = unsafe { std::arch::x86_64::__cpuid(1) }.eax;
            let base = (eax >> 8) & 0xF;
            let family = if base == 0xF {
                base + ((eax >> 20) & 0xFF)
            } else {
                base
            };
            family <= 0x19
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}

/// Whether the formats read in address order take [`Prefetch::Near`] on this core with ISA `I`: an AMD core of
/// family 0x1A or later (Zen 5) running the AVX-512 kernels, where it was measured.
#[inline(always)]
pub(crate) fn near_streams<I: QIsa>() -> bool {
    I::ORDERED_LOAD8 && lone_stream_prefetcher() && !amd_zen4_or_older()
}

/// [`Prefetch::Hardware`] where [`hardware_streams_suffice`], [`Prefetch::Near`] where [`near_streams`], else
/// [`Prefetch::EveryLine`]: the choice of the formats read in address order.
#[inline(always)]
pub(crate) fn in_order_prefetch<I: QIsa>() -> Prefetch {
    if hardware_streams_suffice::<I>() {
        Prefetch::Hardware
    } else if near_streams::<I>() {
        Prefetch::Near
    } else {
        Prefetch::EveryLine
    }
}

/// Whether the core's hardware stream prefetcher keeps up with one Q8_0 stream read upwards with only
/// [`Prefetch::OneLine`]'s hint: AMD's (CPUID vendor `AuthenticAMD`), measured so; not an Intel Xeon's.
pub(crate) fn lone_stream_prefetcher() -> bool {
    static AMD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *AMD.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            #[allow(unused_unsafe)]
            // SAFETY: CPUID leaf 0 exists on every x86-64 CPU.
            let r = unsafe { std::arch::x86_64::__cpuid(0) };
            let vendor = [r.ebx, r.edx, r.ecx].map(u32::to_le_bytes).concat();
            vendor == b"AuthenticAMD"
        }
        #[cfg(not(target_arch = "x86_64"))]
        false
    })
}
