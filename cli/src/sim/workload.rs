//! Workloads: the requests a run serves, either synthetic (Poisson arrivals, log-normal
//! lengths calibrated to the paper's means) or read from a JSONL trace, checked line by
//! line.

use std::path::Path;

use rand::SeedableRng;
use rand::rngs::SmallRng;
use rand_distr::{Distribution, Exp, LogNormal};
use serde::{Deserialize, Serialize};

use super::{SimError, check_range, err, limits};

/// One request of a workload.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct TraceRequest {
    /// Arrival time, seconds from the start.
    pub arrival_s: f64,
    /// Prompt tokens.
    pub prompt_len: u32,
    /// Output tokens.
    pub output_len: u32,
}

/// The synthetic workloads, with the paper's mean lengths (Fig. 11).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WorkloadKind {
    /// Mean prompt 161.31, mean output 337.99 tokens.
    ShareGpt,
    /// Mean prompt 19.31, mean output 58.45 tokens.
    Alpaca,
}

impl WorkloadKind {
    /// Parses `sharegpt` / `alpaca`.
    pub fn parse(s: &str) -> Result<Self, SimError> {
        match s {
            "sharegpt" => Ok(Self::ShareGpt),
            "alpaca" => Ok(Self::Alpaca),
            other => err(format!(
                "--workload: unknown workload `{other}` (sharegpt or alpaca)"
            )),
        }
    }

    /// The paper's mean (prompt, output) lengths.
    pub fn means(self) -> (f64, f64) {
        match self {
            Self::ShareGpt => (161.31, 337.99),
            Self::Alpaca => (19.31, 58.45),
        }
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            Self::ShareGpt => "ShareGPT",
            Self::Alpaca => "Alpaca",
        }
    }
}

/// A workload: requests sorted by arrival, and how they were made.
#[derive(Clone, Debug, PartialEq)]
pub struct Workload {
    /// The requests, by arrival time.
    pub requests: Vec<TraceRequest>,
    /// One line saying where they come from.
    pub description: String,
}

/// Log-normal spread of the synthetic lengths (ln-space standard deviation).
pub const LENGTH_SIGMA: f64 = 1.0;

/// Draws a clipped log-normal length whose *clipped* mean is `mean`: the ln-space
/// location is found by bisection on a fixed sample, so clipping to `[1, max]` does not
/// move the mean.
fn calibrated_lognormal(mean: f64, max: u32) -> LogNormal<f64> {
    let mut probe = SmallRng::seed_from_u64(0x5eed);
    let z: Vec<f64> = (0..20_000)
        .map(|_| {
            let n: f64 = rand_distr::StandardNormal.sample(&mut probe);
            n
        })
        .collect();
    let clipped_mean = |mu: f64| {
        z.iter()
            .map(|n| (mu + LENGTH_SIGMA * n).exp().round().clamp(1.0, max as f64))
            .sum::<f64>()
            / z.len() as f64
    };
    let (mut lo, mut hi) = (-5.0, (max as f64).ln() + 5.0);
    for _ in 0..60 {
        let mid = 0.5 * (lo + hi);
        if clipped_mean(mid) < mean {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    LogNormal::new(0.5 * (lo + hi), LENGTH_SIGMA).expect("finite parameters")
}

impl Workload {
    /// The same requests, each prompt `n` tokens longer (a system prompt before it),
    /// within `max_len` tokens a request: the output shortened first (to one token at
    /// least), then the prompt. The description says how many requests were shortened
    /// ([`Workload::shortened_by_system_prompt`]), none silently.
    pub fn with_system_prompt(&self, n: u32, max_len: u32) -> Workload {
        let requests: Vec<TraceRequest> = self
            .requests
            .iter()
            .map(|r| with_system_prompt(r, n, max_len))
            .collect();
        Workload {
            description: format!(
                "{}, after a {n}-token system prompt ({})",
                self.description,
                shortened_note(
                    self.shortened_by_system_prompt(n, max_len),
                    self.requests.len(),
                    max_len
                )
            ),
            requests,
        }
    }

    /// How many of the requests a system prompt of `n` tokens would push past
    /// `max_len` tokens, so that [`Workload::with_system_prompt`] shortens them.
    pub fn shortened_by_system_prompt(&self, n: u32, max_len: u32) -> usize {
        self.requests
            .iter()
            .filter(|r| {
                let s = with_system_prompt(r, n, max_len);
                s.prompt_len != r.prompt_len.saturating_add(n) || s.output_len != r.output_len
            })
            .count()
    }

    /// `n` requests arriving as a Poisson process at `rate` per second, lengths drawn
    /// from log-normals (σ = [`LENGTH_SIGMA`]) calibrated so their means, after
    /// clipping (prompt and output each to `[1, max_len / 2]`),
    /// match the paper's.
    pub fn synthetic(
        kind: WorkloadKind,
        rate: f64,
        n: usize,
        max_len: u32,
        seed: u64,
    ) -> Result<Self, SimError> {
        check_range("--rate", rate, limits::RATE)?;
        if n == 0 || n > limits::MAX_REQUESTS {
            return err(format!(
                "--num-requests: {n} is outside 1 to {}",
                limits::MAX_REQUESTS
            ));
        }
        let (mp, mo) = kind.means();
        let prompt_d = calibrated_lognormal(mp, max_len / 2);
        let out_d = calibrated_lognormal(mo, max_len / 2);
        let gap = Exp::new(rate).expect("positive rate");
        let mut r = SmallRng::seed_from_u64(seed);
        let mut t = 0.0;
        let mut requests = Vec::with_capacity(n);
        for _ in 0..n {
            t += gap.sample(&mut r);
            let p = prompt_d
                .sample(&mut r)
                .round()
                .clamp(1.0, (max_len / 2) as f64) as u32;
            let o = out_d
                .sample(&mut r)
                .round()
                .clamp(1.0, (max_len / 2) as f64) as u32;
            requests.push(TraceRequest {
                arrival_s: t,
                prompt_len: p,
                output_len: o,
            });
        }
        let (ap, ao) = mean_lengths(&requests);
        Ok(Self {
            description: format!(
                "{} (synthetic: Poisson arrivals at {rate} req/s; log-normal lengths, sigma {LENGTH_SIGMA}, calibrated to the paper's means {mp}/{mo}; this sample's means {ap:.1}/{ao:.1}), {n} requests, seed {seed}",
                kind.name()
            ),
            requests,
        })
    }

    /// Reads a JSONL trace: one `{"arrival_s": …, "prompt_len": …, "output_len": …}` per
    /// line (blank lines skipped), streamed line by line: a line longer than
    /// [`limits::MAX_TRACE_LINE_BYTES`] or more than [`limits::MAX_REQUESTS`] requests is
    /// an error. Errors name the line; a path that is a folder is an error saying so.
    pub fn from_trace(path: &Path, max_len: u32) -> Result<Self, SimError> {
        let f = std::fs::File::open(path)
            .map_err(|e| SimError(format!("--trace {}: {e}", path.display())))?;
        // (Opening a folder succeeds on Unix; reading it would fail as "trace line 1".)
        if f.metadata().is_ok_and(|m| m.is_dir()) {
            return err(format!(
                "--trace {}: is a directory, not a trace file",
                path.display()
            ));
        }
        Self::read_trace(std::io::BufReader::new(f), max_len)
            .map_err(|e| SimError(format!("--trace {}: {e}", path.display())))
            .map(|mut w| {
                w.description = format!("trace {} ({} requests)", path.display(), w.requests.len());
                w
            })
    }

    /// Parses JSONL trace text (see [`Workload::from_trace`]).
    pub fn parse_trace(text: &str, max_len: u32) -> Result<Self, SimError> {
        Self::read_trace(text.as_bytes(), max_len)
    }

    /// Reads a JSONL trace from any reader (see [`Workload::from_trace`]).
    pub fn read_trace(mut r: impl std::io::BufRead, max_len: u32) -> Result<Self, SimError> {
        use std::io::{BufRead as _, Read as _};
        let mut requests = Vec::new();
        let mut buf = Vec::new();
        let limit = limits::MAX_TRACE_LINE_BYTES;
        for n in 1u64.. {
            buf.clear();
            let got = (&mut r)
                .take(limit as u64 + 1)
                .read_until(b'\n', &mut buf)
                .map_err(|e| SimError(format!("trace line {n}: {e}")))?;
            if got == 0 {
                break;
            }
            if buf.last() == Some(&b'\n') {
                buf.pop();
            } else if buf.len() > limit {
                return err(format!("trace line {n}: longer than {limit} bytes"));
            }
            let line = std::str::from_utf8(&buf)
                .map_err(|e| SimError(format!("trace line {n}: not UTF-8 ({e})")))?;
            if line.trim().is_empty() {
                continue;
            }
            if requests.len() == limits::MAX_REQUESTS {
                return err(format!(
                    "trace line {n}: more than {} requests",
                    limits::MAX_REQUESTS
                ));
            }
            requests.push(
                parse_trace_line(line, max_len)
                    .map_err(|e| SimError(format!("trace line {n}: {e}")))?,
            );
        }
        if requests.is_empty() {
            return err("trace: no requests");
        }
        requests.sort_by(|a, b| a.arrival_s.total_cmp(&b.arrival_s));
        Ok(Self {
            description: format!("trace ({} requests)", requests.len()),
            requests,
        })
    }
}

/// `r` after a system prompt of `n` tokens, within `max_len` (see
/// [`Workload::with_system_prompt`]).
fn with_system_prompt(r: &TraceRequest, n: u32, max_len: u32) -> TraceRequest {
    let prompt = r
        .prompt_len
        .saturating_add(n)
        .min(max_len.saturating_sub(1));
    TraceRequest {
        prompt_len: prompt,
        output_len: r.output_len.min(max_len - prompt).max(1),
        ..*r
    }
}

/// What a report says of the requests a system prompt shortened: "3 of 400 requests
/// shortened to fit the model's 2048 tokens, outputs first".
pub(super) fn shortened_note(shortened: usize, requests: usize, max_len: u32) -> String {
    format!(
        "{shortened} of {requests} request{} shortened to fit the model's {max_len} tokens, outputs first",
        if requests == 1 { "" } else { "s" }
    )
}

/// One trace line, checked: a finite arrival time in `[0, MAX_ARRIVAL_S]`, positive
/// lengths whose sum fits the model.
fn parse_trace_line(line: &str, max_len: u32) -> Result<TraceRequest, SimError> {
    #[derive(Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Line {
        arrival_s: f64,
        prompt_len: i64,
        output_len: i64,
    }
    let l: Line = serde_json::from_str(line).map_err(|e| SimError(e.to_string()))?;
    if !(0.0..=limits::MAX_ARRIVAL_S).contains(&l.arrival_s) {
        return err(format!(
            "arrival_s {} is not a time from 0 to {:e} s",
            l.arrival_s,
            limits::MAX_ARRIVAL_S
        ));
    }
    let mut lens = [0u32; 2];
    for (slot, (what, v)) in lens
        .iter_mut()
        .zip([("prompt_len", l.prompt_len), ("output_len", l.output_len)])
    {
        if v <= 0 {
            return err(format!("{what} {v} must be positive"));
        }
        *slot = u32::try_from(v)
            .ok()
            .filter(|&x| x <= max_len)
            .ok_or_else(|| {
                SimError(format!(
                    "{what} {v} exceeds the model's maximum length {max_len}"
                ))
            })?;
    }
    let [prompt_len, output_len] = lens;
    if prompt_len as u64 + output_len as u64 > max_len as u64 {
        return err(format!(
            "{prompt_len} + {output_len} tokens exceed the model's maximum length {max_len}"
        ));
    }
    Ok(TraceRequest {
        arrival_s: l.arrival_s,
        prompt_len,
        output_len,
    })
}

fn mean_lengths(r: &[TraceRequest]) -> (f64, f64) {
    let n = r.len().max(1) as f64;
    (
        r.iter().map(|x| x.prompt_len as f64).sum::<f64>() / n,
        r.iter().map(|x| x.output_len as f64).sum::<f64>() / n,
    )
}
