//! A split-prefill mirror's state transfers: `Sync` (the host's rows and linear states onto the mirror) and
//! `Fetch` (the mirror's rows and states back to the host), docs/PROTOCOL.md §5.4 and §5.6.

use backburner_link::message::{Fetch, FetchDone, Sync};
use backburner_link::ErrorCode;

use super::{bad, size, Fault, Reply, SessionCore};
use crate::wire;

impl SessionCore {
    pub(super) fn sync(&mut self, s: Sync, payload: &[u8]) -> Result<Reply, Fault> {
        let pos = self.mirror.n_tokens() as u64;
        if s.truncate_to > pos || s.pos_after < s.truncate_to {
            return Err(bad(format!(
                "sync truncate_to {} / pos_after {} does not fit a mirror at {pos}",
                s.truncate_to, s.pos_after
            )));
        }
        self.check_positions(s.pos_after)?;
        let n = size(s.pos_after - s.truncate_to, "sync rows")?;
        let want = wire::payload_len(
            self.cfg(),
            self.spec.range.clone(),
            n,
            self.dtype(),
            s.linear,
        );
        if want != Some(payload.len()) {
            return Err(Fault::new(
                ErrorCode::Malformed,
                format!(
                    "sync payload of {} bytes, expected {want:?} for {n} rows",
                    payload.len()
                ),
            ));
        }
        self.reserve_growth(n)?;
        let (range, to) = (self.spec.range.clone(), size(s.truncate_to, "truncate_to")?);
        self.checkpoints.truncate(to);
        wire::truncate_kv(&mut self.mirror, range.clone(), to);
        let cfg = self.model.config().clone();
        let r = wire::apply(&mut self.mirror, &cfg, range, n, s.linear, payload);
        self.settle();
        r.map_err(|e| Fault::new(ErrorCode::Malformed, e.to_string()))?;
        self.mirror.set_position(size(s.pos_after, "pos_after")?);
        Ok(Reply::SyncDone)
    }

    /// The payload of a fetch and a reservation covering it and the frame buffer it is sealed into.
    pub(super) fn fetch(&mut self, q: Fetch) -> Result<Reply, Fault> {
        let pos = self.mirror.n_tokens() as u64;
        if q.from_pos > q.to_pos || q.to_pos > pos {
            return Err(bad(format!(
                "fetch {}..{} outside the mirror's 0..{pos}",
                q.from_pos, q.to_pos
            )));
        }
        let (a, b) = (size(q.from_pos, "from_pos")?, size(q.to_pos, "to_pos")?);
        let len = wire::payload_len(
            self.cfg(),
            self.spec.range.clone(),
            b - a,
            self.dtype(),
            q.linear,
        )
        .filter(|l| *l <= self.spec.max_frame)
        .ok_or_else(|| {
            bad(format!(
                "fetch {a}..{b} exceeds the frame bound of {} bytes",
                self.spec.max_frame
            ))
        })?;
        // the payload, its sealed copy in the frame buffer, and one layer's rows as f32 while encoding
        let tmp = wire::layer_rows_f32_bytes(self.cfg(), b - a).unwrap_or(usize::MAX);
        let transient = (len as u64).saturating_mul(2).saturating_add(tmp as u64);
        let hold = self
            .budget
            .reserve_with(transient, "a fetch's payload", self.room.as_ref())?;
        let cfg = self.model.config().clone();
        let payload = wire::encode(&self.mirror, &cfg, self.spec.range.clone(), a, b, q.linear);
        Ok(Reply::FetchDone(
            FetchDone {
                from_pos: q.from_pos,
                to_pos: q.to_pos,
            },
            payload,
            hold,
        ))
    }
}
