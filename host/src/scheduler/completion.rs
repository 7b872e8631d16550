//! Completion: [`Scheduler::on_step_done`] takes the sampled tokens, and sequences
//! finish (stop token, `max_tokens`, or [`Scheduler::abort`]).
//!
//! `on_step_done` validates everything before it changes anything: every scheduled
//! sequence exactly once, nothing else. A sequence that finishes frees its blocks at
//! once; its blocks' prefix-cache registrations (deferred while the tokens came in)
//! are flushed first, so a freed block is already cached.

use super::seqs::Status;
use super::step::prefetch_distance;
use super::{FinishReason, RequestId, Scheduler, SeqId};
use crate::error::{Error, Result};

impl Scheduler {
    /// Takes the token sampled for every sequence of the last step. Every scheduled
    /// sequence must appear exactly once; otherwise nothing changes and an error says
    /// which. Returns the sequences that finished (their blocks are already free).
    ///
    /// With chunked prefill, a sequence scheduled with a non-final chunk of its prefill
    /// ([`ScheduledSeq::samples`](super::ScheduledSeq::samples) false) must appear too,
    /// with any token: the token is ignored (the sequence's next token is sampled after
    /// its last chunk), but its computed blocks are committed to the prefix cache.
    pub fn on_step_done(&mut self, sampled: &[(SeqId, u32)]) -> Result<Vec<(SeqId, FinishReason)>> {
        if !self.in_step {
            return Err(Error::InvalidState("on_step_done() without a step".into()));
        }
        // Validate first (no state changes on error). Duplicates are found by stamping
        // each sequence with this call's generation: no allocation per step.
        self.generation += 1;
        let generation = self.generation;
        for &(s, _) in sampled {
            let slot = self.seqs.slot(s).ok_or(Error::Unknown {
                what: "sequence",
                id: s,
            })?;
            // A removed sequence's slot is never `scheduled_in` this step, so the
            // sequence itself is read only on the error path.
            if self.seqs.scheduled_in[slot] != self.step_gen {
                if self.seqs.slots[slot].is_none() {
                    return Err(Error::Unknown {
                        what: "sequence",
                        id: s,
                    });
                }
                return Err(Error::invalid(
                    "sampled",
                    format!("sequence {s} was not scheduled"),
                ));
            }
            if self.seqs.stamp[slot] == generation {
                return Err(Error::invalid(
                    "sampled",
                    format!("sequence {s} appears twice"),
                ));
            }
            self.seqs.stamp[slot] = generation;
        }
        if sampled.len() != self.batch.seqs.len() {
            return Err(Error::invalid(
                "sampled",
                format!(
                    "{} tokens for {} scheduled sequences",
                    sampled.len(),
                    self.batch.seqs.len()
                ),
            ));
        }
        self.in_step = false;
        // Apply in order; the sequences that finish are freed after the loop (their
        // blocks' prefix-cache registrations, deferred and batched, come first).
        let mut done = Vec::new();
        let mut result = Ok(());
        let dist = prefetch_distance(sampled.len());
        for (k, &(s, tok)) in sampled.iter().enumerate() {
            // The sequence twice as far ahead: its lines, so that the look-ahead below
            // reads them from cache.
            if let Some(far) = sampled.get(k.saturating_add(dist.saturating_mul(2))) {
                self.seqs.prefetch(far.0);
            }
            // The lines a sequence `dist` ahead appends its token to, and those its
            // commit reads first when it filled a block, which the loop would
            // otherwise wait for.
            if let Some(ahead) = sampled.get(k.saturating_add(dist))
                && let Some(slot) = self.seqs.slot(ahead.0)
                && let Some(q) = &self.seqs.slots[slot]
            {
                q.tokens.prefetch_push(&self.seqs.recent[slot]);
                if self.kv.has_uncommitted(&q.table) {
                    self.kv.prefetch_commit(
                        &q.table,
                        q.tokens.view(&self.seqs.recent[slot]).as_slices(),
                    );
                }
            }
            let slot = (s & 0xffff_ffff) as usize; // validated above
            let (seq, recent) = (
                self.seqs.slots[slot].as_mut().unwrap(),
                &mut self.seqs.recent[slot],
            );
            seq.num_computed = seq.table.num_tokens();
            // Only a sequence that filled a block has anything to commit (1 in 16).
            if self.kv.has_uncommitted(&seq.table)
                && let Err(e) = self.kv.commit_deferred(
                    &mut seq.table,
                    seq.tokens.view(recent).as_slices(),
                    seq.salt,
                )
            {
                result = Err(e);
                break;
            }
            if seq.table.num_tokens() < seq.prefill_end {
                // A non-final chunk of a chunked prefill: the token sampled from its
                // last position is not the sequence's next token. Ignored.
                continue;
            }
            seq.tokens.push(recent, tok);
            let why = if seq.stop_token == Some(tok) {
                Some(FinishReason::Stop)
            } else if seq.tokens.len() >= seq.max_len {
                Some(FinishReason::MaxTokens)
            } else {
                None
            };
            if let Some(why) = why {
                done.push((s, why));
            }
        }
        self.kv.flush_commits();
        result?;
        for &(s, why) in &done {
            self.finish_seq(s, why)?;
        }
        Ok(done)
    }

    /// Ends a request wherever it is, freeing its blocks at once.
    pub fn abort(&mut self, id: RequestId) -> Result<()> {
        if self.in_step {
            return Err(Error::InvalidState(
                "abort between step() and on_step_done()".into(),
            ));
        }
        let g = self.groups.get(&id).ok_or(Error::Unknown {
            what: "request",
            id,
        })?;
        let seqs = g.seqs.clone();
        for s in seqs {
            self.finish_seq(s, FinishReason::Aborted)?;
        }
        Ok(())
    }

    /// Ends sequence `seq`: frees its blocks, records it as finished, and drops its
    /// group once the group has no sequence left.
    fn finish_seq(&mut self, seq: SeqId, why: FinishReason) -> Result<()> {
        let request = self.seqs[&seq].request;
        let status = self.groups[&request].status;
        if status == Status::Running {
            self.remove_row(seq);
        }
        let mut s = self.seqs.remove(&seq).unwrap();
        self.kv.free(&mut s.table)?;
        self.finished
            .push((request, seq, why, s.tokens.into_flushed()));
        let g = self.groups.get_mut(&request).unwrap();
        g.seqs.retain(|&x| x != seq);
        if g.seqs.is_empty() {
            let g = self.groups.remove(&request).unwrap();
            match g.status {
                Status::Waiting => {
                    self.waiting.remove(&g.key(self.cfg.policy));
                }
                Status::Running => {
                    self.running.remove(&g.arrival);
                }
                Status::Swapped => {
                    self.swapped.remove(&g.arrival);
                }
            }
        }
        Ok(())
    }
}
