//! The command line's side of placement: `run`'s, `serve`'s and `chat`'s flags become one engine request
//! ([`SessionRequest`]); the engine ([`backburner_engine::open`]) plans, checks, loads and connects, and this prints
//! what it decides (the plan line, the loading bar, warnings).

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::Result;
use backburner_engine::open::{self, OpenObserver, RunNeed, SessionRequest};
use backburner_engine::plan::Plan;
use backburner_engine::ComputePool;
use backburner_model::device::Backend;
use backburner_model::{ModelConfig, TextTokenizer};
use indicatif::ProgressBar;

use crate::link_args::LinkArgs;
use crate::ModelArgs;

/// Prints what the engine decides while it opens a session: the plan (`plan: …`, unless `quiet_plan`), a loading
/// bar on a TTY, warnings.
pub struct Printer {
    quiet_plan: bool,
    bar: Option<ProgressBar>,
}

impl Printer {
    /// A printer; `quiet_plan` leaves the plan line out (`run --json` puts the plan in its object).
    pub fn new(quiet_plan: bool) -> Self {
        Printer {
            quiet_plan,
            bar: None,
        }
    }
}

impl OpenObserver for Printer {
    fn planned(&mut self, p: &Plan) {
        if !self.quiet_plan {
            eprintln!("plan: {}", backburner_engine::plan::summary(p));
        }
    }

    fn loading(&mut self, done: usize, total: usize) {
        let pb = self
            .bar
            .get_or_insert_with(|| crate::bar(total as u64, "loading"));
        pb.set_position(done as u64);
        if done >= total {
            pb.finish_and_clear();
        }
    }

    fn warning(&mut self, m: &str) {
        eprintln!("warning: {m}");
    }
}

/// The engine request of these flags for the model at `dir` with `config` (as it is to be loaded), computing on
/// `pool`; `run` is a one-shot run's reach (it lets the planner place the model and checks the session's memory).
/// Errors: an unreadable secret file.
pub fn request(
    model: &ModelArgs,
    link: &LinkArgs,
    dir: PathBuf,
    config: ModelConfig,
    pool: &ComputePool,
    run: Option<RunNeed>,
) -> Result<SessionRequest> {
    let mut options = model.session_options(pool);
    options.kv_budget = link.kv_budget;
    options.interleave = !link.no_interleave;
    Ok(SessionRequest {
        dir,
        config,
        max_memory: model.max_memory,
        options,
        workers: link.workers()?,
        placement: link.placement(),
        run,
    })
}

/// A model loaded and placed as the flags ask, with its tokenizer: what `serve` and `chat` make their slots'
/// sessions from ([`open::Host::session`]).
pub struct Placed {
    /// The loaded host.
    pub host: open::Host,
    /// The tokenizer, if the model has one.
    pub tokenizer: Option<TextTokenizer>,
    /// Where the model came from.
    pub dir: PathBuf,
}

/// Loads `--model` (or the bundled default) as the placement flags ask: only the host's layers with
/// `--layer-split`, without the routed experts on workers with `--expert-split` (which are connected), the layers
/// `--device-layers` names placed on `backend` as they load (when given; the line saying where each layer runs is
/// printed; `auto` sizes them for `sequences` sequences of the context). Shared by `serve` and `chat`. Errors: the
/// tokenizer's, `auto`'s, and every refusal of [`open::load_placed`].
pub fn load_placed(
    model: &ModelArgs,
    link: &LinkArgs,
    pool: &ComputePool,
    backend: Option<Arc<dyn Backend>>,
    sequences: usize,
) -> Result<Placed> {
    let dir = match &model.model {
        Some(d) => d.clone(),
        None => crate::default_model::ensure()?,
    };
    let n = model.device_layer_count(backend.as_ref(), &dir, model.ctx_limit(), sequences)?;
    let (mut config, tokenizer) = crate::load_tokenizer(&dir)?;
    config.precision = model.precision;
    if !model.mtp {
        // the MTP block drafts only for --spec mtp: otherwise its weights stay on disk
        config.mtp_num_hidden_layers = 0;
    }
    let place = backend
        .as_ref()
        .and_then(|b| crate::device_args::place(&config, b, n));
    let req = request(model, link, dir.clone(), config, pool, None)?;
    let host = open::load_placed(req, place, &mut Printer::new(true))?;
    crate::device_args::place_loaded(&host.model, backend.as_ref());
    Ok(Placed {
        host,
        tokenizer,
        dir,
    })
}

/// A benchmark's client of the worker at `addr` for `loaded`'s model (split prefill at `split_layer`, checked;
/// deadlines of 600 s; the secret of `BACKBURNER_SECRET`), over `shaper`'s emulated link when given. Errors: a
/// split layer the model refuses, an unreadable secret.
pub fn bench_client(
    loaded: &crate::Loaded,
    addr: &str,
    split_layer: Option<usize>,
    split_min_tokens: usize,
    host_threads: usize,
    shaper: Option<backburner_link::Shaper>,
) -> Result<backburner_engine::WorkerClient> {
    let cfg = loaded.model.config();
    open::check_split_layer(cfg, split_layer)?;
    let workers = open::Workers {
        addrs: vec![addr.to_string()],
        memory: Vec::new(),
        secret: crate::worker_cmd::read_secret(None)?.unwrap_or_default(),
        timeout: std::time::Duration::from_secs(600),
        split_min_tokens,
    };
    let mut st =
        open::worker_settings(&workers, split_layer, host_threads, &mut Printer::new(true))?
            .remove(0);
    st.shaper = shaper;
    let fp = backburner_engine::split::dir_fingerprint_with(loaded.dir.clone(), cfg.precision);
    Ok(backburner_engine::WorkerClient::new(st, fp))
}
