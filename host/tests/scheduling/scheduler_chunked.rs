//! Chunked prefill ([`Scheduler::with_chunked_prefill`]), case by case: a long prompt
//! split across steps, decodes scheduled with the chunks, chunk boundaries mid-block, a
//! prefix hit followed by a chunked remainder, preemption mid-prefill (recompute and
//! swap), fork refused mid-prefill, and the sampled token of a non-final chunk ignored.
//! The random interleavings (half of them chunked) are in `host/tests/scheduling/scheduler.rs`.

use pagedkv_host::Error;
use pagedkv_host::scheduler::{
    FinishReason, PreemptionMode, Request, Scheduler, SchedulerConfig, SeqId,
};

/// `(seq, is_prefill, start_pos, num_new_tokens, num_cached_tokens, samples)`.
type Entry = (SeqId, bool, u32, u32, u32, bool);

/// One step sampling token 5 for every scheduled sequence; the batch's entries, and
/// the requests it preempted.
fn step(s: &mut Scheduler) -> (Vec<Entry>, Vec<(u64, PreemptionMode)>) {
    let b = s.step().unwrap();
    let entries: Vec<Entry> = b
        .seqs
        .iter()
        .map(|q| {
            (
                q.seq,
                q.is_prefill,
                q.start_pos,
                q.num_new_tokens,
                q.num_cached_tokens,
                q.samples,
            )
        })
        .collect();
    // qo_indptr is the prefix sum of the new tokens.
    let mut want = vec![0i32];
    for q in &b.seqs {
        want.push(want.last().unwrap() + q.num_new_tokens as i32);
    }
    if b.seqs.is_empty() {
        assert!(b.qo_indptr.is_empty());
    } else {
        assert_eq!(b.qo_indptr, want);
    }
    let preempted = b.preempted.clone();
    let sampled: Vec<(u64, u32)> = b.seqs.iter().map(|q| (q.seq, 5)).collect();
    if !sampled.is_empty() {
        s.on_step_done(&sampled).unwrap();
    }
    (entries, preempted)
}

fn cfg(max_tokens_per_step: usize) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks: 64,
        block_size: 16,
        max_num_seqs: 4,
        max_tokens_per_step,
        watermark: 0.0,
        max_model_len: 256,
        ..SchedulerConfig::default()
    }
}

#[test]
fn the_budget_may_be_below_max_model_len_only_with_chunked_prefill() {
    assert!(matches!(
        Scheduler::new(cfg(16)),
        Err(Error::InvalidArgument { .. })
    ));
    let s = Scheduler::with_chunked_prefill(cfg(16), true).unwrap();
    assert!(s.chunked_prefill());
    assert!(!Scheduler::new(cfg(256)).unwrap().chunked_prefill());
    // Every running sequence takes a token a step: the budget holds max_num_seqs.
    assert!(matches!(
        Scheduler::with_chunked_prefill(cfg(3), true),
        Err(Error::InvalidArgument { .. })
    ));
}

#[test]
fn a_long_prompt_is_split_across_steps_mid_block_and_only_its_last_chunk_samples() {
    let mut s = Scheduler::with_chunked_prefill(cfg(10), true).unwrap();
    let a = s
        .add_request(Request::new(1, (0..25).collect(), 2))
        .unwrap();
    // 25 tokens in chunks of 10, 10, 5: the boundaries fall mid-block (16).
    let (e, _) = step(&mut s);
    assert_eq!(e, vec![(a, true, 0, 10, 0, false)]);
    assert!(s.is_prefilling(a).unwrap());
    assert_eq!(
        s.tokens(a).unwrap().len(),
        25,
        "a non-final chunk's token is ignored"
    );
    assert_eq!(s.num_computed(a).unwrap(), 10);
    assert_eq!(s.block_table(a).unwrap().blocks().len(), 1);
    let (e, _) = step(&mut s);
    assert_eq!(e, vec![(a, true, 10, 10, 0, false)]);
    assert_eq!(s.block_table(a).unwrap().blocks().len(), 2);
    let (e, _) = step(&mut s);
    assert_eq!(e, vec![(a, true, 20, 5, 0, true)]);
    assert!(!s.is_prefilling(a).unwrap());
    assert_eq!(
        s.tokens(a).unwrap().len(),
        26,
        "the last chunk's token is kept"
    );
    let (e, _) = step(&mut s);
    assert_eq!(e, vec![(a, false, 25, 1, 0, true)]);
    assert!(s.is_idle());
    let f = &s.finished()[0];
    assert_eq!((f.2, f.3.len()), (FinishReason::MaxTokens, 27));
}

#[test]
fn the_slots_of_every_chunk_cover_the_prompt_once_inside_its_blocks() {
    let mut s = Scheduler::with_chunked_prefill(cfg(7), true).unwrap();
    let a = s
        .add_request(Request::new(1, (0..40).collect(), 1))
        .unwrap();
    let mut slots = Vec::new();
    while !s.is_idle() {
        let b = s.step().unwrap();
        let q = b.seqs[0];
        for k in 0..q.num_new_tokens {
            slots.push((
                q.start_pos + k,
                b.slot_mapping[(q.token_offset + k) as usize],
            ));
        }
        assert_eq!(b.context_lens[0] as u32, q.context_len);
        // The slots are in the blocks the batch's table row names.
        let w = b.max_blocks_per_seq as usize;
        let row = b.block_tables[..w].to_vec();
        for &(pos, slot) in &slots {
            assert_eq!(row[pos as usize / 16] as i64 * 16 + (pos % 16) as i64, slot);
        }
        let sampled = vec![(a, 5)];
        s.on_step_done(&sampled).unwrap();
    }
    let positions: Vec<u32> = slots.iter().map(|p| p.0).collect();
    assert_eq!(positions, (0..40).collect::<Vec<_>>());
}

#[test]
fn decodes_are_scheduled_first_and_the_chunks_take_what_they_leave() {
    let mut s = Scheduler::with_chunked_prefill(cfg(8), true).unwrap();
    let a = s
        .add_request(Request::new(1, (0..4).collect(), 20))
        .unwrap();
    let b = s
        .add_request(Request::new(2, (0..30).collect(), 1))
        .unwrap();
    // Step 1: A's whole prompt, and B's first chunk in the 4 tokens left.
    let (e, _) = step(&mut s);
    assert_eq!(e, vec![(a, true, 0, 4, 0, true), (b, true, 0, 4, 0, false)]);
    // Then A decodes every step, and B's chunks take the other 7 tokens.
    let mut start = 4;
    while start < 30 {
        let (e, _) = step(&mut s);
        let n = (30 - start).min(7);
        assert_eq!(e[0].0, a);
        assert!(!e[0].1);
        assert_eq!(e[1], (b, true, start, n, 0, start + n == 30));
        start += n;
    }
}

#[test]
fn a_prefix_hit_is_skipped_and_the_remainder_is_chunked() {
    let mut c = cfg(12);
    c.enable_prefix_caching = true;
    let mut s = Scheduler::with_chunked_prefill(c, true).unwrap();
    s.add_request(Request::new(1, (0..40).collect(), 1))
        .unwrap();
    while !s.is_idle() {
        step(&mut s);
    }
    // Two full blocks (32 tokens) of the next prompt are cached.
    let hits = s.metrics().prefix_hit_tokens;
    let b = s
        .add_request(Request::new(2, (0..50).collect(), 1))
        .unwrap();
    let batch = s.step().unwrap();
    assert_eq!(batch.num_cached_tokens, 32);
    let q = batch.seqs[0];
    assert_eq!(
        (
            q.start_pos,
            q.num_new_tokens,
            q.context_len,
            q.num_cached_tokens,
            q.samples
        ),
        (32, 12, 44, 32, false)
    );
    assert_eq!(batch.slot_mapping.len(), 12);
    s.on_step_done(&[(b, 9)]).unwrap();
    assert_eq!(s.metrics().prefix_hit_tokens - hits, 32);
    let (e, _) = step(&mut s);
    assert_eq!(e, vec![(b, true, 44, 6, 0, true)]);
    assert_eq!(s.finished()[1].3.len(), 51);
}

#[test]
fn a_mid_prefill_sequence_cannot_fork_until_its_last_chunk() {
    let mut s = Scheduler::with_chunked_prefill(cfg(10), true).unwrap();
    let a = s
        .add_request(Request::new(1, (0..15).collect(), 3))
        .unwrap();
    step(&mut s);
    assert!(matches!(s.fork(a), Err(Error::InvalidState(_))));
    step(&mut s);
    let child = s.fork(a).unwrap();
    assert_eq!(s.tokens(child).unwrap(), s.tokens(a).unwrap());
    let (e, _) = step(&mut s);
    assert_eq!(
        e,
        vec![(a, false, 15, 1, 0, true), (child, false, 15, 1, 0, true)]
    );
}

#[test]
fn every_scheduled_sequence_must_be_passed_back_even_a_non_final_chunk() {
    let mut s = Scheduler::with_chunked_prefill(cfg(10), true).unwrap();
    let a = s
        .add_request(Request::new(1, (0..25).collect(), 3))
        .unwrap();
    s.step().unwrap();
    assert!(matches!(
        s.on_step_done(&[]),
        Err(Error::InvalidArgument { .. })
    ));
    // Nothing changed: the step can still complete, the token ignored.
    s.on_step_done(&[(a, 77)]).unwrap();
    assert_eq!(s.tokens(a).unwrap(), (0..25).collect::<Vec<_>>());
}

/// A (older) decodes into a pool that B, mid-prefill, fills: B is preempted mid-prefill
/// and still finishes, with every token in place.
fn preempted_mid_prefill(mode: PreemptionMode) {
    let mut s = Scheduler::with_chunked_prefill(
        SchedulerConfig {
            num_blocks: 5, // 4 usable blocks of 16 tokens
            block_size: 16,
            num_host_blocks: 8,
            max_num_seqs: 2,
            max_tokens_per_step: 8,
            watermark: 0.0,
            preemption: mode,
            max_model_len: 64,
            ..SchedulerConfig::default()
        },
        true,
    )
    .unwrap();
    // A fills its first block on its first decode and takes a second on the next,
    // while B's chunks take the other two: B's fourth block does not fit.
    s.add_request(Request::new(1, (0..15).collect(), 40))
        .unwrap();
    step(&mut s);
    let b = s
        .add_request(Request::new(2, (100..148).collect(), 2))
        .unwrap();
    let mut preempted_mid = false;
    for _ in 0..500 {
        if s.is_idle() {
            break;
        }
        let was_prefilling = s.is_prefilling(b).unwrap_or(false);
        let (_, p) = step(&mut s);
        if p.iter().any(|&(r, _)| r == 2) {
            preempted_mid |= was_prefilling;
            assert!(p.contains(&(2, mode)) || mode == PreemptionMode::Swap);
        }
    }
    assert!(preempted_mid, "B was never preempted mid-prefill");
    assert!(s.is_idle());
    let mut f: Vec<_> = s.finished().iter().map(|f| (f.0, f.3.len())).collect();
    f.sort();
    assert_eq!(f, vec![(1, 55), (2, 50)]);
    let b_tokens = &s.finished().iter().find(|f| f.0 == 2).unwrap().3;
    assert_eq!(&b_tokens[..48], &(100..148).collect::<Vec<_>>()[..]);
    assert_eq!(s.kv().device().num_free(), s.kv().device().num_usable());
}

#[test]
fn preemption_by_recompute_mid_prefill_starts_the_prefill_again() {
    preempted_mid_prefill(PreemptionMode::Recompute);
}

#[test]
fn preemption_by_swap_mid_prefill_resumes_the_prefill() {
    preempted_mid_prefill(PreemptionMode::Swap);
}
