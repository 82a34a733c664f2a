//! Valid files: every value type, arrays, tensors of several types, alignment padding, v2 and v3.

use super::super::{GgmlType, GgufFile, MetaArray, MetaValue};
use super::*;

/// A file with one pair of every scalar type, arrays of several element types, and five tensors.
fn rich_writer(version: u32) -> GgufWriter {
    let mut w = GgufWriter::new();
    w.version = version;
    w.kv("general.architecture", MetaValue::Str("qwen35".into()))
        .kv("t.u8", MetaValue::U8(200))
        .kv("t.i8", MetaValue::I8(-100))
        .kv("t.u16", MetaValue::U16(60_000))
        .kv("t.i16", MetaValue::I16(-30_000))
        .kv("t.u32", MetaValue::U32(4_000_000_000))
        .kv("t.i32", MetaValue::I32(-2_000_000_000))
        .kv("t.u64", MetaValue::U64(u64::MAX))
        .kv("t.i64", MetaValue::I64(i64::MIN))
        .kv("t.f32", MetaValue::F32(1.5e-6))
        .kv("t.f64", MetaValue::F64(-2.25))
        .kv("t.bool", MetaValue::Bool(true))
        .kv("t.str", MetaValue::Str("héllo ✓".into()))
        .kv("t.empty", MetaValue::Str(String::new()))
        .kv("a.u8", MetaValue::Array(MetaArray::U8(vec![1, 2, 3])))
        .kv(
            "a.i32",
            MetaValue::Array(MetaArray::I32(vec![11, 11, 10, 0])),
        )
        .kv("a.u64", MetaValue::Array(MetaArray::U64(vec![7, 1 << 40])))
        .kv("a.f32", MetaValue::Array(MetaArray::F32(vec![0.5, -1.0])))
        .kv(
            "a.bool",
            MetaValue::Array(MetaArray::Bool(vec![true, false, true])),
        )
        .kv("a.str", str_array(&["Ġt", "he", "", "<|im_end|>"]))
        .kv("a.empty", MetaValue::Array(MetaArray::I64(vec![])));
    w.tensor_filled("f32.weight", &[8, 3], GgmlType::F32, 1)
        .tensor_filled("f16.weight", &[16, 2], GgmlType::F16, 2)
        .tensor_filled("q8.weight", &[64, 2], GgmlType::Q8_0, 3)
        .tensor_filled("q4k.weight", &[256, 3], GgmlType::Q4K, 4)
        .tensor_filled("norm.weight", &[5], GgmlType::F32, 5);
    w
}

fn check_rich(f: &GgufFile, w: &GgufWriter) {
    let md = f.metadata();
    assert_eq!(md.len(), 21);
    assert_eq!(f.architecture(), Some("qwen35"));
    assert_eq!(md.get_u64("t.u8"), Some(200));
    assert_eq!(md.get("t.i8"), Some(&MetaValue::I8(-100)));
    assert_eq!(md.get_u64("t.u16"), Some(60_000));
    assert_eq!(md.get_i64("t.i16"), Some(-30_000));
    assert_eq!(md.get_u64("t.u32"), Some(4_000_000_000));
    assert_eq!(md.get_i64("t.i32"), Some(-2_000_000_000));
    assert_eq!(md.get_u64("t.u64"), Some(u64::MAX));
    assert_eq!(md.get_i64("t.i64"), Some(i64::MIN));
    assert_eq!(md.get_f64("t.f32"), Some(f64::from(1.5e-6f32)));
    assert_eq!(md.get_f64("t.f64"), Some(-2.25));
    assert_eq!(md.get_bool("t.bool"), Some(true));
    assert_eq!(md.get_str("t.str"), Some("héllo ✓"));
    assert_eq!(md.get_str("t.empty"), Some(""));
    assert_eq!(md.get_u64_array("a.u8"), Some(vec![1, 2, 3]));
    assert_eq!(md.get_i32_array("a.i32"), Some(vec![11, 11, 10, 0]));
    assert_eq!(md.get_u64_array("a.u64"), Some(vec![7, 1 << 40]));
    assert_eq!(md.get_i32_array("a.u64"), None, "1<<40 does not fit an i32");
    assert_eq!(
        md.get_array("a.f32"),
        Some(&MetaArray::F32(vec![0.5, -1.0]))
    );
    assert_eq!(
        md.get_array("a.bool"),
        Some(&MetaArray::Bool(vec![true, false, true]))
    );
    let s = md.get_str_array("a.str").unwrap();
    assert_eq!(s.iter().collect::<Vec<_>>(), ["Ġt", "he", "", "<|im_end|>"]);
    assert_eq!(md.get_array("a.empty").map(|a| a.len()), Some(0));
    assert_eq!(md.keys().next(), Some("general.architecture"));
    check_rich_tensors(f, w);
}

fn check_rich_tensors(f: &GgufFile, w: &GgufWriter) {
    assert_eq!(
        f.tensor_names(),
        [
            "f16.weight",
            "f32.weight",
            "norm.weight",
            "q4k.weight",
            "q8.weight"
        ]
    );
    let sizes = [(8 * 3 * 4), (16 * 2 * 2), (2 * 2 * 34), (3 * 144), (5 * 4)];
    let mut total = 0;
    for (t, size) in w.tensors.iter().zip(sizes) {
        let info = f.tensor(&t.name).unwrap();
        assert_eq!(info.dims, t.dims);
        assert_eq!(info.ggml_type.id(), t.type_id);
        assert_eq!(info.n_bytes, size, "{}", t.name);
        assert_eq!(info.offset % 32, 0, "{} aligned", t.name);
        assert_eq!(info.part, 0);
        assert_eq!(f.data(&t.name).unwrap(), &t.data[..], "{}", t.name);
        let mut chunks = Vec::new();
        f.read_chunks(&t.name, 7, |c| {
            assert!(c.len() <= 7);
            chunks.extend_from_slice(c)
        })
        .unwrap();
        assert_eq!(chunks, t.data, "{} read in chunks", t.name);
        f.release(&t.name);
        assert_eq!(
            f.data(&t.name).unwrap(),
            &t.data[..],
            "readable after release"
        );
        total += size;
    }
    assert_eq!(f.total_tensor_bytes(), total);
    assert_eq!(f.tensor("q4k.weight").unwrap().rows_cols(), Some((3, 256)));
    assert_eq!(f.tensor("norm.weight").unwrap().rows_cols(), Some((1, 5)));
    assert_eq!(f.tensor("q8.weight").unwrap().ggml_type, GgmlType::Q8_0);
    assert_eq!(f.tensor("q4k.weight").unwrap().n_elements(), 768);
    assert!(f.tensor("nope").is_none());
    assert!(matches!(
        f.data("nope"),
        Err(ModelError::MissingTensor { .. })
    ));
    assert!(matches!(
        f.read_chunks("nope", 8, |_| {}),
        Err(ModelError::MissingTensor { .. })
    ));
}

#[test]
fn gguf_v3_and_v2_files_read_back_every_value_type_and_tensor() {
    let d = tempfile::tempdir().unwrap();
    for version in [3, 2] {
        let w = rich_writer(version);
        let p = write_tmp(&w, d.path(), &format!("v{version}.gguf"));
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.version(), version);
        assert_eq!(f.paths(), std::slice::from_ref(&p));
        assert_eq!(f.alignment(), 32);
        check_rich(&f, &w);
    }
}

#[test]
fn gguf_alignment_comes_from_general_alignment() {
    let d = tempfile::tempdir().unwrap();
    let mut w = rich_writer(3);
    w.kv("general.alignment", MetaValue::U32(256));
    let bytes = w.to_bytes();
    let parsed = super::super::parse::parse(&bytes).unwrap();
    assert_eq!(parsed.alignment, 256);
    assert_eq!(parsed.data_start % 256, 0);
    let p = write_tmp(&w, d.path(), "a256.gguf");
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.alignment(), 256);
    for t in &w.tensors {
        assert_eq!(f.tensor(&t.name).unwrap().offset % 256, 0);
        assert_eq!(f.data(&t.name).unwrap(), &t.data[..]);
    }
    // Not a power of two, or not a u32: refused.
    let mut w = rich_writer(3);
    w.kv("general.alignment", MetaValue::U32(48));
    assert!(parse_err(&w.to_bytes()).contains("power of two"));
    let mut w = rich_writer(3);
    w.kv("general.alignment", MetaValue::U64(32));
    assert!(parse_err(&w.to_bytes()).contains("expected u32"));
}

#[test]
fn gguf_file_without_tensors_and_vocab_only_files_parse() {
    let mut w = GgufWriter::new();
    w.kv("tokenizer.ggml.model", MetaValue::Str("gpt2".into()));
    let bytes = w.to_bytes();
    let p = super::super::parse::parse(&bytes).unwrap();
    assert!(p.tensors.is_empty());
    assert_eq!(p.data_start, bytes.len() as u64);
}

#[test]
fn gguf_rows_cols_reads_ggml_dims_as_row_major_matrices() {
    let info = |dims: Vec<u64>| super::super::TensorInfo {
        name: "x".into(),
        dims,
        ggml_type: GgmlType::F32,
        part: 0,
        offset: 0,
        n_bytes: 0,
    };
    assert_eq!(info(vec![4, 8192]).rows_cols(), Some((8192, 4)));
    assert_eq!(info(vec![7]).rows_cols(), Some((1, 7)));
    assert_eq!(info(vec![3, 2, 1, 1]).rows_cols(), Some((2, 3)));
    assert_eq!(info(vec![3, 2, 5]).rows_cols(), None);
}

/// Every `ggml-vocab-*.gguf` llama.cpp ships parses (real files from its converter). Set
/// `BACKBURNER_LLAMACPP_MODELS` to llama.cpp's `models/` directory to run it.
#[test]
fn gguf_llama_cpp_vocab_files_parse_when_available() {
    let Ok(dir) = std::env::var("BACKBURNER_LLAMACPP_MODELS") else {
        eprintln!("BACKBURNER_LLAMACPP_MODELS unset: skipping");
        return;
    };
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let p = e.unwrap().path();
        if p.extension().is_some_and(|x| x == "gguf") {
            let f = GgufFile::open(&p).unwrap_or_else(|e| panic!("{}: {}", p.display(), chain(&e)));
            assert!(f.metadata().get_str("tokenizer.ggml.model").is_some());
            n += 1;
        }
    }
    assert!(n > 0, "no .gguf files in {dir}");
}
