//! A Gemma 3 (sliding-window layers between global ones) served through pagedkv's
//! hybrid cache (a block table per layer group, window groups holding only their
//! window, prefix caching on) gives, at every step, the logits of candle's own Gemma 3
//! run one request at a time, and the same greedy tokens: over hundreds of tokens past
//! the 32-token window, across continuous batching, preemption (by swap, and by
//! recompute, whose prefills hit the blocks the windows released) and a prefix-cache
//! hit that reaches past the window. The attention runs on pagedkv's kernels in f32
//! (blocks of 16). Measured: max relative error 5.4e-7 (swap) and 4.7e-7 (recompute)
//! over 730 logit vectors each.

use candle_transformers::models::gemma3::Model;
use pagedkv::host::DType;
use pagedkv::host::backend::BackendConfig;
use pagedkv::host::scheduler::{PreemptionMode, SchedulerConfig};
use pagedkv::host::step::StepShape;
use pagedkv_candle_llama::engine::{Arrival, EngineConfig, serve};
use pagedkv_candle_llama::gemma3::{self, PagedGemma3};
use pagedkv_candle_llama::{Engine, reference, weights, workload};

#[test]
fn every_steps_logits_match_candles_own_gemma3_past_the_window() {
    let window = 32;
    let cfg = gemma3::tiny_config(window);
    let w = gemma3::random_weights(&cfg, 23).unwrap();
    let vocab = cfg.vocab_size as u32;
    // Request 2 begins with request 0's first 64 tokens (four blocks, twice the
    // window): a hit the window groups serve from blocks 2 and 3.
    let first = workload::prompt(1, 70, vocab);
    let mut shared = first[..64].to_vec();
    shared.extend(workload::prompt(3, 26, vocab));
    let arrivals = vec![
        Arrival {
            at: 0,
            id: 0,
            prompt: first,
            max_tokens: 200,
        },
        Arrival {
            at: 0,
            id: 1,
            prompt: workload::prompt(2, 40, vocab),
            max_tokens: 150,
        },
        Arrival {
            at: 5,
            id: 2,
            prompt: shared,
            max_tokens: 60,
        },
        Arrival {
            at: 10,
            id: 3,
            prompt: workload::prompt(4, 20, vocab),
            max_tokens: 100,
        },
        Arrival {
            at: 20,
            id: 4,
            prompt: workload::prompt(5, 50, vocab),
            max_tokens: 120,
        },
        Arrival {
            at: 30,
            id: 5,
            prompt: workload::prompt(6, 30, vocab),
            max_tokens: 100,
        },
    ];
    let mut candle = Model::new(false, &cfg, weights::var_builder(w.clone())).unwrap();
    let mut want: Vec<_> = arrivals
        .iter()
        .map(|a| gemma3::generate(&mut candle, a).unwrap())
        .collect();
    want.sort_by_key(|g| g.request);

    for mode in [PreemptionMode::Swap, PreemptionMode::Recompute] {
        let model = PagedGemma3::load(weights::var_builder(w.clone()), &cfg).unwrap();
        let groups = model.groups().clone();
        // 4 window layers and 2 global ones: 3 groups of 2 layers over 2 K/V tensors.
        assert_eq!((groups.specs().len(), groups.layers_per_group()), (3, 2));
        let sched = SchedulerConfig {
            num_blocks: 52,
            block_size: 16,
            num_host_blocks: 64,
            max_num_seqs: 8,
            max_tokens_per_step: 512,
            max_model_len: 512,
            watermark: 0.0,
            preemption: mode,
            enable_prefix_caching: true,
            kv_groups: groups.specs().to_vec(),
            ..SchedulerConfig::default()
        };
        let shape = StepShape {
            num_q_heads: cfg.num_attention_heads as u32,
            num_kv_heads: cfg.num_key_value_heads as u32,
            head_dim: cfg.head_dim as u32,
            block_size: sched.block_size,
            num_blocks: sched.num_blocks,
            dtype: DType::F32,
            kv_dtype: DType::F32,
        };
        let mut bc = BackendConfig::for_groups(shape, &groups, 8, 512 / 16);
        bc.num_host_blocks = sched.num_host_blocks;
        let ec = EngineConfig {
            scheduler: sched,
            emulator_workers: 0,
            dtype: DType::F32,
        };
        let mut engine = Engine::on_cpu_with(model, bc, &ec).unwrap();
        let served = serve(&mut engine, &arrivals).unwrap();

        // Continuous batching, a preemption in the mode asked (a swap out and back in),
        // and request 2's hit past the window.
        assert!(served.steps.iter().any(|s| s.prefills > 0 && s.decodes > 0));
        match mode {
            PreemptionMode::Swap => {
                assert!(served.metrics.preempted_swap > 0, "{:?}", served.metrics);
                assert!(
                    served.steps.iter().any(|s| s.swapped.1 > 0),
                    "never swapped in"
                );
            }
            PreemptionMode::Recompute => {
                assert!(
                    served.metrics.preempted_recompute > 0,
                    "{:?}",
                    served.metrics
                )
            }
        }
        assert!(
            served
                .steps
                .iter()
                .flat_map(|s| &s.prefix_hits)
                .any(|&(r, p)| r == 2 && p == 64),
            "no 64-token hit for request 2: {:?}",
            served.metrics
        );
        let agreement = reference::compare(&served.generated, &want).unwrap();
        let tokens: usize = arrivals.iter().map(|a| a.max_tokens as usize).sum();
        assert_eq!(agreement.compared, tokens);
        assert!(
            agreement.max_relative_error <= 1e-5,
            "relative error {:e}",
            agreement.max_relative_error
        );
        println!(
            "gemma3 {mode:?}: {} steps, {} logit vectors, max relative error {:e}, metrics {:?}",
            served.steps.len(),
            agreement.compared,
            agreement.max_relative_error,
            served.metrics
        );
    }
}
