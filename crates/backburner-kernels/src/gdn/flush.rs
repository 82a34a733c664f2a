//! Subnormal floats flushed to zero while a Gated DeltaNet head runs.
//!
//! The decays of the delta rule (`exp(g)`, and in the chunked form `exp(γ_i − γ_j)` across a chunk) make values
//! below f32's smallest normal (2^-126 ≈ 1.2e-38) whenever a head forgets fast: a state scaled by `exp(-100)`, the
//! far corner of a 64-token chunk's decay matrix. Intel cores run every operation with a subnormal input or output
//! through a microcode assist (about a hundred cycles), so such a head ran several times slower: on the bench model
//! the chunked delta rule of a 2,048-token prefill took 716 ms at 1 thread with them and 300 ms flushed
//! (docs/BENCHMARKS.md). Flushing changes only results below 2^-126 (and reads inputs below it as zero); such values
//! decay further or are added to normal values whose last bit they cannot reach, so an output changes only where
//! it is itself within a few binades of 2^-126 (the bench files' logits over a 1,500-token prompt and 16 greedy
//! steps are bit-identical with and without the flush).
//!
//! x86-64 only (MXCSR's FTZ and DAZ bits); other architectures keep IEEE subnormals.

/// While alive, this thread's SSE/AVX arithmetic flushes subnormal results to zero (FTZ) and reads subnormal
/// inputs as zero (DAZ); dropping it restores the thread's previous mode. Create it on the thread that computes (a
/// rayon task), around the whole head.
pub(super) struct FlushSubnormals {
    #[cfg(target_arch = "x86_64")]
    saved: u32,
}

/// MXCSR's flush-to-zero (bit 15) and denormals-are-zero (bit 6) bits.
#[cfg(target_arch = "x86_64")]
const FTZ_DAZ: u32 = (1 << 15) | (1 << 6);

impl FlushSubnormals {
    /// Sets FTZ and DAZ on this thread until the guard drops.
    #[inline]
    pub(super) fn new() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            let saved = read_mxcsr();
            write_mxcsr(saved | FTZ_DAZ);
            FlushSubnormals { saved }
        }
        #[cfg(not(target_arch = "x86_64"))]
        FlushSubnormals {}
    }
}

impl Drop for FlushSubnormals {
    #[inline]
    fn drop(&mut self) {
        #[cfg(target_arch = "x86_64")]
        write_mxcsr(self.saved);
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn read_mxcsr() -> u32 {
    let mut csr = 0u32;
    // SAFETY: stores the 4-byte MXCSR into a local; SSE is part of x86-64.
    unsafe {
        std::arch::asm!("stmxcsr [{}]", in(reg) &mut csr, options(nostack, preserves_flags));
    }
    csr
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn write_mxcsr(csr: u32) {
    // SAFETY: loads MXCSR from a local holding a value read from MXCSR with only the FTZ/DAZ bits changed (no
    // reserved bit set, so no fault). The asm block is not `nomem`: the compiler keeps memory accesses on their side
    // of it, so the head's loads and stores run under the mode set here.
    unsafe {
        std::arch::asm!("ldmxcsr [{}]", in(reg) &csr, options(nostack, preserves_flags));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subnormals_flush_inside_the_guard_and_survive_outside_it() {
        let tiny = std::hint::black_box(f32::MIN_POSITIVE);
        let half = std::hint::black_box(0.5f32);
        let before = std::hint::black_box(tiny * half);
        assert!(before > 0.0 && before.is_subnormal());
        let inside = {
            let _g = FlushSubnormals::new();
            std::hint::black_box(std::hint::black_box(tiny) * std::hint::black_box(half))
        };
        let after = std::hint::black_box(tiny * half);
        if cfg!(target_arch = "x86_64") {
            assert_eq!(inside.to_bits(), 0, "FTZ inside the guard");
        } else {
            assert!(inside.is_subnormal());
        }
        assert_eq!(after.to_bits(), before.to_bits(), "the mode is restored");
    }
}
