//! The [`Batch`] a step hands out, and the upkeep of its persistent rows.
//!
//! Row `i` of the block tables and of the context lengths belongs to running sequence
//! `Scheduler::rows[i]`, whose `row` field is `i`; the rows stay in place from one step
//! to the next. A sequence joins at the end (`push_row`); one that leaves is replaced
//! by the last row (`remove_row`), so the rows stay dense.
//!
//! A step rewrites only the entries that changed (a pushed or moved row whole, a
//! decode only the entries it changed). (A list of those changes for an incremental
//! upload, `Batch::dirty`, existed until 0.2 but no backend read it: the step path
//! packs the decode rows, `seqs[..num_decodes]`, with one copy a step.)
//!
//! A batch `step()` handed out stays as it was until the next `step()` (the C ABI
//! hands out pointers into it): a sequence that leaves between steps (it finished in
//! `on_step_done`, or was aborted) leaves `rows` at once, but the move of the last row
//! into its place is recorded and applied to the arrays at the start of the next step,
//! or before a row is pushed (a fork).

use super::{PreemptionMode, RequestId, Scheduler, SeqId};
use crate::block::NULL_BLOCK;
use crate::mem::grow_huge;

/// One sequence's part of a step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct ScheduledSeq {
    /// The sequence.
    pub seq: SeqId,
    /// Its request.
    pub request: RequestId,
    /// Whether this is (a chunk of) its prefill or a decode (one new token, the token
    /// sampled last step).
    pub is_prefill: bool,
    /// Position of its first new token (for a prefill admitted this step, the number
    /// of its leading tokens served from the prefix cache; for a continuing chunk,
    /// where the previous chunk ended).
    pub start_pos: u32,
    /// New tokens this step (their slots are consecutive in `slot_mapping`).
    pub num_new_tokens: u32,
    /// Tokens in its cache after this step (the kernels' context length).
    pub context_len: u32,
    /// Offset of its first new token in `slot_mapping` (`Batch::qo_indptr[i]`).
    pub token_offset: u32,
    /// Leading tokens of a prefill admitted this step served from the prefix cache
    /// (positions `0..num_cached_tokens`, not computed here: `start_pos` equals it).
    /// Their K/V is in the pool, or written by this step's `kv_append` for another row
    /// (a prompt admitted earlier in the step that begins the same way): see
    /// [`Batch`]. 0 for decodes and continuing chunks.
    pub num_cached_tokens: u32,
    /// Whether the token sampled from its last new token is its next token: true for
    /// a decode and for the last (or only) chunk of a prefill; false for a non-final
    /// chunk of a chunked prefill, whose sampled token
    /// [`Scheduler::on_step_done`] ignores (the engine may skip sampling it).
    pub samples: bool,
    /// Draft tokens this row verifies (speculative decoding, see
    /// [`Scheduler::set_lookahead`]): its `num_new_tokens = num_draft_tokens + 1`
    /// query tokens are the token sampled last step, then the drafts, at positions
    /// `start_pos..context_len`, causal within the row. Such a *verify row* is not a
    /// decode (`is_prefill` false, after `num_decodes`): it runs through the prefill
    /// path with [`Batch::qo_indptr`]. 0 for decodes and prefills.
    pub num_draft_tokens: u32,
}

/// What one step runs: device-ready arrays for the kernels.
///
/// Rows may read blocks another row of the same step writes (prompts that begin alike,
/// admitted in one step, share the first one's full blocks from that step on): in each
/// layer, write every new token's K/V (`kv_append` over the whole `slot_mapping`)
/// before that layer's attention of any row, as the backends' step path does.
#[derive(Clone, Debug, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Batch {
    /// The scheduled sequences; `seqs[i]` owns row `i` of the block tables. The
    /// decodes come first (`seqs[..num_decodes]`), then the prefills: with chunked
    /// prefill the continuing chunks, then the prompts admitted this step.
    pub seqs: Vec<ScheduledSeq>,
    /// How many leading entries of `seqs` are decodes (one new token each, `is_prefill`
    /// false); the rest are verify rows (a decode with draft tokens,
    /// [`ScheduledSeq::num_draft_tokens`]), prefills or prefill chunks.
    pub num_decodes: u32,
    /// `[seqs.len(), max_blocks_per_seq]`, padded with `NULL_BLOCK`.
    pub block_tables: Vec<i32>,
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: u32,
    /// Tokens per block of the pool the tables and slots index (the scheduler's
    /// [`SchedulerConfig::block_size`](super::SchedulerConfig::block_size)): slot
    /// `b * block_size + i` is token `i` of block `b` only in a cache of this block
    /// size, so a backend refuses a batch of another
    /// ([`AttentionBackend::begin_step`](crate::backend::AttentionBackend::begin_step)).
    pub block_size: u32,
    /// The sliding window the batch was scheduled with (the scheduler's): its tables
    /// hold released ([`NULL_BLOCK`]) entries before each sequence's window, so
    /// attention over them must use a window of at most this many tokens; a backend
    /// refuses anything else ([`AttentionBackend`](crate::backend::AttentionBackend)).
    pub sliding_window: Option<u32>,
    /// `[seqs.len()]`: context length of each sequence after this step.
    pub context_lens: Vec<i32>,
    /// `[total new tokens]`: slot of each new token, sequence by sequence.
    pub slot_mapping: Vec<i64>,
    /// `[total new tokens]`, or empty (the scheduler leaves it empty): each new
    /// token's tree mask, for an engine that verifies its drafts as trees. Fill it
    /// with [`tree_mask`](crate::ops::prefill::tree_mask) over `qo_indptr` (a tree's
    /// parents for each verify row, `None` for the others) before the backend plans
    /// the step; the decodes' words are not read. A tree's accepted path is not a
    /// prefix of its positions: the engine copies the path's K/V into the row's first
    /// positions before it passes the path's tokens to `on_step_done_accepted`.
    pub tree_mask: Vec<u64>,
    /// `[seqs.len() + 1]`: prefix sums of `num_new_tokens` in batch order; sequence
    /// `i`'s new tokens (its query rows, its entries of `slot_mapping`) are
    /// `qo_indptr[i]..qo_indptr[i + 1]` (the prefill kernel's `qo_indptr`). Empty
    /// when `seqs` is.
    pub qo_indptr: Vec<i32>,
    /// Tokens of this step's admitted prefills served from the prefix cache (the sum
    /// of `seqs[i].num_cached_tokens`): their K/V is in the pool or written by this
    /// step's `kv_append` for an earlier row, and they are neither in `slot_mapping`
    /// nor counted in `max_tokens_per_step`.
    pub num_cached_tokens: u32,
    /// Copy-on-write `(src, dst)` block pairs for `copy_blocks`, to run before the
    /// kernels write.
    pub copies: Vec<(u32, u32)>,
    /// `(device, host)` pairs to copy out, first of all.
    pub swap_out: Vec<(u32, u32)>,
    /// `(host, device)` pairs to copy in, after the swap-outs.
    pub swap_in: Vec<(u32, u32)>,
    /// Requests preempted this step, and how.
    pub preempted: Vec<(RequestId, PreemptionMode)>,
    /// The batch is handed out (from `step()` until the next one begins): row removals
    /// wait in `moves`.
    #[cfg_attr(feature = "serde", serde(skip))]
    pub(super) out: bool,
    /// `(dst, src)` row moves removals deferred while the batch was out, in order; the
    /// arrays are then cut to the rows left.
    #[cfg_attr(feature = "serde", serde(skip))]
    pub(super) moves: Vec<(u32, u32)>,
    /// The block tables and slot mappings of layer groups 1.. ([`group`](Self::group)
    /// names every group's, 0 included), row for row and token for token as
    /// `block_tables` and `slot_mapping`; empty for a model of one group. The copies
    /// and swaps above are of blocks of the one pool, whatever their group: run them
    /// on every K/V tensor of the cache.
    pub groups: Vec<GroupTables>,
}

/// A layer group's part of a [`Batch`] (groups 1..; group 0's are the batch's own
/// fields).
#[derive(Clone, Debug, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct GroupTables {
    /// `[seqs.len(), max_blocks_per_seq]`, as [`Batch::block_tables`]: this group's
    /// blocks (`NULL_BLOCK` before its window).
    pub block_tables: Vec<i32>,
    /// `[total new tokens]`, as [`Batch::slot_mapping`]: this group's slots.
    pub slot_mapping: Vec<i64>,
    /// This group's sliding window (as [`Batch::sliding_window`]).
    pub sliding_window: Option<u32>,
}

/// One layer group's view of a [`Batch`] ([`Batch::group`]): what its layers'
/// `kv_append` and attention read.
#[derive(Clone, Copy, Debug)]
pub struct GroupView<'a> {
    /// `[seqs.len(), max_blocks_per_seq]`.
    pub block_tables: &'a [i32],
    /// `[total new tokens]`.
    pub slot_mapping: &'a [i64],
    /// The group's sliding window.
    pub sliding_window: Option<u32>,
}

impl Batch {
    /// Layer groups (1 for a model of one group).
    pub fn num_groups(&self) -> usize {
        1 + self.groups.len()
    }

    /// Layer group `g`'s block tables, slot mapping and window (`g <
    /// num_groups()`; group 0's are `block_tables`, `slot_mapping`, `sliding_window`).
    pub fn group(&self, g: usize) -> Option<GroupView<'_>> {
        match g {
            0 => Some(GroupView {
                block_tables: &self.block_tables,
                slot_mapping: &self.slot_mapping,
                sliding_window: self.sliding_window,
            }),
            g => self.groups.get(g - 1).map(|t| GroupView {
                block_tables: &t.block_tables,
                slot_mapping: &t.slot_mapping,
                sliding_window: t.sliding_window,
            }),
        }
    }
}

impl Scheduler {
    /// Writes sequence `seq`'s block table and context length into batch row `row`
    /// (the whole row).
    pub(super) fn write_row(&mut self, row: usize, seq: SeqId) {
        let w = self.batch.max_blocks_per_seq as usize;
        let s = &self.seqs[&seq];
        let r = &mut self.batch.block_tables[row * w..(row + 1) * w];
        let blocks = s.table.blocks();
        for (dst, b) in r.iter_mut().zip(blocks) {
            *dst = *b as i32;
        }
        for dst in r[blocks.len().min(w)..].iter_mut() {
            *dst = NULL_BLOCK as i32;
        }
        self.batch.context_lens[row] = s.table.num_tokens() as i32;
        let commit_at = self.kv.commit_at(&s.table);
        for (t, plane) in self.seqs.extra(seq).iter().zip(&mut self.batch.groups) {
            let r = &mut plane.block_tables[row * w..(row + 1) * w];
            let blocks = t.blocks();
            for (dst, b) in r.iter_mut().zip(blocks) {
                *dst = *b as i32;
            }
            for dst in r[blocks.len().min(w)..].iter_mut() {
                *dst = NULL_BLOCK as i32;
            }
        }
        self.seqs.set_commit_at(seq, commit_at);
    }

    /// Applies the row moves deferred while the last batch was out, and cuts the arrays
    /// to the rows left; from here on changes go straight to the arrays.
    pub(super) fn settle_rows(&mut self) {
        let b = &mut self.batch;
        b.out = false;
        let w = b.max_blocks_per_seq as usize;
        let rows = self.rows.len();
        if b.moves.is_empty() && b.context_lens.len() == rows {
            return;
        }
        for i in 0..b.moves.len() {
            let (dst, src) = (b.moves[i].0 as usize, b.moves[i].1 as usize);
            b.block_tables.copy_within(src * w..(src + 1) * w, dst * w);
            for g in &mut b.groups {
                g.block_tables.copy_within(src * w..(src + 1) * w, dst * w);
            }
            b.context_lens[dst] = b.context_lens[src];
        }
        b.moves.clear();
        b.block_tables.truncate(rows * w);
        for g in &mut b.groups {
            g.block_tables.truncate(rows * w);
        }
        b.context_lens.truncate(rows);
    }

    /// Gives running sequence `seq` the next batch row.
    pub(super) fn push_row(&mut self, seq: SeqId) {
        self.settle_rows();
        let row = self.rows.len();
        self.rows.push(seq);
        let w = self.batch.max_blocks_per_seq as usize;
        // Grown on huge pages: a step writes a new block's entry into 1 row in 16.
        grow_huge(&mut self.batch.block_tables, (row + 1) * w);
        self.batch
            .block_tables
            .resize((row + 1) * w, NULL_BLOCK as i32);
        for g in &mut self.batch.groups {
            g.block_tables.resize((row + 1) * w, NULL_BLOCK as i32);
        }
        self.batch.context_lens.resize(row + 1, 0);
        self.seqs.cold_mut(seq).row = row;
        self.write_row(row, seq);
    }

    /// Exchanges batch rows `a` and `b`.
    pub(super) fn swap_rows(&mut self, a: usize, b: usize) {
        let w = self.batch.max_blocks_per_seq as usize;
        let (lo, hi) = (a.min(b), a.max(b));
        let (head, tail) = self.batch.block_tables.split_at_mut(hi * w);
        head[lo * w..(lo + 1) * w].swap_with_slice(&mut tail[..w]);
        for g in &mut self.batch.groups {
            let (head, tail) = g.block_tables.split_at_mut(hi * w);
            head[lo * w..(lo + 1) * w].swap_with_slice(&mut tail[..w]);
        }
        self.batch.context_lens.swap(lo, hi);
        self.rows.swap(lo, hi);
        for r in [lo, hi] {
            let id = self.rows[r];
            self.seqs.cold_mut(id).row = r;
        }
    }

    /// Takes sequence `seq` out of the batch rows: the last row moves into its place
    /// (rewritten whole there). While the batch is out the arrays' part waits for
    /// [`settle_rows`](Self::settle_rows) (see the module docs).
    pub(super) fn remove_row(&mut self, seq: SeqId) {
        let row = self.seqs.cold(seq).row;
        let last = self.rows.len() - 1;
        if row != last {
            let moved = self.rows[last];
            self.rows[row] = moved;
            self.seqs.cold_mut(moved).row = row;
            if self.batch.out {
                self.batch.moves.push((row as u32, last as u32));
            } else {
                let w = self.batch.max_blocks_per_seq as usize;
                self.batch
                    .block_tables
                    .copy_within(last * w..(last + 1) * w, row * w);
                for g in &mut self.batch.groups {
                    g.block_tables
                        .copy_within(last * w..(last + 1) * w, row * w);
                }
                self.batch.context_lens[row] = self.batch.context_lens[last];
            }
        }
        self.rows.pop();
        if !self.batch.out {
            let w = self.batch.max_blocks_per_seq as usize;
            self.batch.block_tables.truncate(last * w);
            for g in &mut self.batch.groups {
                g.block_tables.truncate(last * w);
            }
            self.batch.context_lens.truncate(last);
        }
        self.seqs.cold_mut(seq).row = usize::MAX;
    }
}
