//! `bench seed-table` end to end on the tiny GGUF fixture, with stand-ins for llama.cpp's `llama-bench` (records its
//! arguments, reports a fixed rate) and `ggml-rpc-server` (listens on the port it is given): the rows run our
//! benches as child processes, llama.cpp's runs get the placements of ours, and the table, its JSON and the plots
//! are written; a second call with `--report-only` rebuilds the same table from the runs' files.

use crate::common;

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::Command;

use common::*;

/// Writes an executable script.
fn script(path: &Path, body: &str) {
    std::fs::write(path, body).unwrap();
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o755)).unwrap();
}

/// A folder with the two stand-ins; `calls.txt` collects llama-bench's arguments.
fn fake_llama(dir: &Path) {
    std::fs::create_dir_all(dir).unwrap();
    let calls = dir.join("calls.txt");
    script(
        &dir.join("llama-bench"),
        &format!(
            "#!/bin/sh\necho \"$@\" >> {}\necho '[{{\"avg_ts\": 42.5}}]'\n",
            calls.display()
        ),
    );
    script(
        &dir.join("ggml-rpc-server"),
        "#!/bin/sh\nexec python3 -c '\nimport socket, sys\na = sys.argv\ns = socket.socket()\n\
         s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n\
         s.bind((\"127.0.0.1\", int(a[a.index(\"-p\") + 1])))\ns.listen()\nwhile True:\n    s.accept()[0].close()\n' \"$@\"\n",
    );
}

fn seed_table(out: &Path, llama: Option<&Path>, extra: &[&str]) -> std::process::Output {
    let m = fixture("gguf/tiny-f32.gguf");
    let m = m.to_str().unwrap();
    let mut c = Command::new(bin());
    c.args(["bench", "seed-table", "--rounds", "1"])
        .arg("--out")
        .arg(out);
    if let Some(l) = llama {
        c.arg("--llama-cpp").arg(l);
    }
    c.args(["--rows", "zero-to-one,long-prefill,offload-decode"])
        .args(["--z2o-model", m, "--z2o-host-memory", "1GB"])
        .args(["--z2o-layer-split", "4", "--z2o-prompt-tokens", "16"])
        .args(["--prefill-models", m, "--prefill-depths", "1024"])
        .args(["--offload-model", m, "--offload-depth", "1024"])
        .args(["--offload-page-size", "256"])
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn seed_table_runs_every_row_beside_llama_cpp_and_writes_table_json_and_plots() {
    let dir = std::env::temp_dir().join(format!("bb-seed-table-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let (out, llama) = (dir.join("out"), dir.join("llama"));
    fake_llama(&llama);
    let o = seed_table(&out, Some(&llama), &[]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let v: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out.join("seed-table.json")).unwrap()).unwrap();
    let rows = v["rows"].as_array().unwrap();
    let names: Vec<&str> = rows.iter().map(|r| r["row"].as_str().unwrap()).collect();
    assert_eq!(names, ["zero-to-one", "long-prefill", "offload-decode"]);
    let z = &rows[0]["lines"];
    assert_eq!(z[0]["label"], "prefill");
    assert_eq!(z[0]["llama_cpp"], serde_json::json!([42.5]));
    assert_eq!(z[0]["seed"], 64.0);
    assert!(z[1]["ours_median"].as_f64().unwrap() > 0.0, "{z}");
    let ratio = z[1]["vs_llama_cpp"].as_f64().unwrap();
    let want = z[1]["ours_median"].as_f64().unwrap() / 42.5;
    assert!((ratio - want).abs() <= 1e-12 * want, "{ratio} vs {want}");
    let p = &rows[1]["lines"];
    assert_eq!(p.as_array().unwrap().len(), 2, "{p}");
    assert_eq!(p[0]["label"], "tiny-f32: 1024 tokens, local");
    assert_eq!(p[1]["llama_cpp"], serde_json::json!([42.5]));
    let d = rows[2]["lines"].as_array().unwrap();
    assert_eq!(d.len(), 3);
    assert!(
        d.iter().all(|l| l["ours"].as_array().unwrap().len() == 1),
        "{d:?}"
    );
    assert!(d
        .iter()
        .all(|l| l["llama_cpp"].as_array().unwrap().is_empty()));
    // llama.cpp's runs: the zero-to-one split's layers 4..8 on the server (-ngl 5), prefill then decode at depth;
    // then local and the RPC split per prefill depth
    let calls = std::fs::read_to_string(llama.join("calls.txt")).unwrap();
    let calls: Vec<&str> = calls.lines().collect();
    assert_eq!(calls.len(), 4, "{calls:?}");
    assert!(
        calls[0].contains("--rpc 127.0.0.1:") && calls[0].contains("-ngl 5 -p 16 -n 0"),
        "{calls:?}"
    );
    assert!(calls[1].contains("-ngl 5 -p 0 -n 8 -d 16"), "{calls:?}");
    let long = "-p 1024 -n 0 -b 1024 --no-warmup";
    assert!(
        calls[2].ends_with(long) && !calls[2].contains("--rpc"),
        "{calls:?}"
    );
    assert!(
        calls[3].contains("--rpc 127.0.0.1:")
            && calls[3].contains("-ngl 5 -p 1024")
            && calls[3].ends_with(long),
        "{calls:?}"
    );
    for f in ["zero-to-one.svg", "long-prefill.svg", "offload-decode.svg"] {
        let svg = std::fs::read_to_string(out.join(f)).unwrap();
        assert!(
            svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"),
            "{f}"
        );
    }
    let md = std::fs::read_to_string(out.join("seed-table.md")).unwrap();
    assert!(md.contains("| prefill | tok/s |"), "{md}");
    // the table again from the runs' files alone: nothing reruns, the same table
    std::fs::remove_file(llama.join("calls.txt")).unwrap();
    let o = seed_table(&out, Some(&llama), &["--report-only"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read_to_string(out.join("seed-table.md")).unwrap(),
        md
    );
    // and without --llama-cpp: llama.cpp's runs are read from --out all the same
    let o = seed_table(&out, None, &["--report-only"]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(
        std::fs::read_to_string(out.join("seed-table.md")).unwrap(),
        md
    );
    assert!(!llama.join("calls.txt").exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn seed_table_names_the_option_a_row_needs() {
    let dir = std::env::temp_dir().join(format!("bb-seed-need-{}", std::process::id()));
    let o = Command::new(bin())
        .args(["bench", "seed-table", "--rows", "offload-decode"])
        .arg("--out")
        .arg(&dir)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&o.stderr);
    assert_eq!(o.status.code(), Some(1), "{err}");
    assert!(err.contains("--offload-model"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}
