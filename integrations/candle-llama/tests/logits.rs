//! A candle Llama served through pagedkv (scheduler, paged cache, kernels in the
//! emulator) gives, at every step, the logits of candle's own Llama run one request at
//! a time with its own KV cache, and the same greedy tokens: across continuous
//! batching, a forced preemption (recompute and swap) and a prefix-cache hit.

use candle_transformers::models::llama::Llama;
use pagedkv::host::scheduler::PreemptionMode;
use pagedkv_candle_llama::engine::{EngineConfig, serve};
use pagedkv_candle_llama::{Engine, PagedLlama, reference, weights, workload};

#[test]
fn every_steps_logits_match_candles_own_llama() {
    let cfg = weights::tiny();
    let w = weights::random(&cfg, 17).unwrap();
    let llama = Llama::load(weights::var_builder(w.clone()), &cfg).unwrap();
    let arrivals = workload::mixed(cfg.vocab_size as u32);
    let want = reference::generate_all(&llama, &cfg, &arrivals).unwrap();

    for mode in [PreemptionMode::Recompute, PreemptionMode::Swap] {
        let model = PagedLlama::load(weights::var_builder(w.clone()), &cfg).unwrap();
        let ec = EngineConfig {
            scheduler: workload::tight(mode),
            emulator_workers: 0,
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
        // Every tensor went to pagedkv as a view of candle's storage.
        assert!(engine.copies.borrowed > 0);
        if cfg!(all(target_arch = "x86_64", target_os = "linux")) {
            // glibc's malloc aligns to 16 bytes, so nothing needed the fallback copy.
            assert_eq!(engine.copies.copied, 0);
        }

        let agreement = reference::compare(&served.generated, &want).unwrap();
        let tokens: usize = arrivals.iter().map(|a| a.max_tokens as usize).sum();
        assert_eq!(agreement.compared, tokens);
        assert!(
            agreement.max_relative_error <= 1e-5,
            "{mode:?}: relative error {:e}",
            agreement.max_relative_error
        );
        println!(
            "{mode:?}: {} steps, {} logit vectors, max relative error {:e}, metrics {:?}",
            served.steps.len(),
            agreement.compared,
            agreement.max_relative_error,
            served.metrics
        );
    }
}
