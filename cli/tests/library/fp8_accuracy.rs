//! The qualitative facts of docs/fp8.md's accuracy table (`cli/examples/fp8_accuracy.rs`),
//! on small shapes: decode through the real `kv_append` and decode kernels in the
//! emulator against exact f64 attention over the original K/V.
//!
//! * Random data: a 16-bit cache is far more accurate than an fp8 one; e4m3 (3 mantissa
//!   bits) is about twice as accurate as e5m2 (2 bits); the fp8 error is the format's
//!   (bounded below too, so a cache that silently stayed 16-bit fails); the kernels'
//!   own error (against the f64 reference over the stored cache) is small for every
//!   configuration.
//! * An outlier channel in KV head 0: per-head scales leave the other heads exactly as
//!   accurate as without the outlier; at 100x one per-tensor scale costs them next to
//!   nothing (e4m3 still represents them at full precision), at 10^4x it pushes them
//!   into e4m3's subnormals and per-head scales win clearly; e5m2's range covers both.

use pagedkv::host::DType::{self, Bf16, E4m3, E5m2, F16};
use pagedkv::host::emulator::Emulator;
use pagedkv_cli::accuracy::{CONFIGS, Config, Data, Errors, Problem, Scaling, Setup, measure};

fn setup() -> Setup {
    Setup {
        head_dim: 64,
        num_kv_heads: 2,
        group: 2,
        block_size: 16,
        context_lens: vec![300, 237],
        seed: 7,
    }
}

/// Every configuration of the table on `data`.
fn table(data: Data) -> Vec<(Config, Errors)> {
    let problem = Problem::generate(&setup(), data);
    let emu = Emulator::new();
    CONFIGS
        .iter()
        .map(|&c| (c, measure(&emu, &problem, c).unwrap()))
        .collect()
}

fn find(t: &[(Config, Errors)], q: DType, cache: DType, scaling: Scaling) -> Errors {
    t.iter()
        .find(|(c, _)| *c == Config { q, cache, scaling })
        .unwrap()
        .1
}

#[test]
fn fp8_accuracy_on_random_data() {
    let t = table(Data::Random);
    for (c, e) in &t {
        // The kernels against the f64 reference over the cache as stored.
        assert!(e.kernel_rel_l2 <= 1e-2, "{c}: kernel {:e}", e.kernel_rel_l2);
        assert!(e.max_abs.is_finite(), "{c}: max abs {}", e.max_abs);
    }
    let f16 = find(&t, F16, F16, Scaling::None).rel_l2;
    let bf16 = find(&t, Bf16, Bf16, Scaling::None).rel_l2;
    assert!(f16 < 2e-3 && f16 < bf16, "f16 {f16:e}, bf16 {bf16:e}");
    assert!(bf16 < 1e-2, "bf16 {bf16:e}");
    for q in [F16, Bf16] {
        for scaling in [Scaling::PerHead, Scaling::PerTensor] {
            let e4 = find(&t, q, E4m3, scaling).rel_l2;
            let e5 = find(&t, q, E5m2, scaling).rel_l2;
            // e4m3's per-element rounding (rms ~2.6% relative) on K and on V.
            assert!((2e-2..6e-2).contains(&e4), "{q} q, e4m3: {e4:e}");
            assert!(e4 > 5.0 * bf16, "{q} q: e4m3 {e4:e} vs bf16 {bf16:e}");
            // One mantissa bit fewer: twice the error.
            assert!(
                (1.5..2.7).contains(&(e5 / e4)),
                "{q} q: e5m2 {e5:e} vs e4m3 {e4:e}"
            );
        }
    }
}

#[test]
fn per_head_scales_protect_the_heads_without_outliers() {
    let random = table(Data::Random);
    for factor in [100.0, 1e4] {
        let t = table(Data::Outliers { factor });
        for (c, e) in &t {
            assert!(
                e.kernel_rel_l2 <= 1e-2,
                "{factor}x, {c}: kernel {:e}",
                e.kernel_rel_l2
            );
        }
        for q in [F16, Bf16] {
            for cache in [E4m3, E5m2] {
                let clean = find(&random, q, cache, Scaling::PerHead).rel_l2_other_heads;
                let head = find(&t, q, cache, Scaling::PerHead).rel_l2_other_heads;
                let tensor = find(&t, q, cache, Scaling::PerTensor).rel_l2_other_heads;
                let what =
                    format!("{factor}x, {q} q, {cache}: per head {head:e}, per tensor {tensor:e}");
                // Per-head scales: the other heads' data and scales are untouched.
                assert_eq!(head, clean, "{what}");
                let wide = cache == E5m2 || factor <= 100.0;
                if wide {
                    // The scaled values stay in the format's normal range: only where
                    // they round changes.
                    assert!((tensor / head - 1.0).abs() < 0.1, "{what}");
                } else {
                    assert!(tensor > 1.4 * head, "{what}");
                }
            }
        }
    }
}
