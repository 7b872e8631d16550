//! A candle Llama served through pagedkv (scheduler, paged cache, kernels in the
//! emulator) gives, at every step, the logits of candle's own Llama run one request at
//! a time with its own KV cache, and the same greedy tokens: across continuous
//! batching, a forced preemption (recompute and swap) and a prefix-cache hit. The
//! attention (decode and prefill) runs on pagedkv's kernels in f32 (blocks of 8), and
//! in bf16 and f16 on the tensor-core kernels (blocks of 16: the multi-warp prefill),
//! within a tolerance derived from the dtype and the model ([`tolerance`]), which a 1 %
//! error in the attention's scale exceeds
//! ([`a_one_percent_attention_scale_error_exceeds_the_bound`]).

use candle_core::Tensor;
use candle_transformers::models::llama::{Config, Llama};
use pagedkv::host::DType;
use pagedkv::host::backend::PagedCache;
use pagedkv::host::ops::attention::AttentionOptions;
use pagedkv::host::ops::prefill::PrefillKernel;
use pagedkv::host::scheduler::{Batch, PreemptionMode};

/// (attention dtype, block size, preemption mode) of each run.
const RUNS: [(DType, u32, PreemptionMode); 6] = [
    (DType::F32, 8, PreemptionMode::Recompute),
    (DType::F32, 8, PreemptionMode::Swap),
    (DType::Bf16, 16, PreemptionMode::Recompute),
    (DType::Bf16, 16, PreemptionMode::Swap),
    (DType::F16, 16, PreemptionMode::Recompute),
    (DType::F16, 16, PreemptionMode::Swap),
];
use pagedkv_candle_llama::engine::{EngineConfig, backend_config, serve};
use pagedkv_candle_llama::{
    CandleBackend, Copies, Engine, PagedLlama, PagedModel, reference, weights, workload,
};

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
        let tol = tolerance(dtype, &cfg, tokens);
        assert!(
            agreement.max_relative_error <= tol,
            "{dtype:?} {mode:?}: relative error {:e} > {tol:e}",
            agreement.max_relative_error
        );
        println!(
            "{dtype:?} {mode:?}: {} steps, {} logit vectors, max relative error {:e} ({:.2}u, bound {tol:e}), metrics {:?}",
            served.steps.len(),
            agreement.compared,
            agreement.max_relative_error,
            agreement.max_relative_error / unit_roundoff(dtype),
            served.metrics
        );
    }
}

/// The logits' relative error (`max |a - b| / max |b|`) allowed when the attention runs
/// in `dtype` and everything else in f32, as in candle's Llama, for the model `cfg`
/// over `compared` logit vectors.
///
/// f32: candle's attention and pagedkv's differ only in the order of f32 sums (a few
/// units of f32 rounding, 2^-24, per dot product of 64 terms; 1e-5 leaves room).
///
/// f16 and bf16, from the dtype's unit roundoff `u` (2^-11, 2^-8) and the model's
/// depth and size, an estimate of what the dtype's roundings do (the probabilistic
/// model of rounding errors, as in Higham and Mary, "A new approach to probabilistic
/// rounding error analysis", 2019):
/// * A rounding to nearest of `x` errs by `x δ` with `|δ| ≤ u`; the `δ` are taken as
///   independent and mean zero, each uniform over its value's half-ulp, so of variance
///   at most `u²/3`.
/// * The attention rounds five times on its path: q, K, V, the probabilities P (before
///   `P V` on the tensor cores) and its output; the kernels sum in f32. To first
///   order, each rounding perturbs the output `o = Σ_j p_j v_j` by a relative rms of at
///   most `u/√3`: the output's own exactly; V's and P's through `Σ_j p_j v_j δ_j`, whose
///   rms relative to `o`'s is 1 when V's rows are uncorrelated (random weights); q's and
///   K's through score errors of `u/√3` relative to scores that stay O(1) (unit-variance
///   q and K over `sqrt(head_dim)`). Independent, the five add in quadrature: `√(5/3) u`.
///   Neither `head_dim` nor the context length enters.
/// * The layers round independently, and the f32 network after an attention carries a
///   relative perturbation of its output to the logits with a gain of at most about 1
///   (the residual adds it to a stream at least as large, the RMS norms are scale-free,
///   the random projections keep relative rms): each logit errs by an rms of
///   `σ = √(5 layers / 3) u` times the logits' rms.
/// * The metric is the largest error over all `compared × vocab` logits, about
///   `√(2 ln(compared vocab)) σ` for errors of Gaussian tails, over a vector's largest
///   logit, about `√(2 ln vocab)` times their rms.
///
/// Hence `√(ln(compared vocab) / ln vocab) · √(5 layers / 3) · u`: for the test's 2
/// layers and 52 vectors of 256 logits, `2.39u` (9.3e-3 for bf16, 1.2e-3 for f16).
/// Measured: 1.1u (bf16) and 1.3u (f16). A 1 % error in the attention's scale is no
/// rounding's and gives 2.9u in bf16: it fails the bound (the former one, `8u`, five
/// roundings added in the worst case and room for the layers compounding them, let it
/// pass).
fn tolerance(dtype: DType, cfg: &Config, compared: usize) -> f32 {
    if dtype == DType::F32 {
        return 1e-5;
    }
    let roundings = 5.0;
    let layers = cfg.num_hidden_layers as f64;
    let vocab = cfg.vocab_size as f64;
    let logits = compared as f64 * vocab;
    let per_logit = (roundings * layers / 3.0).sqrt();
    let extremes = (logits.ln() / vocab.ln()).sqrt();
    (extremes * per_logit * unit_roundoff(dtype) as f64) as f32
}

/// Half the distance from 1 to the next value of `dtype`.
fn unit_roundoff(dtype: DType) -> f32 {
    match dtype {
        DType::F16 => 2f32.powi(-11),
        DType::Bf16 => 2f32.powi(-8),
        _ => f32::EPSILON / 2.0,
    }
}

/// The largest relative error of `got`'s logits against `want`'s, request by request,
/// up to and including each request's first token that differs (after it the two
/// continue different sequences), how many logit vectors that compared, and whether
/// any token differed.
fn error_until_divergence(
    got: &[pagedkv_candle_llama::Generated],
    want: &[pagedkv_candle_llama::Generated],
) -> (f32, usize, bool) {
    assert_eq!(got.len(), want.len());
    let (mut error, mut compared, mut diverged) = (0f32, 0, false);
    for (g, w) in got.iter().zip(want) {
        assert_eq!((g.request, &g.prompt), (w.request, &w.prompt));
        for i in 0..g.tokens.len().min(w.tokens.len()) {
            error = error.max(reference::relative_error(&g.logits[i], &w.logits[i]));
            compared += 1;
            if g.tokens[i] != w.tokens[i] {
                diverged = true;
                break;
            }
        }
    }
    (error, compared, diverged)
}

/// [`PagedLlama`] whose attention scales its scores by `factor` times the right scale:
/// an injected error.
struct Miscaled(PagedLlama, f32);

impl PagedModel for Miscaled {
    fn num_tensors(&self) -> usize {
        self.0.num_layers()
    }

    fn forward<B: CandleBackend>(
        &self,
        be: &mut B,
        cache: &mut PagedCache<B::Tensor>,
        batch: &Batch,
        tokens: &[u32],
        opts: &AttentionOptions,
        copies: &mut Copies,
    ) -> pagedkv_candle_llama::Result<Tensor> {
        let opts = AttentionOptions {
            scale: opts.scale * self.1,
            ..opts.clone()
        };
        self.0.forward(be, cache, batch, tokens, &opts, copies)
    }
}

/// The bound of [`tolerance`] is tight enough to catch a 1 % error in the attention's
/// score scale, both ways, in bf16 (the coarser dtype) and f16: the same runs as
/// above, but for the scale, give logits farther from candle's than the bound (up to
/// a request's first greedy token that differs, when one does: the 0.99 one in bf16
/// changes one).
#[test]
fn a_one_percent_attention_scale_error_exceeds_the_bound() {
    let cfg = weights::tiny();
    let w = weights::random(&cfg, 17).unwrap();
    let llama = Llama::load(weights::var_builder(w.clone()), &cfg).unwrap();
    let arrivals = workload::mixed(cfg.vocab_size as u32);
    let want = reference::generate_all(&llama, &cfg, &arrivals).unwrap();
    let tokens: usize = arrivals.iter().map(|a| a.max_tokens as usize).sum();
    for (dtype, factor) in [(DType::Bf16, 1.01), (DType::Bf16, 0.99), (DType::F16, 1.01)] {
        let model = PagedLlama::load(weights::var_builder(w.clone()), &cfg).unwrap();
        let ec = EngineConfig {
            scheduler: workload::tight(PreemptionMode::Recompute, 16),
            emulator_workers: 0,
            dtype,
        };
        let bc = backend_config(&cfg, &ec.scheduler, dtype).unwrap();
        let mut engine = Engine::on_cpu_with(Miscaled(model, factor), bc, &ec).unwrap();
        let served = serve(&mut engine, &arrivals).unwrap();
        let (error, compared, diverged) = error_until_divergence(&served.generated, &want);
        let tol = tolerance(dtype, &cfg, tokens);
        println!(
            "{dtype:?}, scale x{factor}: max relative error {error:e} ({:.2}u) over {compared} logit vectors, bound {tol:e} ({:.2}u); greedy tokens diverged: {diverged}",
            error / unit_roundoff(dtype),
            tol / unit_roundoff(dtype)
        );
        assert!(
            error > tol,
            "{dtype:?}, scale x{factor}: relative error {error:e} within the bound {tol:e}"
        );
    }
}
