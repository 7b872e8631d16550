//! Completion: [`Scheduler::on_step_done`] takes the sampled tokens, and sequences
//! finish (stop token, `max_tokens`, or [`Scheduler::abort`]).
//!
//! `on_step_done` validates everything before it changes anything: every scheduled
//! sequence exactly once, nothing else. A sequence that finishes frees its blocks at
//! once; its blocks' prefix-cache registrations (deferred while the tokens came in)
//! are flushed first, so a freed block is already cached.

use super::seqs::{Hot, Status};
use super::step::{PREFETCH_AHEAD, prefetch_distance};
use super::{FinishReason, RequestId, Scheduler, SeqId};
use crate::error::{Error, Result};
use crate::mem::{LineWriter, prefetch_write};

impl Scheduler {
    /// Takes the token sampled for every sequence of the last step. Every scheduled
    /// sequence must appear exactly once; otherwise nothing changes and an error says
    /// which. Returns the sequences that finished (their blocks are already free).
    ///
    /// With chunked prefill, a sequence scheduled with a non-final chunk of its prefill
    /// ([`ScheduledSeq::samples`](super::ScheduledSeq::samples) false) must appear too,
    /// with any token: the token is ignored (the sequence's next token is sampled after
    /// its last chunk; the chunk's full blocks were registered when it was scheduled).
    pub fn on_step_done(&mut self, sampled: &[(SeqId, u32)]) -> Result<Vec<(SeqId, FinishReason)>> {
        if !self.in_step {
            return Err(Error::InvalidState("on_step_done() without a step".into()));
        }
        if self.verify_rows > 0 {
            // Verify rows keep their first token (the one sampled last step) and
            // roll back their drafts.
            let accepted: Vec<(SeqId, &[u32])> = sampled
                .iter()
                .map(|(s, t)| (*s, std::slice::from_ref(t)))
                .collect();
            return self.on_step_done_accepted(&accepted);
        }
        // Validate first (no state changes on error). The common call lists the step's
        // sequences in the step's order, which is row order: then each scheduled
        // sequence appears exactly once, which the two dense lists alone show.
        debug_assert_eq!(self.rows.len(), self.batch.seqs.len());
        let in_order = sampled.len() == self.rows.len()
            && sampled.iter().zip(&self.rows).all(|(&(s, _), &r)| s == r);
        if !in_order {
            self.validate_scheduled(sampled.iter().map(|&(s, _)| s), sampled.len())?;
        }
        self.in_step = false;
        self.complete_step(sampled, in_order)
    }

    /// Takes what every sequence of the last step kept (speculative decoding; see
    /// the module docs): for each scheduled sequence exactly once, the tokens it
    /// appends, in order. A decode or verify row keeps `0..=num_new_tokens` of its
    /// positions and appends as many tokens: with `n` of them, the token sampled
    /// last step and the first `n - 1` drafts keep their K/V, and the tokens are
    /// those `n - 1` drafts (the ones the verifier accepted) and the token sampled
    /// after them (the verifier's bonus or correction); 0 rolls the row back to where
    /// it was before the step. A prefill row takes exactly one token (ignored for a
    /// non-final chunk). A stop token or the `max_tokens` cap among the tokens ends
    /// the sequence there (the tokens after it are dropped). Otherwise nothing changes
    /// and an error says which row is wrong.
    ///
    /// The rejected positions' slots go back to the pool: blocks that held only
    /// rejected positions are freed, a block copied on write for the row is given back
    /// for the shared one when nothing is kept, and nothing rejected was ever named,
    /// so no prefix hit serves a rejected token. When every row of a step that
    /// preempted, swapped and admitted nothing keeps 0, the block tables, pool
    /// (free-queue order included) and prefix map are exactly as before the step,
    /// unless the step evicted a cached block for a new block: the step wrote into
    /// it, so its name is gone (it comes back hash-less).
    /// [`on_step_done`](Self::on_step_done) is this with one token for every row.
    pub fn on_step_done_accepted(
        &mut self,
        accepted: &[(SeqId, &[u32])],
    ) -> Result<Vec<(SeqId, FinishReason)>> {
        if !self.in_step {
            return Err(Error::InvalidState("on_step_done() without a step".into()));
        }
        self.validate_scheduled(accepted.iter().map(|&(s, _)| s), accepted.len())?;
        // Each row's kept positions (validated before anything changes).
        let mut kept = Vec::with_capacity(accepted.len());
        for &(s, toks) in accepted {
            let row = self.seqs.cold(s).row;
            let q = self.batch.seqs[row];
            let n = toks.len();
            if q.is_prefill && n != 1 {
                return Err(Error::invalid(
                    "accepted",
                    format!("{n} tokens for sequence {s}, a prefill row (exactly 1)"),
                ));
            }
            if n > q.num_new_tokens as usize {
                return Err(Error::invalid(
                    "accepted",
                    format!(
                        "{n} tokens for sequence {s}, which verified {} (at most that many)",
                        q.num_new_tokens
                    ),
                ));
            }
            // A stop token or the cap ends it at that token.
            let h = &self.seqs.hot[(s & 0xffff_ffff) as usize];
            let mut keep = n;
            if !q.is_prefill {
                for (i, &t) in toks.iter().enumerate() {
                    if h.stop == Some(t) || i + 1 >= h.left as usize {
                        keep = i + 1;
                        break;
                    }
                }
            }
            kept.push((row, keep as u32));
        }
        self.in_step = false;
        // Rollbacks, last row first: the reverse of the step's appends (each row's
        // layer groups likewise), so the pool returns exactly to its state before.
        let mut undo: Vec<usize> = (0..accepted.len())
            .filter(|&i| {
                let q = &self.batch.seqs[kept[i].0];
                !q.is_prefill && kept[i].1 < q.num_new_tokens
            })
            .collect();
        undo.sort_unstable_by_key(|&i| std::cmp::Reverse(kept[i].0));
        for i in undo {
            let (row, keep) = kept[i];
            let q = self.batch.seqs[row];
            // Per layer group: a copy on write is given back only while the shared
            // block holds no token a fork kept past this row's start (sharers see one
            // fill); its forks may then share their last block with it again.
            let groups = self.specs.len();
            let mut returnable = [false; crate::block::MAX_KV_GROUPS];
            for (g, r) in returnable.iter_mut().enumerate().take(groups) {
                *r = self.copy_returnable(q.seq, g, q.start_pos);
            }
            if returnable[..groups].iter().any(|&r| r) {
                let request = self.seqs[&q.seq].request;
                for k in 0..self.groups[&request].seqs.len() {
                    let o = self.groups[&request].seqs[k];
                    let (t0, extra) = self.seqs.tables_mut(o);
                    t0.mark_last_maybe_shared();
                    extra.iter_mut().for_each(|t| t.mark_last_maybe_shared());
                }
            }
            let copies = |g: usize| {
                if returnable[g] {
                    &self.batch.copies[..]
                } else {
                    &[]
                }
            };
            let (t0, extra) = self.seqs.tables_mut(q.seq);
            for (g, t) in extra.iter_mut().enumerate().rev() {
                self.kv
                    .truncate_appended(t, q.start_pos, q.start_pos + keep, copies(g + 1))?;
            }
            self.kv
                .truncate_appended(t0, q.start_pos, q.start_pos + keep, copies(0))?;
            self.stale_rows.push(q.seq);
        }
        // The accepted drafts join the history here; the last token goes through
        // the common path (commits, stop and cap).
        let mut last = Vec::with_capacity(accepted.len());
        LineWriter::scope(|lines| {
            for (&(s, toks), &(_, keep)) in accepted.iter().zip(&kept) {
                let Some(&tok) = (keep as usize).checked_sub(1).and_then(|i| toks.get(i)) else {
                    continue;
                };
                let h = &mut self.seqs.hot[(s & 0xffff_ffff) as usize];
                if !self.batch.seqs[self.seqs.cold[(s & 0xffff_ffff) as usize].row].is_prefill {
                    for &d in &toks[..keep as usize - 1] {
                        h.tokens.push(d, lines);
                        h.left -= 1;
                    }
                }
                last.push((s, tok));
            }
        });
        self.complete_step(&last, false)
    }

    /// Whether sequence `seq`, rolled back to `start` tokens, may take back in layer
    /// group `g` the shared partial block it copied on write this step (if it did):
    /// no fork of its group holds that block with tokens past `start` (the last
    /// sharer to append wrote into it in place and kept that token).
    fn copy_returnable(&self, seq: SeqId, g: usize, start: u32) -> bool {
        let i = (start / self.cfg.block_size) as usize;
        let own = self.block_table_of(seq, g).expect("a live sequence");
        let Some(src) = own
            .blocks()
            .get(i)
            .and_then(|&b| self.batch.copies.iter().find(|c| c.1 == b))
            .map(|c| c.0)
        else {
            return false;
        };
        let request = self.seqs[&seq].request;
        self.groups[&request].seqs.iter().all(|&o| {
            let t = self.block_table_of(o, g).expect("a live fork");
            o == seq || t.num_tokens() <= start || t.blocks().get(i) != Some(&src)
        })
    }

    /// The rest of `on_step_done` after validation: applies `sampled` (one token for
    /// each sequence that keeps any position, in row order when `in_order`), names
    /// and registers the step's full blocks, finishes the sequences that are done,
    /// and (with a sliding window) releases what the next step no longer sees.
    fn complete_step(
        &mut self,
        sampled: &[(SeqId, u32)],
        in_order: bool,
    ) -> Result<Vec<(SeqId, FinishReason)>> {
        // Apply in order; the sequences that finish are freed after the loop (their
        // blocks' prefix-cache registrations, deferred and batched, come first). Whole
        // lines of history go out with streaming stores, fenced when the loop ends
        // (see `LineWriter`).
        let mut done = Vec::new();
        let result =
            LineWriter::scope(|lines| self.apply_sampled(sampled, in_order, lines, &mut done));
        // The step's commits are named and registered together, and the names written
        // into their tables (tagged by slot), also after an error.
        self.kv.flush_commits();
        for &(slot, i, name) in self.kv.named() {
            let seq = self.seqs.slots[slot as usize].as_mut().unwrap();
            seq.table.set_hash(i as usize, name);
        }
        // The other layer groups' tables take the names (registering their blocks)
        // before any block is freed.
        if !self.batch.groups.is_empty() {
            let mut last = u32::MAX;
            for k in 0..self.kv.named().len() {
                let slot = self.kv.named()[k].0;
                if slot != last {
                    last = slot;
                    let names = self.seqs.slots[slot as usize]
                        .as_ref()
                        .unwrap()
                        .table
                        .hashes();
                    for t in self.seqs.extra[slot as usize].iter_mut() {
                        self.kv.adopt_names(t, names)?;
                    }
                }
            }
        }
        // (Slid also when a commit failed: the next step's rows need their releases
        // written.)
        if self.specs.iter().any(|s| s.window().is_some()) {
            self.slide_windows()?;
        }
        result?;
        for &(s, why) in &done {
            self.finish_seq(s, why)?;
        }
        Ok(done)
    }

    /// `on_step_done`'s loop over validated `sampled` (in row order when `in_order`):
    /// counts, commits and tokens; the sequences that finish go to `done`. Stops at
    /// the first error (a commit's), with the registrations so far still pending.
    fn apply_sampled(
        &mut self,
        sampled: &[(SeqId, u32)],
        in_order: bool,
        lines: &mut LineWriter,
        done: &mut Vec<(SeqId, FinishReason)>,
    ) -> Result<()> {
        // The look-ahead for flushes and commits runs at every size (their lines are
        // cold even when the hot records stay in cache); the hot records' own only
        // for large batches.
        let dist = PREFETCH_AHEAD;
        let far_dist = prefetch_distance(sampled.len()).saturating_mul(2);
        for (k, &(s, tok)) in sampled.iter().enumerate() {
            // A sequence twice as far ahead: its hot record, which the look-ahead
            // below reads, and when it just filled a block (it will likely commit
            // it), its table's lines.
            if let Some(&(far, _)) = sampled.get(k.saturating_add(far_dist))
                && let Some(h) = self.seqs.hot.get((far & 0xffff_ffff) as usize)
            {
                prefetch_write(h);
                prefetch_write((h as *const Hot).cast::<u8>().wrapping_add(64));
                if self.batch.context_lens[k + far_dist] as u32 & (self.cfg.block_size - 1) == 0 {
                    self.seqs.prefetch(far);
                }
            }
            // A sequence `dist` ahead: when its next token fills its pending ones,
            // the end of its token `Vec`, where they go; when it commits a block, the
            // lines its commit reads first. (Its count is row `k + dist`'s when
            // `sampled` is in row order; a hint otherwise.)
            if let Some(&(ahead, _)) = sampled.get(k.saturating_add(dist)) {
                let slot = (ahead & 0xffff_ffff) as usize; // validated: live
                let h = &self.seqs.hot[slot];
                if h.tokens.flushes_next() {
                    h.tokens.prefetch_flush();
                }
                if self.batch.context_lens[k + dist] as u32 >= h.commit_at {
                    self.kv.prefetch_commit(
                        &self.seqs.slots[slot].as_ref().unwrap().table,
                        h.tokens.view().as_slices(),
                    );
                }
            }
            let slot = (s & 0xffff_ffff) as usize; // validated above
            // Its count after the step and whether `tok` is its next token: from its
            // batch row when `sampled` is in row order (a decode samples; a prefill
            // row's `ScheduledSeq` says), else from its table.
            let (num_tokens, samples) = if in_order {
                let n = self.batch.context_lens[k] as u32;
                (
                    n,
                    k < self.batch.num_decodes as usize || self.batch.seqs[k].samples,
                )
            } else {
                let n = self.seqs.slots[slot].as_ref().unwrap().table.num_tokens();
                (n, n >= self.seqs.cold[slot].prefill_end)
            };
            #[cfg(debug_assertions)]
            self.check_hot(slot, num_tokens, samples);
            let h = &mut self.seqs.hot[slot];
            h.num_computed = num_tokens;
            // Only a sequence that filled a block has anything to commit (1 in 16).
            if num_tokens >= h.commit_at {
                let seq = self.seqs.slots[slot].as_mut().unwrap();
                let salt = self.seqs.cold[slot].salt;
                self.kv.commit_deferred(
                    &mut seq.table,
                    h.tokens.view().as_slices(),
                    salt,
                    slot as u32,
                )?;
                h.commit_at = self.kv.commit_at(&seq.table);
            }
            if !samples {
                // A non-final chunk of a chunked prefill: the token sampled from its
                // last position is not the sequence's next token. Ignored.
                continue;
            }
            h.tokens.push(tok, lines);
            h.left = h.left.saturating_sub(1);
            let why = if h.stop == Some(tok) {
                Some(FinishReason::Stop)
            } else if h.left == 0 {
                Some(FinishReason::MaxTokens)
            } else {
                None
            };
            if let Some(why) = why {
                done.push((s, why));
            }
        }
        Ok(())
    }

    /// Validates the `len` sequences `ids` of an `on_step_done` in any order: every
    /// entry a live sequence the step scheduled (its batch row lists it), none twice,
    /// and as many entries as the step scheduled. Duplicates are found by stamping
    /// each sequence with this call's generation: no allocation.
    fn validate_scheduled(&mut self, ids: impl Iterator<Item = SeqId>, len: usize) -> Result<()> {
        self.generation += 1;
        let generation = self.generation;
        for s in ids {
            let unknown = Error::Unknown {
                what: "sequence",
                id: s,
            };
            let slot = self.seqs.slot(s).ok_or(unknown.clone())?;
            if self.seqs.slots[slot].is_none() {
                return Err(unknown);
            }
            let row = self.seqs.cold[slot].row;
            // A running sequence's row is its place in the step's list (the decodes
            // first, in row order, then the prefills, whose rows come after).
            if self.batch.seqs.get(row).is_none_or(|q| q.seq != s) {
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
        if len != self.batch.seqs.len() {
            return Err(Error::invalid(
                "sampled",
                format!(
                    "{} tokens for {} scheduled sequences",
                    len,
                    self.batch.seqs.len()
                ),
            ));
        }
        Ok(())
    }

    /// Checks that scheduled sequence `slot`'s hot record agrees with its others,
    /// and `num_tokens` and `samples` with its table (debug builds: what
    /// `on_step_done` relies on, see `seqs::Hot`).
    #[cfg(debug_assertions)]
    fn check_hot(&self, slot: usize, num_tokens: u32, samples: bool) {
        let (seq, cold, h) = (
            self.seqs.slots[slot].as_ref().unwrap(),
            &self.seqs.cold[slot],
            &self.seqs.hot[slot],
        );
        assert_eq!(num_tokens, seq.table.num_tokens(), "num_tokens");
        assert_eq!(samples, num_tokens >= cold.prefill_end, "samples");
        assert_eq!(h.commit_at, self.kv.commit_at(&seq.table), "hot commit_at");
        let len = h.tokens.len();
        assert_eq!(
            h.left as usize,
            (cold.max_len as usize).saturating_sub(len),
            "hot left"
        );
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
        if self.seqs.cold(seq).lookahead > 0 {
            self.lookahead_seqs -= 1;
        }
        let (mut s, tokens, extra) = self.seqs.remove(&seq).unwrap();
        self.kv.free(&mut s.table)?;
        for mut t in extra {
            self.kv.free(&mut t)?;
        }
        self.finished.push((request, seq, why, tokens.into_vec()));
        let g = self.groups.get_mut(&request).unwrap();
        g.seqs.retain(|&x| x != seq);
        if g.seqs.is_empty() {
            let g = self.groups.remove(&request).unwrap();
            let key = g.key(self.cfg.policy);
            match g.status {
                Status::Waiting => self.waiting.remove(&key),
                Status::Running => self.running.remove(&key),
                Status::Swapped => self.swapped.remove(&key),
            };
        }
        Ok(())
    }
}
