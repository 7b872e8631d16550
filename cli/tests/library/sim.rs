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
