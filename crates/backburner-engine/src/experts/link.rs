//! The host's holders of routed experts over the link: one [`Connection`] per worker, each holding the experts
//! `ids` of the MoE layers in `layers`. Per MoE layer per step every worker with segments gets one `Experts` request
//! before any answer is read (the workers compute in parallel, the host its own experts), then the answers are
//! read in worker order.

use std::ops::Range;
use std::sync::Mutex;
use std::time::Duration;

use backburner_link::frame::Kind;
use backburner_link::message::{Experts, ExpertsDone};
use backburner_link::LinkError;
use backburner_model::{HolderAsk, ModelConfig, RemoteError, RemoteExperts};

use super::wire;
use crate::connection::{why, Connection, SessionShape};
use crate::split::LinkStats;

/// One worker holding routed experts: its connection, the MoE layers and the expert ids (ascending) it holds.
#[derive(Debug)]
pub struct ExpertHolder {
    pub(crate) link: Connection,
    layers: Range<usize>,
    ids: Vec<usize>,
}

impl ExpertHolder {
    /// A worker that will hold the experts `ids` of every MoE layer in `layers` (connected on first use).
    pub fn new(link: Connection, layers: Range<usize>, mut ids: Vec<usize>) -> Self {
        ids.sort_unstable();
        ids.dedup();
        ExpertHolder { link, layers, ids }
    }

    /// The worker's address.
    pub fn addr(&self) -> &str {
        &self.link.settings().addr
    }

    /// The layers whose experts it holds.
    pub fn layers(&self) -> Range<usize> {
        self.layers.clone()
    }

    /// The expert ids it holds in each of them.
    pub fn ids(&self) -> &[usize] {
        &self.ids
    }

    fn holds(&self, layer: usize, expert: usize) -> bool {
        self.layers.contains(&layer) && self.ids.binary_search(&expert).is_ok()
    }
}

/// [`RemoteExperts`] over workers.
pub struct LinkExperts {
    cfg: ModelConfig,
    shape: SessionShape,
    /// (layers, ids) per holder, readable without the lock.
    placement: Vec<(Range<usize>, Vec<usize>)>,
    holders: Mutex<Vec<ExpertHolder>>,
}

impl std::fmt::Debug for LinkExperts {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LinkExperts")
            .field("placement", &self.placement)
            .finish()
    }
}

impl LinkExperts {
    /// Holders for a model of `cfg`; `shape.ubatch` is the largest ubatch the host runs.
    pub fn new(cfg: ModelConfig, shape: SessionShape, holders: Vec<ExpertHolder>) -> Self {
        LinkExperts {
            placement: holders
                .iter()
                .map(|h| (h.layers(), h.ids.clone()))
                .collect(),
            cfg,
            shape,
            holders: Mutex::new(holders),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<ExpertHolder>> {
        self.holders.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Connects every worker not connected yet (a request does so itself; this reports a refusal early).
    ///
    /// Errors: the first worker's that cannot be connected, with its address.
    pub fn connect_all(&self) -> Result<(), RemoteError> {
        let mut hs = self.lock();
        for h in hs.iter_mut() {
            connect(&self.cfg, self.shape, h)?;
        }
        Ok(())
    }

    /// Each worker's address, layers, expert ids and link counters.
    pub fn stats(&self) -> Vec<(String, Range<usize>, Vec<usize>, LinkStats)> {
        self.lock()
            .iter()
            .map(|h| {
                (
                    h.addr().to_string(),
                    h.layers(),
                    h.ids.clone(),
                    h.link.stats(),
                )
            })
            .collect()
    }
}

/// Connects `h` unless connected; a worker backing off after a failure is not tried before its time.
fn connect(
    cfg: &ModelConfig,
    shape: SessionShape,
    h: &mut ExpertHolder,
) -> Result<(), RemoteError> {
    if h.link.is_connected() {
        return Ok(());
    }
    let addr = h.addr().to_string();
    if let Some(d) = h.link.retry_in() {
        return Err(RemoteError(format!(
            "worker {addr} (experts of layers {:?}) failed; next try in {d:?}",
            h.layers
        )));
    }
    let ids: Vec<u32> = h.ids.iter().map(|&e| e as u32).collect();
    h.link.set_experts(ids);
    let layers = h.layers.clone();
    let r = h
        .link
        .connect_with(cfg, shape, false, |_| Ok(layers.clone()));
    r.map(|_| ()).map_err(|e| {
        h.link.fail(&e);
        RemoteError(format!("worker {addr} (experts of layers {layers:?}): {e}"))
    })
}

/// Sends holder `h` its ask for `layer`. Errors: the link's, after failing the connection.
fn send(
    h: &mut ExpertHolder,
    layer: usize,
    hidden: usize,
    x: &[f32],
    ask: &HolderAsk,
) -> Result<(), LinkError> {
    let rows: Vec<f32> = ask
        .rows
        .iter()
        .flat_map(|&r| &x[r as usize * hidden..(r as usize + 1) * hidden])
        .copied()
        .collect();
    let bytes = wire::encode(&rows, &ask.segments);
    let n = |v: usize| {
        u32::try_from(v).map_err(|_| LinkError::Refused(format!("{v} does not fit u32")))
    };
    let msg = Experts {
        layer: n(layer)?,
        n_rows: n(ask.rows.len())?,
        n_segments: n(ask.segments.len())?,
    };
    let answer = ask.segments.len() * hidden * 4;
    let d = h.link.allowance(bytes.len() + answer, Duration::ZERO);
    let c = h
        .link
        .conn
        .as_mut()
        .ok_or_else(|| LinkError::Refused("not connected".into()))?;
    c.set_deadline(Some(d));
    c.writer
        .send(Kind::Experts, &msg, &bytes)
        .map_err(|e| why(c, e))
        .map(|_| ())
}

/// Reads holder `h`'s answer of `n` vectors.
fn recv(h: &mut ExpertHolder, n: usize, hidden: usize) -> Result<Vec<f32>, LinkError> {
    let c = h
        .link
        .conn
        .as_mut()
        .ok_or_else(|| LinkError::Refused("not connected".into()))?;
    let (done, back): (ExpertsDone, _) = c.reader.expect(Kind::ExpertsDone, "ExpertsDone")?;
    if done.n_segments as usize != n {
        return Err(LinkError::Malformed(format!(
            "ExpertsDone has {} vectors for {n} segments",
            done.n_segments
        )));
    }
    wire::decode_answer(&back, n, hidden).map_err(LinkError::Malformed)
}

impl RemoteExperts for LinkExperts {
    fn holder(&self, layer: usize, expert: usize) -> Option<usize> {
        self.placement
            .iter()
            .position(|(l, ids)| l.contains(&layer) && ids.binary_search(&expert).is_ok())
    }

    fn holders(&self) -> usize {
        self.placement.len()
    }

    fn retry_now(&self) {
        for h in self.lock().iter_mut() {
            h.link.retry_now();
        }
    }

    fn run(
        &self,
        layer: usize,
        hidden: usize,
        x: &[f32],
        asks: &[HolderAsk],
        local: &mut dyn FnMut(),
    ) -> Result<Vec<Vec<f32>>, RemoteError> {
        let mut hs = self.lock();
        let mut sent = Vec::new();
        let mut failure = None;
        for (k, (h, ask)) in hs.iter_mut().zip(asks).enumerate() {
            if ask.segments.is_empty() {
                continue;
            }
            debug_assert!(ask
                .segments
                .iter()
                .all(|s| s.pairs.iter().all(|&(e, _)| h.holds(layer, e as usize))));
            let r = connect(&self.cfg, self.shape, h).and_then(|()| {
                send(h, layer, hidden, x, ask).map_err(|e| {
                    h.link.fail(&e);
                    RemoteError(format!(
                        "worker {} (experts of layer {layer}): {e}",
                        h.addr()
                    ))
                })
            });
            match r {
                Ok(()) => sent.push(k),
                Err(e) => {
                    failure = Some(e);
                    break;
                }
            }
        }
        if failure.is_none() {
            local();
        }
        let mut out = vec![Vec::new(); asks.len()];
        for k in sent {
            let h = &mut hs[k];
            match recv(h, asks[k].segments.len(), hidden) {
                Ok(v) => {
                    h.link.succeeded();
                    out[k] = v;
                }
                Err(e) => {
                    h.link.fail(&e);
                    failure.get_or_insert(RemoteError(format!(
                        "worker {} (experts of layer {layer}): {e}",
                        h.addr()
                    )));
                }
            }
        }
        match failure {
            Some(e) => Err(e),
            None => Ok(out),
        }
    }
}
