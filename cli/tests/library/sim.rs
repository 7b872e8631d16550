//! The simulator's parts: workload statistics, the contiguous allocator's limits, the
//! step-time model, and paged memory use.

use pagedkv_cli::sim::{
    GpuSpec, KvDtype, KvFootprint, ModelSpec, Policy, RequestKv, SimConfig, Workload, WorkloadKind,
    binary_size, run_scenario, run_scenario_kv_dtypes, simulate,
};

fn a100_opt13b() -> SimConfig {
    SimConfig::new(
        GpuSpec::preset("a100-40gb").unwrap(),
        ModelSpec::preset("opt-13b").unwrap(),
    )
}

#[test]
fn synthetic_lengths_match_the_papers_means_and_arrivals_the_rate() {
    for (kind, rate) in [(WorkloadKind::ShareGpt, 2.0), (WorkloadKind::Alpaca, 30.0)] {
        let w = Workload::synthetic(kind, rate, 40_000, 2048, 1).unwrap();
        let n = w.requests.len() as f64;
        let (mp, mo) = kind.means();
        let p = w.requests.iter().map(|r| r.prompt_len as f64).sum::<f64>() / n;
        let o = w.requests.iter().map(|r| r.output_len as f64).sum::<f64>() / n;
        assert!(
            (p / mp - 1.0).abs() < 0.05,
            "{kind:?} prompt mean {p} vs {mp}"
        );
        assert!(
            (o / mo - 1.0).abs() < 0.05,
            "{kind:?} output mean {o} vs {mo}"
        );
        assert!(w.requests.iter().all(|r| r.prompt_len >= 1
            && r.output_len >= 1
            && r.prompt_len + r.output_len <= 2048));
        let span = w.requests.last().unwrap().arrival_s;
        assert!(
            (n / span / rate - 1.0).abs() < 0.05,
            "{kind:?}: {} req/s",
            n / span
        );
    }
}

#[test]
fn the_kv_budget_matches_the_papers_a100_figure() {
    // Paper, Table 1: about 12 GB of KV cache, about 15.7K token slots for OPT-13B.
    let c = a100_opt13b();
    assert_eq!(c.model.kv_bytes_per_token(), 800 * 1024);
    let slots = c.capacity_tokens().unwrap();
    assert!((14_500..16_500).contains(&slots), "{slots}");
}

#[test]
fn step_time_grows_with_kv_read_and_is_bounded_below_by_the_weights() {
    let c = a100_opt13b();
    let floor = c.model.weight_bytes() / (c.gpu.bandwidth_gbs * 1e9);
    assert!(c.step_time(1, 0) > floor);
    assert!(c.step_time(32, 10_000) > c.step_time(32, 1_000));
}

#[test]
fn max_reservation_caps_the_batch_and_paged_memory_holds_tokens() {
    let c = a100_opt13b();
    let w = Workload::synthetic(WorkloadKind::ShareGpt, 2.0, 600, 2048, 3).unwrap();
    let max = simulate(Policy::Max, &w, &c, &mut || {}).unwrap();
    let cap = c.capacity_tokens().unwrap() / 2048;
    assert!(max.p99_batch <= cap as f64, "{} > {cap}", max.p99_batch);
    assert_eq!(max.completed, 600);
    let paged = simulate(Policy::Paged(16), &w, &c, &mut || {}).unwrap();
    assert_eq!(paged.completed, 600);
    assert!(
        paged.tokens_per_reserved >= 0.95,
        "{}",
        paged.tokens_per_reserved
    );
    assert!(paged.mean_batch > 2.0 * max.mean_batch);
    let s = paged.split;
    let total = s.token_states + s.reserved_future + s.internal_fragmentation + s.external_and_free;
    assert!((total - 1.0).abs() < 1e-9, "{total}");
}

#[test]
fn kv_footprint_of_the_presets_is_the_product_of_their_shapes() {
    // Published shapes: layers, KV heads (head dim 128, 16-bit cache).
    for (name, layers, kv_heads) in [
        ("opt-13b", 40u64, 40u64),
        ("llama-3-8b", 32, 8),
        ("llama-3-70b", 80, 8),
    ] {
        let m = ModelSpec::preset(name).unwrap();
        let k = KvFootprint::of(&m).unwrap();
        let per_token = 2 * layers * kv_heads * 128 * 2;
        assert_eq!(k.bytes_per_token, per_token, "{name}");
        assert_eq!(
            k.per_request,
            vec![
                RequestKv {
                    tokens: 2048,
                    bytes: 2048 * per_token
                },
                RequestKv {
                    tokens: 8192,
                    bytes: 8192 * per_token
                },
            ],
            "{name}"
        );
        // Hundreds of MB to a few GiB per request of thousands of tokens.
        assert!(k.per_request[0].bytes >= 256 << 20, "{name}");
        assert!(k.per_request[1].bytes <= 8 << 30, "{name}");
    }
}

#[test]
fn kv_footprint_overflow_is_an_error_not_a_wrapped_number() {
    let mut m = ModelSpec::preset("llama-3-8b").unwrap();
    // 2 x 2^20 x 2^20 x 2^10 x 2^8 = 2^59 bytes a token fits; 2048 tokens of it do not.
    (m.num_layers, m.num_kv_heads, m.head_dim, m.dtype_bytes) = (1 << 20, 1 << 20, 1 << 10, 1 << 8);
    assert_eq!(m.checked_kv_bytes_per_token(), Some(1 << 59));
    let e = KvFootprint::of(&m).unwrap_err().to_string();
    assert!(e.contains("2048 tokens") && e.contains("overflows"), "{e}");
    m.dtype_bytes = u32::MAX;
    assert!(KvFootprint::of(&m).is_err());
}

#[test]
fn binary_sizes_read_as_people_write_them() {
    assert_eq!(binary_size(0), "0 B");
    assert_eq!(binary_size(1023), "1023 B");
    assert_eq!(binary_size(800 << 10), "800 KiB");
    assert_eq!(binary_size(256 << 20), "256 MiB");
    assert_eq!(binary_size(1600 << 20), "1.56 GiB");
    assert_eq!(binary_size(25 << 28), "6.25 GiB");
    assert_eq!(binary_size(u64::MAX), "16.0 EiB");
}

fn with_fp8(c: &SimConfig) -> SimConfig {
    let mut c = c.clone();
    c.kv_dtype = KvDtype::Fp8;
    c
}

#[test]
fn an_fp8_cache_holds_twice_the_token_slots_of_f16_in_the_same_budget() {
    // OPT-13B: 2 x 40 layers x 40 KV heads x 128 elements, 2 bytes (f16) or 1 (fp8).
    let (f16_bytes, fp8_bytes) = (2u64 * 40 * 40 * 128 * 2, 2u64 * 40 * 40 * 128);
    let mut c = a100_opt13b();
    c.kv_budget_gib = Some(10.0);
    let budget = 10u64 << 30;
    let (f16, fp8) = (budget / f16_bytes, budget / fp8_bytes);
    assert_eq!((f16, fp8), (13107, 26214));
    assert_eq!(c.capacity_tokens().unwrap(), f16);
    assert_eq!(with_fp8(&c).capacity_tokens().unwrap(), fp8);
    assert_eq!(fp8, 2 * f16);
    assert_eq!(with_fp8(&c).kv_bytes_per_token(), fp8_bytes);
    // The default budget (90% of 40 GiB minus 26 GB of weights) is no whole number of
    // f16 tokens: fp8 gets the floor of twice the fraction, one slot more than 2x here.
    let c = a100_opt13b();
    let budget = 0.9 * 40.0 * (1u64 << 30) as f64 - 13e9 * 2.0;
    let f16 = (budget / f16_bytes as f64).floor() as u64;
    let fp8 = (budget / fp8_bytes as f64).floor() as u64;
    assert_eq!((f16, fp8), (15447, 30895));
    assert_eq!(c.capacity_tokens().unwrap(), f16);
    assert_eq!(with_fp8(&c).capacity_tokens().unwrap(), fp8);
    assert!(fp8 == 2 * f16 || fp8 == 2 * f16 + 1);
}

#[test]
fn an_fp8_cache_halves_the_kv_bytes_a_step_reads_not_the_weights() {
    let c = a100_opt13b();
    let f = with_fp8(&c);
    let bw = c.gpu.bandwidth_gbs * 1e9 * c.bandwidth_efficiency;
    // One token, so memory bound: the difference is exactly half the KV bytes' time.
    let kv = 10_000u64;
    let saved = c.step_time(1, kv) - f.step_time(1, kv);
    let want = kv as f64 * (2 * 40 * 40 * 128) as f64 / bw;
    assert!((saved - want).abs() < 1e-12, "{saved} vs {want}");
    assert_eq!(c.step_time(1, 0), f.step_time(1, 0));
}

#[test]
fn kv_dtype_values_parse_and_unknown_ones_name_the_flag() {
    assert_eq!(KvDtype::parse("f16").unwrap(), KvDtype::F16);
    for v in ["fp8", "e4m3", "e5m2"] {
        assert_eq!(KvDtype::parse(v).unwrap(), KvDtype::Fp8);
    }
    for v in ["", "FP8", "bf8", "int8"] {
        let e = KvDtype::parse(v).unwrap_err().to_string();
        assert!(
            e.starts_with("--kv-dtype: ") && e.contains(&format!("`{v}`")),
            "{e}"
        );
    }
}

#[test]
fn the_fp8_comparison_puts_both_dtypes_side_by_side() {
    let c = a100_opt13b();
    // The default ShareGPT scenario (2 req/s): arrivals bind the paged policy, so fp8's
    // shorter steps keep its throughput and shrink its mean batch (requests finish
    // sooner); the contiguous Max policy, memory bound, doubles its batch.
    let w = Workload::synthetic(WorkloadKind::ShareGpt, 2.0, 2000, 2048, 0).unwrap();
    let kr = Some((WorkloadKind::ShareGpt, 2.0));
    let r = run_scenario_kv_dtypes(&w, kr, &c, &Policy::ALL, KvDtype::Fp8, &mut || {}).unwrap();
    let cmp = r.kv_dtype_comparison.as_ref().unwrap();
    assert_eq!(
        (cmp.baseline_dtype.as_str(), cmp.kv_dtype.as_str()),
        ("f16", "fp8")
    );
    assert_eq!(
        (r.kv_capacity_tokens, cmp.kv_capacity_tokens),
        (15447, 30895)
    );
    assert_eq!(
        cmp.kv_footprint.bytes_per_token * 2,
        r.kv_footprint.bytes_per_token
    );
    assert_eq!(cmp.rows.len(), Policy::ALL.len());
    for (row, p) in cmp.rows.iter().zip(&r.policies) {
        assert_eq!(row.baseline_mean_batch, p.result.mean_batch);
        assert_eq!(row.baseline_tokens_per_s, p.result.tokens_per_s);
        assert!(
            row.tokens_per_s >= row.baseline_tokens_per_s,
            "{}: fp8 {} tok/s < f16 {}",
            row.policy,
            row.tokens_per_s,
            row.baseline_tokens_per_s
        );
    }
    let max = &cmp.rows[0];
    assert_eq!(max.policy, "contiguous Max");
    assert!(max.batch_ratio.unwrap() > 1.9, "{max:?}");
    // The same run without the flag's fp8: no comparison, the same main figures.
    let plain = run_scenario(&w, kr, &c, &Policy::ALL, &mut || {}).unwrap();
    assert_eq!(plain.kv_dtype_comparison, None);
    assert_eq!(plain.policies, r.policies);
    // Memory bound (ShareGPT at 8 req/s): fp8's paged batch is the larger one.
    let w = Workload::synthetic(WorkloadKind::ShareGpt, 8.0, 1000, 2048, 0).unwrap();
    let kr = Some((WorkloadKind::ShareGpt, 8.0));
    let paged = [Policy::Paged(16)];
    let r = run_scenario_kv_dtypes(&w, kr, &c, &paged, KvDtype::Fp8, &mut || {}).unwrap();
    let row = &r.kv_dtype_comparison.unwrap().rows[0];
    assert!(row.mean_batch > 1.5 * row.baseline_mean_batch, "{row:?}");
    assert!(
        row.tokens_per_s > 1.5 * row.baseline_tokens_per_s,
        "{row:?}"
    );
}

/// The hybrid presets carry their published layer patterns: Gemma 3 a global layer
/// every sixth (1024- and 512-token windows), gpt-oss alternating a 128-token window
/// with full attention, its weights stored at about 61 GiB (MXFP4 experts).
#[test]
fn the_hybrid_presets_follow_their_published_layer_patterns() {
    let full_layers = |m: &ModelSpec| -> Vec<usize> {
        (0..m.num_layers as usize)
            .filter(|&l| m.layer_windows[l] == 0)
            .collect()
    };
    let g27 = ModelSpec::preset("gemma-3-27b").unwrap();
    assert_eq!(
        (g27.num_layers, g27.num_kv_heads, g27.head_dim),
        (62, 16, 128)
    );
    assert_eq!(full_layers(&g27), (5..62).step_by(6).collect::<Vec<_>>());
    assert!(g27.layer_windows.iter().all(|&w| w == 0 || w == 1024));
    let g1 = ModelSpec::preset("gemma-3-1b").unwrap();
    assert_eq!((g1.num_layers, g1.num_kv_heads, g1.head_dim), (26, 1, 256));
    assert_eq!(full_layers(&g1), vec![5, 11, 17, 23]);
    assert!(g1.layer_windows.iter().all(|&w| w == 0 || w == 512));
    let oss = ModelSpec::preset("gpt-oss-120b").unwrap();
    assert_eq!(
        (oss.num_layers, oss.num_kv_heads, oss.head_dim),
        (36, 8, 64)
    );
    assert_eq!(full_layers(&oss), (1..36).step_by(2).collect::<Vec<_>>());
    assert_eq!(oss.weight_bytes(), 61.0 * (1u64 << 30) as f64);
    for m in [&g27, &g1, &oss] {
        assert!(m.is_hybrid() && m.check().is_ok(), "{}", m.name);
        assert!(!m.all_full().is_hybrid());
    }
    // A model file says the same per layer; a list of the wrong length is an error.
    let json = r#"{"name": "tiny-hybrid", "num_layers": 4, "num_kv_heads": 2, "head_dim": 64,
        "num_params": 1e9, "dtype_bytes": 2, "max_model_len": 4096,
        "layer_windows": [128, 0, 128, 0], "stored_weight_bytes": 5e8}"#;
    let m = ModelSpec::from_json_str(json).unwrap();
    assert!(m.is_hybrid());
    assert_eq!(m.weight_bytes(), 5e8);
    let bad = json.replace("[128, 0, 128, 0]", "[128, 0]");
    let e = ModelSpec::from_json_str(&bad).unwrap_err();
    assert!(e.0.contains("layer_windows"), "{e}");
}

/// Gemma 3 27B on an H100: a 32k-token request keeps 10 full layers' 32768 tokens and
/// 52 window layers' 1024 (8 KiB a token a layer): 2.9 GiB, against 15.5 GiB with
/// every layer full, so seven fit where one did. Requests of 3000 tokens arriving at
/// once are memory bound: the hybrid allocator runs more of them at a time.
#[test]
fn the_hybrid_allocator_holds_each_window_layers_window() {
    let c = SimConfig::new(
        GpuSpec::preset("h100").unwrap(),
        ModelSpec::preset("gemma-3-27b").unwrap(),
    );
    let layer = 2 * 16 * 128 * 2u64;
    let w = Workload {
        requests: (0..40)
            .map(|i| pagedkv_cli::sim::TraceRequest {
                arrival_s: i as f64 * 1e-3,
                prompt_len: 3000,
                output_len: 200,
            })
            .collect(),
        description: "40 requests of 3000 + 200 tokens at once".into(),
    };
    let r = run_scenario(&w, None, &c, &Policy::ALL, &mut || {}).unwrap();
    let h = r.hybrid.as_ref().expect("a hybrid model's report compares");
    assert_eq!((h.window_layers, h.full_layers), (52, 10));
    assert_eq!((h.layer_groups, h.layers_per_group), (7, 10));
    let at_32k = h.requests.iter().find(|q| q.tokens == 32_768).unwrap();
    assert_eq!(at_32k.hybrid_bytes, (10 * 32_768 + 52 * 1024) * layer);
    assert_eq!(at_32k.all_full_bytes, 62 * 32_768 * layer);
    assert!(at_32k.hybrid_fit >= 6 * at_32k.all_full_fit, "{at_32k:?}");
    assert_eq!(h.rows.len(), 3);
    for row in &h.rows {
        assert!(
            row.hybrid_mean_batch > 1.3 * row.all_full_mean_batch,
            "{row:?}"
        );
    }
    // A model of one group has no comparison.
    let w = Workload::synthetic(WorkloadKind::ShareGpt, 2.0, 100, 2048, 0).unwrap();
    let plain = run_scenario(&w, None, &a100_opt13b(), &[Policy::Paged(16)], &mut || {});
    assert_eq!(plain.unwrap().hybrid, None);
}

/// With a system prompt the paged policies report the K/V a decode step reads flat and
/// as cascade attention: 40 requests arriving together over a 1024-token prompt (64
/// blocks of 16) share it, so a step of them reads the prompt once per 64 query rows
/// (OPT-13B: one query head per KV head, one tile) instead of once per row. The
/// figures are recomputed here from the same model. Without one, no figures.
#[test]
fn a_shared_system_prompt_is_read_once_per_tile_under_cascade() {
    let mut c = a100_opt13b();
    c.system_prompt = 1024;
    let base = Workload {
        requests: (0..40)
            .map(|i| pagedkv_cli::sim::TraceRequest {
                arrival_s: 0.0,
                prompt_len: 16 + i,
                output_len: 8,
            })
            .collect(),
        description: "40 requests at once".into(),
    };
    let w = base.with_system_prompt(1024, 2048);
    assert_eq!(w.requests[3].prompt_len, 1024 + 19);
    let r = run_scenario(
        &w,
        None,
        &c,
        &[Policy::Paged(16), Policy::Oracle],
        &mut || {},
    )
    .unwrap();
    let paged = &r.policies[0].result;
    let t = paged.cascade.expect("a paged policy's cascade figures");
    assert!(
        t.cascade_steps > 0 && t.cascade_steps <= t.decode_steps,
        "{t:?}"
    );
    // Every decode step of all 40 rows: flat reads 40 x (1024 + own) tokens, the
    // cascade 1 x 1024 + 40 x own; the mean over steps is at least 10 times less.
    assert!(
        t.flat_bytes_per_step > 10.0 * t.cascade_bytes_per_step,
        "{t:?}"
    );
    assert!(r.to_table().contains("Cascade attention"));
    assert_eq!(r.policies[1].result.cascade, None);
    c.system_prompt = 0;
    let r = run_scenario(&base, None, &c, &[Policy::Paged(16)], &mut || {}).unwrap();
    assert_eq!(r.policies[0].result.cascade, None);
}
