//! [`Scheduler::step`]: one step's plan, in the four stages the scheduler's module docs
//! list, and stage 3 itself, the decode slots of the running sequences.
//!
//! A step lists the sequences in row order: the decodes in row order first, then (with
//! chunked prefill) the continuing chunks of the mid-prefill sequences, whose rows
//! `plan_chunks` moves after the decoding ones, then the admitted prefills in the
//! order their rows were pushed. The common decode (a free slot in a partial last
//! block this sequence holds alone) changes no block-table entry; any other rewrites
//! only the entries it changed; a chunk rewrites its row whole.

use super::{Batch, ScheduledSeq, Scheduler, SeqId};
use crate::block::NULL_BLOCK;
use crate::error::{Error, Result};
use crate::mem::prefetch_write;

/// What is left for the continuing chunks and verify rows of one step (chunked
/// prefill, speculative decoding).
struct ChunkPlan {
    /// Tokens left in the step's budget after the decodes (each takes one).
    tokens: usize,
    /// Mid-prefill and verify rows not yet scheduled (each takes at least one).
    chunks: usize,
    /// Free blocks the next token of every row not yet scheduled takes (an upper
    /// bound), which a chunk must leave.
    reserve: u32,
}

/// How many sequences ahead the per-sequence loops prefetch.
pub(super) const PREFETCH_AHEAD: usize = 16;
/// Batches from this size prefetch: below it a step's per-sequence data stays in the
/// core's caches from one step to the next, and the look-ahead only costs instructions.
const PREFETCH_MIN_BATCH: usize = 2048;

/// The look-ahead distance for a batch of `n` sequences (`usize::MAX`: none).
pub(super) fn prefetch_distance(n: usize) -> usize {
    if n >= PREFETCH_MIN_BATCH {
        PREFETCH_AHEAD
    } else {
        usize::MAX
    }
}

impl Scheduler {
    /// Plans and returns the next step's batch; see the module docs. Call
    /// [`on_step_done`](Self::on_step_done) with the sampled tokens before the next step.
    pub fn step(&mut self) -> Result<&Batch> {
        if self.in_step {
            return Err(Error::InvalidState(
                "step() called again before on_step_done()".into(),
            ));
        }
        // The rows that left since the last step leave the arrays now, and the rows
        // `on_step_done` changed (rollbacks, a window's releases) are written.
        self.settle_rows();
        self.write_deferred_rows();
        self.verify_rows = 0;
        let b = &mut self.batch;
        b.seqs.clear();
        b.slot_mapping.clear();
        b.qo_indptr.clear();
        b.tree_mask.clear();
        b.num_cached_tokens = 0;
        b.num_decodes = 0;
        b.copies.clear();
        b.swap_out.clear();
        b.swap_in.clear();
        b.preempted.clear();
        for g in &mut b.groups {
            g.slot_mapping.clear();
        }

        // (With a sliding window, what no query of this step sees was released by
        // the last `on_step_done`, so the counts below see those blocks free and a
        // rollback of this step never needs them.)
        // 1. Room for every running sequence's next token, most urgent groups first.
        self.make_room()?;
        // 2. Swap in, most urgent first, above the watermark (when others run), when nobody
        // was preempted.
        self.swap_in_groups()?;
        // 3. Decode slots for every running sequence, in row order.
        self.schedule_decodes()?;
        // 4. Admit waiting groups.
        self.admit_waiting()?;

        // Decodes were pushed in row order and admissions appended rows in push order,
        // so the batch lists sequences in row order.
        debug_assert!(
            self.batch
                .seqs
                .iter()
                .zip(&self.rows)
                .all(|(q, r)| q.seq == *r)
        );

        let b = &mut self.batch;
        if !b.seqs.is_empty() {
            b.qo_indptr.reserve(b.seqs.len() + 1);
            b.qo_indptr
                .extend(b.seqs.iter().map(|q| q.token_offset as i32));
            b.qo_indptr.push(b.slot_mapping.len() as i32);
        }

        self.batch.out = true;
        self.in_step = !self.batch.seqs.is_empty();
        self.update_metrics();
        Ok(&self.batch)
    }

    /// Step 3: gives every running sequence its decode slot, allocating only when a
    /// block fills and copying a shared partial block on write.
    fn schedule_decodes(&mut self) -> Result<()> {
        let chunks = if self.chunked || self.lookahead_seqs > 0 {
            self.plan_chunks()?
        } else {
            None
        };
        // Two copies of the loop: a small batch's records stay in the core's caches
        // from one step to the next, and even a look-ahead that finds nothing to do
        // costs it (about 1 ns a sequence at 1024).
        if self.rows.len() >= PREFETCH_MIN_BATCH {
            self.decode_rows::<true>(chunks)
        } else {
            self.decode_rows::<false>(chunks)
        }
    }

    /// [`schedule_decodes`](Self::schedule_decodes)' loop, with or without the
    /// look-ahead (`LOOK_AHEAD`) that prefetches the lines of the sequences a few rows
    /// on.
    fn decode_rows<const LOOK_AHEAD: bool>(&mut self, mut chunks: Option<ChunkPlan>) -> Result<()> {
        let w = self.batch.max_blocks_per_seq as usize;
        let dist = PREFETCH_AHEAD;
        let mask = self.cfg.block_size - 1; // (block sizes are powers of two)
        for row in 0..self.rows.len() {
            let id = self.rows[row];
            if LOOK_AHEAD {
                self.look_ahead(row, dist, mask, w);
            }
            if let Some(plan) = chunks.as_mut() {
                let cost = self.append_cost(id)?;
                plan.reserve -= cost;
                if self.seqs.is_prefilling(id) {
                    self.schedule_chunk(row, id, cost, plan)?;
                    continue;
                }
                if self.seqs.cold(id).lookahead > 0 {
                    self.schedule_verify(row, id, cost, plan)?;
                    continue;
                }
            }
            let si = (id & 0xffff_ffff) as usize; // a running sequence's id
            let seq = self.seqs.slots[si].as_mut().unwrap();
            let request = seq.request;
            let start = seq.table.num_tokens();
            let offset = self.batch.slot_mapping.len() as u32;
            if let Some(slot) = self.kv.append_in_place(&mut seq.table) {
                // The common case: a slot in the partial last block; the row is as is.
                self.batch.slot_mapping.push(slot);
            } else {
                let before = seq.table.num_blocks();
                let copies_before = self.batch.copies.len();
                let slot = self
                    .kv
                    .append_slot(&mut seq.table, &mut self.batch.copies)?;
                self.batch.slot_mapping.push(slot);
                // Only the entry that changed: a new (or copied-on-write) last block
                // (a window's releases were written by `slide_windows`).
                let n = seq.table.num_blocks();
                let last = n - 1;
                if (n != before || self.batch.copies.len() != copies_before) && last < w {
                    self.batch.block_tables[row * w + last] = seq.table.last_block() as i32;
                }
                // (Its hashes, and so its hot `commit_at`, are as they were: a new
                // or copied block is partial.)
            }
            if !self.batch.groups.is_empty() {
                self.decode_extra_groups(row, id)?;
            }
            self.batch.num_decodes += 1;
            self.batch.context_lens[row] = (start + 1) as i32;
            self.batch.seqs.push(ScheduledSeq {
                seq: id,
                request,
                is_prefill: false,
                start_pos: start,
                num_new_tokens: 1,
                context_len: start + 1,
                token_offset: offset,
                num_cached_tokens: 0,
                samples: true,
                num_draft_tokens: 0,
            });
        }
        Ok(())
    }

    /// The decode slot of running sequence `id` (batch row `row`) in layer groups
    /// 1.. (group 0's is `decode_rows`' own): an append to each of its other tables,
    /// the slot into the group's slot mapping, a new or copied block's entry into the
    /// group's row.
    fn decode_extra_groups(&mut self, row: usize, id: u64) -> Result<()> {
        let w = self.batch.max_blocks_per_seq as usize;
        let (_, extra) = self.seqs.tables_mut(id);
        for (t, plane) in extra.iter_mut().zip(&mut self.batch.groups) {
            let before = t.num_blocks();
            let copies_before = self.batch.copies.len();
            let slot = self.kv.append_slot(t, &mut self.batch.copies)?;
            plane.slot_mapping.push(slot);
            let n = t.num_blocks();
            if (n != before || self.batch.copies.len() != copies_before) && n - 1 < w {
                plane.block_tables[row * w + n - 1] = t.blocks()[n - 1] as i32;
            }
        }
        Ok(())
    }

    /// The end of `on_step_done` (with a sliding window): releases, for every running
    /// sequence and layer group, the blocks wholly before the window of the first
    /// position its next step appends (see the window's release rule in
    /// `block::table::append`); their batch entries become `NULL_BLOCK` at the next
    /// step (the batch is out). The next step's appends then release nothing more,
    /// and a rollback of that step finds every block it needs.
    pub(super) fn slide_windows(&mut self) -> Result<()> {
        for row in 0..self.rows.len() {
            let id = self.rows[row];
            let (t0, extra) = self.seqs.tables_mut(id);
            for (g, t) in std::iter::once(t0).chain(extra.iter_mut()).enumerate() {
                let live_before = t.first_live();
                if self.kv.slide_window(t)? > 0 {
                    self.released
                        .push((id, g as u32, live_before, t.first_live()));
                }
            }
        }
        Ok(())
    }

    /// Writes the batch rows `on_step_done` changed while the batch was out: whole
    /// rows after a rollback, `NULL_BLOCK` over the entries a window released.
    fn write_deferred_rows(&mut self) {
        let w = self.batch.max_blocks_per_seq as usize;
        for i in 0..self.released.len() {
            let (id, g, from, to) = self.released[i];
            let Some(row) = self.running_row(id) else {
                continue;
            };
            let plane = match g {
                0 => &mut self.batch.block_tables,
                g => &mut self.batch.groups[g as usize - 1].block_tables,
            };
            let (from, to) = ((from as usize).min(w), (to as usize).min(w));
            plane[row * w + from..row * w + to].fill(NULL_BLOCK as i32);
        }
        self.released.clear();
        for i in 0..self.stale_rows.len() {
            let id = self.stale_rows[i];
            if let Some(row) = self.running_row(id) {
                self.write_row(row, id);
            }
        }
        self.stale_rows.clear();
    }

    /// The batch row of sequence `id` when it is live and running.
    fn running_row(&self, id: SeqId) -> Option<usize> {
        self.seqs.get(&id)?;
        let row = self.seqs.cold(id).row;
        (row != usize::MAX).then_some(row)
    }

    /// Prefetches, at the decode of row `row`, the record of the sequence 2 × `dist`
    /// rows on, and for a sequence that will take a new block 4 × and 2 × `dist` rows
    /// on, the lines that takes; `mask` is the block size - 1 (a power of two less
    /// one), `w` the batch's row width.
    #[inline(always)]
    fn look_ahead(&self, row: usize, dist: usize, mask: u32, w: usize) {
        // The record the decode reads.
        if let Some(&far) = self.rows.get(row + 2 * dist) {
            self.seqs.prefetch_step(far);
        }
        // A sequence 4 × `dist` rows ahead that will take a new block (its count, in
        // the dense `context_lens`, a multiple of the block size; at most 1 in 16):
        // its record, and the batch's block-table entry its new block goes to. Far
        // ahead: only a few sequences in a window take a block, and these lines are
        // out of order.
        if let Some(&len) = self.batch.context_lens.get(row + 4 * dist)
            && len as u32 & mask == 0
        {
            let r = row + 4 * dist;
            self.seqs.prefetch_step(self.rows[r]);
            if let Some(e) = self
                .batch
                .block_tables
                .get(r * w + (len as u32 >> mask.count_ones()) as usize)
            {
                prefetch_write(e);
            }
        }
        // Half as far: where its new block entry goes.
        if let Some(&len) = self.batch.context_lens.get(row + 2 * dist)
            && len as u32 & mask == 0
            && let Some(q) = self.seqs.get(&self.rows[row + 2 * dist])
        {
            prefetch_write(q.table.next_entry_ptr());
        }
    }

    /// The budgets of this step's continuing chunks and verify rows (chunked
    /// prefill or a lookahead only): `None` when no running sequence is mid-prefill
    /// or has a lookahead. Moves those rows after the others first (decodes keep
    /// their order), so the batch lists the decodes first.
    fn plan_chunks(&mut self) -> Result<Option<ChunkPlan>> {
        let (mut decodes, mut reserve) = (0usize, 0u32);
        let spec = self.lookahead_seqs > 0;
        for i in 0..self.rows.len() {
            let id = self.rows[i];
            reserve += self.append_cost(id)?;
            let verifies = spec && self.seqs.cold(id).lookahead > 0;
            if !verifies && !self.seqs.is_prefilling(id) {
                if i != decodes {
                    self.swap_rows(i, decodes);
                }
                decodes += 1;
            }
        }
        let chunks = self.rows.len() - decodes;
        Ok((chunks > 0).then_some(ChunkPlan {
            tokens: self.cfg.max_tokens_per_step.saturating_sub(decodes),
            chunks,
            reserve,
        }))
    }

    /// Schedules the next chunk of mid-prefill sequence `id` (batch row `row`): as
    /// many of its remaining prefill tokens as the step's token budget leaves after
    /// the decodes and one token for each later chunk, and as fit the free blocks left
    /// above the watermark (when others run) after the later rows' next tokens; at
    /// least one token, whose block `make_room` reserved. `cost` is that one token's
    /// block cost.
    fn schedule_chunk(
        &mut self,
        row: usize,
        id: u64,
        cost: u32,
        plan: &mut ChunkPlan,
    ) -> Result<()> {
        let start = self.seqs[&id].table.num_tokens();
        let prefill_end = self.seqs.cold(id).prefill_end;
        let (offset, take, end) =
            self.append_row_chunk(id, (prefill_end - start) as usize, cost, plan)?;
        // The chunk's full blocks are registered now (see `admit_waiting`): a prompt
        // admitted later in this step may share them.
        let salt = self.seqs.cold(id).salt;
        let tokens = self.seqs.hot[(id & 0xffff_ffff) as usize].tokens.view();
        let seq = self.seqs.slots[(id & 0xffff_ffff) as usize]
            .as_mut()
            .unwrap();
        self.kv
            .commit_parts(&mut seq.table, tokens.as_slices(), salt)?;
        let (request, samples) = (seq.request, end == prefill_end);
        self.adopt_names(id)?;
        // Several entries may change (new blocks, a copy, a window's releases): the
        // whole row is rewritten (chunks are few).
        self.write_row(row, id);
        self.batch.seqs.push(ScheduledSeq {
            seq: id,
            request,
            is_prefill: true,
            start_pos: start,
            num_new_tokens: take as u32,
            context_len: end,
            token_offset: offset,
            num_cached_tokens: 0,
            samples,
            num_draft_tokens: 0,
        });
        Ok(())
    }

    /// Appends the next positions of running sequence `id`, a continuing chunk or a
    /// verify row, as one chunk in every layer group (a sliding window releases only
    /// what the chunk's first query no longer sees): `want` of them, at most what the
    /// step's token budget leaves after one token for each later chunk or verify row
    /// and what [`fit_tokens`](Self::fit_tokens) fits, at least the one token
    /// `make_room` reserved (`cost` blocks). Returns the chunk's offset in the slot
    /// mapping, its length and the table's count after it.
    fn append_row_chunk(
        &mut self,
        id: u64,
        want: usize,
        cost: u32,
        plan: &mut ChunkPlan,
    ) -> Result<(u32, usize, u32)> {
        plan.chunks -= 1;
        let start = self.seqs[&id].table.num_tokens();
        let take = want
            .min(plan.tokens.saturating_sub(plan.chunks))
            .max(1)
            .min(self.fit_tokens(start, cost, plan))
            .max(1);
        plan.tokens = plan.tokens.saturating_sub(take);
        let offset = self.batch.slot_mapping.len() as u32;
        let (t0, extra) = self.seqs.tables_mut(id);
        self.kv.append_chunk(
            t0,
            take as u32,
            &mut self.batch.copies,
            &mut self.batch.slot_mapping,
        )?;
        for (t, plane) in extra.iter_mut().zip(&mut self.batch.groups) {
            self.kv.append_chunk(
                t,
                take as u32,
                &mut self.batch.copies,
                &mut plane.slot_mapping,
            )?;
        }
        Ok((offset, take, self.seqs[&id].table.num_tokens()))
    }

    /// Tokens a row appending from position `start`, whose first token costs `cost`
    /// blocks (reserved by `make_room`), can take from the free blocks left above the
    /// watermark (when others run) after the later rows' next tokens: the rest of a
    /// partial last block (after a copy, which `cost` counts, when it is shared), then
    /// whole blocks. Every layer group's table takes the same blocks for the same
    /// positions (a mid-prefill sequence has no forks; a verify row's forks are
    /// counted at their own rows): `cost` and the free blocks split evenly.
    fn fit_tokens(&self, start: u32, cost: u32, plan: &ChunkPlan) -> usize {
        let bs = self.cfg.block_size;
        let groups = self.specs.len() as u32;
        let blocks = self
            .kv
            .device()
            .num_free()
            .saturating_sub(plan.reserve + self.watermark_now())
            .max(cost)
            / groups;
        let cost = cost / groups;
        let room = (bs - start % bs) % bs;
        let fit = if room > 0 && cost == 1 {
            room as u64 + (blocks as u64).saturating_sub(1) * bs as u64
        } else {
            room as u64 + blocks as u64 * bs as u64
        };
        fit.max(1).min(usize::MAX as u64) as usize
    }

    /// Schedules running sequence `id` (batch row `row`) as a verify row: its token
    /// sampled last step and up to its lookahead of draft tokens, as many as its
    /// token cap leaves (`k + 1` at most what it may still append), the step's token
    /// budget leaves after the decodes and one token for each later chunk or verify
    /// row, and the free blocks fit above the watermark after the later rows' next
    /// tokens ([`fit_tokens`](Self::fit_tokens)): the drafts never preempt anyone.
    /// At least the one token `make_room` reserved (`cost` blocks). The drafts' slots
    /// are appended as one chunk (their queries run together); nothing is named
    /// until `on_step_done` knows which were accepted.
    fn schedule_verify(
        &mut self,
        row: usize,
        id: u64,
        cost: u32,
        plan: &mut ChunkPlan,
    ) -> Result<()> {
        let slot = (id & 0xffff_ffff) as usize;
        let start = self.seqs[&id].table.num_tokens();
        let left = self.seqs.hot[slot].left.max(1) as usize;
        let want = (self.seqs.cold[slot].lookahead as usize + 1).min(left);
        let (offset, take, end) = self.append_row_chunk(id, want, cost, plan)?;
        let request = self.seqs[&id].request;
        // New blocks and a copy may change several entries: the whole row.
        self.write_row(row, id);
        self.verify_rows += 1;
        self.batch.seqs.push(ScheduledSeq {
            seq: id,
            request,
            is_prefill: false,
            start_pos: start,
            num_new_tokens: take as u32,
            context_len: end,
            token_offset: offset,
            num_cached_tokens: 0,
            samples: true,
            num_draft_tokens: take as u32 - 1,
        });
        Ok(())
    }

    /// Refreshes the metrics' gauges after a step.
    fn update_metrics(&mut self) {
        let m = &mut self.metrics;
        m.steps += 1;
        let pool = self.kv.device();
        m.blocks_used = pool.num_used();
        m.blocks_free = pool.num_free();
        m.blocks_cached_free = pool.num_cached_free();
        m.kv_utilization = if m.blocks_used == 0 {
            0.0
        } else {
            pool.held_fill() as f64 / (m.blocks_used as f64 * self.cfg.block_size as f64)
        };
        m.running = self.running.len();
        m.waiting = self.waiting.len();
        m.swapped = self.swapped.len();
        m.arena_bytes = self.arena.held();
    }
}
