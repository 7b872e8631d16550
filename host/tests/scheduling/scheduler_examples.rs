//! The scheduler on small hand-made cases, each checking one behaviour exactly: prefix
//! hits (and the one token a prefill always computes), fork's copy-on-write, and input
//! the scheduler must refuse with an error rather than a panic. The random
//! interleavings against a model are in `host/tests/scheduling/scheduler.rs`.

use pagedkv_host::Error;
use pagedkv_host::scheduler::{Request, Scheduler, SchedulerConfig};

#[test]
fn prefix_hits_reuse_blocks_and_leave_one_token_to_compute() {
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 32,
        block_size: 8,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    })
    .unwrap();
    let prompt: Vec<u32> = (0..24).collect();
    let a = s.add_request(Request::new(1, prompt.clone(), 2)).unwrap();
    let b = s.step().unwrap();
    assert_eq!(b.seqs[0].num_new_tokens, 24);
    s.on_step_done(&[(a, 99)]).unwrap();
    let a_blocks = s.block_table(a).unwrap().blocks().to_vec();
    // Same 24-token prompt: 3 full blocks cached, but one token must be computed, so 2 hit.
    let c = s.add_request(Request::new(2, prompt, 2)).unwrap();
    let b = s.step().unwrap().clone();
    let q = b.seqs.iter().find(|q| q.seq == c).unwrap();
    assert_eq!((q.start_pos, q.num_new_tokens), (16, 8));
    let c_blocks = s.block_table(c).unwrap().blocks().to_vec();
    assert_eq!(c_blocks[..2], a_blocks[..2]);
    assert_ne!(c_blocks[2], a_blocks[2]);
    assert_eq!(s.kv().device().ref_cnt(a_blocks[0]).unwrap(), 2);
    assert!((s.metrics().prefix_hit_rate() - 16.0 / 48.0).abs() < 1e-12);
    // A different salt never hits.
    let mut r = Request::new(3, (0..24).collect(), 2);
    r.cache_salt = Some(5);
    s.on_step_done(&b.seqs.iter().map(|q| (q.seq, 1)).collect::<Vec<_>>())
        .unwrap();
    let d = s.add_request(r).unwrap();
    let b = s.step().unwrap();
    assert_eq!(b.seqs.iter().find(|q| q.seq == d).unwrap().start_pos, 0);
}

#[test]
fn fork_shares_blocks_and_copies_the_partial_block_on_write() {
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 16,
        block_size: 8,
        ..SchedulerConfig::default()
    })
    .unwrap();
    let a = s
        .add_request(Request::new(1, (0..12).collect(), 10))
        .unwrap();
    s.step().unwrap();
    s.on_step_done(&[(a, 50)]).unwrap();
    let child = s.fork(a).unwrap();
    let blocks = s.block_table(a).unwrap().blocks().to_vec();
    assert_eq!(s.block_table(child).unwrap().blocks(), blocks.as_slice());
    assert_eq!(s.kv().device().ref_cnt(blocks[1]).unwrap(), 2);
    let b = s.step().unwrap();
    // The first writer into the shared partial block 1 copies it; the second then owns
    // the original alone.
    assert_eq!(b.copies.len(), 1);
    assert_eq!(b.copies[0].0, blocks[1]);
    let (ta, tc) = (s.block_table(a).unwrap(), s.block_table(child).unwrap());
    assert_eq!(ta.blocks()[0], tc.blocks()[0]);
    assert_ne!(ta.blocks()[1], tc.blocks()[1]);
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let cfg = SchedulerConfig {
        num_blocks: 8,
        block_size: 16,
        max_model_len: 512,
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg.clone()).unwrap();
    let err = |r: Result<u64, Error>| match r {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    };
    assert_eq!(err(s.add_request(Request::new(1, vec![], 4))), "prompt");
    assert_eq!(
        err(s.add_request(Request::new(1, vec![1], 0))),
        "max_tokens"
    );
    // 7 usable blocks of 16 tokens: 200 tokens can never fit.
    assert_eq!(
        err(s.add_request(Request::new(1, vec![1; 150], 50))),
        "prompt"
    );
    assert_eq!(
        err(s.add_request(Request::new(1, vec![1; 500], 50))),
        "prompt"
    );
    s.add_request(Request::new(1, vec![1, 2], 4)).unwrap();
    assert_eq!(err(s.add_request(Request::new(1, vec![1], 4))), "id");
    assert!(matches!(
        s.abort(99),
        Err(Error::Unknown {
            what: "request",
            id: 99
        })
    ));
    assert!(matches!(
        s.fork(99),
        Err(Error::Unknown {
            what: "sequence",
            ..
        })
    ));
    assert!(matches!(s.on_step_done(&[]), Err(Error::InvalidState(_))));
    let b = s.step().unwrap().clone();
    assert!(matches!(s.step(), Err(Error::InvalidState(_))));
    assert!(matches!(
        s.on_step_done(&[(42, 1)]),
        Err(Error::Unknown { .. })
    ));
    assert!(matches!(
        s.on_step_done(&[]),
        Err(Error::InvalidArgument { .. })
    ));
    let q = b.seqs[0].seq;
    assert!(matches!(
        s.on_step_done(&[(q, 1), (q, 2)]),
        Err(Error::InvalidArgument { .. })
    ));
    // A live sequence the step did not schedule (it arrived after the step), alone or
    // in place of a scheduled one.
    let late = s.add_request(Request::new(2, vec![5, 6], 4)).unwrap();
    for bad in [vec![(late, 1)], vec![(late, 1), (q, 1)]] {
        match s.on_step_done(&bad) {
            Err(Error::InvalidArgument { arg, reason }) => {
                assert_eq!(arg, "sampled");
                assert!(reason.contains("not scheduled"), "{reason}");
            }
            other => panic!("{bad:?}: expected not scheduled, got {other:?}"),
        }
    }
    s.on_step_done(&[(q, 1)]).unwrap();
    for bad in [
        SchedulerConfig {
            block_size: 12,
            ..cfg.clone()
        },
        SchedulerConfig {
            num_blocks: 1,
            ..cfg.clone()
        },
        SchedulerConfig {
            max_tokens_per_step: 100,
            ..cfg.clone()
        },
        SchedulerConfig {
            watermark: 1.5,
            ..cfg.clone()
        },
    ] {
        assert!(Scheduler::new(bad).is_err());
    }
}

/// A request of `max_tokens = 1` (scoring, classification, a prefill-only request)
/// finishes with the token its prefill samples, whole or chunked, and frees its
/// blocks: no decode step runs for it.
#[test]
fn a_request_of_one_token_finishes_at_its_prefill() {
    use pagedkv_host::scheduler::FinishReason;
    for chunked in [false, true] {
        let mut s = Scheduler::with_chunked_prefill(
            SchedulerConfig {
                num_blocks: 16,
                block_size: 8,
                max_num_seqs: 4,
                max_tokens_per_step: if chunked { 16 } else { 4096 },
                ..SchedulerConfig::default()
            },
            chunked,
        )
        .unwrap();
        let seq = s
            .add_request(Request::new(1, (0..40).collect(), 1))
            .unwrap();
        let mut steps = 0;
        while !s.is_idle() {
            let b = s.step().unwrap().clone();
            assert!(b.seqs.iter().all(|q| q.is_prefill), "a decode ran");
            let done = s
                .on_step_done(&b.seqs.iter().map(|q| (q.seq, 77)).collect::<Vec<_>>())
                .unwrap();
            steps += 1;
            assert_eq!(done.is_empty(), !b.seqs[0].samples);
        }
        assert_eq!(steps, if chunked { 3 } else { 1 });
        let f = s.finished();
        assert_eq!((f[0].1, f[0].2), (seq, FinishReason::MaxTokens));
        assert_eq!(f[0].3.len(), 41);
        assert_eq!(s.kv().device().num_used(), 0);
    }
}

/// vLLM's free-queue order (tests/v1/core/test_prefix_caching.py, `test_prefill` and
/// `test_evict`): a freed block that holds nothing reusable goes to the front of the
/// free queue, a freed cached block to the back (a sequence's blocks last first), so a
/// full pool takes a hash-less block before it evicts a cached one. (Every freed block
/// once went to the back: the oldest cached prefix was evicted while a hash-less block
/// sat free.)
#[test]
fn hash_less_freed_blocks_are_taken_before_any_cached_block() {
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 6,
        block_size: 16,
        max_num_seqs: 4,
        max_model_len: 128,
        watermark: 0.0,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    })
    .unwrap();
    // 40 tokens: blocks 1 and 2 full (cached at commit), block 3 partial.
    let a = s
        .add_request(Request::new(1, (0..40).collect(), 1))
        .unwrap();
    let blocks = {
        s.step().unwrap();
        let t = s.block_table(a).unwrap().blocks().to_vec();
        s.on_step_done(&[(a, 5)]).unwrap(); // finishes: its blocks are freed
        t
    };
    let pool = s.kv().device();
    assert_eq!(pool.num_cached_free(), 2);
    // The partial block first (freed first: last block first), then the never-used
    // blocks, then the cached ones, the sequence's last block first.
    assert_eq!(
        pool.free_queue(),
        vec![blocks[2], 4, 5, blocks[1], blocks[0]],
        "{blocks:?}"
    );
    // A 45-token prompt of other tokens needs 3 blocks: the hash-less ones, no
    // eviction; the cached prefix still hits afterwards.
    let b = s
        .add_request(Request::new(2, (100..145).collect(), 1))
        .unwrap();
    s.step().unwrap();
    assert_eq!(
        s.kv().device().num_cached_free(),
        2,
        "a cached block was evicted"
    );
    s.on_step_done(&[(b, 5)]).unwrap();
    let c = s
        .add_request(Request::new(3, (0..40).collect(), 1))
        .unwrap();
    let q = s.step().unwrap().seqs[0];
    assert_eq!((q.seq, q.num_cached_tokens), (c, 32));
}

/// vLLM's `reset_prefix_cache`: after a weight update every cached block is stale, yet
/// a prefix hit would serve it. Refused while a request runs (its blocks are in use)
/// or between step and on_step_done; once only waiting requests are left, it drops
/// every cached prefix and nothing hits. (There was no way to drop the cache but a new
/// scheduler.)
#[test]
fn reset_prefix_cache_drops_every_hit_and_waits_for_running_requests() {
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 16,
        block_size: 8,
        max_num_seqs: 4,
        max_model_len: 64,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    })
    .unwrap();
    let a = s
        .add_request(Request::new(1, (0..20).collect(), 2))
        .unwrap();
    s.step().unwrap();
    assert!(matches!(
        s.reset_prefix_cache(),
        Err(Error::InvalidState(_))
    ));
    s.on_step_done(&[(a, 5)]).unwrap();
    // Running: refused, nothing changed.
    assert!(matches!(
        s.reset_prefix_cache(),
        Err(Error::InvalidState(_))
    ));
    let b = s.step().unwrap().clone();
    s.on_step_done(&[(b.seqs[0].seq, 5)]).unwrap();
    assert!(s.is_idle());
    assert_eq!(s.kv().device().num_cached(), 2);
    // A waiting request would hit; after the reset it does not.
    let c = s
        .add_request(Request::new(2, (0..20).collect(), 1))
        .unwrap();
    s.reset_prefix_cache().unwrap();
    let pool = s.kv().device();
    assert_eq!((pool.num_cached(), pool.num_cached_free()), (0, 0));
    assert!(
        pool.free_queue()
            .iter()
            .all(|&b| pool.block_hash(b).unwrap().is_none())
    );
    let q = s.step().unwrap().seqs[0];
    assert_eq!((q.seq, q.num_cached_tokens), (c, 0));
    s.on_step_done(&[(c, 5)]).unwrap();
    // It caches again from then on.
    assert_eq!(s.kv().device().num_cached(), 2);
}

/// vLLM's priority convention (tests/v1/core/test_scheduler.py,
/// `test_priority_scheduling_*`): a *lower* `priority` is more urgent. Waiting
/// requests are admitted lowest first, and when the pool runs short the least urgent
/// running request is preempted first, even when it is not the newest
/// (`test_priority_scheduling_preemption`). Here the higher value came first and the
/// victim was always the newest arrival.
#[test]
fn lower_priority_values_are_more_urgent_and_preempted_last() {
    use pagedkv_host::scheduler::QueuePolicy;
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 7, // 6 usable blocks of 8 tokens
        block_size: 8,
        max_num_seqs: 4,
        max_model_len: 64,
        watermark: 0.0,
        policy: QueuePolicy::Priority,
        ..SchedulerConfig::default()
    })
    .unwrap();
    let req = |id, prio| {
        let mut r = Request::new(id, vec![1; 8], 20);
        r.priority = prio;
        r
    };
    // Arrival order 1, 2, 3; urgency 2 (prio 0) > 3 (prio 1) > 1 (prio 5).
    let a = s.add_request(req(1, 5)).unwrap();
    let b = s.add_request(req(2, 0)).unwrap();
    let c = s.add_request(req(3, 1)).unwrap();
    let order: Vec<u64> = s.step().unwrap().seqs.iter().map(|q| q.seq).collect();
    assert_eq!(order, vec![b, c, a], "admitted most urgent first");
    s.on_step_done(&order.iter().map(|&q| (q, 9)).collect::<Vec<_>>())
        .unwrap();
    let mut preempted = Vec::new();
    for _ in 0..12 {
        let batch = s.step().unwrap().clone();
        preempted.extend(batch.preempted.iter().map(|p| p.0));
        let sampled: Vec<_> = batch.seqs.iter().map(|q| (q.seq, 9)).collect();
        if !sampled.is_empty() {
            s.on_step_done(&sampled).unwrap();
        }
    }
    // Every prompt fills its first block; the pool holds 6 blocks: the first request
    // preempted is the least urgent (id 1, the oldest arrival), never the most urgent.
    assert_eq!(preempted.first(), Some(&1), "{preempted:?}");
    assert!(!preempted.contains(&2), "{preempted:?}");
}

/// Identical prompts admitted in the same step share their full blocks from that step
/// on, as vLLM shares blocks once they are allocated: the first computes them, the
/// others start past them (their K/V is written by the step's kv_append before any
/// attention of the step reads it). Each once prefilled the whole prompt, so a burst
/// of requests with one system prompt computed it once per request. Another salt
/// shares nothing.
#[test]
fn identical_prompts_admitted_in_one_step_share_their_full_blocks() {
    let mut s = Scheduler::new(SchedulerConfig {
        num_blocks: 32,
        block_size: 8,
        max_num_seqs: 8,
        max_model_len: 64,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    })
    .unwrap();
    let prompt: Vec<u32> = (0..20).collect(); // two full blocks and 4 tokens
    let ids: Vec<u64> = (0..3)
        .map(|i| s.add_request(Request::new(i, prompt.clone(), 2)).unwrap())
        .collect();
    let mut salted = Request::new(9, prompt.clone(), 2);
    salted.cache_salt = Some(1);
    let other = s.add_request(salted).unwrap();
    let b = s.step().unwrap().clone();
    let cached: Vec<(u64, u32, u32)> = b
        .seqs
        .iter()
        .map(|q| (q.seq, q.num_cached_tokens, q.num_new_tokens))
        .collect();
    assert_eq!(
        cached,
        vec![
            (ids[0], 0, 20),
            (ids[1], 16, 4),
            (ids[2], 16, 4),
            (other, 0, 20)
        ]
    );
    assert_eq!(b.slot_mapping.len(), 48);
    let first = s.block_table(ids[0]).unwrap().blocks()[..2].to_vec();
    for &q in &ids[1..] {
        assert_eq!(s.block_table(q).unwrap().blocks()[..2], first[..]);
    }
    assert_eq!(s.kv().device().ref_cnt(first[0]).unwrap(), 3);
    assert_ne!(s.block_table(other).unwrap().blocks()[0], first[0]);
    assert_eq!(s.metrics().prefix_hit_tokens, 32);
}
