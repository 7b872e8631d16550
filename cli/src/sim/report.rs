//! A scenario's report: every policy's results next to the paper's figures (Fig. 2's
//! token-state shares, Fig. 13's batch sizes), checked finite, as a text table or JSON.

use std::fmt::Write as _;

use serde::Serialize;

use super::{
    KvDtype, KvFootprint, MemorySplit, Policy, PolicyResult, SimConfig, SimError, Workload,
    WorkloadKind, err, simulate,
};

/// The paper's Fig. 13 mean batch sizes for OPT-13B on one A100 (vLLM, Orca Oracle,
/// Pow2, Max), for the two published scenarios.
pub fn paper_batch(kind: WorkloadKind, rate: f64, policy: Policy) -> Option<f64> {
    let row = match (kind, rate) {
        (WorkloadKind::ShareGpt, r) if (r - 2.0).abs() < 1e-9 => [30.42, 13.62, 9.81, 7.00],
        (WorkloadKind::Alpaca, r) if (r - 30.0).abs() < 1e-9 => [132.44, 72.75, 43.24, 7.00],
        _ => return None,
    };
    Some(match policy {
        Policy::Paged(_) => row[0],
        Policy::Oracle => row[1],
        Policy::Pow2 => row[2],
        Policy::Max => row[3],
    })
}

/// A scenario's results, ready to print or serialise.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct ScenarioReport {
    /// Where the requests come from.
    pub workload: String,
    /// The GPU.
    pub gpu: String,
    /// The model.
    pub model: String,
    /// KV budget, GiB.
    pub kv_budget_gib: f64,
    /// KV token slots.
    pub kv_capacity_tokens: u64,
    /// KV bytes of one token and of one request of 2k and 8k tokens, for the model.
    pub kv_footprint: KvFootprint,
    /// Whether the paper's Fig. 13 has this scenario (OPT-13B, A100-40GB, ShareGPT
    /// 2 req/s or Alpaca 30 req/s).
    pub paper_scenario: Option<String>,
    /// One entry per policy.
    pub policies: Vec<PolicyReport>,
    /// With `--kv-dtype fp8`: the same scenario, GPU and KV budget with an fp8 cache,
    /// next to the figures above (the model's own dtype). Absent from the JSON otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_dtype_comparison: Option<KvDtypeComparison>,
    /// For a model that mixes sliding-window and full layers: the hybrid allocator
    /// (the paged policies above) against the same model with every layer treated as
    /// full, in the same budget. Absent from the JSON otherwise.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hybrid: Option<HybridComparison>,
}

/// A hybrid model under the hybrid allocator and with every layer full: what one
/// request keeps, how many fit the budget, and the paged policies' batches and
/// throughput side by side. Every figure comes from the model's shapes, the
/// step-time model and the scheduler's admission decisions.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HybridComparison {
    /// Layers with a sliding window, and with full attention.
    pub window_layers: u32,
    /// Layers with full attention.
    pub full_layers: u32,
    /// Layer groups and layers per group (the K/V tensors the groups share).
    pub layer_groups: usize,
    /// Layers per group.
    pub layers_per_group: usize,
    /// K and V bytes of one token in one layer.
    pub layer_token_bytes: u64,
    /// One request at each of [`HybridComparison::REQUEST_TOKENS`] tokens.
    pub requests: Vec<HybridRequest>,
    /// Per paged policy, its mean batch and throughput both ways.
    pub rows: Vec<HybridRow>,
    /// The all-full runs' full results per paged policy.
    pub all_full: Vec<PolicyResult>,
}

/// One request of a hybrid model, both ways.
#[derive(Clone, Copy, Debug, PartialEq, Serialize)]
pub struct HybridRequest {
    /// Tokens held.
    pub tokens: u64,
    /// K/V bytes the hybrid allocator keeps (each window layer its window).
    pub hybrid_bytes: u64,
    /// K/V bytes with every layer full.
    pub all_full_bytes: u64,
    /// Such requests the KV budget holds at once, hybrid.
    pub hybrid_fit: u64,
    /// Such requests the KV budget holds at once, all full.
    pub all_full_fit: u64,
}

/// One paged policy under the hybrid allocator and all-full.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct HybridRow {
    /// The policy's name.
    pub policy: String,
    /// Mean batch, hybrid.
    pub hybrid_mean_batch: f64,
    /// Mean batch, all full.
    pub all_full_mean_batch: f64,
    /// Generated tokens per second, hybrid.
    pub hybrid_tokens_per_s: f64,
    /// Generated tokens per second, all full.
    pub all_full_tokens_per_s: f64,
}

impl HybridComparison {
    /// The request lengths the comparison prices: 4k and 32k tokens.
    pub const REQUEST_TOKENS: [u64; 2] = [4096, 32_768];

    /// The comparison for `cfg`'s (hybrid) model, whose paged policies gave `hybrid`,
    /// running them again with every layer full.
    fn run(
        workload: &Workload,
        cfg: &SimConfig,
        (policies, hybrid): (&[Policy], &[PolicyReport]),
        on_finish: &mut dyn FnMut(),
    ) -> Result<Self, SimError> {
        let m = &cfg.model;
        let element = cfg.kv_dtype.element_bytes(m);
        let budget = cfg.kv_budget_bytes()?;
        let groups = m.layer_groups()?;
        let window_layers = m.layer_windows.iter().filter(|&&w| w > 0).count() as u32;
        let full = m.all_full();
        let requests = Self::REQUEST_TOKENS
            .iter()
            .map(|&tokens| {
                let overflow = || {
                    SimError(format!(
                        "--model {}: KV bytes of {tokens} tokens overflow",
                        m.name
                    ))
                };
                let h = m.kv_bytes_held(tokens, element).ok_or_else(overflow)?;
                let f = full.kv_bytes_held(tokens, element).ok_or_else(overflow)?;
                Ok(HybridRequest {
                    tokens,
                    hybrid_bytes: h,
                    all_full_bytes: f,
                    hybrid_fit: (budget / h.max(1) as f64) as u64,
                    all_full_fit: (budget / f.max(1) as f64) as u64,
                })
            })
            .collect::<Result<Vec<_>, SimError>>()?;
        let mut full_cfg = cfg.clone();
        full_cfg.model = full;
        let (mut rows, mut all_full) = (Vec::new(), Vec::new());
        for (&kind, p) in policies
            .iter()
            .zip(hybrid)
            .filter(|(k, _)| matches!(k, Policy::Paged(_)))
        {
            let r = simulate(kind, workload, &full_cfg, on_finish)?;
            rows.push(HybridRow {
                policy: p.result.policy.clone(),
                hybrid_mean_batch: p.result.mean_batch,
                all_full_mean_batch: r.mean_batch,
                hybrid_tokens_per_s: p.result.tokens_per_s,
                all_full_tokens_per_s: r.tokens_per_s,
            });
            all_full.push(r);
        }
        Ok(Self {
            window_layers,
            full_layers: m.num_layers - window_layers,
            layer_groups: groups.specs().len(),
            layers_per_group: groups.layers_per_group(),
            layer_token_bytes: m.layer_token_bytes(element),
            requests,
            rows,
            all_full,
        })
    }

    /// The comparison as a text table.
    pub fn to_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "Hybrid allocator ({} window + {} full layers in {} groups of {}, one block table per group, window groups holding their window) vs every layer full, same budget:",
            self.window_layers, self.full_layers, self.layer_groups, self.layers_per_group
        );
        for r in &self.requests {
            let _ = writeln!(
                o,
                "  a {}-token request keeps {} (hybrid, {} a token) vs {} (all full, {} a token): {} vs {} such requests fit ({:.2}x)",
                r.tokens,
                binary_size(r.hybrid_bytes),
                binary_size(r.hybrid_bytes / r.tokens.max(1)),
                binary_size(r.all_full_bytes),
                binary_size(r.all_full_bytes / r.tokens.max(1)),
                r.hybrid_fit,
                r.all_full_fit,
                r.hybrid_fit as f64 / r.all_full_fit.max(1) as f64
            );
        }
        let _ = writeln!(
            o,
            "  {:<20} {:>12} {:>12} {:>12} {:>12}",
            "policy", "batch hyb", "batch full", "tok/s hyb", "tok/s full"
        );
        for r in &self.rows {
            let _ = writeln!(
                o,
                "  {:<20} {:>12.2} {:>12.2} {:>12.0} {:>12.0}",
                r.policy,
                r.hybrid_mean_batch,
                r.all_full_mean_batch,
                r.hybrid_tokens_per_s,
                r.all_full_tokens_per_s
            );
        }
        o
    }
}

/// The same scenario run twice, the cache at the model's own dtype (the report's main
/// figures) and at another (fp8): token slots, batch sizes and throughput side by side.
/// Every figure comes from the step-time model and the policies' admission decisions.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KvDtypeComparison {
    /// The dtype of the report's main figures (`f16` for the presets).
    pub baseline_dtype: String,
    /// The dtype compared (`fp8`).
    pub kv_dtype: String,
    /// KV token slots in the same budget with the compared dtype.
    pub kv_capacity_tokens: u64,
    /// `kv_capacity_tokens` over the baseline's.
    pub capacity_ratio: f64,
    /// KV bytes of one token and of one request with the compared dtype.
    pub kv_footprint: KvFootprint,
    /// Per policy, baseline and compared figures with their ratios.
    pub rows: Vec<DtypeRow>,
    /// The compared dtype's full results per policy (same fields as `policies`).
    pub policies: Vec<PolicyResult>,
}

/// One policy under the two cache dtypes; a ratio is compared over baseline (`None`
/// when the baseline figure is 0).
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DtypeRow {
    /// The policy's name.
    pub policy: String,
    /// Mean batch size, baseline dtype.
    pub baseline_mean_batch: f64,
    /// Mean batch size, compared dtype.
    pub mean_batch: f64,
    /// `mean_batch / baseline_mean_batch`.
    pub batch_ratio: Option<f64>,
    /// Completed requests per second, baseline dtype.
    pub baseline_requests_per_s: f64,
    /// Completed requests per second, compared dtype.
    pub requests_per_s: f64,
    /// `requests_per_s / baseline_requests_per_s`.
    pub requests_ratio: Option<f64>,
    /// Generated tokens per second, baseline dtype.
    pub baseline_tokens_per_s: f64,
    /// Generated tokens per second, compared dtype.
    pub tokens_per_s: f64,
    /// `tokens_per_s / baseline_tokens_per_s`.
    pub tokens_ratio: Option<f64>,
}

fn ratio(new: f64, base: f64) -> Option<f64> {
    (base > 0.0).then(|| new / base)
}

impl KvDtypeComparison {
    /// The comparison of `base` (the cache at the model's own dtype, named
    /// `baseline_dtype`) and `other` (the same scenario with the cache at `kv_dtype`); an
    /// error when their policies differ.
    pub fn new(
        base: &ScenarioReport,
        other: ScenarioReport,
        baseline_dtype: String,
        kv_dtype: String,
    ) -> Result<Self, SimError> {
        if base.policies.len() != other.policies.len()
            || base
                .policies
                .iter()
                .zip(&other.policies)
                .any(|(a, b)| a.result.policy != b.result.policy)
        {
            return err("internal error: the two dtypes' runs have different policies");
        }
        let rows = base
            .policies
            .iter()
            .zip(&other.policies)
            .map(|(a, b)| {
                let (a, b) = (&a.result, &b.result);
                DtypeRow {
                    policy: a.policy.clone(),
                    baseline_mean_batch: a.mean_batch,
                    mean_batch: b.mean_batch,
                    batch_ratio: ratio(b.mean_batch, a.mean_batch),
                    baseline_requests_per_s: a.requests_per_s,
                    requests_per_s: b.requests_per_s,
                    requests_ratio: ratio(b.requests_per_s, a.requests_per_s),
                    baseline_tokens_per_s: a.tokens_per_s,
                    tokens_per_s: b.tokens_per_s,
                    tokens_ratio: ratio(b.tokens_per_s, a.tokens_per_s),
                }
            })
            .collect();
        Ok(Self {
            baseline_dtype,
            kv_dtype,
            kv_capacity_tokens: other.kv_capacity_tokens,
            capacity_ratio: other.kv_capacity_tokens as f64 / base.kv_capacity_tokens.max(1) as f64,
            kv_footprint: other.kv_footprint,
            rows,
            policies: other.policies.into_iter().map(|p| p.result).collect(),
        })
    }

    /// The comparison as a compact text table (printed after the scenario's main one).
    pub fn to_table(&self, base: &ScenarioReport) -> String {
        let mut o = String::new();
        let (b, d) = (&self.baseline_dtype, &self.kv_dtype);
        let (kb, kd) = (&base.kv_footprint, &self.kv_footprint);
        let per_request = |k: &KvFootprint| {
            k.per_request
                .iter()
                .map(|r| format!("{} at {}", binary_size(r.bytes), r.tokens))
                .collect::<Vec<_>>()
                .join(", ")
        };
        let _ = writeln!(
            o,
            "KV cache {d} vs {b} (same GPU, same {:.2} GiB KV budget; weights unchanged; modelled):",
            base.kv_budget_gib
        );
        let _ = writeln!(
            o,
            "  KV per token: {b} {} bytes = {}, {d} {} bytes = {}; one request ({b} / {d}): {} / {}",
            kb.bytes_per_token,
            binary_size(kb.bytes_per_token),
            kd.bytes_per_token,
            binary_size(kd.bytes_per_token),
            per_request(kb),
            per_request(kd),
        );
        let _ = writeln!(
            o,
            "  token slots: {b} {}, {d} {} ({:.2}x)",
            base.kv_capacity_tokens, self.kv_capacity_tokens, self.capacity_ratio
        );
        let groups = format!(
            "  {:<20} {:^22} | {:^22} | {:^22}",
            "", "mean batch", "req/s", "tok/s"
        );
        let _ = writeln!(o, "{}", groups.trim_end());
        let head = format!("{b:>7} {d:>7} {:>6}", "ratio");
        let _ = writeln!(o, "  {:<20} {head} | {head} | {head}", "policy");
        let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}x"));
        for r in &self.rows {
            let _ = writeln!(
                o,
                "  {:<20} {:>7.2} {:>7.2} {:>6} | {:>7.2} {:>7.2} {:>6} | {:>7.0} {:>7.0} {:>6}",
                r.policy,
                r.baseline_mean_batch,
                r.mean_batch,
                f(r.batch_ratio),
                r.baseline_requests_per_s,
                r.requests_per_s,
                f(r.requests_ratio),
                r.baseline_tokens_per_s,
                r.tokens_per_s,
                f(r.tokens_ratio),
            );
        }
        o
    }
}

/// One policy's results next to the paper's.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicyReport {
    /// Our results.
    #[serde(flatten)]
    pub result: PolicyResult,
    /// The paper's Fig. 2 token-states share for the matching system.
    pub paper_token_share: Option<f64>,
    /// The paper's Fig. 13 mean batch size, when the scenario is the paper's.
    pub paper_mean_batch: Option<f64>,
}

impl PolicyReport {
    /// Whether the policy is paged (its name is `paged (block N)`).
    pub fn is_paged(&self) -> bool {
        self.result.policy.starts_with("paged")
    }

    /// Where the KV memory goes, as the paper's Fig. 2 draws it, shares summing to 1.
    /// A contiguous policy: shares of the whole KV pool ([`PolicyResult::split`], as the
    /// paper's Orca bars). A paged one: shares of the memory its blocks hold, token states
    /// and the unfilled slots of last blocks (as the paper's vLLM bar): the blocks a paged
    /// server does not hold are free for any request, not reserved or fragmented, so its
    /// bar says how much of the memory it uses holds token states, not how many bytes.
    pub fn figure_split(&self) -> MemorySplit {
        if self.is_paged() {
            let t = self.result.tokens_per_reserved.clamp(0.0, 1.0);
            MemorySplit {
                token_states: t,
                reserved_future: 0.0,
                internal_fragmentation: 1.0 - t,
                external_and_free: 0.0,
            }
        } else {
            self.result.split
        }
    }
}

impl ScenarioReport {
    /// An error naming the first figure that is NaN or infinite: [`run_scenario`]
    /// refuses to return such a report, so no NaN or infinity reaches a table, a JSON
    /// file or a plot.
    pub fn check_finite(&self) -> Result<(), SimError> {
        let bad = |what: &str, policy: &str| {
            err(format!(
                "internal error: {what} of {policy} is not a finite number; please report the inputs"
            ))
        };
        if !self.kv_budget_gib.is_finite() {
            return bad("kv_budget_gib", "the scenario");
        }
        for p in &self.policies {
            let r = &p.result;
            let s = &r.split;
            for (what, v) in [
                ("sim_seconds", r.sim_seconds),
                ("requests_per_s", r.requests_per_s),
                ("tokens_per_s", r.tokens_per_s),
                ("mean_batch", r.mean_batch),
                ("p99_batch", r.p99_batch),
                ("token_states", s.token_states),
                ("reserved_future", s.reserved_future),
                ("internal_fragmentation", s.internal_fragmentation),
                ("external_and_free", s.external_and_free),
                ("tokens_per_reserved", r.tokens_per_reserved),
            ] {
                if !v.is_finite() {
                    return bad(what, &r.policy);
                }
            }
            if r.timeline
                .iter()
                .any(|&(t, h, _)| !(t.is_finite() && h.is_finite()))
            {
                return bad("timeline", &r.policy);
            }
        }
        if let Some(c) = &self.kv_dtype_comparison {
            if !c.capacity_ratio.is_finite() {
                return bad("capacity_ratio", "the scenario");
            }
            for r in &c.rows {
                for (what, v) in [
                    ("mean_batch", Some(r.mean_batch)),
                    ("requests_per_s", Some(r.requests_per_s)),
                    ("tokens_per_s", Some(r.tokens_per_s)),
                    ("batch_ratio", r.batch_ratio),
                    ("requests_ratio", r.requests_ratio),
                    ("tokens_ratio", r.tokens_ratio),
                ] {
                    if v.is_some_and(|v| !v.is_finite()) {
                        return bad(what, &format!("{} ({})", r.policy, c.kv_dtype));
                    }
                }
            }
            if c.policies.iter().any(|r| {
                r.timeline
                    .iter()
                    .any(|&(t, h, _)| !(t.is_finite() && h.is_finite()))
            }) {
                return bad("timeline", &c.kv_dtype);
            }
        }
        Ok(())
    }

    /// The report as a text table.
    pub fn to_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "\n{} on {}: {}", self.model, self.gpu, self.workload);
        let _ = writeln!(
            o,
            "KV cache: {:.2} GiB = {} token slots{}",
            self.kv_budget_gib,
            self.kv_capacity_tokens,
            match &self.paper_scenario {
                Some(s) => format!("; paper scenario: {s}"),
                None => String::new(),
            }
        );
        let k = &self.kv_footprint;
        let requests: Vec<String> = k
            .per_request
            .iter()
            .map(|r| format!("{} at {} tokens", binary_size(r.bytes), r.tokens))
            .collect();
        let beyond: Vec<String> = k
            .per_request
            .iter()
            .filter(|r| r.tokens > k.max_model_len as u64)
            .map(|r| r.tokens.to_string())
            .collect();
        let _ = writeln!(
            o,
            "KV per token: {} bytes = {} (2 x {} layers x {} KV heads x {} x {} bytes); one request: {}{}",
            k.bytes_per_token,
            binary_size(k.bytes_per_token),
            k.num_layers,
            k.num_kv_heads,
            k.head_dim,
            k.dtype_bytes,
            requests.join(", "),
            if beyond.is_empty() {
                String::new()
            } else {
                format!(
                    " ({} beyond the model's {}-token maximum)",
                    beyond.join(", "),
                    k.max_model_len
                )
            }
        );
        let _ = writeln!(
            o,
            "{:<20} {:>7} {:>8} {:>6} {:>5} {:>6} | {:>7} {:>7} {:>7} {:>7} | {:>8} {:>7} {:>6} | {:>6} {:>6} {:>6}",
            "policy",
            "req/s",
            "tok/s",
            "batch",
            "p99",
            "preem",
            "tokens",
            "future",
            "intfrag",
            "ext+free",
            "tok/rsv",
            "paper",
            "ratio",
            "paperB",
            "ratioB",
            "done"
        );
        for p in &self.policies {
            let r = &p.result;
            // Paged systems: share of held memory (the paper's vLLM bar); contiguous:
            // share of the whole pool (the paper's Orca bars).
            let ours_share = p.figure_split().token_states;
            let paper = p.paper_token_share;
            let f = |x: Option<f64>, d: usize| x.map_or("-".to_string(), |v| format!("{v:.d$}"));
            let _ = writeln!(
                o,
                "{:<20} {:>7.2} {:>8.0} {:>6.2} {:>5.0} {:>6} | {:>6.1}% {:>6.1}% {:>6.1}% {:>7.1}% | {:>7.1}% {:>7} {:>6} | {:>6} {:>6} {:>6}",
                r.policy,
                r.requests_per_s,
                r.tokens_per_s,
                r.mean_batch,
                r.p99_batch,
                r.preemptions,
                100.0 * r.split.token_states,
                100.0 * r.split.reserved_future,
                100.0 * r.split.internal_fragmentation,
                100.0 * r.split.external_and_free,
                100.0 * r.tokens_per_reserved,
                f(paper.map(|x| 100.0 * x), 1),
                f(paper.map(|x| ours_share / x), 2),
                f(p.paper_mean_batch, 2),
                f(p.paper_mean_batch.map(|x| r.mean_batch / x), 2),
                r.completed,
            );
        }
        if let Some(c) = &self.kv_dtype_comparison {
            o.push_str(&c.to_table(self));
        }
        if let Some(h) = &self.hybrid {
            o.push_str(&h.to_table());
        }
        let cascades: Vec<_> = self
            .policies
            .iter()
            .filter_map(|p| p.result.cascade.map(|c| (&p.result.policy, c)))
            .collect();
        if !cascades.is_empty() {
            let _ = writeln!(
                o,
                "Cascade attention (a model from the scheduler's block tables: shared blocks read once per CTA tile of query rows, 64 or 16, each row's own tokens once; step times price flat attention):"
            );
            for (policy, c) in cascades {
                let _ = writeln!(
                    o,
                    "  {policy:<18} K/V read per decode step: flat {}, cascade {} ({:.1}x less); {} of {} decode steps had rows sharing a block",
                    binary_size(c.flat_bytes_per_step as u64),
                    binary_size(c.cascade_bytes_per_step as u64),
                    c.flat_bytes_per_step / c.cascade_bytes_per_step.max(1.0),
                    c.cascade_steps,
                    c.decode_steps
                );
            }
        }
        o
    }
}

/// Runs every policy over a workload and assembles the report.
pub fn run_scenario(
    workload: &Workload,
    kind_rate: Option<(WorkloadKind, f64)>,
    cfg: &SimConfig,
    policies: &[Policy],
    on_finish: &mut dyn FnMut(),
) -> Result<ScenarioReport, SimError> {
    let budget = cfg.kv_budget_bytes()?;
    let paper_scenario = match kind_rate {
        Some((k, r))
            if cfg.model.name == "opt-13b"
                && cfg.gpu.name == "a100-40gb"
                && paper_batch(k, r, Policy::Max).is_some() =>
        {
            Some(format!("Fig. 13, {} at {r} req/s", k.name()))
        }
        _ => None,
    };
    let mut out = Vec::new();
    for &p in policies {
        let result = simulate(p, workload, cfg, on_finish)?;
        out.push(PolicyReport {
            result,
            paper_token_share: p.paper_token_share(),
            paper_mean_batch: match (&paper_scenario, kind_rate) {
                (Some(_), Some((k, r))) => paper_batch(k, r, p),
                _ => None,
            },
        });
    }
    let report = ScenarioReport {
        workload: workload.description.clone(),
        gpu: cfg.gpu.name.clone(),
        model: cfg.model.name.clone(),
        kv_budget_gib: budget / (1u64 << 30) as f64,
        kv_capacity_tokens: cfg.capacity_tokens()?,
        kv_footprint: KvFootprint::at(&cfg.model, cfg.kv_dtype.element_bytes(&cfg.model))?,
        paper_scenario,
        policies: out,
        kv_dtype_comparison: None,
        hybrid: None,
    };
    report.check_finite()?;
    let mut report = report;
    if cfg.model.is_hybrid() {
        report.hybrid = Some(HybridComparison::run(
            workload,
            cfg,
            (policies, &report.policies),
            on_finish,
        )?);
    }
    Ok(report)
}

/// Runs every policy over a workload with the cache at the model's own dtype and, when
/// `kv_dtype` is another (fp8), again with the cache at `kv_dtype` on the same GPU and
/// budget, the second run's figures attached as [`ScenarioReport::kv_dtype_comparison`].
/// `cfg.kv_dtype` is ignored: the main figures are always the model's own dtype.
pub fn run_scenario_kv_dtypes(
    workload: &Workload,
    kind_rate: Option<(WorkloadKind, f64)>,
    cfg: &SimConfig,
    policies: &[Policy],
    kv_dtype: KvDtype,
    on_finish: &mut dyn FnMut(),
) -> Result<ScenarioReport, SimError> {
    let mut base_cfg = cfg.clone();
    base_cfg.kv_dtype = KvDtype::F16;
    let mut report = run_scenario(workload, kind_rate, &base_cfg, policies, on_finish)?;
    if kv_dtype != KvDtype::F16 {
        let mut other_cfg = cfg.clone();
        other_cfg.kv_dtype = kv_dtype;
        let other = run_scenario(workload, kind_rate, &other_cfg, policies, on_finish)?;
        report.kv_dtype_comparison = Some(KvDtypeComparison::new(
            &report,
            other,
            KvDtype::F16.label(&cfg.model),
            kv_dtype.label(&cfg.model),
        )?);
        report.check_finite()?;
    }
    Ok(report)
}

/// `bytes` in the largest binary unit (B, KiB, MiB, GiB, TiB, PiB, EiB) that leaves at
/// least 1, to three significant figures: `800 KiB`, `1.56 GiB`, `6.25 GiB`.
pub fn binary_size(bytes: u64) -> String {
    const UNITS: [&str; 7] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];
    let mut unit = 0;
    while unit + 1 < UNITS.len() && bytes >> (10 * (unit + 1)) > 0 {
        unit += 1;
    }
    if unit == 0 {
        return format!("{bytes} B");
    }
    let v = bytes as f64 / (1u64 << (10 * unit)) as f64;
    let digits = if v < 10.0 {
        2
    } else if v < 100.0 {
        1
    } else {
        0
    };
    format!("{v:.digits$} {}", UNITS[unit])
}
