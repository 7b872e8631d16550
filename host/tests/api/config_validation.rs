//! `SchedulerConfig` sizes from user input that overflow the batch's i32 arrays or
//! their byte size, or pools beyond `MAX_POOL_BLOCKS`, are refused by `Scheduler::new`,
//! naming the field (issue #13, #28), before anything is allocated.

use pagedkv_host::Error;
use pagedkv_host::block::{KvCacheManager, MAX_POOL_BLOCKS};
use pagedkv_host::scheduler::{Request, Scheduler, SchedulerConfig};
use proptest::prelude::*;

#[test]
fn config_sizes_that_overflow_are_refused_by_name() {
    let base = SchedulerConfig::default();
    let arg = |cfg: SchedulerConfig| match Scheduler::new(cfg) {
        Err(Error::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected InvalidArgument, got {:?}", other.map(drop)),
    };
    // Context lengths travel as i32.
    assert_eq!(
        arg(SchedulerConfig {
            max_model_len: u32::MAX,
            max_tokens_per_step: usize::MAX,
            ..base.clone()
        }),
        "max_model_len"
    );
    // max_num_seqs rows of max_model_len / block_size entries overflow.
    assert_eq!(
        arg(SchedulerConfig {
            max_num_seqs: usize::MAX / 2,
            ..base.clone()
        }),
        "max_num_seqs"
    );
    assert_eq!(
        arg(SchedulerConfig {
            watermark: f64::NAN,
            ..base.clone()
        }),
        "watermark"
    );
    // Block ids travel as i32 (refused before a pool of 2^31 blocks is built).
    assert_eq!(
        arg(SchedulerConfig {
            num_blocks: i32::MAX as u32 + 1,
            ..base
        }),
        "num_blocks"
    );
}

/// Pools of more than `MAX_POOL_BLOCKS` blocks are refused by name before anything is
/// allocated: `num_host_blocks` near `u32::MAX`, `num_blocks` at `i32::MAX`, or 2^28
/// host blocks once passed validation and then aborted the process ("memory allocation
/// of 17179869176 bytes failed"; the 2^28 one after 54 s and 7.4 GB), and
/// `num_host_blocks = u32::MAX` was reported as "`num_blocks`: 4294967295 (must be at
/// least 1)".
#[test]
fn pools_beyond_the_cap_are_refused_by_name_before_any_allocation() {
    let base = SchedulerConfig::default();
    let refused = |cfg: SchedulerConfig| match Scheduler::new(cfg) {
        Err(Error::InvalidArgument { arg, reason }) => (arg, reason),
        other => panic!("expected InvalidArgument, got {:?}", other.map(drop)),
    };
    for n in [u32::MAX, u32::MAX - 1, 1 << 28, MAX_POOL_BLOCKS + 1] {
        let (arg, reason) = refused(SchedulerConfig {
            num_host_blocks: n,
            ..base.clone()
        });
        assert_eq!(arg, "num_host_blocks", "{reason}");
        assert!(reason.contains("MAX_POOL_BLOCKS"), "{reason}");
    }
    for n in [i32::MAX as u32, 1 << 28, MAX_POOL_BLOCKS + 1] {
        let (arg, reason) = refused(SchedulerConfig {
            num_blocks: n,
            ..base.clone()
        });
        assert_eq!(arg, "num_blocks", "{reason}");
    }
    // The block manager names its own arguments the same way.
    match KvCacheManager::new(64, u32::MAX, 16, false, None) {
        Err(Error::InvalidArgument { arg, .. }) => assert_eq!(arg, "num_host_blocks"),
        other => panic!("expected InvalidArgument, got {:?}", other.map(drop)),
    }
}

/// A size near a type's limits, a small one, or one around the pool cap.
fn size_u32() -> impl Strategy<Value = u32> {
    prop_oneof![
        24 => 0u32..64,
        2 => (0u32..4).prop_map(|k| u32::MAX - k),
        1 => (0u32..4).prop_map(|k| (i32::MAX as u32).wrapping_add(k).wrapping_sub(1)),
        1 => (0u32..4).prop_map(|k| MAX_POOL_BLOCKS + 1 + k),
        1 => (20u32..32).prop_map(|p| 1u32 << p),
    ]
}

fn size_usize() -> impl Strategy<Value = usize> {
    prop_oneof![
        20 => 0usize..5000,
        2 => (0usize..4).prop_map(|k| usize::MAX - k),
        1 => (20u32..64).prop_map(|p| 1usize << p),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: std::env::var("PROPTEST_CASES").ok().and_then(|s| s.parse().ok()).unwrap_or(256),
        ..ProptestConfig::default()
    })]

    /// Every size of a `SchedulerConfig` near its type's limits: `Scheduler::new` (and
    /// with chunked prefill) never panics or aborts; it refuses by name, or builds a
    /// scheduler that then takes a request and steps. (Valid pools here are small: a
    /// pool at the cap is 1 GB of bookkeeping.)
    #[test]
    fn scheduler_sizes_near_the_limits_are_refused_by_name_or_work(
        num_blocks in size_u32(),
        num_host_blocks in size_u32(),
        block_size in prop_oneof![3 => Just(8u32), 3 => Just(16), 3 => Just(32), 1 => size_u32()],
        max_num_seqs in size_usize(),
        max_tokens_per_step in size_usize(),
        max_model_len in size_u32(),
        window in prop::option::of(size_u32()),
        watermark in prop_oneof![8 => Just(0.0), 8 => Just(0.01), 1 => Just(f64::NAN), 1 => Just(1.0), 2 => -1.0f64..2.0],
        chunked in any::<bool>(),
    ) {
        let cfg = SchedulerConfig {
            num_blocks,
            block_size,
            num_host_blocks,
            max_num_seqs,
            max_tokens_per_step,
            watermark,
            sliding_window: window,
            max_model_len,
            ..SchedulerConfig::default()
        };
        match Scheduler::with_chunked_prefill(cfg.clone(), chunked) {
            Err(Error::InvalidArgument { arg, .. }) => {
                prop_assert!(
                    [
                        "num_blocks", "num_host_blocks", "block_size", "max_num_seqs",
                        "max_tokens_per_step", "max_model_len", "watermark", "sliding_window",
                    ]
                    .contains(&arg),
                    "{}",
                    arg
                );
            }
            Err(e) => prop_assert!(false, "not an argument error: {}", e),
            Ok(mut s) => {
                prop_assert!(num_blocks <= MAX_POOL_BLOCKS && num_host_blocks <= MAX_POOL_BLOCKS);
                // A request is either refused or runs one step.
                let len = (max_model_len as usize).clamp(1, 40) - 1;
                if len > 0 && s.add_request(Request::new(1, vec![3; len], 1)).is_ok() {
                    let b = s.step().unwrap();
                    let sampled: Vec<_> = b.seqs.iter().map(|q| (q.seq, 5)).collect();
                    if !sampled.is_empty() {
                        s.on_step_done(&sampled).unwrap();
                    }
                }
            }
        }
    }
}
