//! The workload of the test and of `cargo run` (the speed comparison): requests of
//! different lengths arriving over time, one sharing a long prefix with an earlier
//! one, on a pool small enough that the scheduler must preempt.

use pagedkv::host::scheduler::{PreemptionMode, SchedulerConfig};

use crate::engine::Arrival;

/// `len` deterministic token ids below `vocab`, from `seed`.
pub fn prompt(seed: u64, len: usize, vocab: u32) -> Vec<u32> {
    (0..len as u64)
        .map(|i| ((seed * 7919 + i * 104_729 + (i * i) % 13) % vocab as u64) as u32)
        .collect()
}

/// Five requests (prompts of 21, 13, 5, 30 and 9 tokens, 6 to 16 new tokens each)
/// arriving at steps 0, 0, 0, 2 and 4; request 3's prompt starts with request 0's
/// first 16 tokens (two blocks of 8: a prefix-cache hit).
pub fn mixed(vocab: u32) -> Vec<Arrival> {
    let a = prompt(1, 21, vocab);
    let mut d = a[..16].to_vec();
    d.extend(prompt(4, 14, vocab));
    vec![
        Arrival {
            at: 0,
            id: 0,
            prompt: a,
            max_tokens: 12,
        },
        Arrival {
            at: 0,
            id: 1,
            prompt: prompt(2, 13, vocab),
            max_tokens: 10,
        },
        Arrival {
            at: 0,
            id: 2,
            prompt: prompt(3, 5, vocab),
            max_tokens: 16,
        },
        Arrival {
            at: 2,
            id: 3,
            prompt: d,
            max_tokens: 6,
        },
        Arrival {
            at: 4,
            id: 4,
            prompt: prompt(5, 9, vocab),
            max_tokens: 8,
        },
    ]
}

/// The scheduler for [`mixed`] with blocks of `block_size` tokens (8 or 16): 11 usable
/// blocks of 8 or 6 of 16 (the requests hold 14 of 8 or 10 of 16 at once if none is
/// preempted, so the newest is preempted by `mode`), 8 host blocks for swapping,
/// prefix caching on, sequences of up to 64 tokens.
pub fn tight(mode: PreemptionMode, block_size: u32) -> SchedulerConfig {
    SchedulerConfig {
        num_blocks: if block_size >= 16 { 7 } else { 12 },
        block_size,
        num_host_blocks: 8,
        max_num_seqs: 8,
        max_model_len: 64,
        watermark: 0.0,
        preemption: mode,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    }
}
