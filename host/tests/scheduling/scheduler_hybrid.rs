//! Layer groups (models that mix sliding-window and full-attention layers): what a
//! window group holds, admission counting each group's real need, and prefix hits past
//! the window. The model-based proptest (`scheduler.rs`) runs random interleavings
//! with two or three groups; these are the behaviours by hand.

use pagedkv_host::block::{KvSpec, NULL_BLOCK};
use pagedkv_host::scheduler::{Request, Scheduler, SchedulerConfig};

/// Gemma-3-like groups: a window of `w` tokens, then full attention; sequences of up
/// to 512 tokens (a whole prefill fits a step).
fn hybrid(w: u32, num_blocks: u32, prefix: bool) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks,
        block_size: 16,
        max_num_seqs: 4,
        max_tokens_per_step: 512,
        watermark: 0.0,
        enable_prefix_caching: prefix,
        kv_groups: vec![KvSpec::SlidingWindow(w), KvSpec::Full],
        max_model_len: 512,
        ..SchedulerConfig::default()
    }
}

/// Steps until idle, sampling token 9; returns the steps.
fn drive(s: &mut Scheduler, mut each: impl FnMut(&Scheduler)) -> usize {
    let mut steps = 0;
    while !s.is_idle() {
        let batch = s.step().unwrap().clone();
        each(s);
        let sampled: Vec<_> = batch.seqs.iter().map(|q| (q.seq, 9)).collect();
        s.on_step_done(&sampled).unwrap();
        steps += 1;
        assert!(steps < 100_000, "no progress");
    }
    steps
}

/// A 32k-token request (chunked prefill) holds its window's blocks (and one more)
/// in the window group once it decodes, and every block in the full group: admission
/// counts that, not 2 × 2001 blocks.
#[test]
fn a_long_request_holds_only_its_window_in_the_window_group() {
    let (w, bs) = (512u32, 16u32);
    let prompt = 32_000usize;
    // Room for the full group's 2001 blocks, the window group's 33 and a few: far
    // below the 4002 that two full groups would need.
    let num_blocks = 2001 + 33 + 8;
    let long = |kv_groups| SchedulerConfig {
        kv_groups,
        max_model_len: 40_000,
        ..hybrid(w, num_blocks, false)
    };
    let cfg = long(vec![KvSpec::SlidingWindow(w), KvSpec::Full]);
    let mut s = Scheduler::with_chunked_prefill(cfg, true).unwrap();
    let seq = s
        .add_request(Request::new(1, (0..prompt as u32).collect(), 10))
        .unwrap();
    let mut most = 0;
    drive(&mut s, |s| {
        if let Ok(t) = s.block_table_of(seq, 0) {
            let live = t.blocks().iter().filter(|&&b| b != NULL_BLOCK).count();
            // Decode steps (a chunk holds its own tokens' blocks too, while it is
            // computed).
            if t.num_tokens() as usize > prompt {
                most = most.max(live);
            }
            let full = s.block_table_of(seq, 1).unwrap();
            assert!(full.blocks().iter().all(|&b| b != NULL_BLOCK));
            assert_eq!(full.num_tokens(), t.num_tokens());
        }
    });
    assert!(
        most as u32 <= w / bs + 1,
        "the window group held {most} blocks"
    );
    assert!(most > 0);
    // The same pool for the model with every layer full: refused up front.
    let all_full = long(vec![KvSpec::Full, KvSpec::Full]);
    let mut s = Scheduler::with_chunked_prefill(all_full, true).unwrap();
    assert!(
        s.add_request(Request::new(1, (0..prompt as u32).collect(), 10))
            .is_err()
    );
}

/// A prompt that begins like a finished one hits past the window: the full group
/// serves every cached block of the chain, the window group the blocks its window
/// needs at the first computed position, which stayed cached after the window (and
/// then the finish) released them.
#[test]
fn a_prefix_hit_reaches_past_the_window() {
    let mut s = Scheduler::new(hybrid(32, 64, true)).unwrap();
    let prompt: Vec<u32> = (0..200).collect();
    s.add_request(Request::new(1, prompt.clone(), 1)).unwrap();
    drive(&mut s, |_| {});
    let mut longer = prompt.clone();
    longer.extend(500..520);
    let seq = s.add_request(Request::new(2, longer, 3)).unwrap();
    let batch = s.step().unwrap().clone();
    // 201 tokens were computed: 12 full blocks (192 tokens) are cached in both groups.
    assert_eq!(batch.seqs[0].num_cached_tokens, 192);
    let win = s.block_table_of(seq, 0).unwrap();
    let full = s.block_table_of(seq, 1).unwrap();
    // The window group takes only blocks 10 and 11 (the window of position 192 is
    // 161..=192) from the cache; the full group all twelve.
    assert!(win.blocks()[..10].iter().all(|&b| b == NULL_BLOCK));
    assert!(win.blocks()[10..].iter().all(|&b| b != NULL_BLOCK));
    assert!(full.blocks().iter().all(|&b| b != NULL_BLOCK));
    // The groups' copies are blocks of their own.
    assert!(
        win.blocks()[10..12]
            .iter()
            .all(|b| !full.blocks().contains(b))
    );
    let sampled: Vec<_> = batch.seqs.iter().map(|q| (q.seq, 9)).collect();
    s.on_step_done(&sampled).unwrap();
    drive(&mut s, |_| {});
    assert_eq!(s.metrics().prefix_hit_tokens, 192);
}

/// Without the window group's blocks a hit is shorter: evicting them (another
/// prompt's allocations take the free cached blocks, oldest first) leaves the full
/// group's chain but no hit the window group can serve there.
#[test]
fn a_hit_needs_every_group() {
    let mut s = Scheduler::new(hybrid(32, 40, true)).unwrap();
    let prompt: Vec<u32> = (0..200).collect();
    s.add_request(Request::new(1, prompt.clone(), 1)).unwrap();
    drive(&mut s, |_| {});
    let (hits, _) = s.kv().count_prefix_hits(&prompt, None);
    assert_eq!(hits, 12);
    // A different 240-token prompt takes 2 × 15 blocks of the 39: the LRU's oldest
    // cached blocks go first, and with them some of the chain in some group.
    s.add_request(Request::new(2, (1000..1240).collect(), 1))
        .unwrap();
    drive(&mut s, |_| {});
    let (hits, _) = s.kv().count_prefix_hits(&prompt, None);
    assert!(hits < 12, "{hits} hits after eviction");
    // Whatever is left is served by both groups: the hit runs and reads its blocks.
    let seq = s.add_request(Request::new(3, prompt.clone(), 2)).unwrap();
    let batch = s.step().unwrap().clone();
    assert_eq!(batch.seqs[0].num_cached_tokens, hits * 16);
    let win = s.block_table_of(seq, 0).unwrap();
    let first = s.kv().dead_before(0, hits * 16) as usize;
    assert!(win.blocks()[first..].iter().all(|&b| b != NULL_BLOCK));
}

/// The scheduler refuses `sliding_window` and `kv_groups` together, and a group's
/// window of 0 tokens.
#[test]
fn layer_groups_are_validated() {
    let both = SchedulerConfig {
        sliding_window: Some(64),
        ..hybrid(32, 64, false)
    };
    assert!(Scheduler::new(both).is_err());
    let zero = SchedulerConfig {
        kv_groups: vec![KvSpec::SlidingWindow(0), KvSpec::Full],
        ..hybrid(32, 64, false)
    };
    assert!(Scheduler::new(zero).is_err());
}

/// A request's blocks summed over many layer groups do not wrap: 32 full groups of a
/// 2^30-token request need 32 × 2^27 blocks (past `u32`), and it is refused, never a
/// debug-build overflow panic or, wrapped, a request accepted that can never run.
#[test]
fn a_requests_blocks_over_many_groups_do_not_wrap() {
    let cfg = SchedulerConfig {
        num_blocks: 64,
        block_size: 8,
        max_num_seqs: 1,
        max_tokens_per_step: 1 << 30,
        max_model_len: 1 << 30,
        kv_groups: vec![KvSpec::Full; 32],
        ..SchedulerConfig::default()
    };
    let mut s = Scheduler::new(cfg).unwrap();
    assert!(
        s.add_request(Request::new(1, vec![1], (1 << 30) - 1))
            .is_err()
    );
    // And a manager asked about a group it does not have says "no window".
    assert_eq!(s.kv().dead_before(40, 100), 0);
}
