//! A candle Llama served through pagedkv (scheduler, paged cache, kernels in the
//! emulator) gives, at every step, the logits of candle's own Llama run one request at
//! a time with its own KV cache, and the same greedy tokens: across continuous
//! batching, a forced preemption (recompute and swap) and a prefix-cache hit. The
//! attention (decode and prefill) runs on pagedkv's kernels in f32 (blocks of 8), and
//! in bf16 and f16 on the tensor-core kernels (blocks of 16: the multi-warp prefill),
//! within a tolerance derived from the dtype ([`tolerance`]).

use candle_transformers::models::llama::Llama;
use pagedkv::host::DType;
use pagedkv::host::ops::prefill::PrefillKernel;
use pagedkv::host::scheduler::PreemptionMode;

/// (attention dtype, block size, preemption mode) of each run.
const RUNS: [(DType, u32, PreemptionMode); 6] = [
    (DType::F32, 8, PreemptionMode::Recompute),
    (DType::F32, 8, PreemptionMode::Swap),
    (DType::Bf16, 16, PreemptionMode::Recompute),
    (DType::Bf16, 16, PreemptionMode::Swap),
    (DType::F16, 16, PreemptionMode::Recompute),
    (DType::F16, 16, PreemptionMode::Swap),
];
use pagedkv_candle_llama::engine::{EngineConfig, serve};
use pagedkv_candle_llama::{Engine, PagedLlama, reference, weights, workload};

#[test]
fn every_steps_logits_match_candles_own_llama() {
    let cfg = weights::tiny();
    let w = weights::random(&cfg, 17).unwrap();
    let llama = Llama::load(weights::var_builder(w.clone()), &cfg).unwrap();
    let arrivals = workload::mixed(cfg.vocab_size as u32);
    let want = reference::generate_all(&llama, &cfg, &arrivals).unwrap();

    for (dtype, block, mode) in RUNS {
        let model = PagedLlama::load(weights::var_builder(w.clone()), &cfg).unwrap();
        let ec = EngineConfig {
            scheduler: workload::tight(mode, block),
            emulator_workers: 0,
            dtype,
        };
        let mut engine = Engine::on_cpu(model, &cfg, &ec).unwrap();
        let served = serve(&mut engine, &arrivals).unwrap();

        // Several requests of different lengths in one batch, and continuous batching:
        // a step mixing a prefill with decodes.
        assert!(served.steps.iter().any(|s| s.prefills + s.decodes >= 3));
        assert!(served.steps.iter().any(|s| s.prefills > 0 && s.decodes > 0));
        // The preemption really happened, in the asked mode.
        let preempted: Vec<_> = served
            .steps
            .iter()
            .flat_map(|s| s.preempted.clone())
            .collect();
        assert!(!preempted.is_empty(), "{mode:?}: no preemption");
        assert!(preempted.iter().all(|&(_, m)| m == mode), "{preempted:?}");
        match mode {
            PreemptionMode::Recompute => assert!(served.metrics.preempted_recompute > 0),
            PreemptionMode::Swap => {
                assert!(served.metrics.preempted_swap > 0);
                assert!(
                    served.steps.iter().any(|s| s.swapped.1 > 0),
                    "never swapped in"
                );
            }
        }
        // Request 3 reused request 0's two cached blocks.
        assert!(
            served.metrics.prefix_hit_tokens >= 16,
            "{:?}",
            served.metrics
        );
        assert!(
            served
                .steps
                .iter()
                .flat_map(|s| &s.prefix_hits)
                .any(|&(r, p)| r == 3 && p >= 16),
            "no prefix hit for request 3"
        );
        // Every prefill ran on pagedkv's kernel the planner picked for the dtype: the
        // multi-warp tensor-core kernel for f16 / bf16 (block 16, head_dim 64).
        let want_kernel = match dtype {
            DType::F32 => PrefillKernel::Simt,
            _ => PrefillKernel::MultiWarp { head_dim: 64 },
        };
        let prefill_steps: Vec<_> = served.steps.iter().filter(|s| s.prefills > 0).collect();
        assert!(!prefill_steps.is_empty());
        for s in prefill_steps {
            assert_eq!(s.prefill_kernel, Some(want_kernel), "{dtype:?} {mode:?}");
        }
        // Every tensor went to pagedkv as a view of candle's storage.
        assert!(engine.copies.borrowed > 0);
        if cfg!(all(target_arch = "x86_64", target_os = "linux")) {
            // glibc's malloc aligns to 16 bytes, so nothing needed the fallback copy.
            assert_eq!(engine.copies.copied, 0);
        }

        let agreement = reference::compare(&served.generated, &want).unwrap();
        let tokens: usize = arrivals.iter().map(|a| a.max_tokens as usize).sum();
        assert_eq!(agreement.compared, tokens);
        let tol = tolerance(dtype);
        assert!(
            agreement.max_relative_error <= tol,
            "{dtype:?} {mode:?}: relative error {:e} > {tol:e}",
            agreement.max_relative_error
        );
        println!(
            "{dtype:?} {mode:?}: {} steps, {} logit vectors, max relative error {:e}, metrics {:?}",
            served.steps.len(),
            agreement.compared,
            agreement.max_relative_error,
            served.metrics
        );
    }
}

/// The logits' relative error (`max |a - b| / max |b|`) allowed when the attention runs
/// in `dtype` and everything else in f32, as in candle's Llama.
///
/// f32: candle's attention and pagedkv's differ only in the order of f32 sums (a few
/// units of f32 rounding, 2^-24, per dot product of 64 terms; 1e-5 leaves room).
///
/// f16 and bf16, with `u` the dtype's unit roundoff (2^-11 and 2^-8): the attention
/// rounds q, K, V, the probabilities P (before `P V` on the tensor cores) and its output
/// to the dtype, five roundings of at most `u` relative each, which to first order bound
/// its output's relative error by `5u` while the scaled scores stay O(1) (they do here:
/// unit-variance q and K over sqrt(head_dim)); the f32 layers after it carry that error
/// to the logits with a gain near 1. `8u` (3.1e-2 for bf16, 3.9e-3 for f16) leaves room
/// for the two layers compounding it; measured: 1.1u and 1.3u.
fn tolerance(dtype: DType) -> f32 {
    match dtype {
        DType::F32 => 1e-5,
        _ => 8.0 * unit_roundoff(dtype),
    }
}

/// Half the distance from 1 to the next value of `dtype`.
fn unit_roundoff(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => 2f32.powi(-11),
        DType::Bf16 => 2f32.powi(-8),
        _ => f32::EPSILON / 2.0,
    }
}
