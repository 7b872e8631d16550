//! The paper's headline result (Fig. 12 of the vLLM paper): throughput at equal
//! latency. Each policy serves the same synthetic workload at a range of request
//! rates; per rate the report has the mean *normalised latency* (a request's
//! end-to-end latency divided by its output tokens, averaged over requests, as the
//! paper defines it), throughput, mean batch and preemptions; per policy, the highest
//! rate it sustains (normalised latency within one common bound); and the ratios
//! paged ÷ Oracle and paged ÷ Max at that bound, next to the paper's.
//!
//! # Sustained
//! A rate is sustained by a policy ([`PolicySweep::sustains`]) when its mean
//! normalised latency stays within the bound, every request is served, and the rate is
//! at most the policy's saturated throughput (its completed req/s with every request
//! arriving at once). The last condition matters for short runs: past saturation the
//! queue grows without limit, but a run of a few hundred requests drains it before
//! its mean latency shows it. The results still depend on the number of requests a
//! rate serves (the knee sharpens as it grows): the defaults are those of the
//! fixed-rate report, 2000 ShareGPT and 6000 Alpaca requests.
//!
//! # How rates are chosen
//! Every rate serves the same requests (same seed: the same lengths, arrival times
//! scaled by the rate), so the curves differ by the rate alone, not by the sample.
//! * Automatically ([`SweepConfig::rates`] `None`): a probe serves every request at
//!   once under the paged policy; its throughput `R` (req/s) anchors a geometric grid of
//!   [`AUTO_GRID_POINTS`] rates from `R / 16` to `1.25 R`, which brackets every policy's
//!   knee (no policy sustains much more than the paged one's saturated throughput). A
//!   policy that does not sustain the lowest rate is run at rates 1.5x lower, one that
//!   sustains the top at rates 1.5x higher, up to [`MAX_EXTENSIONS`] times each way.
//! * Given (`--rates`, at most [`MAX_RATES`]): those rates, sorted; no extension.
//!
//! Each policy's knee is then refined by [`SweepConfig::refine_steps`] bisections
//! (geometric midpoints) between its last rate sustained and its first not. A
//! policy's sustained rate is the highest rate run such that every rate run up to it
//! is sustained ([`PolicySweep::max_rate`]); `censored` says every rate run was (the
//! true figure is higher, and no ratio is formed of it).
//!
//! # The bound
//! [`SweepConfig::latency_bound`] (`--latency-bound`, s/token), or by default twice the
//! paged policy's normalised latency at the lowest rate: about twice an unloaded
//! server's, in the region where latency "suddenly explodes" (the paper's words), so
//! the sustained rates sit at the knees, and the bound is the same for every policy.

use std::fmt::Write as _;

use serde::Serialize;

use super::{
    KvDtype, Policy, PolicyResult, PrefillModel, SimConfig, SimError, Workload, WorkloadKind,
    check_range, err, limits, simulate,
};

/// Rates of the automatic grid.
pub const AUTO_GRID_POINTS: usize = 12;
/// The most rates `--rates` may list.
pub const MAX_RATES: usize = 64;
/// Times a policy that does not sustain the grid's lowest rate is run 1.5x slower, and
/// one that sustains its top 1.5x faster.
pub const MAX_EXTENSIONS: usize = 8;
/// The policies of the default sweep: the paper's three Orca variants and vLLM's
/// (paged, block 16).
pub const SWEEP_POLICIES: [Policy; 4] =
    [Policy::Max, Policy::Pow2, Policy::Oracle, Policy::Paged(16)];

/// A sweep's settings (the [`SimConfig`] gives the GPU, model and step-time model).
#[derive(Clone, Debug, PartialEq)]
pub struct SweepConfig {
    /// The synthetic workload.
    pub kind: WorkloadKind,
    /// Requests served at each rate.
    pub num_requests: usize,
    /// Seed of the workload (the same at every rate).
    pub seed: u64,
    /// Rates to run, req/s; `None`: chosen automatically (module docs).
    pub rates: Option<Vec<f64>>,
    /// Bound on mean normalised latency, s/token; `None`: twice the paged policy's at
    /// the lowest rate.
    pub latency_bound: Option<f64>,
    /// Bisections refining each policy's knee.
    pub refine_steps: u32,
    /// The policies: exactly one paged one (it sets the default bound and the
    /// ratios' numerator); Oracle, Max and Pow2 for the ratios.
    pub policies: Vec<Policy>,
}

impl SweepConfig {
    /// The default sweep of `kind`: [`SWEEP_POLICIES`], automatic rates, the default
    /// bound, 5 refinements, 2000 ShareGPT or 6000 Alpaca requests a rate (as the
    /// fixed-rate report), seed 0.
    pub fn new(kind: WorkloadKind) -> Self {
        Self {
            kind,
            num_requests: match kind {
                WorkloadKind::ShareGpt => 2000,
                WorkloadKind::Alpaca => 6000,
            },
            seed: 0,
            rates: None,
            latency_bound: None,
            refine_steps: 5,
            policies: SWEEP_POLICIES.to_vec(),
        }
    }
}

/// One policy at one rate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepPoint {
    /// Arrival rate, req/s.
    pub rate: f64,
    /// Mean normalised latency, s/token.
    pub mean_normalized_latency: f64,
    /// Mean end-to-end latency, s.
    pub mean_latency_s: f64,
    /// Completed requests per simulated second.
    pub requests_per_s: f64,
    /// Generated tokens per simulated second.
    pub tokens_per_s: f64,
    /// Mean running requests per step.
    pub mean_batch: f64,
    /// Preemptions.
    pub preemptions: u64,
    /// Requests completed (the rest could not run under the policy).
    pub completed: usize,
    /// Whether the rate comes from refining the knee (else from the grid or its
    /// extension).
    pub refined: bool,
}

impl SweepPoint {
    fn new(rate: f64, r: &PolicyResult, refined: bool) -> Self {
        Self {
            rate,
            mean_normalized_latency: r.mean_normalized_latency,
            mean_latency_s: r.mean_latency_s,
            requests_per_s: r.requests_per_s,
            tokens_per_s: r.tokens_per_s,
            mean_batch: r.mean_batch,
            preemptions: r.preemptions,
            completed: r.completed,
            refined,
        }
    }
}

/// One policy's curve and its sustained rate.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PolicySweep {
    /// The policy's name.
    pub policy: String,
    /// The policy's saturated throughput: completed requests per second when every
    /// request arrives at once. No rate above it is sustained, whatever the latency
    /// of a finite run (past saturation the queue grows without limit, but a run of
    /// few requests drains it before its mean latency shows it).
    pub saturation_rate: f64,
    /// Every rate run, ascending.
    pub points: Vec<SweepPoint>,
    /// The highest rate run such that every rate run up to it was sustained
    /// ([`PolicySweep::sustains`]); `None` when the lowest was not.
    pub max_rate: Option<f64>,
    /// Every rate run was sustained (the policy's sustained rate is at least
    /// `max_rate`; run higher rates to find it).
    pub censored: bool,
}

impl PolicySweep {
    /// Whether a point is sustained under `bound`: its mean normalised latency within
    /// the bound, its rate at most the policy's `saturation_rate`, and every one of
    /// the workload's `num_requests` requests served.
    pub fn sustains(x: &SweepPoint, bound: f64, saturation_rate: f64, num_requests: usize) -> bool {
        x.mean_normalized_latency <= bound
            && x.rate <= saturation_rate
            && x.completed == num_requests
    }

    /// [`PolicySweep::max_rate`] and [`PolicySweep::censored`] of `points` (ascending),
    /// as [`PolicySweep::sustains`] judges each.
    pub fn sustained(
        points: &[SweepPoint],
        bound: f64,
        saturation_rate: f64,
        num_requests: usize,
    ) -> (Option<f64>, bool) {
        let first_over = points
            .iter()
            .position(|p| !Self::sustains(p, bound, saturation_rate, num_requests));
        match first_over {
            Some(0) => (None, false),
            Some(i) => (Some(points[i - 1].rate), false),
            None => (points.last().map(|p| p.rate), true),
        }
    }
}

/// The paper's Fig. 12 for OPT-13B on one A100-40GB, for comparison.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct PaperFig12 {
    /// The panel.
    pub figure: String,
    /// Approximate knee rates (req/s) read visually from the published plot (not
    /// printed in the paper): Orca (Max), Orca (Pow2), Orca (Oracle), vLLM.
    pub knee_max: f64,
    /// Orca (Pow2)'s knee.
    pub knee_pow2: f64,
    /// Orca (Oracle)'s knee.
    pub knee_oracle: f64,
    /// vLLM's knee.
    pub knee_vllm: f64,
    /// The range of vLLM ÷ Orca (Oracle) the paper's text gives over OPT-13B, 66B and
    /// 175B, when it gives one (ShareGPT only).
    pub text_over_oracle: Option<(f64, f64)>,
    /// The range of vLLM ÷ Orca (Max) the text gives (ShareGPT only).
    pub text_over_max: Option<(f64, f64)>,
    /// What else the paper says.
    pub note: String,
}

impl PaperFig12 {
    /// The panel for `kind` (Fig. 12(a) ShareGPT, 12(d) Alpaca).
    pub fn of(kind: WorkloadKind) -> Self {
        match kind {
            WorkloadKind::ShareGpt => Self {
                figure: "Fig. 12(a), OPT-13B, 1 A100, ShareGPT".into(),
                knee_max: 0.5,
                knee_pow2: 0.75,
                knee_oracle: 1.1,
                knee_vllm: 1.9,
                text_over_oracle: Some((1.7, 2.7)),
                text_over_max: Some((2.7, 8.0)),
                note: "§6.2: \"vLLM can sustain 1.7x-2.7x higher request rates compared to Orca (Oracle) and 2.7x-8x compared to Orca (Max)\" on ShareGPT, over OPT-13B, 66B and 175B".into(),
            },
            WorkloadKind::Alpaca => Self {
                figure: "Fig. 12(d), OPT-13B, 1 A100, Alpaca".into(),
                knee_max: 7.0,
                knee_pow2: 13.0,
                knee_oracle: 20.0,
                knee_vllm: 28.0,
                text_over_oracle: None,
                text_over_max: None,
                note: "the paper gives no range of this form for Alpaca; §6.3 puts vLLM's gain over Orca (Oracle) for OPT-13B on Alpaca at 1.3x in basic sampling".into(),
            },
        }
    }

    /// vLLM ÷ Orca (Oracle) from the knees.
    pub fn over_oracle(&self) -> f64 {
        self.knee_vllm / self.knee_oracle
    }

    /// vLLM ÷ Orca (Max) from the knees.
    pub fn over_max(&self) -> f64 {
        self.knee_vllm / self.knee_max
    }
}

/// One workload's sweep.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct SweepReport {
    /// The workload.
    pub workload: String,
    /// The GPU.
    pub gpu: String,
    /// The model.
    pub model: String,
    /// The KV cache's dtype.
    pub kv_dtype: String,
    /// KV token slots.
    pub kv_capacity_tokens: u64,
    /// How steps with prompt tokens are priced.
    pub prefill: PrefillModel,
    /// Requests served at each rate.
    pub num_requests: usize,
    /// The workload's seed.
    pub seed: u64,
    /// `auto` or `given`.
    pub rates_chosen: String,
    /// Automatic rates: the paged policy's throughput with every request arriving at
    /// once, req/s (the grid's anchor).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub saturation_probe: Option<f64>,
    /// The bound on mean normalised latency, s/token.
    pub latency_bound: f64,
    /// Where the bound comes from.
    pub latency_bound_source: String,
    /// Per policy, its curve.
    pub policies: Vec<PolicySweep>,
    /// The paged policy's sustained rate over Oracle's; `None` when either has none or
    /// either is censored (a lower bound, not a rate).
    pub paged_over_oracle: Option<f64>,
    /// The paged policy's sustained rate over Pow2's (as `paged_over_oracle`).
    pub paged_over_pow2: Option<f64>,
    /// The paged policy's sustained rate over Max's (as `paged_over_oracle`).
    pub paged_over_max: Option<f64>,
    /// The paper's panel, when the model and GPU are the paper's (OPT-13B, A100-40GB).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub paper: Option<PaperFig12>,
}

impl SweepReport {
    /// The sweep of `policy`, if it ran.
    pub fn policy(&self, p: Policy) -> Option<&PolicySweep> {
        let name = p.name();
        self.policies.iter().find(|s| s.policy == name)
    }

    /// The report as text: a row per rate (per policy: normalised latency, req/s,
    /// mean batch, preemptions; `*` past the bound), the sustained rates, the ratios
    /// next to the paper's.
    pub fn to_table(&self) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "\nFig. 12 sweep: {} on {} ({} KV cache, {} token slots), {}; prefill {}",
            self.model,
            self.gpu,
            self.kv_dtype,
            self.kv_capacity_tokens,
            self.workload,
            self.prefill.name()
        );
        let _ = writeln!(
            o,
            "latency bound: {:.4} s/token ({}); rates {}",
            self.latency_bound,
            self.latency_bound_source,
            match self.saturation_probe {
                Some(r) => format!(
                    "chosen automatically around the paged policy's {r:.3} req/s with every request arriving at once"
                ),
                None => "given".into(),
            }
        );
        let mut rates: Vec<f64> = self
            .policies
            .iter()
            .flat_map(|p| p.points.iter().map(|x| x.rate))
            .collect();
        rates.sort_by(f64::total_cmp);
        rates.dedup();
        let _ = write!(o, "{:>8}", "");
        for p in &self.policies {
            let _ = write!(o, " | {:^29}", p.policy);
        }
        let _ = write!(o, "\n{:>8}", "req/s");
        for _ in &self.policies {
            let _ = write!(
                o,
                " | {:>8} {:>7} {:>6} {:>5}",
                "s/token", "done/s", "batch", "preem"
            );
        }
        o.push('\n');
        for r in rates {
            let _ = write!(o, "{:>8}", format_rate(r));
            for p in &self.policies {
                match p.points.iter().find(|x| x.rate == r) {
                    Some(x) => {
                        let sustained = PolicySweep::sustains(
                            x,
                            self.latency_bound,
                            p.saturation_rate,
                            self.num_requests,
                        );
                        let over = if sustained { ' ' } else { '*' };
                        let _ = write!(
                            o,
                            " | {:>7.4}{over} {:>7.3} {:>6.1} {:>5}",
                            x.mean_normalized_latency,
                            x.requests_per_s,
                            x.mean_batch,
                            x.preemptions
                        );
                    }
                    None => {
                        let _ = write!(o, " | {:>8} {:>7} {:>6} {:>5}", "", "", "", "");
                    }
                }
            }
            o.push('\n');
        }
        let _ = writeln!(
            o,
            "highest rate sustained (* marks a rate not sustained: over the bound, above the policy's saturated throughput, or not every request served):"
        );
        for p in &self.policies {
            let rate = match (p.max_rate, p.censored) {
                (None, _) => "none: not sustained at the lowest rate".to_string(),
                (Some(r), false) => format!("{} req/s", format_rate(r)),
                (Some(r), true) => format!(
                    "at least {} req/s (every rate run sustained)",
                    format_rate(r)
                ),
            };
            let _ = writeln!(
                o,
                "  {:<20} {rate} (saturated: {} req/s)",
                p.policy,
                format_rate(p.saturation_rate)
            );
        }
        let f = |x: Option<f64>| x.map_or("-".to_string(), |v| format!("{v:.2}x"));
        let _ = writeln!(
            o,
            "paged / Oracle {}, paged / Pow2 {}, paged / Max {}",
            f(self.paged_over_oracle),
            f(self.paged_over_pow2),
            f(self.paged_over_max)
        );
        if let Some(p) = &self.paper {
            let range = |r: Option<(f64, f64)>| {
                r.map_or("no range given".to_string(), |(a, b)| format!("{a}x-{b}x"))
            };
            let _ = writeln!(
                o,
                "paper, {}: knees (read off the plot, approximate) Max {}, Pow2 {}, Oracle {}, vLLM {} req/s: vLLM / Oracle {:.2}x, vLLM / Max {:.2}x; text range over OPT-13B/66B/175B: / Oracle {}, / Max {}",
                p.figure,
                p.knee_max,
                p.knee_pow2,
                p.knee_oracle,
                p.knee_vllm,
                p.over_oracle(),
                p.over_max(),
                range(p.text_over_oracle),
                range(p.text_over_max)
            );
            let _ = writeln!(o, "  ({})", p.note);
        }
        o
    }

    /// An error naming the first figure that is NaN or infinite.
    pub fn check_finite(&self) -> Result<(), SimError> {
        let bad = |what: &str| {
            err(format!(
                "internal error: {what} is not a finite number; please report the inputs"
            ))
        };
        if !self.latency_bound.is_finite() {
            return bad("the latency bound");
        }
        for p in &self.policies {
            for x in &p.points {
                for v in [
                    x.rate,
                    x.mean_normalized_latency,
                    x.mean_latency_s,
                    x.requests_per_s,
                    x.tokens_per_s,
                    x.mean_batch,
                ] {
                    if !v.is_finite() {
                        return bad(&format!("a point of {}", p.policy));
                    }
                }
            }
        }
        Ok(())
    }
}

/// A rate with as many digits as it needs (3 significant figures at least).
fn format_rate(r: f64) -> String {
    if r >= 1e5 {
        format!("{r:.2e}")
    } else if r >= 100.0 {
        format!("{r:.1}")
    } else if r >= 10.0 {
        format!("{r:.2}")
    } else if r >= 1.0 {
        format!("{r:.3}")
    } else {
        format!("{r:.4}")
    }
}

/// Runs the sweep (module docs). `on_run` is called before each simulation with what
/// it runs (for progress output).
pub fn sweep(
    cfg: &SimConfig,
    sc: &SweepConfig,
    on_run: &mut dyn FnMut(&str),
) -> Result<SweepReport, SimError> {
    let paged: Vec<Policy> = sc
        .policies
        .iter()
        .copied()
        .filter(|p| matches!(p, Policy::Paged(_)))
        .collect();
    let &[paged] = paged.as_slice() else {
        return err("sweep: the policies must hold exactly one paged policy");
    };
    if sc.num_requests == 0 || sc.num_requests > limits::MAX_REQUESTS {
        return err(format!(
            "--num-requests: {} is outside 1 to {}",
            sc.num_requests,
            limits::MAX_REQUESTS
        ));
    }
    if let Some(b) = sc.latency_bound
        && !(b.is_finite() && b > 0.0 && b <= 1e9)
    {
        return err(format!(
            "--latency-bound: {b} is not a latency in (0, 1e9] s/token"
        ));
    }
    let max_len = cfg.model.max_model_len;
    let capacity = cfg.capacity_tokens()?;
    let workload = |rate: f64| -> Result<Workload, SimError> {
        let w = Workload::synthetic(sc.kind, rate, sc.num_requests, max_len, sc.seed)?;
        Ok(if cfg.system_prompt > 0 {
            w.with_system_prompt(cfg.system_prompt, max_len)
        } else {
            w
        })
    };
    let mut run = |p: Policy, rate: f64, refined: bool| -> Result<SweepPoint, SimError> {
        on_run(&format!(
            "{} {} at {} req/s",
            sc.kind.name(),
            p.name(),
            format_rate(rate)
        ));
        let r = simulate(p, &workload(rate)?, cfg, &mut || {})?;
        Ok(SweepPoint::new(rate, &r, refined))
    };

    let (grid, probe) = match &sc.rates {
        Some(given) => {
            if given.is_empty() {
                return err("--rates: no rates");
            }
            if given.len() > MAX_RATES {
                return err(format!(
                    "--rates: {} rates, more than {MAX_RATES}",
                    given.len()
                ));
            }
            let mut g = Vec::with_capacity(given.len());
            for &r in given {
                g.push(check_range("--rates", r, limits::RATE)?);
            }
            g.sort_by(f64::total_cmp);
            g.dedup();
            (g, None)
        }
        None => {
            let sat = run(paged, *limits::RATE.end(), false)?.requests_per_s;
            if !(sat.is_finite() && sat > 0.0) {
                return err("sweep: the saturation probe served nothing");
            }
            let (lo, hi) = (sat / 16.0, sat * 1.25);
            let n = AUTO_GRID_POINTS;
            let g: Vec<f64> = (0..n)
                .map(|i| lo * (hi / lo).powf(i as f64 / (n - 1) as f64))
                .map(|r| r.clamp(*limits::RATE.start(), *limits::RATE.end()))
                .collect();
            let mut g: Vec<f64> = g;
            g.dedup();
            (g, Some(sat))
        }
    };

    // Every policy's saturated throughput (the paged one's is the auto grid's anchor).
    let mut saturation = Vec::with_capacity(sc.policies.len());
    for &p in &sc.policies {
        saturation.push(match probe {
            Some(sat) if p == paged => sat,
            _ => run(p, *limits::RATE.end(), false)?.requests_per_s,
        });
    }
    let mut curves: Vec<Vec<SweepPoint>> = Vec::with_capacity(sc.policies.len());
    for &p in &sc.policies {
        let mut pts = Vec::with_capacity(grid.len());
        for &r in &grid {
            pts.push(run(p, r, false)?);
        }
        curves.push(pts);
    }
    let paged_at = sc
        .policies
        .iter()
        .position(|&p| p == paged)
        .expect("paged is one of the policies");
    let (bound, source) = match sc.latency_bound {
        Some(b) => (b, "--latency-bound".to_string()),
        None => {
            let lowest = &curves[paged_at][0];
            let b = 2.0 * lowest.mean_normalized_latency;
            if !(b.is_finite() && b > 0.0) {
                return err(format!(
                    "sweep: {} completed no request at {} req/s; set --latency-bound",
                    paged.name(),
                    format_rate(lowest.rate)
                ));
            }
            (
                b,
                format!(
                    "twice {}'s {:.4} s/token at the lowest rate, {} req/s",
                    paged.name(),
                    lowest.mean_normalized_latency,
                    format_rate(lowest.rate)
                ),
            )
        }
    };

    let mut policies = Vec::with_capacity(sc.policies.len());
    for ((&p, mut pts), &sat) in sc.policies.iter().zip(curves).zip(&saturation) {
        let over = |x: &SweepPoint| !PolicySweep::sustains(x, bound, sat, sc.num_requests);
        // Automatic rates: extend below the grid until a rate is within the bound, and
        // past its top until one is over it.
        if sc.rates.is_none() {
            for _ in 0..MAX_EXTENSIONS {
                if !over(&pts[0]) {
                    break;
                }
                let low = pts[0].rate / 1.5;
                if low < *limits::RATE.start() {
                    break;
                }
                pts.insert(0, run(p, low, false)?);
            }
            for _ in 0..MAX_EXTENSIONS {
                if pts.iter().any(over) {
                    break;
                }
                let top = pts.last().expect("a grid point").rate * 1.5;
                if top > *limits::RATE.end() {
                    break;
                }
                pts.push(run(p, top, false)?);
            }
        }
        // Refine the knee between the last rate under the bound and the first over it.
        if let Some(i) = pts.iter().position(over)
            && i > 0
        {
            let (mut lo, mut hi) = (pts[i - 1].rate, pts[i].rate);
            for _ in 0..sc.refine_steps {
                let mid = (lo * hi).sqrt();
                if !(lo < mid && mid < hi) {
                    break;
                }
                let x = run(p, mid, true)?;
                if over(&x) {
                    hi = mid;
                } else {
                    lo = mid;
                }
                pts.push(x);
            }
        }
        pts.sort_by(|a, b| a.rate.total_cmp(&b.rate));
        let (max_rate, censored) = PolicySweep::sustained(&pts, bound, sat, sc.num_requests);
        policies.push(PolicySweep {
            policy: p.name(),
            saturation_rate: sat,
            points: pts,
            max_rate,
            censored,
        });
    }

    // (A censored rate is a lower bound: no ratio of it.)
    let rate_of = |want: Policy| {
        sc.policies
            .iter()
            .position(|&p| p == want)
            .filter(|&i| !policies[i].censored)
            .and_then(|i| policies[i].max_rate)
    };
    let ratio = |base: Policy| match (rate_of(paged), rate_of(base)) {
        (Some(a), Some(b)) if b > 0.0 => Some(a / b),
        _ => None,
    };
    let paper = (cfg.model.name == "opt-13b"
        && cfg.gpu.name == "a100-40gb"
        && cfg.kv_dtype == KvDtype::F16
        && cfg.kv_budget_gib.is_none()
        && cfg.system_prompt == 0)
        .then(|| PaperFig12::of(sc.kind));
    let (mp, mo) = sc.kind.means();
    let report = SweepReport {
        workload: format!(
            "{} (synthetic: Poisson arrivals, log-normal lengths calibrated to the paper's means {mp}/{mo}{}), {} requests at each rate, seed {}",
            sc.kind.name(),
            if cfg.system_prompt > 0 {
                // (Every rate serves the same lengths.)
                let shortened =
                    Workload::synthetic(sc.kind, 1.0, sc.num_requests, max_len, sc.seed)?
                        .shortened_by_system_prompt(cfg.system_prompt, max_len);
                format!(
                    ", after a {}-token system prompt, {}",
                    cfg.system_prompt,
                    super::workload::shortened_note(shortened, sc.num_requests, max_len)
                )
            } else {
                String::new()
            },
            sc.num_requests,
            sc.seed
        ),
        gpu: cfg.gpu.name.clone(),
        model: cfg.model.name.clone(),
        kv_dtype: cfg.kv_dtype.label(&cfg.model),
        kv_capacity_tokens: capacity,
        prefill: cfg.prefill,
        num_requests: sc.num_requests,
        seed: sc.seed,
        rates_chosen: if sc.rates.is_some() { "given" } else { "auto" }.into(),
        saturation_probe: probe,
        latency_bound: bound,
        latency_bound_source: source,
        paged_over_oracle: ratio(Policy::Oracle),
        paged_over_pow2: ratio(Policy::Pow2),
        paged_over_max: ratio(Policy::Max),
        policies,
        paper,
    };
    report.check_finite()?;
    Ok(report)
}
