//! Liveness regressions (issue #13, "Hostile input"): every request `add_request`
//! accepts finishes if the caller keeps stepping, and one that never could is refused
//! up front with an error that says why.
//!
//! Every case runs twice: as it is (module `whole`) and with chunked prefill under a
//! small step budget (module `chunked`).
//!
//! Each test drives the scheduler like an engine loop and asserts that no step returns
//! an empty batch while requests are live (before the fixes these spun forever: empty
//! batches, `is_idle()` false).

use pagedkv_host::Error;
use pagedkv_host::scheduler::{
    FinishReason, PreemptionMode, Request, RequestId, Scheduler, SchedulerConfig,
};

/// A scheduler of `cfg`, with chunked prefill when `chunked`, and then a step budget
/// of `max_num_seqs` (at least 8) tokens, far below most prompts here, so they split.
fn sched(chunked: bool, mut cfg: SchedulerConfig) -> Result<Scheduler, Error> {
    if chunked {
        cfg.max_tokens_per_step = cfg.max_num_seqs.max(8);
    }
    Scheduler::with_chunked_prefill(cfg, chunked)
}

/// Steps until idle, sampling a token that never stops a sequence; fails on an empty
/// batch while requests are live, or after `max_steps`. Returns the requests
/// preempted along the way, and how.
fn drive(s: &mut Scheduler, max_steps: usize) -> Vec<(RequestId, PreemptionMode)> {
    let mut preempted = Vec::new();
    // Chunks of a small budget take more steps.
    let max_steps = if s.chunked_prefill() {
        max_steps * 20
    } else {
        max_steps
    };
    for _ in 0..max_steps {
        if s.is_idle() {
            return preempted;
        }
        let b = s.step().unwrap();
        assert!(
            !b.seqs.is_empty(),
            "stalled: live requests but an empty batch ({:?})",
            s.metrics()
        );
        preempted.extend_from_slice(&b.preempted);
        let sampled: Vec<(u64, u32)> = b.seqs.iter().map(|q| (q.seq, 5)).collect();
        s.on_step_done(&sampled).unwrap();
    }
    panic!("not idle after {max_steps} steps: {:?}", s.metrics());
}

/// One step, with the same token for every scheduled sequence.
fn step(s: &mut Scheduler) -> Vec<(RequestId, PreemptionMode)> {
    let b = s.step().unwrap();
    let preempted = b.preempted.clone();
    let sampled: Vec<(u64, u32)> = b.seqs.iter().map(|q| (q.seq, 5)).collect();
    if !sampled.is_empty() {
        s.on_step_done(&sampled).unwrap();
    }
    preempted
}

/// `(tokens, reason)` of each finished sequence of request `id`.
fn finished_of(s: &Scheduler, id: RequestId) -> Vec<(usize, FinishReason)> {
    s.finished()
        .iter()
        .filter(|f| f.0 == id)
        .map(|f| (f.3.len(), f.2))
        .collect()
}

fn a_swapped_out_forked_group_comes_back_into_the_whole_pool(chunked: bool) {
    // 4 usable blocks of 16 tokens. A (older) holds 1 block and grows into a second;
    // B is a forked pair holding the other 3 (a shared full prompt block and a partial
    // block each), so A's growth swaps B out. Swap-in used to demand B's 3 blocks plus
    // one free block per sequence (5 > 4): B never came back, even with A finished and
    // the pool empty. B's last blocks are partial and its own: its next decodes take
    // no block, so it needs 3.
    let mut s = sched(
        chunked,
        SchedulerConfig {
            num_blocks: 5,
            block_size: 16,
            num_host_blocks: 8,
            max_num_seqs: 4,
            max_tokens_per_step: 64,
            watermark: 0.0,
            preemption: PreemptionMode::Swap,
            max_model_len: 32,
            ..SchedulerConfig::default()
        },
    )
    .unwrap();
    s.add_request(Request::new(1, (0..10).collect(), 20))
        .unwrap();
    let b = s
        .add_request(Request::new(2, (0..16).collect(), 16))
        .unwrap();
    // (With chunked prefill, B's prompt takes a few steps.)
    while s.num_computed(b).unwrap() < 16 {
        assert!(step(&mut s).is_empty());
    }
    s.fork(b).unwrap();
    let preempted = drive(&mut s, 200);
    assert_eq!(preempted, vec![(2, PreemptionMode::Swap)]);
    assert_eq!(s.metrics().swapped_out_blocks, 3);
    assert_eq!(finished_of(&s, 1), vec![(30, FinishReason::MaxTokens)]);
    assert_eq!(finished_of(&s, 2), vec![(32, FinishReason::MaxTokens); 2]);
    assert_eq!(s.kv().device().num_free(), s.kv().device().num_usable());
    assert_eq!(s.kv().host().num_free(), s.kv().host().num_blocks());
}

fn forks_sharing_a_partial_block_are_not_preempted_for_a_copy_they_do_not_need(chunked: bool) {
    // 2 usable blocks. Two forks share one partial block: their next decodes take one
    // block (the first writer copies, the second then holds the original alone), and
    // one is free. Counting a copy per sharer (2 > 1) made the group preempt itself
    // when another request arrived, and then it could not swap back in.
    let mut s = sched(
        chunked,
        SchedulerConfig {
            num_blocks: 3,
            block_size: 16,
            num_host_blocks: 3,
            max_num_seqs: 2,
            max_tokens_per_step: 22,
            watermark: 0.0,
            max_model_len: 16,
            ..SchedulerConfig::default()
        },
    )
    .unwrap();
    let mut r = Request::new(0, vec![1], 2);
    r.preemption = Some(PreemptionMode::Swap);
    let a = s.add_request(r).unwrap();
    step(&mut s);
    s.fork(a).unwrap();
    s.add_request(Request::new(1, vec![1], 1)).unwrap();
    assert!(drive(&mut s, 20).is_empty());
    assert_eq!(finished_of(&s, 0), vec![(3, FinishReason::MaxTokens); 2]);
    assert_eq!(finished_of(&s, 1), vec![(2, FinishReason::MaxTokens)]);
}

fn a_request_that_fits_the_pool_but_not_the_watermark_runs_alone(chunked: bool) {
    // Watermark 0.5 of 11 blocks keeps 5 free; the request needs 8 of the 10 usable.
    // Admission used to demand 8 + 5 free blocks: accepted, never admitted.
    let mut s = sched(
        chunked,
        SchedulerConfig {
            num_blocks: 11,
            block_size: 16,
            watermark: 0.5,
            max_model_len: 256,
            ..SchedulerConfig::default()
        },
    )
    .unwrap();
    s.add_request(Request::new(1, (0..120).collect(), 8))
        .unwrap();
    drive(&mut s, 50);
    assert_eq!(finished_of(&s, 1), vec![(128, FinishReason::MaxTokens)]);
}

fn the_default_watermark_does_not_strand_a_request_of_the_whole_pool(chunked: bool) {
    // 200 blocks, 199 usable, the default watermark 0.01 keeps 2: a request of 199
    // blocks (3183 + 1 tokens) used to wait forever. The simulator's paged policy with
    // a budget of exactly one maximal request hit the same.
    let mut s = sched(
        chunked,
        SchedulerConfig {
            num_blocks: 200,
            block_size: 16,
            ..SchedulerConfig::default()
        },
    )
    .unwrap();
    s.add_request(Request::new(1, (0..3183).collect(), 1))
        .unwrap();
    drive(&mut s, 5);
    assert_eq!(finished_of(&s, 1), vec![(3184, FinishReason::MaxTokens)]);
}

fn the_watermark_still_applies_while_others_run(chunked: bool) {
    // 10 usable blocks, watermark 5. A holds 1 block for a while; B (6 blocks) would
    // leave 3 free < 5, so it waits for A, then runs alone.
    let mut s = sched(
        chunked,
        SchedulerConfig {
            num_blocks: 11,
            block_size: 16,
            watermark: 0.5,
            max_model_len: 256,
            ..SchedulerConfig::default()
        },
    )
    .unwrap();
    s.add_request(Request::new(1, vec![1], 10)).unwrap();
    step(&mut s);
    s.add_request(Request::new(2, (0..90).collect(), 2))
        .unwrap();
    for _ in 0..8 {
        step(&mut s);
        assert_eq!(s.metrics().waiting, 1, "B admitted under the watermark");
    }
    drive(&mut s, 10);
    assert_eq!(finished_of(&s, 1), vec![(11, FinishReason::MaxTokens)]);
    assert_eq!(finished_of(&s, 2), vec![(92, FinishReason::MaxTokens)]);
}

fn a_request_that_grows_past_the_pool_is_refused_up_front(chunked: bool) {
    // 7 usable blocks of 16 tokens, watermark 0.3 (2 blocks).
    let cfg = SchedulerConfig {
        num_blocks: 8,
        block_size: 16,
        watermark: 0.3,
        max_model_len: 512,
        ..SchedulerConfig::default()
    };
    let mut s = sched(chunked, cfg.clone()).unwrap();
    // A short prompt that would grow to 113 tokens (8 blocks): refused, not preempted
    // and recomputed forever.
    match s.add_request(Request::new(1, vec![1; 10], 103)) {
        Err(Error::InvalidArgument { reason, .. }) => {
            assert!(reason.contains("could never run"), "{reason}")
        }
        other => panic!("expected a refusal, got {other:?}"),
    }
    // 112 tokens (7 blocks, the whole pool, above the watermark): runs to the end.
    s.add_request(Request::new(2, vec![1; 10], 102)).unwrap();
    drive(&mut s, 200);
    assert_eq!(finished_of(&s, 2), vec![(112, FinishReason::MaxTokens)]);
    // With a sliding window of 32 tokens and chunked prefill a sequence holds at most
    // 3 blocks: a long request fits. Without chunked prefill it does not: a prefill
    // (or the recompute of a preempted sequence) holds all its tokens' blocks at once,
    // since its queries read them together.
    let mut s = sched(
        chunked,
        SchedulerConfig {
            sliding_window: Some(32),
            ..cfg
        },
    )
    .unwrap();
    if chunked {
        s.add_request(Request::new(3, vec![1; 10], 400)).unwrap();
        drive(&mut s, 500);
        assert_eq!(finished_of(&s, 3), vec![(410, FinishReason::MaxTokens)]);
        // A prompt longer than the pool is prefilled in chunks of the window's blocks.
        s.add_request(Request::new(4, (0..300).collect(), 4))
            .unwrap();
        drive(&mut s, 500);
        assert_eq!(finished_of(&s, 4), vec![(304, FinishReason::MaxTokens)]);
    } else {
        match s.add_request(Request::new(3, vec![1; 10], 400)) {
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(reason.contains("only with chunked prefill"), "{reason}")
            }
            other => panic!("expected a refusal, got {other:?}"),
        }
    }
}

fn a_fork_that_could_not_come_back_whole_is_refused(chunked: bool) {
    // 7 usable blocks; each sequence may grow to 4 blocks: two fit only by sharing,
    // which recompute would not preserve, so the fork is refused.
    let mut s = sched(
        chunked,
        SchedulerConfig {
            num_blocks: 8,
            block_size: 16,
            max_model_len: 512,
            ..SchedulerConfig::default()
        },
    )
    .unwrap();
    let a = s.add_request(Request::new(1, vec![1; 40], 20)).unwrap();
    step(&mut s);
    assert!(matches!(
        s.fork(a),
        Err(Error::InvalidArgument { arg: "seq", .. })
    ));
    drive(&mut s, 50);
    assert_eq!(finished_of(&s, 1), vec![(60, FinishReason::MaxTokens)]);
}

/// Every case above as it was, without chunked prefill.
mod whole {
    #[test]
    fn a_swapped_out_forked_group_comes_back_into_the_whole_pool() {
        super::a_swapped_out_forked_group_comes_back_into_the_whole_pool(false);
    }
    #[test]
    fn forks_sharing_a_partial_block_are_not_preempted_for_a_copy_they_do_not_need() {
        super::forks_sharing_a_partial_block_are_not_preempted_for_a_copy_they_do_not_need(false);
    }
    #[test]
    fn a_request_that_fits_the_pool_but_not_the_watermark_runs_alone() {
        super::a_request_that_fits_the_pool_but_not_the_watermark_runs_alone(false);
    }
    #[test]
    fn the_default_watermark_does_not_strand_a_request_of_the_whole_pool() {
        super::the_default_watermark_does_not_strand_a_request_of_the_whole_pool(false);
    }
    #[test]
    fn the_watermark_still_applies_while_others_run() {
        super::the_watermark_still_applies_while_others_run(false);
    }
    #[test]
    fn a_request_that_grows_past_the_pool_is_refused_up_front() {
        super::a_request_that_grows_past_the_pool_is_refused_up_front(false);
    }
    #[test]
    fn a_fork_that_could_not_come_back_whole_is_refused() {
        super::a_fork_that_could_not_come_back_whole_is_refused(false);
    }
}

/// Every case above with chunked prefill and a small step budget.
mod chunked {
    #[test]
    fn a_swapped_out_forked_group_comes_back_into_the_whole_pool() {
        super::a_swapped_out_forked_group_comes_back_into_the_whole_pool(true);
    }
    #[test]
    fn forks_sharing_a_partial_block_are_not_preempted_for_a_copy_they_do_not_need() {
        super::forks_sharing_a_partial_block_are_not_preempted_for_a_copy_they_do_not_need(true);
    }
    #[test]
    fn a_request_that_fits_the_pool_but_not_the_watermark_runs_alone() {
        super::a_request_that_fits_the_pool_but_not_the_watermark_runs_alone(true);
    }
    #[test]
    fn the_default_watermark_does_not_strand_a_request_of_the_whole_pool() {
        super::the_default_watermark_does_not_strand_a_request_of_the_whole_pool(true);
    }
    #[test]
    fn the_watermark_still_applies_while_others_run() {
        super::the_watermark_still_applies_while_others_run(true);
    }
    #[test]
    fn a_request_that_grows_past_the_pool_is_refused_up_front() {
        super::a_request_that_grows_past_the_pool_is_refused_up_front(true);
    }
    #[test]
    fn a_fork_that_could_not_come_back_whole_is_refused() {
        super::a_fork_that_could_not_come_back_whole_is_refused(true);
    }
}
