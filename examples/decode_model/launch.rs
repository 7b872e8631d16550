//! A CTA-level simulation of one streaming kernel launch (a model, not a measurement).
//!
//! The grid's CTAs, in launch order, go to the SMs' resident slots: the first wave one
//! SM after another (CTA `i` to SM `i % SMs`), each later CTA to the slot that frees
//! first. A CTA then passes three phases:
//!
//! 1. *prologue*: its code before the stage loop (replayed once) and the first stage's
//!    memory latency (the pipeline fill);
//! 2. *stream*: its K/V bytes at a rate no more than what its SM's compute allows (the
//!    replayed cycles a stage with as many CTAs resident on that SM as now run there),
//!    what its stages in flight allow (`stages_in_flight × stage bytes / latency`,
//!    Little's law), and its share of the sustained DRAM bandwidth: the streaming CTAs
//!    share it max-min fairly (water-filling on their own caps);
//! 3. *epilogue*: its code after the loop (replayed once).
//!
//! The kernel ends when its last CTA does: the tail wave and the CTAs of uneven length
//! are in. Rates change only when a CTA changes phase, so the simulation steps from
//! one such event to the next.

/// One CTA's work.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Cta {
    /// K/V bytes it streams.
    pub(crate) bytes: f64,
}

/// What the simulation knows of a kernel on a GPU.
pub(crate) struct Kernel {
    pub(crate) sms: u32,
    /// CTAs an SM holds at once.
    pub(crate) resident: u32,
    /// `stage_seconds[k - 1]`: a stage's time for one CTA while `k` CTAs run on its SM.
    pub(crate) stage_seconds: Vec<f64>,
    /// Bytes of one stage.
    pub(crate) stage_bytes: f64,
    pub(crate) stages_in_flight: u32,
    pub(crate) prologue_s: f64,
    pub(crate) epilogue_s: f64,
    /// Memory latency the stages in flight cover.
    pub(crate) latency_s: f64,
    /// Sustained DRAM bandwidth, bytes per second.
    pub(crate) dram_bytes_per_s: f64,
}

/// The simulated launch.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Simulated {
    pub(crate) seconds: f64,
    /// Share of the time at least one SM had no CTA to run while another still ran
    /// (the tail).
    pub(crate) tail_s: f64,
    /// What bound the streaming phase most of the time (by bytes moved): `DRAM`,
    /// `compute` or `latency`.
    pub(crate) limit: &'static str,
}

#[derive(Clone, Copy)]
enum Phase {
    Prologue(f64),
    Stream(f64),
    Epilogue(f64),
}

struct Running {
    sm: usize,
    phase: Phase,
}

/// Simulates the launch of `ctas` (in launch order) on `k`.
pub(crate) fn simulate(k: &Kernel, ctas: &[Cta]) -> Simulated {
    let sms = k.sms as usize;
    let mut on_sm = vec![0u32; sms];
    let mut running: Vec<Running> = Vec::new();
    let mut next = 0usize;
    // The first wave, one SM after another.
    while next < ctas.len() && next < sms * k.resident as usize {
        let sm = next % sms;
        on_sm[sm] += 1;
        running.push(Running {
            sm,
            phase: Phase::Prologue(k.prologue_s),
        });
        next += 1;
    }
    let mut pending: Vec<f64> = ctas[..next].iter().map(|c| c.bytes).collect();
    let mut t = 0.0;
    let mut tail_s = 0.0;
    let mut by_limit = [0.0f64; 3]; // bytes moved while DRAM / compute / latency bound
    while !running.is_empty() {
        // Each streaming CTA's own cap, then the DRAM share (water-filling).
        let caps: Vec<(f64, usize)> = running
            .iter()
            .map(|r| match r.phase {
                Phase::Stream(_) => {
                    let compute =
                        k.stage_bytes / k.stage_seconds[(on_sm[r.sm] as usize).max(1) - 1];
                    let latency = k.stages_in_flight as f64 * k.stage_bytes / k.latency_s;
                    if compute <= latency {
                        (compute, 1)
                    } else {
                        (latency, 2)
                    }
                }
                _ => (0.0, 0),
            })
            .collect();
        let rates = water_fill(
            &caps.iter().map(|c| c.0).collect::<Vec<_>>(),
            k.dram_bytes_per_s,
        );
        // The next event.
        let mut dt = f64::INFINITY;
        for (r, &rate) in running.iter().zip(&rates) {
            let d = match r.phase {
                Phase::Prologue(left) | Phase::Epilogue(left) => left,
                Phase::Stream(left) if rate > 0.0 => left / rate,
                Phase::Stream(_) => f64::INFINITY,
            };
            dt = dt.min(d);
        }
        if !dt.is_finite() {
            break; // nothing can progress: cannot happen with positive rates
        }
        if next >= ctas.len() && on_sm.contains(&0) {
            tail_s += dt;
        }
        t += dt;
        let mut finished = Vec::new();
        for (i, (r, &rate)) in running.iter_mut().zip(&rates).enumerate() {
            r.phase = match r.phase {
                Phase::Prologue(left) if left - dt <= 1e-15 => Phase::Stream(pending[i]),
                Phase::Prologue(left) => Phase::Prologue(left - dt),
                Phase::Stream(left) => {
                    let moved = (rate * dt).min(left);
                    let bound = if rate < caps[i].0 * (1.0 - 1e-9) {
                        0
                    } else {
                        caps[i].1
                    };
                    by_limit[bound] += moved;
                    if left - moved <= left * 1e-12 + 1e-9 {
                        Phase::Epilogue(k.epilogue_s)
                    } else {
                        Phase::Stream(left - moved)
                    }
                }
                Phase::Epilogue(left) if left - dt <= 1e-15 => {
                    finished.push(i);
                    Phase::Epilogue(0.0)
                }
                Phase::Epilogue(left) => Phase::Epilogue(left - dt),
            };
        }
        // Finished CTAs free their slots; the next CTAs in launch order take them.
        for &i in finished.iter().rev() {
            let sm = running[i].sm;
            running.swap_remove(i);
            pending.swap_remove(i);
            on_sm[sm] -= 1;
            if next < ctas.len() {
                on_sm[sm] += 1;
                running.push(Running {
                    sm,
                    phase: Phase::Prologue(k.prologue_s),
                });
                pending.push(ctas[next].bytes);
                next += 1;
            }
        }
    }
    let limit = ["DRAM", "compute", "latency"][by_limit
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .map_or(0, |m| m.0)];
    Simulated {
        seconds: t,
        tail_s,
        limit,
    }
}

/// Max-min fair shares of `total` among demands capped at `caps` (0: not a taker).
fn water_fill(caps: &[f64], total: f64) -> Vec<f64> {
    let mut rates = vec![0.0; caps.len()];
    let mut takers: Vec<usize> = (0..caps.len()).filter(|&i| caps[i] > 0.0).collect();
    takers.sort_by(|&a, &b| caps[a].total_cmp(&caps[b]));
    let mut left = total;
    let mut n = takers.len();
    for &i in &takers {
        let share = left / n as f64;
        rates[i] = caps[i].min(share);
        left -= rates[i];
        n -= 1;
    }
    rates
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(resident: u32) -> Kernel {
        Kernel {
            sms: 2,
            resident,
            stage_seconds: vec![1e-6; resident as usize],
            stage_bytes: 1000.0,
            stages_in_flight: 2,
            prologue_s: 0.0,
            epilogue_s: 0.0,
            latency_s: 1e-6,
            dram_bytes_per_s: 1e12,
        }
    }

    #[test]
    fn dram_bound_launch_takes_bytes_over_bandwidth() {
        // Caps 1 GB/s per CTA compute... far above the DRAM share of 4 CTAs.
        let mut k = kernel(2);
        k.stage_seconds = vec![1e-12; 2];
        k.latency_s = 1e-12;
        let ctas = vec![Cta { bytes: 1e6 }; 8];
        let s = simulate(&k, &ctas);
        assert!((s.seconds - 8e-6).abs() < 1e-9, "{}", s.seconds);
        assert_eq!(s.limit, "DRAM");
    }

    #[test]
    fn a_tail_wave_costs_a_whole_cta() {
        // Compute bound: each CTA 1e6 bytes at 1e9 B/s = 1 ms; 5 CTAs on 2 SMs x 1 slot
        // take three waves.
        let mut k = kernel(1);
        k.dram_bytes_per_s = 1e15;
        k.latency_s = 1e-12;
        let ctas = vec![Cta { bytes: 1e6 }; 5];
        let s = simulate(&k, &ctas);
        assert!((s.seconds - 3e-3).abs() < 1e-9, "{}", s.seconds);
        assert!((s.tail_s - 1e-3).abs() < 1e-9, "{}", s.tail_s);
        assert_eq!(s.limit, "compute");
    }

    #[test]
    fn water_fill_is_max_min_fair() {
        let r = water_fill(&[1.0, 10.0, 10.0, 0.0], 9.0);
        assert_eq!(r, vec![1.0, 4.0, 4.0, 0.0]);
    }
}
