//! Memory accounting and budgets: what a session or worker holds ([`MemoryReport`]), the process's resident memory
//! ([`rss_bytes`], [`peak_rss_bytes`]), the limits the OS puts on it ([`os_limits`]: `RLIMIT_DATA`, `RLIMIT_AS`,
//! cgroup `memory.max`), and the check a host runs before it allocates ([`check_fits`]), so that a load that cannot
//! fit fails with an error naming what did not fit instead of an allocator abort.
//!
//! All sizes are bytes.

use std::fmt;
use std::path::{Path, PathBuf};

use backburner_model::{KvOptions, ModelConfig};
use serde::Serialize;

/// What a session (or a worker) holds, in bytes: in host memory, but for `device_weights`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct MemoryReport {
    /// Weights held in host memory ([`backburner_model::Model::host_weight_bytes`]): packed projections, embedding
    /// and head, f32 vectors; layers placed on a device not included.
    pub weights: u64,
    /// Weights of the layers placed on devices, as the devices hold them
    /// ([`backburner_model::Model::device_weight_bytes`]); 0 without devices. Not part of [`MemoryReport::total`].
    pub device_weights: u64,
    /// KV cache pages held here (offloaded pages not included).
    pub kv_pages: u64,
    /// Gated DeltaNet conv and recurrent states.
    pub recurrent_state: u64,
    /// The forward pass's reusable activation buffers, as grown so far.
    pub scratch: u64,
}

impl MemoryReport {
    /// The sum of the four parts held in host memory (saturating: it is a report, not a budget).
    pub fn total(&self) -> u64 {
        self.weights
            .saturating_add(self.kv_pages)
            .saturating_add(self.recurrent_state)
            .saturating_add(self.scratch)
    }
}

/// Bytes for people in decimal units (10^3 steps, as `--max-memory` and `plan` take them) with one decimal, a `.0`
/// dropped: `512 B`, `800 KB`, `271.3 MB`, `24 GB`, `53.8 GB` (GB from 1 GB up, MB from 1 MB, KB from 1 KB).
pub fn human(bytes: u64) -> String {
    const GB: u64 = 1_000_000_000;
    let (unit, name) = match bytes {
        b if b >= GB => (GB, "GB"),
        b if b >= 1_000_000 => (1_000_000, "MB"),
        b if b >= 1_000 => (1_000, "KB"),
        b => return format!("{b} B"),
    };
    let tenths = (bytes as u128 * 10 + unit as u128 / 2) / unit as u128;
    if tenths.is_multiple_of(10) {
        format!("{} {name}", tenths / 10)
    } else {
        format!("{}.{} {name}", tenths / 10, tenths % 10)
    }
}

fn proc_status_kib(key: &str) -> Option<u64> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = s.lines().find(|l| l.starts_with(key))?;
    line.split_whitespace()
        .nth(1)?
        .parse::<u64>()
        .ok()?
        .checked_mul(1024)
}

/// The process's peak resident set size so far (`VmHWM` of `/proc/self/status`); `None` where the OS does not report
/// it (not Linux).
pub fn peak_rss_bytes() -> Option<u64> {
    proc_status_kib("VmHWM:")
}

/// The process's resident set size now (`VmRSS`); `None` where the OS does not report it.
pub fn rss_bytes() -> Option<u64> {
    proc_status_kib("VmRSS:")
}

/// Where a memory limit comes from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LimitSource {
    /// `--max-memory` (bytes the command may allocate for weights, KV, state and buffers).
    Flag,
    /// `RLIMIT_DATA` (`ulimit -d`): private writable memory, heap included.
    RlimitData,
    /// `RLIMIT_AS` (`ulimit -v`): the whole address space, the checkpoint's file map included.
    RlimitAs,
    /// A cgroup's `memory.max` (v2) or `memory.limit_in_bytes` (v1), at this file.
    Cgroup(PathBuf),
}

impl fmt::Display for LimitSource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LimitSource::Flag => f.write_str("--max-memory"),
            LimitSource::RlimitData => {
                f.write_str("the process's data limit (RLIMIT_DATA, ulimit -d)")
            }
            LimitSource::RlimitAs => {
                f.write_str("the process's address-space limit (RLIMIT_AS, ulimit -v)")
            }
            LimitSource::Cgroup(p) => write!(f, "the cgroup memory limit ({})", p.display()),
        }
    }
}

/// One limit on the memory a command may allocate.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryLimit {
    /// The limit (bytes).
    pub bytes: u64,
    /// Bytes already counted against it when it was read (the process's data size, address space or resident
    /// memory; 0 for `--max-memory`, which counts only what the command allocates after the check).
    pub used: u64,
    /// Where it comes from.
    pub source: LimitSource,
}

impl MemoryLimit {
    /// `--max-memory` of `bytes`.
    pub fn flag(bytes: u64) -> Self {
        MemoryLimit {
            bytes,
            used: 0,
            source: LimitSource::Flag,
        }
    }

    /// Bytes still free under this limit.
    pub fn free(&self) -> u64 {
        self.bytes.saturating_sub(self.used)
    }
}

/// Limits at or above this are "unlimited" (cgroup v1 reports 2⁶³ rounded to a page).
const UNLIMITED: u64 = 1 << 62;

/// The soft limit of a `/proc/self/limits` row (e.g. `Max data size`), `None` when unlimited or unreadable.
fn rlimit(limits: &str, row: &str) -> Option<u64> {
    let line = limits.lines().find(|l| l.starts_with(row))?;
    let soft = line[row.len()..].split_whitespace().next()?;
    soft.parse::<u64>().ok().filter(|&b| b < UNLIMITED)
}

/// The tightest cgroup memory limit on this process: the smallest `memory.max` (v2) or `memory.limit_in_bytes` (v1)
/// of its cgroup and every ancestor, from `/proc/self/cgroup` under `/sys/fs/cgroup`.
fn cgroup_limit(cgroup: &str, root: &Path) -> Option<(u64, PathBuf)> {
    let mut best: Option<(u64, PathBuf)> = None;
    for line in cgroup.lines() {
        let mut f = line.splitn(3, ':');
        let (_, ctrl, path) = (f.next()?, f.next()?, f.next()?);
        let (base, file) = if ctrl.is_empty() {
            (root.to_path_buf(), "memory.max")
        } else if ctrl.split(',').any(|c| c == "memory") {
            (root.join("memory"), "memory.limit_in_bytes")
        } else {
            continue;
        };
        // the cgroup and its ancestors; inside a cgroup namespace the path may not exist under the mount, whose
        // root is then this process's cgroup
        let mut dir = base.join(path.trim_start_matches('/'));
        loop {
            let p = dir.join(file);
            if let Some(b) = std::fs::read_to_string(&p)
                .ok()
                .and_then(|s| s.trim().parse::<u64>().ok())
                .filter(|&b| b < UNLIMITED)
            {
                if best.as_ref().is_none_or(|(x, _)| b < *x) {
                    best = Some((b, p));
                }
            }
            if dir == base || !dir.pop() {
                break;
            }
        }
    }
    best
}

/// The OS's limits on this process's memory, each with what it already counts: `RLIMIT_DATA` (with `VmData`),
/// `RLIMIT_AS` (with `VmSize`) and the cgroup memory limit (with this process's resident memory; other processes in
/// the cgroup are not counted). Unlimited and unreadable ones are left out: empty where the OS sets none or does not
/// report them (not Linux).
pub fn os_limits() -> Vec<MemoryLimit> {
    let mut out = Vec::new();
    if let Ok(l) = std::fs::read_to_string("/proc/self/limits") {
        if let Some(b) = rlimit(&l, "Max data size") {
            out.push(MemoryLimit {
                bytes: b,
                used: proc_status_kib("VmData:").unwrap_or(0),
                source: LimitSource::RlimitData,
            });
        }
        if let Some(b) = rlimit(&l, "Max address space") {
            out.push(MemoryLimit {
                bytes: b,
                used: proc_status_kib("VmSize:").unwrap_or(0),
                source: LimitSource::RlimitAs,
            });
        }
    }
    if let Ok(c) = std::fs::read_to_string("/proc/self/cgroup") {
        if let Some((b, p)) = cgroup_limit(&c, Path::new("/sys/fs/cgroup")) {
            out.push(MemoryLimit {
                bytes: b,
                used: rss_bytes().unwrap_or(0),
                source: LimitSource::Cgroup(p),
            });
        }
    }
    out
}

/// `--max-memory` (if given) and the OS's limits ([`os_limits`]).
pub fn host_limits(max_memory: Option<u64>) -> Vec<MemoryLimit> {
    let mut v: Vec<MemoryLimit> = max_memory.map(MemoryLimit::flag).into_iter().collect();
    v.extend(os_limits());
    v
}

/// Something to allocate, named for the error.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MemoryNeed {
    /// What it is, a plural noun phrase for the error's "… need N" (e.g. `weights of layers 0..8 and the ends`).
    pub what: String,
    /// Bytes.
    pub bytes: u64,
    /// What the user can do when it does not fit (default: raise the limit, or load fewer layers or a shorter
    /// context).
    pub advice: Option<&'static str>,
}

impl MemoryNeed {
    /// A need of `bytes` for `what`.
    pub fn new(what: impl Into<String>, bytes: u64) -> Self {
        MemoryNeed {
            what: what.into(),
            bytes,
            advice: None,
        }
    }

    /// The same need, with `advice` instead of the default in its error.
    pub fn with_advice(mut self, advice: &'static str) -> Self {
        self.advice = Some(advice);
        self
    }
}

/// What did not fit a memory limit.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub struct OverMemory {
    /// The first need (in order) that did not fit beside the ones before it.
    pub what: String,
    /// Its bytes.
    pub need: u64,
    /// Bytes of the needs before it.
    pub before: u64,
    /// The limit it did not fit.
    pub limit: MemoryLimit,
    /// The need's own advice, if any ([`MemoryNeed::with_advice`]).
    pub advice: Option<&'static str>,
}

impl fmt::Display for OverMemory {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} need {}", self.what, human(self.need))?;
        if self.before > 0 {
            write!(f, " (after {} for what comes before)", human(self.before))?;
        }
        write!(f, "; {} is {}", self.limit.source, human(self.limit.bytes))?;
        if self.limit.used > 0 {
            write!(
                f,
                ", of which {} are in use",
                human(self.limit.used.min(self.limit.bytes))
            )?;
        }
        if let Some(a) = self.advice {
            return write!(f, " ({a})");
        }
        f.write_str(match self.limit.source {
            LimitSource::Flag => " (raise --max-memory, load fewer layers or shorten the context)",
            _ => " (raise the limit or give --max-memory below it and fewer layers or a shorter context)",
        })
    }
}

/// Checks that `needs`, allocated in order, fit every limit: the running sum after each need must stay within each
/// limit's free bytes. Errors: [`OverMemory`] naming the first need that does not fit and the limit (the tightest
/// one that it exceeds).
pub fn check_fits(needs: &[MemoryNeed], limits: &[MemoryLimit]) -> Result<(), OverMemory> {
    let mut before = 0u64;
    for n in needs {
        let after = before.saturating_add(n.bytes);
        if let Some(l) = limits
            .iter()
            .filter(|l| after > l.free())
            .min_by_key(|l| l.free())
        {
            return Err(OverMemory {
                what: n.what.clone(),
                need: n.bytes,
                before,
                limit: l.clone(),
                advice: n.advice,
            });
        }
        before = after;
    }
    Ok(())
}

/// Bytes of the KV cache of `positions` positions over all of `cfg`'s full-attention layers in `layers`, rounded up
/// to whole blocks of 64 positions (what pages allocate). `None` on overflow.
pub fn kv_bytes(
    cfg: &ModelConfig,
    layers: std::ops::Range<usize>,
    kv: KvOptions,
    positions: usize,
) -> Option<u64> {
    let n_attn = layers
        .filter(|&i| cfg.layer_types.get(i) == Some(&backburner_model::LayerKind::FullAttention))
        .count() as u64;
    let rows = (positions as u64).div_ceil(64).checked_mul(64)?;
    rows.checked_mul(n_attn)?
        .checked_mul(2)?
        .checked_mul(cfg.num_key_value_heads as u64)?
        .checked_mul(cfg.head_dim as u64)?
        .checked_mul(kv.dtype.size_of() as u64)
}

/// Bytes of the Gated DeltaNet states (conv + recurrent, f32) of `cfg`'s linear layers in `layers`. `None` on
/// overflow.
pub fn recurrent_bytes(cfg: &ModelConfig, layers: std::ops::Range<usize>) -> Option<u64> {
    let n_lin = layers
        .filter(|&i| cfg.layer_types.get(i) == Some(&backburner_model::LayerKind::LinearAttention))
        .count() as u64;
    let conv =
        (cfg.conv_dim() as u64).checked_mul(cfg.linear_conv_kernel_dim.saturating_sub(1) as u64)?;
    let rec = (cfg.linear_num_value_heads as u64)
        .checked_mul(cfg.linear_key_head_dim as u64)?
        .checked_mul(cfg.linear_value_head_dim as u64)?;
    conv.checked_add(rec)?.checked_mul(4)?.checked_mul(n_lin)
}

/// An upper estimate of the forward pass's activation memory for ubatches of `ubatch` tokens (f32): the planner's
/// per-token estimate ([`crate::plan::ModelCosts::scratch_bytes`]: the forward pass's buffers, ×2 for the second
/// set of interleaved halves and the kernels' temporaries) times `ubatch`, plus one row of logits. An estimate, not
/// a measurement: [`MemoryReport::scratch`] reports what a session grew. `None` on overflow.
pub fn scratch_estimate(cfg: &ModelConfig, ubatch: usize) -> Option<u64> {
    crate::plan::memory::scratch_bytes_per_token(cfg)
        .checked_mul(ubatch as u64)?
        .checked_add((cfg.vocab_size as u64).checked_mul(4)?)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rss_is_read_on_linux_and_the_peak_is_at_least_the_current() {
        if cfg!(target_os = "linux") {
            let (now, peak) = (rss_bytes().unwrap(), peak_rss_bytes().unwrap());
            assert!(now > 0 && peak >= now, "{now} {peak}");
        }
    }

    #[test]
    fn a_sessions_report_matches_the_estimates_made_before_allocating() {
        use crate::{Logits, Session, SessionOptions};
        use backburner_model::{synthetic, Checkpoint, LoadOptions, Model};
        let dir = tempfile::tempdir().unwrap();
        synthetic::write_random_checkpoint(dir.path(), &synthetic::tiny_config(8), 5).unwrap();
        let cfg = ModelConfig::from_dir(dir.path()).unwrap();
        let ck = Checkpoint::open(dir.path()).unwrap();
        let opts = LoadOptions {
            layers: 0..8,
            ends: true,
        };
        let want_w = backburner_model::load_bytes(&ck, &cfg, &opts).unwrap();
        let model = std::sync::Arc::new(Model::load(dir.path()).unwrap());
        let so = SessionOptions {
            ubatch: 32,
            kv: KvOptions {
                page_size: 64,
                ..KvOptions::default()
            },
            ..SessionOptions::default()
        };
        let mut s = Session::new(model, so.clone()).unwrap();
        let ids: Vec<u32> = (0..100).map(|i| (i * 7 % 500) as u32).collect();
        s.prefill(&ids, Logits::Last, |_, _| {}).unwrap();
        let m = s.memory();
        assert_eq!(m.weights, want_w);
        // the report counts stored rows; the estimate whole blocks of 64
        assert_eq!(m.kv_pages, 100 * 2 * 2 * 2 * 32 * 2);
        assert_eq!(
            kv_bytes(&cfg, 0..8, so.kv, 100),
            Some(128 * 2 * 2 * 2 * 32 * 2)
        );
        assert_eq!(Some(m.recurrent_state), recurrent_bytes(&cfg, 0..8));
        let est = scratch_estimate(&cfg, 32).unwrap();
        assert!(m.scratch > 0 && m.scratch <= est, "{} > {est}", m.scratch);
        assert_eq!(
            m.total(),
            m.weights + m.kv_pages + m.recurrent_state + m.scratch
        );
        let json = serde_json::to_value(m).unwrap();
        assert_eq!(json["kv_pages"], m.kv_pages);
    }

    #[test]
    fn rlimits_parse_soft_values_and_skip_unlimited() {
        let l = "Limit                     Soft Limit           Hard Limit           Units     \n\
                 Max data size             209715200            unlimited            bytes     \n\
                 Max address space         unlimited            unlimited            bytes     \n";
        assert_eq!(rlimit(l, "Max data size"), Some(200 << 20));
        assert_eq!(rlimit(l, "Max address space"), None);
    }

    #[test]
    fn cgroup_limits_are_the_smallest_of_the_cgroup_and_its_ancestors() {
        let root = tempfile::tempdir().unwrap();
        let leaf = root.path().join("a/b");
        std::fs::create_dir_all(&leaf).unwrap();
        std::fs::write(root.path().join("a/memory.max"), "1000000\n").unwrap();
        std::fs::write(leaf.join("memory.max"), "max\n").unwrap();
        let (b, p) = cgroup_limit("0::/a/b\n", root.path()).unwrap();
        assert_eq!((b, p), (1_000_000, root.path().join("a/memory.max")));
        // v1: the memory controller's line and limit_in_bytes; 2^63 rounded is unlimited
        let v1 = root.path().join("memory/x");
        std::fs::create_dir_all(&v1).unwrap();
        std::fs::write(v1.join("memory.limit_in_bytes"), "9223372036854771712\n").unwrap();
        assert_eq!(cgroup_limit("4:memory:/x\n", root.path()), None);
        std::fs::write(v1.join("memory.limit_in_bytes"), "5000\n").unwrap();
        assert_eq!(
            cgroup_limit("4:cpu,memory:/x\n", root.path()).unwrap().0,
            5000
        );
    }

    #[test]
    fn the_first_need_past_the_tightest_limit_is_named() {
        let needs = [
            MemoryNeed::new("weights of layers 0..8 and the ends", 271_300_000),
            MemoryNeed::new("the KV cache of 4096 positions", 50_000_000),
        ];
        assert!(check_fits(&needs, &[]).is_ok());
        assert!(check_fits(&needs, &[MemoryLimit::flag(400_000_000)]).is_ok());
        let e = check_fits(&needs, &[MemoryLimit::flag(200_000_000)]).unwrap_err();
        assert_eq!(e.what, "weights of layers 0..8 and the ends");
        let msg = e.to_string();
        assert!(
            msg.starts_with(
                "weights of layers 0..8 and the ends need 271.3 MB; --max-memory is 200 MB"
            ),
            "{msg}"
        );
        let data = MemoryLimit {
            bytes: 300_000_000,
            used: 10_000_000,
            source: LimitSource::RlimitData,
        };
        let e = check_fits(&needs, &[MemoryLimit::flag(1 << 40), data]).unwrap_err();
        assert_eq!(
            (e.what.as_str(), e.before),
            ("the KV cache of 4096 positions", 271_300_000)
        );
        assert!(e.to_string().contains("RLIMIT_DATA"), "{e}");
        assert!(e.to_string().contains("of which 10 MB are in use"), "{e}");
    }
}
