//! ggml tensor types: their ids in GGUF files and their block sizes (elements and bytes per block), so that a
//! tensor's byte size can be checked for every standard type, including the ones we cannot compute with.
//!
//! Ids and sizes are those of `GGMLQuantizationType` / `GGML_QUANT_SIZES` in llama.cpp's `gguf-py/gguf/constants.py`.

/// The storage type of a GGUF tensor.
///
/// The types a checkpoint of this engine's models is likely to use have their own variant; every other id is
/// [`GgmlType::Other`] (its block size is still known for the standard ones: I8, I16, I32, I64, F64, Q8_1, NVFP4,
/// Q1_0, Q2_0).
#[allow(non_camel_case_types)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum GgmlType {
    /// 32-bit float (id 0).
    F32,
    /// IEEE half (id 1).
    F16,
    /// bfloat16 (id 30).
    BF16,
    /// 4-bit, blocks of 32 with an f16 scale (id 2).
    Q4_0,
    /// 4-bit, blocks of 32 with f16 scale and min (id 3).
    Q4_1,
    /// 5-bit, blocks of 32 (id 6).
    Q5_0,
    /// 5-bit with min, blocks of 32 (id 7).
    Q5_1,
    /// 8-bit, blocks of 32 with an f16 scale (id 8).
    Q8_0,
    /// k-quant 2-bit, super-blocks of 256 (id 10).
    Q2K,
    /// k-quant 3-bit (id 11).
    Q3K,
    /// k-quant 4-bit (id 12).
    Q4K,
    /// k-quant 5-bit (id 13).
    Q5K,
    /// k-quant 6-bit (id 14).
    Q6K,
    /// k-quant 8-bit (id 15; intermediate type for dot products).
    Q8K,
    /// i-quant (id 16).
    Iq2Xxs,
    /// i-quant (id 17).
    Iq2Xs,
    /// i-quant (id 18).
    Iq3Xxs,
    /// i-quant (id 19).
    Iq1S,
    /// i-quant, blocks of 32 (id 20).
    Iq4Nl,
    /// i-quant (id 21).
    Iq3S,
    /// i-quant (id 22).
    Iq2S,
    /// i-quant (id 23).
    Iq4Xs,
    /// i-quant (id 29).
    Iq1M,
    /// ternary (id 34).
    Tq1_0,
    /// ternary (id 35).
    Tq2_0,
    /// microscaling fp4, blocks of 32 (id 39).
    Mxfp4,
    /// Any other id: a standard type without its own variant, or an id no ggml version defines
    /// ([`GgmlType::block`] tells which).
    Other(u32),
}

/// 256: elements per super-block of the k-quants and i-quants.
const QK_K: usize = 256;

impl GgmlType {
    /// The type for a GGUF type id. Never fails: unknown ids become [`GgmlType::Other`].
    pub fn from_u32(t: u32) -> Self {
        use GgmlType::*;
        match t {
            0 => F32,
            1 => F16,
            2 => Q4_0,
            3 => Q4_1,
            6 => Q5_0,
            7 => Q5_1,
            8 => Q8_0,
            10 => Q2K,
            11 => Q3K,
            12 => Q4K,
            13 => Q5K,
            14 => Q6K,
            15 => Q8K,
            16 => Iq2Xxs,
            17 => Iq2Xs,
            18 => Iq3Xxs,
            19 => Iq1S,
            20 => Iq4Nl,
            21 => Iq3S,
            22 => Iq2S,
            23 => Iq4Xs,
            29 => Iq1M,
            30 => BF16,
            34 => Tq1_0,
            35 => Tq2_0,
            39 => Mxfp4,
            other => Other(other),
        }
    }

    /// The GGUF type id.
    pub fn id(self) -> u32 {
        use GgmlType::*;
        match self {
            F32 => 0,
            F16 => 1,
            Q4_0 => 2,
            Q4_1 => 3,
            Q5_0 => 6,
            Q5_1 => 7,
            Q8_0 => 8,
            Q2K => 10,
            Q3K => 11,
            Q4K => 12,
            Q5K => 13,
            Q6K => 14,
            Q8K => 15,
            Iq2Xxs => 16,
            Iq2Xs => 17,
            Iq3Xxs => 18,
            Iq1S => 19,
            Iq4Nl => 20,
            Iq3S => 21,
            Iq2S => 22,
            Iq4Xs => 23,
            Iq1M => 29,
            BF16 => 30,
            Tq1_0 => 34,
            Tq2_0 => 35,
            Mxfp4 => 39,
            Other(t) => t,
        }
    }

    /// The name llama.cpp's Python tools use (`F32`, `Q4_K`, `IQ2_XXS`, …); `type<id>` for an id no ggml version
    /// defines.
    pub fn name(self) -> String {
        use GgmlType::*;
        let s = match self {
            F32 => "F32",
            F16 => "F16",
            BF16 => "BF16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q2K => "Q2_K",
            Q3K => "Q3_K",
            Q4K => "Q4_K",
            Q5K => "Q5_K",
            Q6K => "Q6_K",
            Q8K => "Q8_K",
            Iq2Xxs => "IQ2_XXS",
            Iq2Xs => "IQ2_XS",
            Iq3Xxs => "IQ3_XXS",
            Iq1S => "IQ1_S",
            Iq4Nl => "IQ4_NL",
            Iq3S => "IQ3_S",
            Iq2S => "IQ2_S",
            Iq4Xs => "IQ4_XS",
            Iq1M => "IQ1_M",
            Tq1_0 => "TQ1_0",
            Tq2_0 => "TQ2_0",
            Mxfp4 => "MXFP4",
            Other(9) => "Q8_1",
            Other(24) => "I8",
            Other(25) => "I16",
            Other(26) => "I32",
            Other(27) => "I64",
            Other(28) => "F64",
            Other(40) => "NVFP4",
            Other(41) => "Q1_0",
            Other(42) => "Q2_0",
            Other(t) => return format!("type{t}"),
        };
        s.to_string()
    }

    /// `(elements, bytes)` per block, or `None` for an id no current ggml defines (including the removed
    /// Q4_2/Q4_3 and the repacked Q4_0_4_4-style ids 31–33 and 36–38, which files no longer carry).
    pub fn block(self) -> Option<(usize, usize)> {
        use GgmlType::*;
        let b = match self {
            F32 => (1, 4),
            F16 | BF16 => (1, 2),
            Q4_0 => (32, 2 + 16),
            Q4_1 => (32, 2 + 2 + 16),
            Q5_0 => (32, 2 + 4 + 16),
            Q5_1 => (32, 2 + 2 + 4 + 16),
            Q8_0 => (32, 2 + 32),
            Q2K => (QK_K, 2 + 2 + QK_K / 16 + QK_K / 4),
            Q3K => (QK_K, 2 + QK_K / 4 + QK_K / 8 + 12),
            Q4K => (QK_K, 2 + 2 + QK_K / 2 + 12),
            Q5K => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 8 + 12),
            Q6K => (QK_K, 2 + QK_K / 2 + QK_K / 4 + QK_K / 16),
            Q8K => (QK_K, 4 + QK_K + QK_K / 8),
            Iq2Xxs => (QK_K, 2 + QK_K / 4),
            Iq2Xs => (QK_K, 2 + QK_K / 4 + QK_K / 32),
            Iq3Xxs => (QK_K, 2 + QK_K / 4 + QK_K / 8),
            Iq1S => (QK_K, 2 + QK_K / 8 + QK_K / 16),
            Iq4Nl => (32, 2 + 16),
            Iq3S => (QK_K, 2 + QK_K / 4 + QK_K / 8 + QK_K / 32 + 4),
            Iq2S => (QK_K, 2 + QK_K / 4 + QK_K / 16),
            Iq4Xs => (QK_K, 2 + 2 + QK_K / 2 + QK_K / 64),
            Iq1M => (QK_K, QK_K / 8 + QK_K / 16 + QK_K / 32),
            Tq1_0 => (QK_K, 2 + 4 * 13),
            Tq2_0 => (QK_K, 2 + 64),
            Mxfp4 => (32, 1 + 16),
            Other(9) => (32, 2 + 2 + 32),
            Other(24) => (1, 1),
            Other(25) => (1, 2),
            Other(26) => (1, 4),
            Other(27) | Other(28) => (1, 8),
            Other(40) => (64, 4 + 32),
            Other(41) => (128, 2 + 16),
            Other(42) => (64, 2 + 16),
            Other(_) => return None,
        };
        Some(b)
    }
}

impl std::fmt::Display for GgmlType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gguf_type_ids_round_trip_and_sizes_match_llama_cpp() {
        for id in 0..64u32 {
            let t = GgmlType::from_u32(id);
            assert_eq!(t.id(), id);
        }
        // Spot checks against GGML_QUANT_SIZES.
        assert_eq!(GgmlType::Q4K.block(), Some((256, 144)));
        assert_eq!(GgmlType::Q6K.block(), Some((256, 210)));
        assert_eq!(GgmlType::Q8_0.block(), Some((32, 34)));
        assert_eq!(GgmlType::Q2K.block(), Some((256, 84)));
        assert_eq!(GgmlType::Q3K.block(), Some((256, 110)));
        assert_eq!(GgmlType::Q5K.block(), Some((256, 176)));
        assert_eq!(GgmlType::Iq4Xs.block(), Some((256, 136)));
        assert_eq!(GgmlType::Iq1M.block(), Some((256, 56)));
        assert_eq!(GgmlType::BF16.block(), Some((1, 2)));
        assert_eq!(GgmlType::from_u32(28).name(), "F64");
        // Removed or never-defined ids have no size.
        for id in [4, 5, 31, 32, 33, 36, 37, 38, 43, 1000] {
            assert_eq!(GgmlType::from_u32(id).block(), None, "id {id}");
        }
        assert_eq!(GgmlType::from_u32(12).name(), "Q4_K");
        assert_eq!(GgmlType::from_u32(1000).name(), "type1000");
    }
}
