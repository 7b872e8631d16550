//! The block manager and scheduler against a simple model, under random interleavings
//! of add, step (with sampled tokens), fork, abort, preemption and swap.
//!
//! A fake cache holds a token id per slot (device and host). Every step applies the
//! batch's swap-outs, swap-ins and copy-on-write copies, then writes each new token's id
//! through `slot_mapping`, like the kernels would write its K and V. After every step,
//! every sequence is read back through its block table and must equal its tokens. The
//! invariants are checked after every operation.
//!
//! Half the cases run with chunked prefill, often with a step budget far below the
//! longest prompt: each step's token accounting is checked too (`qo_indptr`, the
//! budget, each sequence's new tokens starting where its last step ended, prefix hits
//! reported, non-final chunks' sampled tokens ignored, no fork mid-prefill).
//!
//! Hand-made cases of single behaviours are in `host/tests/scheduling/scheduler_examples.rs` and
//! `host/tests/scheduling/scheduler_chunked.rs`.

use std::collections::{HashMap, HashSet};

use pagedkv_host::Error;
use pagedkv_host::block::{KvSpec, Location, NULL_BLOCK, PAD_SLOT};
use pagedkv_host::scheduler::{
    FinishReason, PreemptionMode, QueuePolicy, Request, Scheduler, SchedulerConfig,
};
use proptest::prelude::*;

#[derive(Clone, Debug)]
enum Op {
    Add {
        prefix: usize,
        len: usize,
        max_tokens: u32,
        swap: bool,
    },
    Step {
        stop_every: u32,
        /// The order of the sampled tokens: the step's (0), reversed (1), rotated by
        /// one (2), or reversed after two bad lists (3, see `Model::step`).
        order: u8,
    },
    Fork(usize),
    Abort(usize),
    /// `reset_prefix_cache`: refused while anything runs or is swapped out.
    Reset,
    /// `set_lookahead(k)` on a running sequence: its later steps verify up to `k`
    /// draft tokens, and the model accepts a random number of them.
    Lookahead(usize, u32),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        3 => (0usize..3, 1usize..50, 1u32..40, any::<bool>()).prop_map(|(prefix, len, max_tokens, swap)| Op::Add { prefix, len, max_tokens, swap }),
        8 => (0u32..12, prop_oneof![3 => Just(0u8), 1 => 1u8..4]).prop_map(|(stop_every, order)| Op::Step { stop_every, order }),
        2 => any::<usize>().prop_map(Op::Fork),
        1 => any::<usize>().prop_map(Op::Abort),
        1 => Just(Op::Reset),
        2 => (any::<usize>(), prop_oneof![1 => Just(0u32), 3 => 1u32..6]).prop_map(|(i, k)| Op::Lookahead(i, k)),
    ]
}

/// A configuration, and whether chunked prefill is on (then `max_tokens_per_step` is
/// often far below `max_model_len`, so long prompts split across steps).
fn config() -> impl Strategy<Value = (SchedulerConfig, bool)> {
    (
        any::<bool>(),
        0usize..24,
        prop::sample::select(vec![8u32, 16, 32]),
        prop_oneof![2u32..8, 8u32..48],
        prop::sample::select(vec![0u32, 3, 8, 40]),
        any::<bool>(),
        any::<bool>(),
        prop::option::weighted(0.25, 10u32..60),
        any::<bool>(),
        1usize..12,
        prop_oneof![Just(0.0), Just(0.01), 0.0f64..0.5],
        (
            16u32..=128,
            0usize..200,
            // Layer groups (a hybrid model) in a third of the cases: two or three,
            // each full or windowed (then `sliding_window` is unset).
            prop_oneof![
                2 => Just(Vec::new()),
                1 => prop::collection::vec(prop::option::weighted(0.6, 4u32..60), 2..=3),
            ],
        ),
    )
        .prop_map(
            |(
                chunked,
                small_budget,
                block_size,
                num_blocks,
                host,
                swap,
                prefix,
                window,
                prio,
                max_seqs,
                watermark,
                (max_model_len, extra_tokens, groups),
            )| {
                let cfg = SchedulerConfig {
                    num_blocks,
                    block_size,
                    num_host_blocks: host,
                    max_num_seqs: max_seqs,
                    max_tokens_per_step: if chunked && extra_tokens % 2 == 0 {
                        max_seqs + small_budget
                    } else {
                        max_model_len as usize + extra_tokens
                    },
                    watermark,
                    preemption: if swap {
                        PreemptionMode::Swap
                    } else {
                        PreemptionMode::Recompute
                    },
                    policy: if prio {
                        QueuePolicy::Priority
                    } else {
                        QueuePolicy::Fcfs
                    },
                    enable_prefix_caching: prefix,
                    sliding_window: if groups.is_empty() { window } else { None },
                    kv_groups: groups.into_iter().map(KvSpec::from_window).collect(),
                    max_model_len,
                };
                (cfg, chunked)
            },
        )
}

/// The tokens row `q` writes: its sequence's history, then (a verify row) its
/// drafts, a function of the sequence and position (never the stop token 7).
fn with_drafts(s: &Scheduler, q: &pagedkv_host::scheduler::ScheduledSeq) -> Vec<u32> {
    let mut t = s.tokens(q.seq).unwrap().to_vec();
    while t.len() < q.context_len as usize {
        t.push(draft_token(q.seq, t.len()));
    }
    t
}

/// The draft token of sequence `seq` at position `pos`.
fn draft_token(seq: u64, pos: usize) -> u32 {
    (seq as u32).wrapping_mul(31).wrapping_add(pos as u32 * 7) % 300 + 100
}

struct Model {
    s: Scheduler,
    dev: Vec<Option<u32>>,
    host: Vec<Option<u32>>,
    next_req: u64,
    next_token: u32,
    /// Accepted requests: prompt length and `max_tokens`.
    accepted: HashMap<u64, (usize, u32)>,
    /// Per live sequence, the context length it had when last scheduled (0 after a
    /// recompute): the next step's new tokens must start there, with no gap.
    ctx: HashMap<u64, u32>,
    /// Per live sequence, the first new position of its last step: with a sliding
    /// window, the blocks wholly before that position's window are released, and no
    /// others.
    last_start: HashMap<u64, u32>,
    /// Whether a step may keep no position of a decode or verify row (a rollback);
    /// off for the liveness phase, where every step must make progress.
    rollbacks: bool,
}

impl Model {
    fn new(cfg: SchedulerConfig, chunked: bool) -> Self {
        let bs = cfg.block_size as usize;
        let dev = vec![None; cfg.num_blocks as usize * bs];
        let host = vec![None; cfg.num_host_blocks.max(1) as usize * bs];
        Model {
            s: Scheduler::with_chunked_prefill(cfg, chunked).unwrap(),
            ctx: HashMap::new(),
            last_start: HashMap::new(),
            rollbacks: false,
            dev,
            host,
            next_req: 0,
            next_token: 1000,
            accepted: HashMap::new(),
        }
    }

    fn bs(&self) -> usize {
        self.s.config().block_size as usize
    }

    fn copy(src: &[Option<u32>], dst: &mut [Option<u32>], s: u32, d: u32, bs: usize) {
        let (s, d) = (s as usize * bs, d as usize * bs);
        dst[d..d + bs].copy_from_slice(&src[s..s + bs]);
    }

    /// One step: apply the batch to the fake cache like an engine would, sample.
    fn step(&mut self, stop_every: u32, order: u8) -> Result<(), TestCaseError> {
        let bs = self.bs();
        let idle = self.s.is_idle();
        let hits_before = self.s.metrics().prefix_hit_tokens;
        let batch = self.s.step().unwrap().clone();
        // Liveness: a scheduler with live requests always schedules something (every
        // step then gives some sequence a token it keeps, so it finishes).
        prop_assert!(
            idle || !batch.seqs.is_empty(),
            "stalled: live requests but an empty batch: {:?}",
            self.s.metrics()
        );
        self.check_chunks(&batch, hits_before)?;
        // Swap-outs first, then swap-ins, then copy-on-write copies, then the writes.
        for &(d, h) in &batch.swap_out {
            Self::copy(&self.dev, &mut self.host, d, h, bs);
        }
        for &(h, d) in &batch.swap_in {
            Self::copy(&self.host, &mut self.dev, h, d, bs);
        }
        let dsts: HashSet<u32> = batch.copies.iter().map(|c| c.1).collect();
        prop_assert_eq!(dsts.len(), batch.copies.len(), "a copy destination repeats");
        for &(src, dst) in &batch.copies {
            prop_assert!(!dsts.contains(&src), "a copy source is also a destination");
            let dev = self.dev.clone();
            Self::copy(&dev, &mut self.dev, src, dst, bs);
        }
        // No two new tokens share a slot (in any layer group: a block id belongs to
        // one group), and every written block is held alone.
        let groups = self.s.kv_specs().len();
        prop_assert_eq!(batch.num_groups(), groups);
        let real: Vec<i64> = (0..groups)
            .flat_map(|g| batch.group(g).unwrap().slot_mapping.iter().copied())
            .filter(|s| *s >= 0)
            .collect();
        let slots: HashSet<i64> = real.iter().copied().collect();
        prop_assert_eq!(slots.len(), real.len(), "two tokens got the same slot");
        let w = batch.max_blocks_per_seq as usize;
        for g in 0..groups {
            let view = batch.group(g).unwrap();
            prop_assert_eq!(view.block_tables.len(), batch.seqs.len() * w);
            prop_assert_eq!(view.slot_mapping.len(), batch.slot_mapping.len());
            for (row, q) in batch.seqs.iter().enumerate() {
                let tokens = with_drafts(&self.s, q);
                prop_assert_eq!(batch.context_lens[row] as u32, q.context_len);
                let table = self.s.block_table_of(q.seq, g).unwrap();
                for (i, b) in table.blocks().iter().enumerate() {
                    prop_assert_eq!(
                        view.block_tables[row * w + i],
                        *b as i32,
                        "group {} row {} entry {}",
                        g,
                        row,
                        i
                    );
                }
                for i in table.blocks().len()..w {
                    prop_assert_eq!(view.block_tables[row * w + i], NULL_BLOCK as i32, "padding");
                }
                for k in 0..q.num_new_tokens {
                    let slot = view.slot_mapping[(q.token_offset + k) as usize];
                    let pos = q.start_pos + k;
                    // Every new token's K/V is stored: some query of the step reads it
                    // (a prefill's tokens before the window once went unstored, and
                    // its early queries read released blocks).
                    prop_assert!(slot != PAD_SLOT, "pad slot at {} of {:?}", pos, q);
                    prop_assert!(slot >= 0);
                    let block = (slot as usize / bs) as u32;
                    prop_assert_eq!(table.blocks()[pos as usize / bs], block);
                    // A block another sequence holds is written only as a full block of
                    // a prefill sharing it the step it is computed (an identical prompt
                    // admitted in the same step, as vLLM shares them), with the token
                    // every holder has there; a partial block is copied on write first.
                    if self.s.kv().device().ref_cnt(block).unwrap() > 1 {
                        prop_assert!(
                            q.is_prefill && (pos as usize / bs + 1) * bs <= q.context_len as usize,
                            "write into a shared partial block at {} of {:?}",
                            pos,
                            q
                        );
                        for other in self.s.live_seqs() {
                            let t = self.s.block_table_of(other, g).unwrap();
                            if t.location() == Location::Device
                                && t.blocks().get(pos as usize / bs) == Some(&block)
                            {
                                prop_assert_eq!(
                                    self.s.tokens(other).unwrap().get(pos as usize),
                                    tokens.get(pos as usize).copied(),
                                    "sequence {} shares block {} with other tokens",
                                    other,
                                    block
                                );
                            }
                        }
                    }
                    self.dev[slot as usize] = Some(tokens[pos as usize]);
                }
            }
        }
        // What the kernels read: every position some new query of the step attends to
        // (from the window of its first new position on) reads its own token back
        // through the batch's block-table row, in every layer group.
        for g in 0..groups {
            let window = self.s.kv_specs()[g].window();
            let view = batch.group(g).unwrap();
            prop_assert_eq!(view.sliding_window, window);
            for (row, q) in batch.seqs.iter().enumerate() {
                let tokens = with_drafts(&self.s, q);
                for pos in window_start(window, q.start_pos)..q.context_len {
                    let b = view.block_tables[row * w + pos as usize / bs];
                    prop_assert!(
                        b != NULL_BLOCK as i32,
                        "{:?} attends to position {} in a released block",
                        q,
                        pos
                    );
                    prop_assert_eq!(
                        self.dev[b as usize * bs + pos as usize % bs],
                        Some(tokens[pos as usize]),
                        "{:?} reads position {} (group {})",
                        q,
                        pos,
                        g
                    );
                }
            }
        }
        let sampled: Vec<(u64, u32)> = batch
            .seqs
            .iter()
            .enumerate()
            .map(|(i, q)| {
                self.next_token += 1;
                let stop =
                    stop_every > 0 && (i as u32 + self.next_token).is_multiple_of(stop_every * 7);
                (q.seq, if stop { 7 } else { self.next_token % 300 + 100 })
            })
            .collect();
        let lens: Vec<usize> = batch
            .seqs
            .iter()
            .map(|q| self.s.tokens(q.seq).unwrap().len())
            .collect();
        // Verify rows keep a random number of their positions (from 0 while
        // `rollbacks`, else from 1): the first drafts, then a sampled token.
        let mut kept: HashMap<u64, usize> = HashMap::new();
        let mut accepted: Vec<(u64, Vec<u32>)> = Vec::new();
        let verifies = batch.seqs.len() > batch.num_decodes as usize
            && batch.seqs[batch.num_decodes as usize..]
                .iter()
                .any(|q| !q.is_prefill);
        let rollbacks = self.rollbacks;
        for (q, &(_, tok)) in batch.seqs.iter().zip(&sampled) {
            let mut toks = vec![tok];
            if !q.is_prefill && (verifies || rollbacks) {
                let n = q.num_new_tokens as usize;
                let lo = if rollbacks { 0 } else { 1 };
                let r = (tok as usize * 7 + q.seq as usize) % (n + 1 - lo) + lo;
                let drafts = with_drafts(&self.s, q);
                toks = Vec::new();
                if r > 0 {
                    toks.extend_from_slice(
                        &drafts[q.start_pos as usize + 1..q.start_pos as usize + r],
                    );
                    toks.push(tok);
                }
                kept.insert(q.seq, toks.len());
            }
            accepted.push((q.seq, toks));
        }
        let mut sampled = sampled;
        match order {
            1 | 3 => sampled.reverse(),
            2 if !sampled.is_empty() => sampled.rotate_left(1),
            _ => {}
        }
        if order == 3 && sampled.len() >= 2 {
            // Bad lists in another order than the step's: a duplicate in place of an
            // entry, and one entry short. Both are errors that change nothing (the
            // model's checks after the real call below would see a change).
            let mut dup = sampled.clone();
            dup[1] = dup[0];
            prop_assert!(
                matches!(
                    self.s.on_step_done(&dup),
                    Err(Error::InvalidArgument { .. })
                ),
                "a duplicate was accepted"
            );
            prop_assert!(
                matches!(
                    self.s.on_step_done(&sampled[1..]),
                    Err(Error::InvalidArgument { .. })
                ),
                "a missing entry was accepted"
            );
        }
        if !batch.seqs.is_empty() {
            if kept.is_empty() {
                self.s.on_step_done(&sampled).unwrap();
            } else {
                if order != 0 {
                    accepted.reverse();
                }
                let lists: Vec<(u64, &[u32])> =
                    accepted.iter().map(|(s, t)| (*s, t.as_slice())).collect();
                self.s.on_step_done_accepted(&lists).unwrap();
            }
        }
        // A decode or a prefill's last chunk keeps its sampled token; a non-final
        // chunk's token is ignored.
        for (q, len) in batch.seqs.iter().zip(lens) {
            self.last_start.insert(q.seq, q.start_pos);
            if let Some(&n) = kept.get(&q.seq) {
                // A live row kept exactly the positions it was told to (a stop or the
                // cap would have finished it), and as many tokens.
                self.ctx.insert(q.seq, q.start_pos + n as u32);
                if let Ok(t) = self.s.tokens(q.seq) {
                    prop_assert_eq!(t.len(), len + n, "sequence {}", q.seq);
                    prop_assert_eq!(self.s.num_computed(q.seq).unwrap(), q.start_pos + n as u32);
                }
                continue;
            }
            self.ctx.insert(q.seq, q.context_len);
            if let Ok(t) = self.s.tokens(q.seq) {
                prop_assert_eq!(t.len(), len + q.samples as usize, "sequence {}", q.seq);
                prop_assert_eq!(self.s.num_computed(q.seq).unwrap(), q.context_len);
                prop_assert_eq!(self.s.is_prefilling(q.seq).unwrap(), !q.samples);
            }
        }
        Ok(())
    }

    /// The batch's token accounting: `qo_indptr`, the budget, chunks in order with no
    /// gap from where the sequence's last step ended, prefix hits reported, every
    /// running sequence scheduled.
    fn check_chunks(
        &mut self,
        batch: &pagedkv_host::scheduler::Batch,
        hits_before: u64,
    ) -> Result<(), TestCaseError> {
        let cfg = self.s.config();
        // Preemption takes the least urgent first: every group preempted this step is
        // less urgent than every group that was running before the step and still
        // runs (the queue key: priority, lower first, under the priority policy, then
        // arrival, which is request id order here).
        let urgency = |req: u64| {
            let prio = if cfg.policy == QueuePolicy::Priority {
                (req % 3) as i64
            } else {
                0
            };
            (prio, req)
        };
        for &(victim, _) in &batch.preempted {
            // (A victim preempted by recompute may be admitted again in the same step.)
            let victims: HashSet<u64> = batch.preempted.iter().map(|p| p.0).collect();
            for q in &batch.seqs {
                if !victims.contains(&q.request) && self.ctx.get(&q.seq).is_some_and(|&c| c > 0) {
                    prop_assert!(
                        urgency(q.request) < urgency(victim),
                        "preempted {} but kept the less urgent {}",
                        victim,
                        q.request
                    );
                }
            }
        }
        for &(req, mode) in &batch.preempted {
            if mode == PreemptionMode::Recompute {
                for q in self.s.request_seqs(req).unwrap() {
                    self.ctx.remove(q);
                    self.last_start.remove(q);
                }
            }
        }
        // Every running sequence is in the batch (decodes never starve).
        let seqs: Vec<u64> = batch.seqs.iter().map(|q| q.seq).collect();
        prop_assert_eq!(&seqs[..], self.s.running_seqs());
        let new: usize = batch.seqs.iter().map(|q| q.num_new_tokens as usize).sum();
        prop_assert_eq!(new, batch.slot_mapping.len());
        prop_assert!(new <= cfg.max_tokens_per_step, "{} tokens in a step", new);
        if batch.seqs.is_empty() {
            prop_assert!(batch.qo_indptr.is_empty());
        } else {
            prop_assert_eq!(batch.qo_indptr.len(), batch.seqs.len() + 1);
            prop_assert_eq!(*batch.qo_indptr.last().unwrap() as usize, new);
        }
        // Decodes first, then verify rows and prefills (chunks, then admissions).
        let decodes = batch.num_decodes as usize;
        prop_assert!(
            batch.seqs[..decodes]
                .iter()
                .all(|q| !q.is_prefill && q.num_draft_tokens == 0),
            "a prefill or verify row among the decodes"
        );
        for q in &batch.seqs[decodes..] {
            prop_assert!(
                q.is_prefill || self.s.lookahead(q.seq).unwrap() >= q.num_draft_tokens,
                "a decode after a prefill or more drafts than asked: {:?}",
                q
            );
        }
        let mut cached = 0;
        for (i, q) in batch.seqs.iter().enumerate() {
            prop_assert_eq!(batch.qo_indptr[i], q.token_offset as i32);
            prop_assert!(q.num_new_tokens >= 1);
            prop_assert_eq!(q.context_len, q.start_pos + q.num_new_tokens);
            let prior = self.ctx.get(&q.seq).copied().unwrap_or(0);
            prop_assert!(q.num_cached_tokens == 0 || prior == 0);
            prop_assert_eq!(
                q.start_pos,
                prior + q.num_cached_tokens,
                "a gap before {:?}",
                q
            );
            let len = self.s.tokens(q.seq).unwrap().len() as u32;
            if q.is_prefill {
                prop_assert!(q.context_len <= len);
                prop_assert_eq!(q.samples, q.context_len == len, "{:?}", q);
                prop_assert_eq!(q.num_draft_tokens, 0);
            } else {
                // A decode, or a verify row: the last token and its drafts, no more
                // than the sequence may still generate.
                prop_assert!(
                    q.num_new_tokens == q.num_draft_tokens + 1
                        && q.samples
                        && q.num_cached_tokens == 0
                );
                prop_assert_eq!(q.context_len, len + q.num_draft_tokens);
                if let Some(&(plen, max_tokens)) = self.accepted.get(&q.request) {
                    prop_assert!(q.context_len as usize <= plen + max_tokens as usize);
                }
            }
            cached += q.num_cached_tokens;
        }
        prop_assert_eq!(cached, batch.num_cached_tokens);
        prop_assert_eq!(
            self.s.metrics().prefix_hit_tokens - hits_before,
            cached as u64
        );
        Ok(())
    }

    /// Submits a request; one that is refused must be one that could never run.
    fn add(&mut self, r: Request) -> Result<(), TestCaseError> {
        let (id, len, max_tokens) = (r.id, r.prompt.len(), r.max_tokens);
        match self.s.add_request(r) {
            Ok(_) => {
                self.accepted.insert(id, (len, max_tokens));
            }
            Err(e) => {
                let cfg = self.s.config();
                let bs = cfg.block_size as usize;
                let total = len + max_tokens as usize;
                // Every layer group's blocks. (Without chunked prefill a prefill
                // holds all its tokens' blocks.)
                let mut blocks = 0;
                for spec in self.s.kv_specs() {
                    let mut b = total.div_ceil(bs);
                    if let Some(w) = spec.window()
                        && self.s.chunked_prefill()
                    {
                        b = b.min((w as usize).div_ceil(bs) + 1);
                    }
                    blocks += b;
                }
                let usable = cfg.num_blocks as usize - 1;
                prop_assert!(
                    total > cfg.max_model_len as usize || blocks > usable,
                    "refused a request that fits ({} + {} tokens, {} of {} blocks): {}",
                    len,
                    max_tokens,
                    blocks,
                    usable,
                    e
                );
            }
        }
        Ok(())
    }

    /// Tokens the live sequences may still generate: each non-empty step takes at
    /// least one of them, so it bounds the steps until idle.
    fn remaining_tokens(&self) -> usize {
        let mut n = 0;
        for (&id, &(len, max_tokens)) in &self.accepted {
            if let Ok(seqs) = self.s.request_seqs(id) {
                for &q in seqs {
                    let generated = self.s.tokens(q).unwrap().len() - len;
                    n += max_tokens as usize - generated;
                }
            }
        }
        n
    }

    /// Every invariant, and every sequence's tokens read back through its table.
    fn check(&self) -> Result<(), TestCaseError> {
        let bs = self.bs();
        let kv = self.s.kv();
        let (dev, host) = (kv.device(), kv.host());
        let mut dref: HashMap<u32, u32> = HashMap::new();
        let mut dfill: HashMap<u32, usize> = HashMap::new();
        let mut href: HashMap<u32, u32> = HashMap::new();
        // The layer group each device and host block belongs to: a block id names
        // slots in the layers of one group only, so no two groups hold it.
        let mut owner: HashMap<(bool, u32), usize> = HashMap::new();
        for (seq, g) in self
            .s
            .live_seqs()
            .into_iter()
            .flat_map(|q| (0..self.s.kv_specs().len()).map(move |g| (q, g)))
        {
            let t = self.s.block_table_of(seq, g).unwrap();
            prop_assert_eq!(t.group(), g);
            let computed = self.s.num_computed(seq).unwrap() as usize;
            let tokens = self.s.tokens(seq).unwrap();
            // The blocks wholly before the window of the next step's first new
            // position are released (at the end of `on_step_done`, so a rollback of
            // the next step never needs them); every later one is held. (A
            // swapped-out table was slid so before the step that swapped it out.)
            let start = t.num_tokens();
            let first = window_start(self.s.kv_specs()[g].window(), start) as usize / bs;
            for (i, &b) in t.blocks().iter().enumerate() {
                if i < first {
                    if t.location() == Location::Device {
                        prop_assert_eq!(b, NULL_BLOCK, "a block before the window is still held");
                    }
                    continue;
                }
                prop_assert!(
                    b != NULL_BLOCK || t.location() == Location::Host,
                    "sequence {} entry {} inside the window is released",
                    seq,
                    i
                );
                let m = if t.location() == Location::Device {
                    &mut dref
                } else {
                    &mut href
                };
                *m.entry(b).or_default() += 1;
                let on_device = t.location() == Location::Device;
                let first = *owner.entry((on_device, b)).or_insert(g);
                prop_assert_eq!(first, g, "block {} is held in two layer groups", b);
                if t.location() == Location::Device {
                    let fill = (t.num_tokens() as usize - i * bs).min(bs);
                    let f = dfill.entry(b).or_default();
                    *f = (*f).max(fill);
                }
            }
            let cache = if t.location() == Location::Device {
                &self.dev
            } else {
                &self.host
            };
            for pos in first * bs..computed {
                let b = t.blocks()[pos / bs] as usize;
                prop_assert_eq!(
                    cache[b * bs + pos % bs],
                    Some(tokens[pos]),
                    "sequence {} position {} ({:?})",
                    seq,
                    pos,
                    t.location()
                );
            }
        }
        prop_assert!(
            !dref.contains_key(&NULL_BLOCK),
            "the null block is in a table"
        );
        prop_assert_eq!(
            dev.held_fill() as usize,
            dfill.values().sum::<usize>(),
            "held fill"
        );
        for b in 1..dev.num_blocks() {
            prop_assert_eq!(
                dev.ref_cnt(b).unwrap(),
                dref.get(&b).copied().unwrap_or(0),
                "device block {} ref_cnt",
                b
            );
        }
        if self.s.config().num_host_blocks > 0 {
            for b in 0..host.num_blocks() {
                prop_assert_eq!(
                    host.ref_cnt(b).unwrap(),
                    href.get(&b).copied().unwrap_or(0),
                    "host block {} ref_cnt",
                    b
                );
            }
        }
        // The free queue holds the hash-less blocks first, then the cached ones (vLLM's
        // order: a block with nothing reusable is taken before any cached one).
        let queue = dev.free_queue();
        let first_cached = queue
            .iter()
            .position(|&b| dev.block_hash(b).unwrap().is_some())
            .unwrap_or(queue.len());
        prop_assert!(
            queue[first_cached..]
                .iter()
                .all(|&b| dev.block_hash(b).unwrap().is_some()),
            "a hash-less block behind a cached one in the free queue"
        );
        let mut free: Vec<u32> = queue;
        free.sort();
        let want: Vec<u32> = (1..dev.num_blocks())
            .filter(|b| dev.ref_cnt(*b).unwrap() == 0)
            .collect();
        prop_assert_eq!(free, want, "free queue != blocks with ref_cnt 0");
        prop_assert_eq!(dev.num_used() + dev.num_free(), dev.num_usable());
        Ok(())
    }
}

/// The first position the query at `pos` attends to under `window`.
fn window_start(window: Option<u32>, pos: u32) -> u32 {
    window.map_or(0, |w| (pos + 1).saturating_sub(w))
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(512),
        ..ProptestConfig::default()
    })]

    #[test]
    fn random_interleavings_keep_every_invariant((cfg, chunked) in config(), ops in prop::collection::vec(op(), 1..120)) {
        let mut m = Model::new(cfg, chunked);
        m.rollbacks = true;
        let prefixes: [Vec<u32>; 3] = [(0..40).collect(), (50..70).collect(), vec![]];
        for op in ops {
            match op {
                Op::Add { prefix, len, max_tokens, swap } => {
                    let mut prompt: Vec<u32> = prefixes[prefix].iter().copied().take(len).collect();
                    while prompt.len() < len {
                        prompt.push(200 + prompt.len() as u32);
                    }
                    let mut r = Request::new(m.next_req, prompt, max_tokens);
                    r.stop_token = Some(7);
                    r.priority = (m.next_req % 3) as i32;
                    r.preemption = swap.then_some(PreemptionMode::Swap);
                    m.next_req += 1;
                    // Too long for this pool: an error, never a panic.
                    m.add(r)?;
                }
                Op::Step { stop_every, order } => m.step(stop_every, order)?,
                Op::Fork(i) => {
                    let running = m.s.running_seqs().to_vec();
                    if !running.is_empty() {
                        let parent = running[i % running.len()];
                        let mid = m.s.is_prefilling(parent).unwrap();
                        let r = m.s.fork(parent);
                        prop_assert!(!mid || r.is_err(), "forked a sequence mid-prefill");
                        if let Ok(child) = r {
                            let c = m.ctx.get(&parent).copied();
                            if let Some(c) = c {
                                m.ctx.insert(child, c);
                            }
                            if let Some(&p) = m.last_start.get(&parent) {
                                m.last_start.insert(child, p);
                            }
                        }
                    }
                }
                Op::Reset => {
                    let live = m.s.live_seqs();
                    let in_use = !m.s.running_seqs().is_empty()
                        || live.iter().any(|&q| m.s.block_table(q).unwrap().location() == Location::Host);
                    match m.s.reset_prefix_cache() {
                        Ok(()) => {
                            prop_assert!(!in_use, "reset while in use");
                            prop_assert_eq!(m.s.kv().device().num_cached(), 0);
                        }
                        Err(Error::InvalidState(_)) => {
                            prop_assert!(in_use, "reset refused with nothing in use");
                        }
                        Err(e) => prop_assert!(false, "{}", e),
                    }
                }
                Op::Lookahead(i, k) => {
                    let running = m.s.running_seqs().to_vec();
                    if !running.is_empty() {
                        m.s.set_lookahead(running[i % running.len()], k).unwrap();
                    }
                }
                Op::Abort(i) => {
                    let live = m.s.live_seqs();
                    if !live.is_empty() {
                        let seq = live[i % live.len()];
                        let id = (0..m.next_req).find(|r| m.s.request_seqs(*r).is_ok_and(|s| s.contains(&seq)));
                        m.s.abort(id.unwrap()).unwrap();
                    }
                }
            }
            m.check()?;
        }
        // Liveness: with no new arrivals, every accepted request finishes within as
        // many steps as its sequences have tokens left to generate (every step gives
        // some sequence a token it keeps). With chunked prefill a step may only advance
        // prefills, whose chunks a recompute may throw away: a looser bound.
        m.rollbacks = false;
        let mut bound = m.remaining_tokens() + 1;
        if chunked {
            let prompts: usize = m.s.live_seqs().iter().map(|q| m.s.tokens(*q).unwrap().len()).sum();
            bound = (bound + prompts) * (m.s.live_seqs().len() + 1);
        }
        for _ in 0..bound {
            if m.s.is_idle() {
                break;
            }
            m.step(0, 0)?;
            m.check()?;
        }
        prop_assert!(m.s.is_idle(), "requests never finished within {} steps: {:?}", bound, m.s.metrics());
        let finished: HashSet<u64> = m.s.finished().iter().map(|f| f.0).collect();
        for id in m.accepted.keys() {
            prop_assert!(finished.contains(id), "accepted request {} never finished", id);
        }
        let dev = m.s.kv().device();
        prop_assert_eq!(dev.num_free(), dev.num_usable(), "blocks leaked");
        if m.s.config().num_host_blocks > 0 {
            prop_assert_eq!(m.s.kv().host().num_free(), m.s.kv().host().num_blocks(), "host blocks leaked");
        }
    }

    #[test]
    fn under_fcfs_every_request_that_fits_finishes(
        lens in prop::collection::vec((1usize..60, 1u32..60), 1..25),
        swap in any::<bool>(),
        chunk_budget in prop::option::of(8usize..40),
        groups in prop_oneof![
            Just(Vec::new()),
            Just(vec![KvSpec::SlidingWindow(24), KvSpec::Full]),
            Just(vec![KvSpec::Full, KvSpec::SlidingWindow(40), KvSpec::SlidingWindow(9)]),
        ],
    ) {
        // The pool holds the longest request (128 tokens = 8 blocks of 16) and a bit,
        // in every layer group.
        let g = groups.len().max(1) as u32;
        let cfg = SchedulerConfig {
            num_blocks: 12 * g,
            kv_groups: groups,
            block_size: 16,
            num_host_blocks: if swap { 16 } else { 0 },
            max_num_seqs: 8,
            max_tokens_per_step: chunk_budget.unwrap_or(256),
            watermark: 0.0,
            preemption: if swap { PreemptionMode::Swap } else { PreemptionMode::Recompute },
            max_model_len: 128,
            ..SchedulerConfig::default()
        };
        let mut m = Model::new(cfg, chunk_budget.is_some());
        for (i, (len, max_tokens)) in lens.iter().enumerate() {
            m.s.add_request(Request::new(i as u64, (0..*len as u32).collect(), *max_tokens)).unwrap();
        }
        let mut steps = 0;
        while !m.s.is_idle() {
            m.step(0, 0)?;
            m.check()?;
            steps += 1;
            prop_assert!(steps < 20_000, "no progress");
        }
        let finished = m.s.finished();
        prop_assert_eq!(finished.len(), lens.len());
        for (req, _, why, tokens) in finished {
            let (len, max_tokens) = lens[*req as usize];
            prop_assert_eq!(*why, FinishReason::MaxTokens);
            prop_assert_eq!(tokens.len(), len + max_tokens as usize);
        }
    }
}
