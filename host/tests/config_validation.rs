//! `SchedulerConfig` sizes from user input that overflow the batch's i32 arrays or
//! their byte size are refused by `Scheduler::new`, naming the field (issue #13),
//! before anything is allocated.

use pagedkv_host::Error;
use pagedkv_host::scheduler::{Scheduler, SchedulerConfig};

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
