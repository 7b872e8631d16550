//! `pagedkv run --spec`'s library: speculative decoding through the scheduler's verify
//! rows and rollbacks, against plain greedy decoding of the same requests.

use pagedkv::host::DType;
use pagedkv_cli::tiny::{RunConfig, compare_greedy, run};

/// Every dtype, with chunked prefill and with preemption (a pool too small for every
/// request): the speculative run verifies drafts, rejects some, finishes every request
/// with its tokens, and its greedy outputs are the plain run's wherever the margin
/// exceeds the error bound (here: everywhere).
#[test]
fn speculative_runs_generate_the_plain_greedy_tokens() {
    for (dtype, spec, num_blocks, step_tokens) in [
        (DType::F32, 3, 64, 2048),
        (DType::Bf16, 6, 64, 9),
        (DType::F16, 4, 16, 2048),
    ] {
        let cfg = RunConfig {
            num_requests: 6,
            max_tokens: 30,
            dtype,
            spec,
            num_blocks,
            step_tokens,
            seed: 3,
            ..RunConfig::default()
        };
        let quiet = &mut |_: String| {};
        let sr = run(&cfg, quiet).unwrap();
        let plain = run(
            &RunConfig {
                spec: 0,
                ..cfg.clone()
            },
            quiet,
        )
        .unwrap();
        assert!(sr.verified() && plain.verified(), "{dtype}");
        let s = sr.spec.expect("spec stats");
        assert!(s.verify_rows > 0 && s.drafted > 0, "{dtype}: {s:?}");
        assert!(s.accepted < s.drafted, "{dtype}: no draft rejected: {s:?}");
        assert_eq!(sr.tokens, 6 * 30, "{dtype}");
        assert!(
            sr.steps < plain.steps,
            "{dtype}: {} vs {}",
            sr.steps,
            plain.steps
        );
        let m = compare_greedy(&sr, &plain);
        assert!(m.holds(), "{dtype}: {m:?}");
        if num_blocks < 64 {
            assert!(
                sr.preemptions > 0,
                "{dtype}: the small pool preempted nothing"
            );
        }
    }
}
