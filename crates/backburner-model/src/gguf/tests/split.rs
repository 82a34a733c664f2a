//! Split sets (`<stem>-0000K-of-0000N.gguf`) and directories.

use super::super::{GgmlType, GgufFile, MetaValue};
use super::*;

/// Part `no` (from 0) of `count`, holding `tensors` (name, seed); the first part has the model's metadata.
fn part(no: u16, count: u16, tensors: &[(&str, u8)]) -> GgufWriter {
    let mut w = GgufWriter::new();
    if no == 0 {
        w.kv("general.architecture", MetaValue::Str("qwen35".into()))
            .kv("split.tensors.count", MetaValue::I32(3));
    }
    w.kv("split.no", MetaValue::U16(no))
        .kv("split.count", MetaValue::U16(count));
    for (name, seed) in tensors {
        w.tensor_filled(name, &[32, 3], GgmlType::F16, *seed);
    }
    w
}

fn two_parts(dir: &Path) -> (GgufWriter, GgufWriter) {
    let a = part(0, 2, &[("a.weight", 1), ("b.weight", 2)]);
    let b = part(1, 2, &[("c.weight", 3)]);
    write_tmp(&a, dir, "m-00001-of-00002.gguf");
    write_tmp(&b, dir, "m-00002-of-00002.gguf");
    (a, b)
}

#[test]
fn gguf_split_set_opens_from_any_part_and_from_its_directory() {
    let d = tempfile::tempdir().unwrap();
    let (a, b) = two_parts(d.path());
    let want = [
        d.path().join("m-00001-of-00002.gguf"),
        d.path().join("m-00002-of-00002.gguf"),
    ];
    for p in [want[0].clone(), want[1].clone(), d.path().to_path_buf()] {
        let f = GgufFile::open(&p).unwrap();
        assert_eq!(f.paths(), want, "opened from {}", p.display());
        assert_eq!(f.architecture(), Some("qwen35"));
        assert_eq!(f.tensor_names(), ["a.weight", "b.weight", "c.weight"]);
        assert_eq!(f.tensor("a.weight").unwrap().part, 0);
        assert_eq!(f.tensor("c.weight").unwrap().part, 1);
        assert_eq!(f.data("b.weight").unwrap(), &a.tensors[1].data[..]);
        assert_eq!(f.data("c.weight").unwrap(), &b.tensors[0].data[..]);
        let mut got = Vec::new();
        f.read_chunks("c.weight", 5, |c| got.extend_from_slice(c))
            .unwrap();
        assert_eq!(got, b.tensors[0].data);
        assert_eq!(f.total_tensor_bytes(), 3 * 32 * 3 * 2);
    }
}

#[test]
fn gguf_incomplete_or_inconsistent_split_sets_are_refused() {
    // A missing part.
    let d = tempfile::tempdir().unwrap();
    two_parts(d.path());
    std::fs::remove_file(d.path().join("m-00002-of-00002.gguf")).unwrap();
    let e = GgufFile::open(&d.path().join("m-00001-of-00002.gguf")).unwrap_err();
    assert!(matches!(e, ModelError::Io { .. }), "{e:?}");
    // A part that says it is another part.
    write_tmp(
        &part(0, 2, &[("c.weight", 3)]),
        d.path(),
        "m-00002-of-00002.gguf",
    );
    let m = corrupt_message(GgufFile::open(d.path()));
    assert!(m.contains("split.no = 1"), "{m}");
    assert!(m.contains("found split.no 0, split.count 2"), "{m}");
    // The wrong count.
    write_tmp(
        &part(1, 3, &[("c.weight", 3)]),
        d.path(),
        "m-00002-of-00002.gguf",
    );
    let m = corrupt_message(GgufFile::open(d.path()));
    assert!(m.contains("split.count = 2"), "{m}");
    assert!(m.contains("found split.no 1, split.count 3"), "{m}");
    // A tensor in both parts.
    write_tmp(
        &part(1, 2, &[("a.weight", 3)]),
        d.path(),
        "m-00002-of-00002.gguf",
    );
    let m = corrupt_message(GgufFile::open(d.path()));
    assert!(m.contains("also in an earlier part"), "{m}");
    // split.tensors.count disagreeing with the parts.
    write_tmp(
        &part(1, 2, &[("c.weight", 3), ("d.weight", 4)]),
        d.path(),
        "m-00002-of-00002.gguf",
    );
    let m = corrupt_message(GgufFile::open(d.path()));
    assert!(m.contains("split.tensors.count = 3"), "{m}");
    // A FIFO in place of a part.
    let p2 = d.path().join("m-00002-of-00002.gguf");
    std::fs::remove_file(&p2).unwrap();
    if mkfifo(&p2) {
        let dir = d.path().to_path_buf();
        let e = within_10s(move || GgufFile::open(&dir).map(|_| ()).map_err(|e| chain(&e)));
        assert!(e.unwrap_err().contains("not a regular file"));
    }
    // One part of a set under a plain name: its siblings cannot be found.
    let d = tempfile::tempdir().unwrap();
    let p = write_tmp(&part(0, 2, &[("a.weight", 1)]), d.path(), "model.gguf");
    let e = GgufFile::open(&p).unwrap_err();
    assert!(
        matches!(&e, ModelError::GgufPath { message, .. } if message.contains("split set of 2")),
        "{e:?}"
    );
}

#[test]
fn gguf_directory_must_hold_exactly_one_model() {
    let d = tempfile::tempdir().unwrap();
    let e = GgufFile::open(d.path()).unwrap_err();
    assert!(
        matches!(&e, ModelError::GgufPath { message, .. } if message.contains("no .gguf")),
        "{e:?}"
    );
    let single = part(0, 1, &[("a.weight", 1)]);
    write_tmp(&single, d.path(), "model-Q4_K_M.gguf");
    // A vision projector next to the model is not a second model.
    write_tmp(&single, d.path(), "mmproj-model-f16.gguf");
    std::fs::write(d.path().join("README.md"), "x").unwrap();
    // Neither is a directory named like a model, nor a symlink loop.
    std::fs::create_dir(d.path().join("sub.gguf")).unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(d.path(), d.path().join("loop.gguf")).unwrap();
    let f = GgufFile::open(d.path()).unwrap();
    assert_eq!(f.paths(), [d.path().join("model-Q4_K_M.gguf")]);
    // Two models: the caller must choose.
    two_parts(d.path());
    let e = GgufFile::open(d.path()).unwrap_err();
    match &e {
        ModelError::GgufPath { message, .. } => {
            assert!(message.contains("model-Q4_K_M.gguf"), "{message}");
            assert!(message.contains("m-00001-of-00002.gguf"), "{message}");
        }
        other => panic!("{other:?}"),
    }
    // Naming the file still works.
    GgufFile::open(&d.path().join("model-Q4_K_M.gguf")).unwrap();
    GgufFile::open(&d.path().join("m-00002-of-00002.gguf")).unwrap();
}
