//! The Fig. 12 sweep: normalised latency as the paper defines it, the prefill models,
//! and sweep reports whose sustained rates and ratios are recomputed from their JSON.

use pagedkv_cli::sim::{
    GpuSpec, ModelSpec, Policy, PolicySweep, PrefillModel, SimConfig, StepLoad, SweepConfig,
    SweepPoint, TraceRequest, Workload, WorkloadKind, simulate, sweep,
};
use serde_json::Value;

fn a100_opt13b() -> SimConfig {
    SimConfig::new(
        GpuSpec::preset("a100-40gb").unwrap(),
        ModelSpec::preset("opt-13b").unwrap(),
    )
}

/// One request alone: its latency is the sum of its steps (a prefill step that yields
/// the first token, then one decode step per further token, each reading one more
/// token's K/V), counted from its arrival, and its normalised latency that over its
/// output tokens; the same under every policy.
#[test]
fn a_lone_requests_latency_is_its_steps_from_its_arrival() {
    for prefill in [PrefillModel::Separate, PrefillModel::Mixed] {
        let mut c = a100_opt13b();
        c.prefill = prefill;
        let w = Workload {
            requests: vec![TraceRequest {
                arrival_s: 0.5,
                prompt_len: 10,
                output_len: 3,
            }],
            description: "one request".into(),
        };
        let steps = c.step_duration(&StepLoad {
            prefill_tokens: 10,
            prefill_kv_bytes: c.kv_bytes_of(10),
            ..StepLoad::default()
        }) + c.step_time(1, 11)
            + c.step_time(1, 12);
        for p in [Policy::Max, Policy::Pow2, Policy::Oracle, Policy::Paged(16)] {
            let r = simulate(p, &w, &c, &mut || {}).unwrap();
            assert_eq!(r.completed, 1);
            assert!(
                (r.mean_latency_s - steps).abs() < 1e-12,
                "{p:?} {prefill:?}: latency {} vs {steps}",
                r.mean_latency_s
            );
            assert!(
                (r.mean_normalized_latency - steps / 3.0).abs() < 1e-12,
                "{p:?} {prefill:?}: normalised {} vs {}",
                r.mean_normalized_latency,
                steps / 3.0
            );
        }
    }
}

/// Two requests whose steps overlap: the second's prompt joins the first's decode
/// step, priced as two passes (`Separate`) or one (`Mixed`); each request's latency
/// runs from its own arrival.
#[test]
fn a_step_with_a_prompt_and_a_decode_is_priced_by_the_prefill_model() {
    for prefill in [PrefillModel::Separate, PrefillModel::Mixed] {
        let mut c = a100_opt13b();
        c.prefill = prefill;
        let req = |arrival_s, prompt_len, output_len| TraceRequest {
            arrival_s,
            prompt_len,
            output_len,
        };
        // B arrives during A's prefill step and joins A's first decode step.
        let w = Workload {
            requests: vec![req(0.0, 10, 3), req(1e-6, 5, 1)],
            description: "two requests".into(),
        };
        let t1 = c.step_duration(&StepLoad {
            prefill_tokens: 10,
            prefill_kv_bytes: c.kv_bytes_of(10),
            ..StepLoad::default()
        });
        let t2 = t1
            + c.step_duration(&StepLoad {
                prefill_tokens: 5,
                prefill_kv_bytes: c.kv_bytes_of(5),
                decode_tokens: 1,
                decode_kv_bytes: c.kv_bytes_of(11),
            });
        let t3 = t2 + c.step_time(1, 12);
        let (a, b) = (t3, t2 - 1e-6);
        for p in [Policy::Max, Policy::Pow2, Policy::Oracle, Policy::Paged(16)] {
            let r = simulate(p, &w, &c, &mut || {}).unwrap();
            assert_eq!(r.completed, 2);
            let near = |x: f64, y: f64| (x - y).abs() < 1e-12;
            assert!(
                near(r.mean_latency_s, (a + b) / 2.0),
                "{p:?} {prefill:?}: {} vs {}",
                r.mean_latency_s,
                (a + b) / 2.0
            );
            assert!(
                near(r.mean_normalized_latency, (a / 3.0 + b) / 2.0),
                "{p:?} {prefill:?}"
            );
        }
    }
}

/// A step with prompt and decode tokens is two passes under `Separate` (weights read
/// and overhead paid twice) and one under `Mixed`; a step with one kind is one pass
/// either way.
#[test]
fn the_prefill_model_prices_a_mixed_step_as_one_or_two_passes() {
    let mut c = a100_opt13b();
    let both = StepLoad {
        prefill_tokens: 160,
        prefill_kv_bytes: c.kv_bytes_of(160),
        decode_tokens: 20,
        decode_kv_bytes: c.kv_bytes_of(20 * 300),
    };
    let decode_only = StepLoad {
        prefill_tokens: 0,
        prefill_kv_bytes: 0.0,
        ..both
    };
    c.prefill = PrefillModel::Separate;
    let separate = c.step_duration(&both);
    assert_eq!(
        separate,
        c.step_time_bytes(160, both.prefill_kv_bytes) + c.step_time_bytes(20, both.decode_kv_bytes)
    );
    let separate_decode = c.step_duration(&decode_only);
    c.prefill = PrefillModel::Mixed;
    let mixed = c.step_duration(&both);
    assert_eq!(
        mixed,
        c.step_time_bytes(180, both.prefill_kv_bytes + both.decode_kv_bytes)
    );
    assert!(
        separate > mixed + c.step_overhead_s,
        "{separate} vs {mixed}"
    );
    assert_eq!(separate_decode, c.step_duration(&decode_only));
    assert_eq!(PrefillModel::default(), PrefillModel::Separate);
    assert!(PrefillModel::parse("interleaved").is_err());
}

/// Reads a point of the JSON.
fn point(v: &Value) -> SweepPoint {
    SweepPoint {
        rate: v["rate"].as_f64().unwrap(),
        mean_normalized_latency: v["mean_normalized_latency"].as_f64().unwrap(),
        mean_latency_s: v["mean_latency_s"].as_f64().unwrap(),
        requests_per_s: v["requests_per_s"].as_f64().unwrap(),
        tokens_per_s: v["tokens_per_s"].as_f64().unwrap(),
        mean_batch: v["mean_batch"].as_f64().unwrap(),
        preemptions: v["preemptions"].as_u64().unwrap(),
        completed: v["completed"].as_u64().unwrap() as usize,
        refined: v["refined"].as_bool().unwrap(),
    }
}

/// Recomputes from the JSON: points ascending; the default bound, twice the paged
/// policy's normalised latency at the lowest rate; each policy's sustained rate (the
/// highest rate before its first point over the bound, above its saturated
/// throughput, or short of a request); the ratios; and the qualitative result of the
/// paper (paged > Oracle > Pow2 > Max).
#[test]
fn a_sweeps_rates_and_ratios_recompute_from_its_json() {
    let c = a100_opt13b();
    let mut sc = SweepConfig::new(WorkloadKind::ShareGpt);
    sc.num_requests = 300;
    sc.refine_steps = 3;
    let mut runs = 0;
    let report = sweep(&c, &sc, &mut |_| runs += 1).unwrap();
    let json: Value = serde_json::from_str(&serde_json::to_string(&report).unwrap()).unwrap();
    let bound = json["latency_bound"].as_f64().unwrap();
    let n = json["num_requests"].as_u64().unwrap() as usize;
    let policies = json["policies"].as_array().unwrap();
    assert_eq!(policies.len(), 4);
    let mut rate = std::collections::HashMap::new();
    for p in policies {
        let name = p["policy"].as_str().unwrap().to_string();
        let pts: Vec<SweepPoint> = p["points"].as_array().unwrap().iter().map(point).collect();
        let saturation = p["saturation_rate"].as_f64().unwrap();
        assert!(pts.windows(2).all(|w| w[0].rate < w[1].rate), "{name}");
        if name == "paged (block 16)" {
            assert_eq!(bound, 2.0 * pts[0].mean_normalized_latency);
        }
        // Sustained: every point up to it within the bound, the next one over.
        let first_over = pts
            .iter()
            .position(|x| {
                x.mean_normalized_latency > bound || x.rate > saturation || x.completed != n
            })
            .unwrap_or_else(|| panic!("{name} never exceeded the bound"));
        assert!(first_over > 0, "{name} over the bound at its lowest rate");
        let sustained = pts[first_over - 1].rate;
        assert_eq!(p["max_rate"].as_f64(), Some(sustained), "{name}");
        assert_eq!(p["censored"].as_bool(), Some(false), "{name}");
        assert_eq!(
            PolicySweep::sustained(&pts, bound, saturation, n),
            (Some(sustained), false)
        );
        assert!(
            sustained <= saturation,
            "{name}: {sustained} > {saturation}"
        );
        // The knee is refined: a refined point sits next to it.
        assert!(
            pts[first_over - 1].refined || pts[first_over].refined,
            "{name}"
        );
        rate.insert(name, sustained);
    }
    let paged = rate["paged (block 16)"];
    for (field, base) in [
        ("paged_over_oracle", "contiguous Oracle"),
        ("paged_over_pow2", "contiguous Pow2"),
        ("paged_over_max", "contiguous Max"),
    ] {
        let want = paged / rate[base];
        let got = json[field].as_f64().unwrap();
        assert!(
            (got - want).abs() <= 1e-12 * want,
            "{field}: {got} vs {want}"
        );
    }
    assert!(paged > rate["contiguous Oracle"]);
    assert!(rate["contiguous Oracle"] > rate["contiguous Pow2"]);
    assert!(rate["contiguous Pow2"] > rate["contiguous Max"]);
    // The paper's panel is attached for its model and GPU, and every run reported.
    assert_eq!(json["paper"]["knee_vllm"].as_f64(), Some(1.9));
    let points: usize = report.policies.iter().map(|p| p.points.len()).sum();
    assert_eq!(runs, points + 4, "a probe per policy and a run per point");
    // The table prints every policy's sustained rate and the ratios.
    let table = report.to_table();
    for want in [
        "paged / Oracle",
        "paper, Fig. 12(a)",
        "highest rate sustained",
    ] {
        assert!(table.contains(want), "missing {want}:\n{table}");
    }
}

/// Given rates are run as given (sorted, once each), never extended: a policy within
/// the bound at every one is censored at the highest. A bound no rate meets leaves no
/// sustained rate and no ratio.
#[test]
fn given_rates_are_run_as_given() {
    let c = a100_opt13b();
    let mut sc = SweepConfig::new(WorkloadKind::Alpaca);
    sc.num_requests = 200;
    sc.rates = Some(vec![2.0, 1.0, 2.0]);
    let r = sweep(&c, &sc, &mut |_| {}).unwrap();
    assert_eq!(r.rates_chosen, "given");
    assert_eq!(r.saturation_probe, None);
    for p in &r.policies {
        let rates: Vec<f64> = p.points.iter().map(|x| x.rate).collect();
        assert_eq!(rates, [1.0, 2.0], "{}", p.policy);
        assert_eq!((p.max_rate, p.censored), (Some(2.0), true), "{}", p.policy);
    }
    // Censored rates are lower bounds: no ratio of them.
    assert_eq!(r.paged_over_oracle, None);
    sc.latency_bound = Some(1e-6);
    let r = sweep(&c, &sc, &mut |_| {}).unwrap();
    assert!(r.policies.iter().all(|p| p.max_rate.is_none()));
    assert_eq!(r.paged_over_max, None);
    assert_eq!(r.latency_bound_source, "--latency-bound");
}

/// Bad sweep settings are errors naming the setting, before anything runs.
#[test]
fn bad_sweep_settings_are_errors() {
    let c = a100_opt13b();
    let base = || {
        let mut sc = SweepConfig::new(WorkloadKind::ShareGpt);
        sc.num_requests = 10;
        sc.rates = Some(vec![1.0]);
        sc
    };
    let cases: Vec<(SweepConfig, &str)> = vec![
        (
            SweepConfig {
                latency_bound: Some(f64::NAN),
                ..base()
            },
            "--latency-bound",
        ),
        (
            SweepConfig {
                latency_bound: Some(0.0),
                ..base()
            },
            "--latency-bound",
        ),
        (
            SweepConfig {
                latency_bound: Some(-1.0),
                ..base()
            },
            "--latency-bound",
        ),
        (
            SweepConfig {
                rates: Some(vec![]),
                ..base()
            },
            "--rates",
        ),
        (
            SweepConfig {
                rates: Some(vec![1.0, f64::INFINITY]),
                ..base()
            },
            "--rates",
        ),
        (
            SweepConfig {
                rates: Some(vec![0.0]),
                ..base()
            },
            "--rates",
        ),
        (
            SweepConfig {
                num_requests: 0,
                ..base()
            },
            "--num-requests",
        ),
        (
            SweepConfig {
                policies: vec![Policy::Max, Policy::Oracle],
                ..base()
            },
            "exactly one paged policy",
        ),
        (
            SweepConfig {
                policies: vec![Policy::Paged(8), Policy::Paged(16)],
                ..base()
            },
            "exactly one paged policy",
        ),
    ];
    for (sc, want) in cases {
        let mut runs = 0;
        let e = sweep(&c, &sc, &mut |_| runs += 1).unwrap_err().to_string();
        assert!(e.contains(want), "{sc:?}: {e}");
        assert_eq!(runs, 0, "{sc:?} ran before failing");
    }
}

/// A short run cannot report a rate above what the policy serves flat out: past
/// saturation a few hundred requests drain before their mean latency shows the queue
/// (100 ShareGPT requests once reported paged sustaining 10.7 req/s against a
/// saturated 2.6).
#[test]
fn no_sustained_rate_exceeds_the_policys_saturated_throughput() {
    let c = a100_opt13b();
    let mut sc = SweepConfig::new(WorkloadKind::ShareGpt);
    sc.num_requests = 100;
    sc.refine_steps = 2;
    let r = sweep(&c, &sc, &mut |_| {}).unwrap();
    for p in &r.policies {
        let m = p.max_rate.unwrap();
        assert!(
            m <= p.saturation_rate,
            "{}: {m} > {}",
            p.policy,
            p.saturation_rate
        );
    }
}
