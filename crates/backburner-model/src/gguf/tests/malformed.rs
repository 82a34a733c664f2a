//! Malformed files: each is refused with a typed error naming the problem, without a panic and without allocating
//! what a claimed count or length would need.

use super::super::{GgmlType, GgufFile, MetaValue};
use super::*;

fn small_writer() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.kv("general.architecture", MetaValue::Str("qwen35".into()))
        .kv("a.str", str_array(&["x", "yz"]))
        .kv("n", MetaValue::U32(7));
    w.tensor_filled("a.weight", &[32, 2], GgmlType::Q8_0, 9)
        .tensor_filled("b.weight", &[3], GgmlType::F32, 8);
    w
}

/// Header with `n_tensors` and `n_kv` followed by `rest`.
fn raw(n_tensors: u64, n_kv: u64, rest: &[u8]) -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend_from_slice(&3u32.to_le_bytes());
    b.extend_from_slice(&n_tensors.to_le_bytes());
    b.extend_from_slice(&n_kv.to_le_bytes());
    b.extend_from_slice(rest);
    b
}

#[test]
fn gguf_every_truncation_is_refused_and_never_panics() {
    let bytes = small_writer().to_bytes();
    let full = super::super::parse::parse(&bytes).unwrap();
    let data_end = full
        .tensors
        .iter()
        .map(|t| t.offset + t.n_bytes)
        .max()
        .unwrap() as usize;
    for cut in 0..bytes.len() {
        let r = super::super::parse::parse(&bytes[..cut]);
        // Cutting only the padding after the last tensor leaves a valid file.
        assert_eq!(r.is_ok(), cut >= data_end, "cut at {cut}: {r:?}");
    }
    // The same through open(), for a cut inside the header.
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("t.gguf");
    std::fs::write(&p, &bytes[..30]).unwrap();
    let m = corrupt_message(GgufFile::open(&p));
    assert!(m.contains("truncated"), "{m}");
    std::fs::write(&p, []).unwrap();
    corrupt_message(GgufFile::open(&p));
}

#[test]
fn gguf_bad_magic_big_endian_and_other_versions_are_refused() {
    let mut b = small_writer().to_bytes();
    b[0] = b'X';
    assert!(parse_err(&b).contains("not a GGUF file"));
    let mut b = small_writer().to_bytes();
    b[4..8].copy_from_slice(&3u32.to_be_bytes());
    assert!(parse_err(&b).contains("big-endian"));
    for (v, what) in [(1u32, "v1"), (4, "version 4"), (0, "version 0")] {
        let mut b = small_writer().to_bytes();
        b[4..8].copy_from_slice(&v.to_le_bytes());
        let m = parse_err(&b);
        assert!(m.contains(what), "{m}");
    }
}

#[test]
fn gguf_huge_counts_and_lengths_are_refused_before_allocating() {
    // KV and tensor counts past what the file could hold.
    assert!(parse_err(&raw(0, u64::MAX, &[0; 64])).contains("key-value pairs"));
    assert!(parse_err(&raw(u64::MAX, 0, &[0; 64])).contains("tensors"));
    assert!(parse_err(&raw(1 << 40, 0, &[0; 64])).contains("tensors"));
    // A key whose length runs past the file.
    let mut rest = u64::MAX.to_le_bytes().to_vec();
    rest.extend_from_slice(&[b'a'; 32]);
    assert!(parse_err(&raw(0, 1, &rest)).contains("key of pair 0"));
    // A string value longer than the file, and one over the string cap.
    for len in [1u64 << 40, 100, super::super::parse::MAX_STRING + 1] {
        let mut w = GgufWriter::new();
        let mut v = len.to_le_bytes().to_vec();
        v.extend_from_slice(b"short");
        w.kv_raw("s", 8, &v);
        let m = parse_err(&w.to_bytes());
        assert!(m.contains("value of \"s\""), "{m}");
    }
    // Arrays claiming more elements than the bytes left: numbers, strings, and an overflowing count.
    for (elem, count) in [
        (4u32, 1u64 << 62),
        (8, 1 << 40),
        (0, u64::MAX),
        (10, u64::MAX / 4),
    ] {
        let mut w = GgufWriter::new();
        let mut v = elem.to_le_bytes().to_vec();
        v.extend_from_slice(&count.to_le_bytes());
        v.extend_from_slice(&[0; 16]);
        w.kv_raw("arr", 9, &v);
        let m = parse_err(&w.to_bytes());
        assert!(m.contains("cannot fit"), "{elem} × {count}: {m}");
    }
}

#[test]
fn gguf_bad_value_types_keys_and_text_are_refused() {
    let cases: Vec<(GgufWriter, &str)> = vec![
        (
            {
                let mut w = GgufWriter::new();
                w.kv_raw("x", 13, &[0; 8]);
                w
            },
            "unknown value type 13",
        ),
        (
            {
                let mut w = GgufWriter::new();
                w.kv_raw("x", 9, &[99, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
                w
            },
            "unknown value type 99",
        ),
        (
            {
                let mut w = GgufWriter::new();
                w.kv_raw("x", 9, &[9, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0]);
                w
            },
            "array of arrays",
        ),
        (
            {
                let mut w = GgufWriter::new();
                w.kv("", MetaValue::U8(1));
                w
            },
            "is empty",
        ),
        (
            {
                let mut w = GgufWriter::new();
                w.kv("k", MetaValue::U8(1)).kv("k", MetaValue::U8(2));
                w
            },
            "appears twice",
        ),
        (
            {
                let mut w = GgufWriter::new();
                w.kv_raw("s", 8, &[2, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xfe]);
                w
            },
            "not UTF-8",
        ),
    ];
    for (w, want) in cases {
        let m = parse_err(&w.to_bytes());
        assert!(m.contains(want), "want {want:?}: {m}");
    }
    // A key that is not UTF-8.
    let mut rest = 2u64.to_le_bytes().to_vec();
    rest.extend_from_slice(&[0xc3, 0x28]);
    rest.extend_from_slice(&[0; 8]);
    assert!(parse_err(&raw(0, 1, &rest)).contains("not UTF-8"));
}

#[test]
fn gguf_a_kv_count_of_0_is_refused_as_a_file_without_metadata() {
    let d = tempfile::tempdir().unwrap();
    // The count patched to 0 over pairs still there: they are read as tensor infos, which fail; the error says first
    // that the file has no metadata (it named general.architecture's "dimensions" alone).
    let mut b = small_writer().to_bytes();
    b[16..24].copy_from_slice(&0u64.to_le_bytes());
    let p = d.path().join("zero-kv.gguf");
    std::fs::write(&p, &b).unwrap();
    assert_eq!(
        corrupt_message(GgufFile::open(&p)),
        "the header's key-value count is 0: the file has no metadata (no general.architecture), and what follows \
         the header is not valid tensor infos: tensor \"general.architecture\" has 8 dimensions (must be 1..=4)"
    );
    // A well-formed file without pairs opens, and the model config says the key is missing.
    let mut w = GgufWriter::new();
    w.tensor_filled("b.weight", &[3], GgmlType::F32, 8);
    let f = GgufFile::open(&write_tmp(&w, d.path(), "no-kv.gguf")).unwrap();
    let e = super::super::config_from_gguf(&f).unwrap_err();
    assert!(
        matches!(&e, ModelError::UnsupportedArchitecture { found, .. } if found.is_empty()),
        "{e:?}"
    );
    assert_eq!(
        e.to_string(),
        "the GGUF file has no general.architecture (string) key; supported: qwen35, qwen35moe, qwen3next"
    );
}

/// A one-tensor file whose tensor has these dims and type id (data: `n` zero bytes).
fn one_tensor(dims: &[u64], type_id: u32, n: usize) -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.tensor("t", dims, GgmlType::from_u32(type_id), vec![0; n]);
    w.to_bytes()
}

#[test]
fn gguf_bad_tensor_shapes_and_types_are_refused() {
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (one_tensor(&[1, 1, 1, 1, 1], 0, 4), "5 dimensions"),
        (one_tensor(&[], 0, 4), "0 dimensions"),
        (one_tensor(&[4, 0], 0, 0), "dimension 1 of size 0"),
        (one_tensor(&[1 << 32, 1 << 32], 0, 4), "overflows"),
        (one_tensor(&[1 << 21, 1 << 21, 1 << 21], 0, 4), "overflows"),
        (one_tensor(&[u64::MAX], 0, 4), "dimension 0 of size"),
        (one_tensor(&[4], 1000, 4), "unknown ggml type id 1000"),
        (one_tensor(&[4], 4, 4), "unknown ggml type id 4"),
        (
            one_tensor(&[33, 1], GgmlType::Q8_0.id(), 68),
            "not a multiple of its block of 32",
        ),
        (
            one_tensor(&[1 << 62], GgmlType::F32.id(), 4),
            "size in bytes overflows",
        ),
        (
            one_tensor(&[1 << 40], GgmlType::F32.id(), 4),
            "past the end",
        ),
    ];
    for (bytes, want) in cases {
        let m = parse_err(&bytes);
        assert!(m.contains(want), "want {want:?}: {m}");
    }
    // Names: empty, too long, repeated.
    let mut w = GgufWriter::new();
    w.tensor("", &[1], GgmlType::F32, vec![0; 4]);
    assert!(parse_err(&w.to_bytes()).contains("name of 0 bytes"));
    let mut w = GgufWriter::new();
    w.tensor(&"n".repeat(300), &[1], GgmlType::F32, vec![0; 4]);
    assert!(parse_err(&w.to_bytes()).contains("name of 300 bytes"));
    let mut w = GgufWriter::new();
    w.tensor("t", &[1], GgmlType::F32, vec![0; 4])
        .tensor("t", &[1], GgmlType::F32, vec![0; 4]);
    assert!(parse_err(&w.to_bytes()).contains("appears twice"));
}

#[test]
fn gguf_misaligned_overlapping_and_out_of_file_offsets_are_refused() {
    let with_offset = |i: usize, off: u64| {
        let mut w = small_writer();
        w.tensors[i].declared_offset = Some(off);
        w.to_bytes()
    };
    assert!(parse_err(&with_offset(1, 16)).contains("not a multiple of the alignment 32"));
    assert!(parse_err(&with_offset(1, 0)).contains("overlap"));
    assert!(parse_err(&with_offset(1, 32)).contains("overlap"));
    assert!(parse_err(&with_offset(0, 64)).contains("past the end"));
    assert!(parse_err(&with_offset(1, 1 << 20)).contains("past the end"));
    assert!(parse_err(&with_offset(1, u64::MAX - 31)).contains("past the end"));
    // Offsets in a different order than the infos, not overlapping: fine.
    let mut w = small_writer();
    w.tensors[0].declared_offset = Some(32);
    w.tensors[1].declared_offset = Some(0);
    let mut bytes = w.to_bytes();
    bytes.extend_from_slice(&[0; 64]);
    super::super::parse::parse(&bytes).unwrap();
}

/// SplitMix64.
fn next(s: &mut u64) -> u64 {
    *s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *s;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

#[test]
fn gguf_random_corruptions_never_panic() {
    let good = small_writer().to_bytes();
    let mut seed = 42u64;
    let mut refused = 0;
    for _ in 0..20_000 {
        let mut b = good.clone();
        for _ in 0..1 + next(&mut seed) % 4 {
            let at = (next(&mut seed) % b.len() as u64) as usize;
            b[at] = match next(&mut seed) % 4 {
                0 => 0xff,
                1 => 0,
                _ => next(&mut seed) as u8,
            };
        }
        if next(&mut seed).is_multiple_of(8) {
            b.truncate((next(&mut seed) % b.len() as u64) as usize);
        }
        refused += usize::from(super::super::parse::parse(&b).is_err());
    }
    assert!(refused > 1000, "{refused}");
}

#[test]
fn gguf_fifo_missing_file_and_directory_paths_are_refused_without_blocking() {
    let d = tempfile::tempdir().unwrap();
    let p = d.path().join("model.gguf");
    if mkfifo(&p) {
        let p2 = p.clone();
        let e = within_10s(move || GgufFile::open(&p2).map(|_| ()).map_err(|e| chain(&e)));
        let m = e.unwrap_err();
        assert!(m.contains("not a regular file"), "{m}");
        // The FIFO is also what a directory listing finds.
        let d2 = d.path().to_path_buf();
        let e = within_10s(move || GgufFile::open(&d2).map(|_| ()).map_err(|e| chain(&e)));
        assert!(e.unwrap_err().contains("not a regular file"));
    } else {
        eprintln!("mkfifo unavailable: skipping the FIFO case");
    }
    let e = GgufFile::open(&d.path().join("absent.gguf")).unwrap_err();
    assert!(matches!(e, ModelError::Io { .. }), "{e:?}");
}
