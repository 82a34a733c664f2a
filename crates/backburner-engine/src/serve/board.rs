//! What each slot is doing, as the scheduler last published it (for the server's `/slots`): a small table behind one
//! mutex, written when a slot takes a request and once per scheduler turn (no allocation then), read by anyone.

use std::sync::Mutex;

use super::Slot;

/// One slot's state as last published.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotInfo {
    /// The slot's index.
    pub id: usize,
    /// The choice of a request running in it; `None` while it is idle.
    pub task: Option<SlotTask>,
    /// Tokens the slot's session holds: while idle, the history a next request may reuse a prefix of; while
    /// running, the prompt ingested so far and the tokens decoded.
    pub n_past: usize,
}

/// The request (one of its choices) a slot runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SlotTask {
    /// The task's number: sequential from 0, one per choice taking a slot (a choice run again as a job of its own
    /// gets a new one).
    pub task: u64,
    /// The request's id ([`super::Job::id`] of its choice 0: every choice of an `n` > 1 request shows it).
    pub id: String,
    /// The choice's index in its request (0 … n−1; 0 for `n` = 1).
    pub choice: usize,
    /// Prompt tokens (cached ones included).
    pub prompt_tokens: usize,
    /// Of those, tokens reused from the slot's cache.
    pub cached_tokens: usize,
    /// Of those, tokens processed so far (the cached ones, then those prefilled).
    pub prompt_done: usize,
    /// Tokens generated so far.
    pub generated: usize,
    /// The most tokens it may generate (`usize::MAX`: until the context is full).
    pub max_tokens: usize,
}

/// The slots' published states ([`SlotInfo`]), kept in [`super::Metrics::slots`].
#[derive(Debug, Default)]
pub struct SlotBoard {
    inner: Mutex<Board>,
}

#[derive(Debug, Default)]
struct Board {
    infos: Vec<SlotInfo>,
    /// Scratch for [`SlotBoard::update`]: which slots have a running job this turn.
    busy: Vec<bool>,
    /// The next task's number.
    next_task: u64,
}

impl SlotBoard {
    fn lock(&self) -> std::sync::MutexGuard<'_, Board> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// `n` idle, empty slots.
    pub fn reset(&self, n: usize) {
        let mut b = self.lock();
        b.infos = (0..n)
            .map(|id| SlotInfo {
                id,
                ..SlotInfo::default()
            })
            .collect();
        b.busy = vec![false; n];
    }

    /// Slot `slot` took choice `choice` of request `id`, of `prompt_tokens` tokens, `cached_tokens` of them from its
    /// cache, to generate at most `max_tokens`; returns the task's number ([`SlotTask::task`]).
    pub fn start(
        &self,
        slot: usize,
        (id, choice): (&str, usize),
        prompt_tokens: usize,
        cached_tokens: usize,
        max_tokens: usize,
    ) -> u64 {
        let mut b = self.lock();
        let task = b.next_task;
        b.next_task += 1;
        if b.infos.len() <= slot {
            let n = b.infos.len();
            b.infos.extend((n..=slot).map(|id| SlotInfo {
                id,
                ..SlotInfo::default()
            }));
            b.busy.resize(slot + 1, false);
        }
        let info = &mut b.infos[slot];
        info.n_past = cached_tokens;
        info.task = Some(SlotTask {
            task,
            id: id.to_string(),
            choice,
            prompt_tokens,
            cached_tokens,
            prompt_done: cached_tokens,
            generated: 0,
            max_tokens,
        });
        task
    }

    /// The end of a scheduler turn: every slot's history length; for each running job `(slot, prompt tokens left,
    /// tokens generated)` its progress; a slot without one is idle again.
    pub(crate) fn update(
        &self,
        slots: &[Slot],
        running: impl Iterator<Item = (usize, usize, usize)>,
    ) {
        let mut b = self.lock();
        let b = &mut *b;
        b.busy.iter_mut().for_each(|x| *x = false);
        for (slot, left, generated) in running {
            let Some(t) = b.infos.get_mut(slot).and_then(|i| i.task.as_mut()) else {
                continue;
            };
            t.prompt_done = t.prompt_tokens.saturating_sub(left);
            t.generated = generated;
            b.busy[slot] = true;
        }
        for (info, (slot, busy)) in b.infos.iter_mut().zip(slots.iter().zip(&b.busy)) {
            info.n_past = slot.session().tokens().len();
            if !busy {
                info.task = None;
            }
        }
    }

    /// A copy of the published states, one per slot in order (empty before [`SlotBoard::reset`]).
    pub fn snapshot(&self) -> Vec<SlotInfo> {
        self.lock().infos.clone()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn start_publishes_a_task_and_snapshot_copies() {
        let b = SlotBoard::default();
        b.reset(2);
        assert_eq!(b.start(1, ("req-1", 0), 40, 16, 100), 0);
        assert_eq!(b.start(0, ("req-1", 1), 40, 40, 100), 1);
        let s = b.snapshot();
        assert_eq!(s.len(), 2);
        let t = s[0].task.as_ref().expect("a task");
        assert_eq!((t.task, t.id.as_str(), t.choice), (1, "req-1", 1));
        let t = s[1].task.as_ref().expect("a task");
        assert_eq!((t.task, t.choice), (0, 0));
        assert_eq!(
            (t.id.as_str(), t.prompt_tokens, t.cached_tokens),
            ("req-1", 40, 16)
        );
        assert_eq!((t.prompt_done, t.generated, t.max_tokens), (16, 0, 100));
        assert_eq!(s[1].n_past, 16);
    }
}
