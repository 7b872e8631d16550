//! A Gemma 3 (sliding-window layers between global ones) served through pagedkv's
//! hybrid cache (a block table per layer group, window groups holding only their
//! window, prefix caching on) gives, at every step, the logits of candle's own Gemma 3
//! run one request at a time, and the same greedy tokens: over hundreds of tokens past
//! the 32-token window, across continuous batching, preemption (by swap, and by
//! recompute, whose prefills hit the blocks the windows released) and a prefix-cache
//! hit that reaches past the window. The attention runs on pagedkv's kernels in f32
//! (blocks of 16). Measured: max relative error 5.4e-7 (swap) and 4.7e-7 (recompute)
//! over 730 logit vectors each.
//!
//! candle's Gemma 3 scales the scores by `1 / sqrt(head_dim)` and has no RoPE scaling,
//! so it cannot check a model whose `query_pre_attn_scalar` is not its `head_dim` or
//! whose global layers scale RoPE (gemma-3-27b: 168 against 128, linear by 8): a
//! Gemma 3 in plain f64 Rust ([`gemma3_f64`], checked against candle's where candle is
//! right) is the reference for those.

mod gemma3_f64;

use candle_transformers::models::gemma3::Model;
use pagedkv::host::DType;
use pagedkv::host::backend::{BackendConfig, CpuBackend};
use pagedkv::host::scheduler::{PreemptionMode, SchedulerConfig};
use pagedkv::host::step::StepShape;
use pagedkv_candle_llama::engine::{Arrival, EngineConfig, serve};
use pagedkv_candle_llama::gemma3::{self, Gemma3Config, LayerKind, PagedGemma3, RopeScaling};
use pagedkv_candle_llama::{Engine, reference, weights, workload};

use gemma3_f64::Spec;

/// An engine serving `model` (of `cfg`) on the CPU backend, f32 attention, blocks of
/// 16 in a pool of `num_blocks`, prefix caching on, preempting by `mode`.
fn engine(
    model: PagedGemma3,
    cfg: &Gemma3Config,
    mode: PreemptionMode,
    num_blocks: u32,
) -> Engine<CpuBackend, PagedGemma3> {
    let groups = model.groups().clone();
    let sched = SchedulerConfig {
        num_blocks,
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
    Engine::on_cpu_with(model, bc, &ec).unwrap()
}

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
    let candle_cfg = cfg.to_candle().unwrap();
    let mut candle = Model::new(false, &candle_cfg, weights::var_builder(w.clone())).unwrap();
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
        let mut engine = engine(model, &cfg, mode, 52);
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

/// [`gemma3::tiny_config`]'s sizes as the f64 reference is told them, with `scale`
/// and the RoPEs (base, factor) of the sliding and of the global layers.
fn tiny_spec(window: usize, scale: f64, local: (f64, f64), global: (f64, f64)) -> Spec {
    Spec {
        hidden: 128,
        intermediate: 256,
        layers: 6,
        heads: 4,
        kv_heads: 2,
        head_dim: 32,
        vocab: 256,
        eps: 1e-6,
        pattern: 3,
        window,
        scale,
        local,
        global,
    }
}

/// The f64 reference is candle's Gemma 3 where candle's is right (`query_pre_attn_scalar`
/// = `head_dim`, no RoPE scaling): the rest of its math (norms, q/k norms, RoPE,
/// windows, GQA, the MLP, tied logits) checked, so that it can be the reference where
/// candle's is wrong.
#[test]
fn the_f64_reference_is_candles_gemma3_where_candle_is_right() {
    let window = 16;
    let cfg = gemma3::tiny_config(window);
    let w = gemma3::random_weights(&cfg, 29).unwrap();
    let mut candle = Model::new(
        false,
        &cfg.to_candle().unwrap(),
        weights::var_builder(w.clone()),
    )
    .unwrap();
    let a = Arrival {
        at: 0,
        id: 0,
        prompt: workload::prompt(7, 40, cfg.vocab_size as u32),
        max_tokens: 12,
    };
    let want = gemma3::generate(&mut candle, &a).unwrap();
    let spec = tiny_spec(window, 32f64.powf(-0.5), (1e4, 1.0), (1e6, 1.0));
    let got = gemma3_f64::follow(&spec, &gemma3_f64::Weights::new(&w), &want);
    let agreement = reference::compare(&[got], &[want]).unwrap();
    assert_eq!(agreement.compared, 12);
    assert!(
        agreement.max_relative_error <= 1e-5,
        "relative error {:e}",
        agreement.max_relative_error
    );
    println!(
        "f64 reference vs candle's Gemma 3: max relative error {:e}",
        agreement.max_relative_error
    );
}

/// gemma-3-27b's attention in the test's small model, in a `config.json` laid out
/// like gemma-3-27b's: `query_pre_attn_scalar` 42 over a `head_dim` of 32 (27b's
/// 168 / 128) and linear RoPE scaling by 8, which Gemma 3 applies to the global layers
/// only (`rope_theta` 1e6; the sliding ones keep `rope_local_base_freq` 1e4, unscaled).
const SMALL_27B: &str = r#"{
  "architectures": ["Gemma3ForConditionalGeneration"],
  "model_type": "gemma3",
  "text_config": {
    "head_dim": 32,
    "hidden_size": 128,
    "intermediate_size": 256,
    "max_position_embeddings": 512,
    "model_type": "gemma3_text",
    "num_attention_heads": 4,
    "num_hidden_layers": 6,
    "num_key_value_heads": 2,
    "query_pre_attn_scalar": 42,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 16,
    "sliding_window_pattern": 3,
    "vocab_size": 256
  }
}"#;

/// Served through pagedkv (continuous batching, the hybrid cache, a preemption), a
/// Gemma 3 whose scores scale by `query_pre_attn_scalar^-0.5` with 42 against a
/// `head_dim` of 32, and whose global layers divide RoPE's positions by 8, gives the
/// f64 reference's logits and greedy tokens at every step. Scaling by
/// `1 / sqrt(head_dim)`, or leaving RoPE unscaled, fails it (checked by hand:
/// docs/candle.md).
#[test]
fn a_scalar_other_than_head_dim_and_linear_rope_scaling_match_the_f64_reference() {
    let cfg = Gemma3Config::from_json(SMALL_27B).unwrap();
    assert_eq!(cfg.query_pre_attn_scalar, 42.0);
    assert_eq!(cfg.global_rope.scaling, RopeScaling::Linear { factor: 8.0 });
    assert_eq!(cfg.local_rope.scaling, RopeScaling::None);
    assert_eq!(cfg.layer_types[2], LayerKind::Full);
    // candle's Gemma 3 would compute another model.
    assert!(cfg.to_candle().is_err());
    let w = gemma3::random_weights(&cfg, 31).unwrap();
    let vocab = cfg.vocab_size as u32;
    let arrivals: Vec<Arrival> = [(0, 50, 24), (0, 30, 30), (3, 70, 16), (6, 20, 28)]
        .into_iter()
        .enumerate()
        .map(|(i, (at, len, max_tokens))| Arrival {
            at,
            id: i as u64,
            prompt: workload::prompt(40 + i as u64, len, vocab),
            max_tokens,
        })
        .collect();
    let model = PagedGemma3::load(weights::var_builder(w.clone()), &cfg).unwrap();
    let mut engine = engine(model, &cfg, PreemptionMode::Recompute, 32);
    let served = serve(&mut engine, &arrivals).unwrap();
    assert!(served.steps.iter().any(|s| s.prefills > 0 && s.decodes > 0));
    assert!(
        served.metrics.preempted_recompute > 0,
        "{:?}",
        served.metrics
    );

    let spec = tiny_spec(16, 42f64.powf(-0.5), (1e4, 1.0), (1e6, 8.0));
    let weights = gemma3_f64::Weights::new(&w);
    let want: Vec<_> = served
        .generated
        .iter()
        .map(|g| gemma3_f64::follow(&spec, &weights, g))
        .collect();
    let agreement = reference::compare(&served.generated, &want).unwrap();
    let tokens: usize = arrivals.iter().map(|a| a.max_tokens as usize).sum();
    assert_eq!(agreement.compared, tokens);
    assert!(
        agreement.max_relative_error <= 1e-5,
        "relative error {:e}",
        agreement.max_relative_error
    );
    println!(
        "gemma3 (scalar 42 / head_dim 32, global RoPE linear x8) vs f64: {} steps, {} logit vectors, max relative error {:e}, metrics {:?}",
        served.steps.len(),
        agreement.compared,
        agreement.max_relative_error,
        served.metrics
    );
}

/// A position from `max_position_embeddings` on is an error, not an unchecked RoPE
/// angle (the RoPE tables it once indexed are computed per step now).
#[test]
fn a_position_past_max_position_embeddings_is_an_error() {
    let mut cfg = gemma3::tiny_config(16);
    cfg.max_position_embeddings = 64;
    let w = gemma3::random_weights(&cfg, 37).unwrap();
    let model = PagedGemma3::load(weights::var_builder(w), &cfg).unwrap();
    let mut engine = engine(model, &cfg, PreemptionMode::Recompute, 32);
    let fits = Arrival {
        at: 0,
        id: 0,
        prompt: workload::prompt(8, 60, cfg.vocab_size as u32),
        max_tokens: 4,
    };
    serve(&mut engine, &[fits]).unwrap();
    let past = Arrival {
        at: 0,
        id: 1,
        prompt: workload::prompt(9, 60, cfg.vocab_size as u32),
        max_tokens: 6,
    };
    let e = serve(&mut engine, &[past]).unwrap_err().to_string();
    assert!(
        e.contains("position 64 past max_position_embeddings 64"),
        "{e}"
    );
}
