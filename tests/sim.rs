//! The simulator's parts: workload statistics, the contiguous allocator's limits, the
//! step-time model, and paged memory use.

use pagedkv::sim::{
    GpuSpec, KvFootprint, ModelSpec, Policy, RequestKv, SimConfig, Workload, WorkloadKind,
    binary_size, simulate,
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
