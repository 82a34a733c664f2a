//! llama.cpp's side of the seed table: `llama-bench` on the same file, locally or with layers on a
//! `ggml-rpc-server` (its RPC backend, the split it offers), one repetition per call (the rounds alternate with ours).

use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use backburner_kernels::kv::KvDtype;
use serde_json::Value;

/// A llama.cpp build.
pub(crate) struct Llama {
    bin: PathBuf,
    threads: usize,
    worker_threads: usize,
}

/// A running `ggml-rpc-server` (killed on drop).
pub(crate) struct RpcServer {
    child: Child,
    /// `127.0.0.1:port`.
    pub addr: String,
}

impl Drop for RpcServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Llama {
    /// The build in `dir` (a folder holding `llama-bench` and `ggml-rpc-server`, or a llama.cpp checkout whose
    /// `build/bin` does). Errors: neither is there.
    pub fn new(dir: &Path, threads: usize, worker_threads: usize) -> Result<Llama> {
        let bin = [dir.to_path_buf(), dir.join("build/bin")]
            .into_iter()
            .find(|d| d.join("llama-bench").is_file() && d.join("ggml-rpc-server").is_file())
            .with_context(|| {
                format!(
                    "--llama-cpp {}: no llama-bench and ggml-rpc-server there or in build/bin",
                    dir.display()
                )
            })?;
        Ok(Llama {
            bin,
            threads,
            worker_threads,
        })
    }

    /// One `llama-bench` repetition on `model` with `extra` options (e.g. `-p 512 -n 0`, `--rpc A -ngl N`), flash
    /// attention and an f16 KV cache as ours; its JSON report.
    pub fn bench(&self, model: &Path, extra: &[String]) -> Result<Value> {
        self.bench_kv(model, extra, KvDtype::F16)
    }

    /// [`Llama::bench`] with a KV cache of `kv` (`-ctk`, `-ctv`).
    pub fn bench_kv(&self, model: &Path, extra: &[String], kv: KvDtype) -> Result<Value> {
        let kv = kv.as_str();
        let out = Command::new(self.bin.join("llama-bench"))
            .arg("-m")
            .arg(model)
            .args(["-t", &self.threads.to_string(), "-r", "1", "-o", "json"])
            .args(["-fa", "on", "-ctk", kv, "-ctv", kv, "-ub", "512"])
            .args(extra)
            .stderr(Stdio::null())
            .output()
            .context("start llama-bench")?;
        if !out.status.success() {
            bail!("llama-bench {} failed ({})", extra.join(" "), out.status);
        }
        serde_json::from_slice(&out.stdout).context("llama-bench's JSON")
    }

    /// Starts a `ggml-rpc-server` with the worker's threads on a free loopback port and waits until it listens.
    pub fn rpc_server(&self) -> Result<RpcServer> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let child = Command::new(self.bin.join("ggml-rpc-server"))
            .args(["-t", &self.worker_threads.to_string(), "-H", "127.0.0.1"])
            .args(["-p", &port.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .context("start ggml-rpc-server")?;
        let addr = format!("127.0.0.1:{port}");
        let server = RpcServer { child, addr };
        let t = Instant::now();
        while TcpStream::connect(&server.addr).is_err() {
            if t.elapsed() > Duration::from_secs(30) {
                bail!("ggml-rpc-server did not listen on {} in 30 s", server.addr);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        Ok(server)
    }
}

/// The tokens per second of a `llama-bench` JSON report's first test.
pub(crate) fn tok_s(v: &Value) -> Result<f64> {
    v.get(0)
        .and_then(|t| t["avg_ts"].as_f64())
        .context("llama-bench's report has no avg_ts")
}

/// llama.cpp's `-ngl` that puts layers `[first, n)` (and not the output) on the RPC server: it offloads the layers
/// from `n + 1 - ngl` on, the output too when `ngl > n`.
pub(crate) fn ngl_from(first: usize, n: usize) -> usize {
    n + 1 - first
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ngl_puts_exactly_the_worker_layers_on_the_server() {
        // an 8-layer model split at 4: layers 4..8 on the server, i_gpu_start = 8 + 1 - 5 = 4
        assert_eq!(ngl_from(4, 8), 5);
        assert_eq!(ngl_from(32, 64), 33);
        let v: Value = serde_json::from_str(r#"[{"avg_ts": 12.5, "n_prompt": 512}]"#).unwrap();
        assert_eq!(tok_s(&v).unwrap(), 12.5);
        assert!(tok_s(&serde_json::json!([])).is_err());
    }
}
