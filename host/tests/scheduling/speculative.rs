//! Speculative decoding in the scheduler: lookahead slots, verify rows, and the
//! rollback of rejected draft tokens.
//!
//! The two properties of the issue: a step whose rows all keep nothing leaves the
//! scheduler exactly as it was (block tables, pool with its free-queue order, prefix
//! map), and a step whose rows accept all `k` drafts leaves it as `k + 1` plain decode
//! steps would. The model-based proptest (`scheduler.rs`) adds random lookaheads and
//! random acceptance (rollbacks included) to its interleavings and its liveness run.

use std::collections::BTreeSet;

use pagedkv_host::Error;
use pagedkv_host::block::{BlockHash, KvSpec, Location};
use pagedkv_host::scheduler::{Batch, Request, Scheduler, SchedulerConfig, SeqId};
use proptest::prelude::*;

/// One layer group's table of a sequence, as it is observed.
#[derive(Clone, Debug, PartialEq, Eq)]
struct TableState {
    blocks: Vec<u32>,
    num_tokens: u32,
    hashes: Vec<BlockHash>,
    location: Location,
}

/// Everything observable about a scheduler's sequences, pool and prefix map.
#[derive(Clone, Debug, PartialEq, Eq)]
struct State {
    /// Per live sequence (by id): tokens, computed count, each group's table.
    seqs: Vec<(SeqId, Vec<u32>, u32, Vec<TableState>)>,
    /// The device pool's free queue, in order.
    free_queue: Vec<u32>,
    /// Per device block: reference count, name, and whether the map serves it.
    blocks: Vec<(u32, Option<BlockHash>, bool)>,
    num_cached: usize,
    held_fill: u64,
    finished: usize,
}

fn state(s: &Scheduler) -> State {
    let mut ids = s.live_seqs();
    ids.sort_unstable();
    let seqs = ids
        .iter()
        .map(|&q| {
            let tables = (0..s.kv_specs().len())
                .map(|g| {
                    let t = s.block_table_of(q, g).unwrap();
                    TableState {
                        blocks: t.blocks().to_vec(),
                        num_tokens: t.num_tokens(),
                        hashes: t.hashes().to_vec(),
                        location: t.location(),
                    }
                })
                .collect();
            (
                q,
                s.tokens(q).unwrap().to_vec(),
                s.num_computed(q).unwrap(),
                tables,
            )
        })
        .collect();
    let dev = s.kv().device();
    let blocks = (0..dev.num_blocks())
        .map(|b| {
            let h = dev.block_hash(b).unwrap();
            (
                dev.ref_cnt(b).unwrap(),
                h,
                h.is_some_and(|h| dev.lookup(h) == Some(b)),
            )
        })
        .collect();
    State {
        seqs,
        free_queue: dev.free_queue(),
        blocks,
        num_cached: dev.num_cached(),
        held_fill: dev.held_fill(),
        finished: s.finished().len(),
    }
}

/// A table without its block ids: which entries are released, the count, the names.
type TableShape = (Vec<bool>, u32, Vec<BlockHash>);

/// [`State`] without block ids: what two schedulers that allocated the same blocks
/// in another order share. Per table: which entries are released, the count, the
/// names; the pool's counts; the set of names the map serves.
#[derive(Debug, PartialEq, Eq)]
struct Shape {
    seqs: Vec<(Vec<u32>, u32, Vec<TableShape>)>,
    num_free: u32,
    num_cached_free: u32,
    served: BTreeSet<[u8; 32]>,
    held_fill: u64,
    finished: Vec<(u64, Vec<u32>)>,
}

fn shape(s: &Scheduler) -> Shape {
    let st = state(s);
    let dev = s.kv().device();
    let served = st
        .blocks
        .iter()
        .filter(|b| b.2)
        .map(|b| b.1.unwrap().to_bytes())
        .collect();
    let mut finished: Vec<(u64, Vec<u32>)> =
        s.finished().iter().map(|f| (f.0, f.3.clone())).collect();
    finished.sort();
    Shape {
        seqs: st
            .seqs
            .into_iter()
            .map(|(_, tokens, computed, tables)| {
                let t = tables
                    .into_iter()
                    .map(|t| {
                        let live = t.blocks.iter().map(|&b| b != 0).collect();
                        (live, t.num_tokens, t.hashes)
                    })
                    .collect();
                (tokens, computed, t)
            })
            .collect(),
        num_free: dev.num_free(),
        num_cached_free: dev.num_cached_free(),
        served,
        held_fill: dev.held_fill(),
        finished,
    }
}

/// The token a sequence samples (or drafts) at position `pos`: never the stop token.
fn token(seq: SeqId, pos: usize) -> u32 {
    ((seq as u32).wrapping_mul(13).wrapping_add(pos as u32 * 5)) % 500 + 10
}

/// A plain step: every row samples `token` at its next position; returns the batch.
fn plain_step(s: &mut Scheduler) -> Batch {
    let batch = s.step().unwrap().clone();
    let sampled: Vec<(SeqId, u32)> = batch
        .seqs
        .iter()
        .map(|q| (q.seq, token(q.seq, s.tokens(q.seq).unwrap().len())))
        .collect();
    if !batch.seqs.is_empty() {
        s.on_step_done(&sampled).unwrap();
    }
    batch
}

/// A step of decode and verify rows only: nothing admitted, preempted or swapped.
fn only_decodes(b: &Batch) -> bool {
    b.seqs.iter().all(|q| !q.is_prefill)
        && b.preempted.is_empty()
        && b.swap_in.is_empty()
        && b.swap_out.is_empty()
}

/// What a spec test runs: a configuration, prompts (some sharing a prefix), forks.
fn workload() -> impl Strategy<Value = (SchedulerConfig, Vec<(usize, u32)>, Vec<usize>)> {
    (
        prop::sample::select(vec![8u32, 16]),
        any::<bool>(),
        prop_oneof![
            2 => Just(Vec::new()),
            1 => (12u32..50).prop_map(|w| vec![KvSpec::SlidingWindow(w)]),
            1 => (12u32..50).prop_map(|w| vec![KvSpec::SlidingWindow(w), KvSpec::Full]),
        ],
        prop::collection::vec((1usize..60, 8u32..80), 1..6),
        prop::collection::vec(0usize..8, 0..3),
        16u32..80,
    )
        .prop_map(|(bs, prefix, groups, reqs, forks, blocks)| {
            let g = groups.len().max(1) as u32;
            let cfg = SchedulerConfig {
                num_blocks: blocks * g,
                block_size: bs,
                max_num_seqs: 8,
                max_tokens_per_step: 256,
                watermark: 0.0,
                enable_prefix_caching: prefix,
                kv_groups: groups,
                max_model_len: 160,
                ..SchedulerConfig::default()
            };
            (cfg, reqs, forks)
        })
}

/// A scheduler with `reqs` added (prompts begin alike, so prefix hits occur).
fn scheduler(cfg: &SchedulerConfig, reqs: &[(usize, u32)]) -> Scheduler {
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    for (i, &(len, max_tokens)) in reqs.iter().enumerate() {
        let prompt: Vec<u32> = (0..len as u32)
            .map(|t| if t < 20 { t } else { t + i as u32 * 1000 })
            .collect();
        // Too big for a small pool: refused, never a panic.
        let _ = s.add_request(Request::new(i as u64, prompt, max_tokens));
    }
    s
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256),
        ..ProptestConfig::default()
    })]

    /// A step whose rows all keep nothing restores the exact state of before it:
    /// block tables, tokens, the pool's counts and free-queue order, the prefix map,
    /// and the next step is the very same batch. (A step that evicted a cached block
    /// for a new one is excluded: the step wrote into it, its name is gone.)
    #[test]
    fn accepting_nothing_restores_the_exact_state(
        (cfg, reqs, forks) in workload(),
        warmup in 0usize..40,
        ks in prop::collection::vec(0u32..7, 8),
        accept in prop::collection::vec(0usize..8, 64),
        fork_last in any::<bool>(),
    ) {
        let mut s = scheduler(&cfg, &reqs);
        let mut a = accept.iter().cycle();
        for step in 0..warmup {
            for (i, &q) in s.running_seqs().to_vec().iter().enumerate() {
                s.set_lookahead(q, ks[(i + step) % ks.len()]).unwrap();
            }
            if forks.contains(&step) && let Some(&q) = s.running_seqs().first() {
                let _ = s.fork(q);
            }
            let batch = s.step().unwrap().clone();
            if batch.seqs.is_empty() {
                break;
            }
            // Random acceptance, at least one position (progress).
            let lists: Vec<(SeqId, Vec<u32>)> = batch
                .seqs
                .iter()
                .map(|q| {
                    let len = s.tokens(q.seq).unwrap().len();
                    let n = if q.is_prefill { 1 } else { 1 + a.next().unwrap() % q.num_new_tokens as usize };
                    (q.seq, (0..n).map(|i| token(q.seq, len + i)).collect())
                })
                .collect();
            let refs: Vec<(SeqId, &[u32])> = lists.iter().map(|(q, t)| (*q, t.as_slice())).collect();
            s.on_step_done_accepted(&refs).unwrap();
        }
        // A fork right before the step: the two share a partial block, and the
        // first to append copies it (a copy the rollback gives back).
        if fork_last && let Some(&q) = s.running_seqs().first() {
            let _ = s.fork(q);
        }
        for (i, &q) in s.running_seqs().to_vec().iter().enumerate() {
            s.set_lookahead(q, ks[i % ks.len()]).unwrap();
        }
        let before = state(&s);
        let batch = s.step().unwrap().clone();
        if batch.seqs.is_empty() || !only_decodes(&batch) || s.kv().device().num_cached() != before.num_cached {
            if !batch.seqs.is_empty() {
                let refs: Vec<(SeqId, u32)> = batch.seqs.iter().map(|q| (q.seq, 1)).collect();
                s.on_step_done(&refs).unwrap();
            }
            return Ok(());
        }
        let none: Vec<(SeqId, &[u32])> = batch.seqs.iter().map(|q| (q.seq, &[][..])).collect();
        s.on_step_done_accepted(&none).unwrap();
        prop_assert_eq!(&state(&s), &before, "a rollback of every row left a trace");
        // The same step again: the same batch, row for row.
        let again = s.step().unwrap().clone();
        prop_assert_eq!(&again.seqs, &batch.seqs);
        prop_assert_eq!(&again.slot_mapping, &batch.slot_mapping);
        prop_assert_eq!(&again.block_tables, &batch.block_tables);
        prop_assert_eq!(&again.context_lens, &batch.context_lens);
        prop_assert_eq!(&again.copies, &batch.copies);
        for g in 1..again.num_groups() {
            prop_assert_eq!(again.group(g).unwrap().block_tables, batch.group(g).unwrap().block_tables);
            prop_assert_eq!(again.group(g).unwrap().slot_mapping, batch.group(g).unwrap().slot_mapping);
        }
    }

    /// A step whose rows each verify `k` drafts and accept them all (and the token
    /// after them) leaves the scheduler as `k + 1` plain decode steps that sample the
    /// same tokens: the same tokens, tables (block ids too when one sequence runs and
    /// no window releases between the plain steps), pool counts, names and finished
    /// sequences (a cap reached mid-way finishes both at the same token). Unless a
    /// new block evicted a cached one in either: the plain steps free the blocks of
    /// sequences that finish before they allocate, the verify step after.
    #[test]
    fn accepting_every_draft_equals_k_plus_1_plain_steps(
        (cfg, reqs, _forks) in workload(),
        warmup in 0usize..30,
        k in 1u32..7,
    ) {
        let mut spec = scheduler(&cfg, &reqs);
        let mut plain = scheduler(&cfg, &reqs);
        // The same history for both.
        for _ in 0..warmup {
            let a = plain_step(&mut spec);
            let b = plain_step(&mut plain);
            prop_assert_eq!(&a.seqs, &b.seqs);
        }
        // Until every request runs and decodes.
        let mut guard = 0;
        while spec.metrics().waiting > 0 || spec.running_seqs().iter().any(|&q| spec.is_prefilling(q).unwrap()) {
            plain_step(&mut spec);
            plain_step(&mut plain);
            guard += 1;
            prop_assert!(guard < 500);
        }
        prop_assert_eq!(shape(&spec), shape(&plain));
        let running = spec.running_seqs().to_vec();
        if running.is_empty() {
            return Ok(());
        }
        for &q in &running {
            spec.set_lookahead(q, k).unwrap();
        }
        let cached = spec.kv().device().num_cached();
        let batch = spec.step().unwrap().clone();
        // A new block that evicted a cached one: the plain steps, whose sequences may
        // finish and free blocks before they allocate, need not evict it.
        let mut evicted = spec.kv().device().num_cached() < cached;
        let capped = batch.seqs.iter().any(|q| {
            let left = (cfg.max_model_len as usize).min(
                reqs[q.request as usize].0 + reqs[q.request as usize].1 as usize,
            ) - spec.tokens(q.seq).unwrap().len();
            q.num_draft_tokens < k && (q.num_draft_tokens as usize + 1) < left
        });
        if !only_decodes(&batch) || capped {
            // Drafts cut short by the pool: no comparison (the rows must still be
            // passed back).
            let refs: Vec<(SeqId, u32)> = batch.seqs.iter().map(|q| (q.seq, 1)).collect();
            spec.on_step_done(&refs).unwrap();
            return Ok(());
        }
        let lists: Vec<(SeqId, Vec<u32>)> = batch
            .seqs
            .iter()
            .map(|q| {
                let len = spec.tokens(q.seq).unwrap().len();
                (q.seq, (0..q.num_new_tokens as usize).map(|i| token(q.seq, len + i)).collect())
            })
            .collect();
        let refs: Vec<(SeqId, &[u32])> = lists.iter().map(|(q, t)| (*q, t.as_slice())).collect();
        spec.on_step_done_accepted(&refs).unwrap();
        let steps = batch.seqs.iter().map(|q| q.num_new_tokens).max().unwrap();
        let mut releases = false;
        for _ in 0..steps {
            let cached = plain.kv().device().num_cached();
            let b = plain.step().unwrap().clone();
            evicted |= plain.kv().device().num_cached() < cached;
            let sampled: Vec<(SeqId, u32)> = b
                .seqs
                .iter()
                .map(|q| (q.seq, token(q.seq, plain.tokens(q.seq).unwrap().len())))
                .collect();
            if !b.seqs.is_empty() {
                plain.on_step_done(&sampled).unwrap();
            }
            prop_assert!(only_decodes(&b), "the plain steps preempted or admitted");
            releases |= cfg.kv_groups.iter().any(|g| g.window().is_some());
        }
        if evicted {
            return Ok(());
        }
        prop_assert_eq!(shape(&spec), shape(&plain));
        if running.len() == 1 && !releases {
            prop_assert_eq!(state(&spec), state(&plain));
        }
    }
}

/// The verify rows of a step: after the decodes, `k + 1` query tokens each (the token
/// sampled last step, then the drafts), their slots consecutive, `qo_indptr` over
/// them; a stop token among the accepted drafts ends the sequence there.
#[test]
fn verify_rows_follow_the_decodes_and_a_stop_among_the_drafts_ends_there() {
    let cfg = SchedulerConfig {
        num_blocks: 64,
        block_size: 8,
        max_num_seqs: 4,
        max_tokens_per_step: 512,
        watermark: 0.0,
        max_model_len: 256,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    for i in 0..3u64 {
        let mut r = Request::new(i, (0..10).collect(), 50);
        r.stop_token = Some(99);
        s.add_request(r).unwrap();
    }
    plain_step(&mut s);
    let rows = s.running_seqs().to_vec();
    s.set_lookahead(rows[0], 4).unwrap();
    s.set_lookahead(rows[2], 2).unwrap();
    let b = s.step().unwrap().clone();
    assert_eq!(b.num_decodes, 1);
    assert_eq!(b.seqs[0].seq, rows[1]);
    let v: Vec<(SeqId, u32, u32)> = b.seqs[1..]
        .iter()
        .map(|q| (q.seq, q.num_draft_tokens, q.num_new_tokens))
        .collect();
    assert_eq!(v, vec![(rows[0], 4, 5), (rows[2], 2, 3)]);
    assert_eq!(b.qo_indptr, vec![0, 1, 6, 9]);
    for q in &b.seqs[1..] {
        assert!(!q.is_prefill && q.samples);
        assert_eq!((q.start_pos, q.context_len), (10, 10 + q.num_new_tokens));
    }
    // Row 0 keeps 3 positions (two drafts accepted, then a correction), row 2 hits
    // the stop token as its first accepted draft: it finishes there.
    let done = s
        .on_step_done_accepted(&[
            (rows[1], &[7]),
            (rows[0], &[21, 22, 23]),
            (rows[2], &[99, 5, 6]),
        ])
        .unwrap();
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].0, rows[2]);
    let t = s.tokens(rows[0]).unwrap().to_vec();
    assert_eq!(&t[11..], &[21, 22, 23]);
    assert_eq!(s.num_computed(rows[0]).unwrap(), 13);
    assert_eq!(s.block_table(rows[0]).unwrap().num_tokens(), 13);
    let f = s.finished().iter().find(|f| f.1 == rows[2]).unwrap();
    assert_eq!(&f.3[11..], &[99]);
}

/// Bad acceptance lists are errors that change nothing: more tokens than the row
/// verified, a prefill row without its token, a lookahead above the cap or set
/// mid-step.
#[test]
fn bad_acceptance_is_refused_and_changes_nothing() {
    let cfg = SchedulerConfig {
        num_blocks: 64,
        block_size: 8,
        max_tokens_per_step: 512,
        max_model_len: 256,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(Request::new(0, (0..10).collect(), 50))
        .unwrap();
    let b = s.step().unwrap().clone();
    let q = b.seqs[0].seq;
    assert!(matches!(
        s.on_step_done_accepted(&[(q, &[])]),
        Err(Error::InvalidArgument { .. })
    ));
    s.on_step_done_accepted(&[(q, &[3])]).unwrap();
    assert!(matches!(
        s.set_lookahead(q, pagedkv_host::scheduler::MAX_LOOKAHEAD + 1),
        Err(Error::InvalidArgument { .. })
    ));
    s.set_lookahead(q, 2).unwrap();
    let before = state(&s);
    s.step().unwrap();
    assert!(matches!(s.set_lookahead(q, 1), Err(Error::InvalidState(_))));
    assert!(matches!(
        s.on_step_done_accepted(&[(q, &[1, 2, 3, 4])]),
        Err(Error::InvalidArgument { .. })
    ));
    s.on_step_done_accepted(&[(q, &[])]).unwrap();
    assert_eq!(state(&s), before);
}

/// Drafts never preempt: with the pool nearly full, a verify row gets only the
/// drafts that fit the free blocks (here none past its block), and nobody is
/// preempted for them.
#[test]
fn drafts_take_only_free_blocks() {
    let cfg = SchedulerConfig {
        num_blocks: 5, // 4 usable blocks of 8
        block_size: 8,
        max_num_seqs: 4,
        max_tokens_per_step: 256,
        watermark: 0.0,
        max_model_len: 32,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(Request::new(0, (0..14).collect(), 10))
        .unwrap();
    s.add_request(Request::new(1, (100..114).collect(), 10))
        .unwrap();
    plain_step(&mut s); // both prefilled: 14 of 15 tokens computed, 2 blocks each

    assert_eq!(s.kv().device().num_free(), 0);
    let q = s.running_seqs()[0];
    s.set_lookahead(q, 6).unwrap();
    let b = s.step().unwrap().clone();
    assert!(b.preempted.is_empty());
    let v = b.seqs.iter().find(|r| r.seq == q).unwrap();
    // Positions 14 and 15 are the last slots of its second block: one draft fits.
    assert_eq!((v.start_pos, v.num_draft_tokens), (14, 1));
}

/// A rejected draft is never a prefix hit: a block the drafts filled is given back
/// unnamed, and a prompt equal to the history plus the rejected drafts hits only
/// the blocks of accepted tokens.
#[test]
fn a_rejected_draft_is_never_a_prefix_hit() {
    let cfg = SchedulerConfig {
        num_blocks: 64,
        block_size: 8,
        max_tokens_per_step: 512,
        watermark: 0.0,
        enable_prefix_caching: true,
        max_model_len: 256,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    s.add_request(Request::new(0, (0..6).collect(), 40))
        .unwrap();
    plain_step(&mut s); // 7 tokens, 6 computed
    let q = s.running_seqs()[0];
    s.set_lookahead(q, 9).unwrap();
    let b = s.step().unwrap().clone();
    assert_eq!(b.seqs[0].num_new_tokens, 10); // positions 6..16: two blocks filled
    let drafts: Vec<u32> = (0..9).map(|i| 500 + i).collect();
    // Only the token sampled last step is kept (then a correction).
    s.on_step_done_accepted(&[(q, &[77])]).unwrap();
    assert_eq!(s.block_table(q).unwrap().num_tokens(), 7);
    assert!(s.block_table(q).unwrap().hashes().is_empty());
    let mut prompt = s.tokens(q).unwrap().to_vec();
    prompt.truncate(7);
    prompt.extend(&drafts);
    s.add_request(Request::new(1, prompt, 4)).unwrap();
    s.set_lookahead(q, 0).unwrap();
    let b = s.step().unwrap().clone();
    let p = b.seqs.iter().find(|r| r.request == 1).unwrap();
    assert_eq!(
        p.num_cached_tokens, 0,
        "a block of rejected drafts was served"
    );
}
