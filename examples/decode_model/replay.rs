//! A cycle-level replay of one SM running a kernel's steady-state loop, from the SASS
//! control codes (a model, not a measurement).
//!
//! `scripts/decode-model.py` turns each instruction of a loop into an [`Op`]: its pipe
//! class and, from bits 105-127 of the 128-bit instruction (`nvdisasm -hex`), the
//! compiler's stall count, the scoreboard it sets when its result (write) or its operands
//! (read) are ready, and the scoreboards it waits on. The replay runs every resident
//! warp of `ctas` CTAs on the SM's four schedulers:
//!
//! 1. A scheduler issues at most one warp-instruction a cycle, greedy then oldest: the
//!    warp it issued last while that warp is ready, else the lowest-numbered ready warp.
//! 2. A warp is ready when its last instruction's stall count has elapsed, every
//!    scoreboard in the instruction's wait mask is released, its pipe is free, and it
//!    is not waiting at a barrier.
//! 3. Fixed-latency results need nothing more: the compiler's stall counts cover them
//!    (HMMA never sets a scoreboard on sm_80 or sm_90). Variable-latency results
//!    (shared-memory loads, shuffles, MUFU, conversions, constant and global loads)
//!    release their scoreboard [`Machine::latency`] cycles after issue, or after the
//!    shared-memory data path has moved their bytes when it is busy.
//! 4. Pipes: per scheduler, the FMA pipe (FFMA/FMUL/FADD, HFMA2, IMAD), the integer ALU,
//!    the XU (MUFU and conversions) and the tensor pipe hold for their cycles per
//!    warp-instruction; per SM, the shared-memory data path moves
//!    [`Machine::shared_bytes_per_clk`] (LDS, LDSM, STS and the cp.async writes) and the
//!    shuffle unit takes one warp-instruction a cycle.
//! 5. `BAR.SYNC` holds a warp until every warp of its CTA has arrived, then releases
//!    them [`Machine::bar_release`] cycles later. `DEPBAR` (the cp.async wait) is free
//!    here: the data's arrival is the launch model's business (`launch.rs`).
//!
//! Warps are placed on schedulers as the hardware numbers them: warp `w` of the SM on
//! scheduler `w % 4`.

/// The pipe class of an instruction (`decode-model.py`'s `CLASS`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Class {
    Fma,
    Half,
    Imad,
    Alu,
    Uniform,
    Conv,
    Mufu,
    Shfl,
    Lds,
    Ldsm,
    Sts,
    Ldgsts,
    Ldg,
    Stg,
    Ldc,
    S2r,
    Hmma,
    Bar,
    Depbar,
    Branch,
}

impl Class {
    fn parse(s: &str) -> Result<Class, String> {
        Ok(match s {
            "fma" => Class::Fma,
            "half" => Class::Half,
            "imad" => Class::Imad,
            "alu" => Class::Alu,
            "uniform" => Class::Uniform,
            "conv" => Class::Conv,
            "mufu" => Class::Mufu,
            "shfl" => Class::Shfl,
            "lds" => Class::Lds,
            "ldsm" => Class::Ldsm,
            "sts" => Class::Sts,
            "ldgsts" => Class::Ldgsts,
            "ldg" => Class::Ldg,
            "stg" => Class::Stg,
            "ldc" => Class::Ldc,
            "s2r" => Class::S2r,
            "hmma" => Class::Hmma,
            "bar" => Class::Bar,
            "depbar" => Class::Depbar,
            "branch" => Class::Branch,
            _ => return Err(format!("unknown instruction class {s:?}")),
        })
    }

    fn shared(self) -> bool {
        matches!(self, Class::Lds | Class::Ldsm | Class::Sts | Class::Ldgsts)
    }
}

/// One instruction of a trace.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Op {
    pub(crate) class: Class,
    /// Bytes a shared-memory access moves for the warp, or an HMMA's m16n8k16 count.
    pub(crate) size: u32,
    /// Cycles before the warp's next instruction may issue (the control code's stall).
    pub(crate) stall: u32,
    /// Scoreboard released when the result is written (7: none).
    pub(crate) write_sb: u8,
    /// Scoreboard released when the operands have been read (7: none).
    pub(crate) read_sb: u8,
    /// Scoreboards (bit mask) the instruction waits on before it issues.
    pub(crate) wait: u8,
}

/// Parses `decode-model.py`'s trace: comma-separated `class.size.stall.wb.rb.wait`.
pub(crate) fn parse_trace(s: &str) -> Result<Vec<Op>, String> {
    if s.is_empty() {
        return Ok(Vec::new());
    }
    s.split(',')
        .map(|tok| {
            let f: Vec<&str> = tok.split('.').collect();
            let [class, size, stall, wb, rb, wait] = f[..] else {
                return Err(format!("bad trace token {tok:?}"));
            };
            let n = |v: &str| v.parse::<u32>().map_err(|e| format!("{tok:?}: {e}"));
            Ok(Op {
                class: Class::parse(class)?,
                size: n(size)?,
                stall: n(stall)?,
                write_sb: n(wb)? as u8,
                read_sb: n(rb)? as u8,
                wait: n(wait)? as u8,
            })
        })
        .collect()
}

/// An SM's pipes and latencies, per architecture. Every constant is documented where
/// `sm80` and `sm90` set it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Machine {
    /// Cycles a scheduler's FMA pipe holds for an FFMA/FMUL/FADD warp-instruction.
    pub(crate) fma: u32,
    /// … for an HFMA2/HADD2/HMUL2.
    pub(crate) half: u32,
    /// … for an IMAD (the FMA-heavy pipe).
    pub(crate) imad: u32,
    /// Cycles the integer ALU holds for an IADD3/LOP3/ISETP/... warp-instruction.
    pub(crate) alu: u32,
    /// Cycles the XU holds for a MUFU or a conversion.
    pub(crate) xu: u32,
    /// Cycles the tensor pipe holds for one HMMA.16816 (m16n8k16, f16 in, f32 out).
    pub(crate) hmma: u32,
    /// Bytes the SM's shared-memory data path moves a cycle.
    pub(crate) shared_bytes_per_clk: u32,
    /// Cycles from a barrier's last arrival to the release of its warps.
    pub(crate) bar_release: u32,
    /// Cycles from issue to the release of a global load's scoreboard (the memory
    /// latency in cycles at the model's clock).
    pub(crate) global_latency: u32,
}

impl Machine {
    /// Cycles from issue to the release of the write scoreboard of a variable-latency
    /// instruction of `class` (the shared-memory data path's queueing aside).
    pub(crate) fn latency(&self, class: Class) -> u32 {
        match class {
            // Shared-memory loads and ldmatrix: ~30 cycles on Ampere and Hopper
            // (microbenchmarks: Jia et al. 2019 for Turing/Volta, Luo et al. 2024 for
            // Hopper, rounded up).
            Class::Lds | Class::Ldsm => 30,
            Class::Shfl => 24,
            Class::Mufu => 18,
            Class::Conv => 14,
            Class::Ldc => 12,
            Class::S2r => 20,
            Class::Ldg => self.global_latency,
            // Everything else that sets a scoreboard (POPC, FLO, F2F with a
            // scoreboard, …): a short variable latency.
            _ => 12,
        }
    }

    /// Cycles from issue to the release of a read scoreboard (the operands read).
    pub(crate) fn read_latency(&self, class: Class) -> u32 {
        match class {
            Class::Ldgsts | Class::Sts | Class::Stg | Class::Ldg => 12,
            _ => 8,
        }
    }

    fn pipe(&self, op: &Op) -> Option<(usize, u32)> {
        match op.class {
            Class::Fma => Some((PIPE_FMA, self.fma)),
            Class::Half => Some((PIPE_FMA, self.half)),
            Class::Imad => Some((PIPE_FMA, self.imad)),
            Class::Alu => Some((PIPE_ALU, self.alu)),
            Class::Mufu | Class::Conv => Some((PIPE_XU, self.xu)),
            Class::Hmma => Some((PIPE_TENSOR, self.hmma * op.size.max(1) / 2)),
            _ => None,
        }
    }
}

const PIPE_FMA: usize = 0;
const PIPE_ALU: usize = 1;
const PIPE_XU: usize = 2;
const PIPE_TENSOR: usize = 3;
const SCHEDULERS: usize = 4;
/// A replay that has not finished by then is reported as such, not looped forever.
const MAX_CYCLES: u64 = 50_000_000;

struct Warp {
    cta: usize,
    pc: usize,
    iter: u32,
    next_issue: u64,
    scoreboard: [u64; 6],
    at_barrier: bool,
}

/// The result of a replay.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Replayed {
    /// Cycles per iteration of the loop on the SM, every CTA doing one iteration in
    /// that time (steady state: after the warm-up iterations).
    pub(crate) cycles_per_iter: f64,
    /// Cycles until the last warp finished its last iteration.
    pub(crate) total_cycles: u64,
}

/// Replays `body` on one SM: `ctas` CTAs of `warps_per_cta` warps, each warp running
/// `iters` iterations; the steady-state figure leaves out the first and the last
/// `warmup` iterations' worth of warp-iterations.
pub(crate) fn replay(
    body: &[Op],
    m: &Machine,
    ctas: u32,
    warps_per_cta: u32,
    iters: u32,
    warmup: u32,
) -> Result<Replayed, String> {
    if body.is_empty() {
        return Ok(Replayed {
            cycles_per_iter: 0.0,
            total_cycles: 0,
        });
    }
    let n = (ctas * warps_per_cta) as usize;
    let mut warps: Vec<Warp> = (0..n)
        .map(|w| Warp {
            cta: w / warps_per_cta as usize,
            pc: 0,
            iter: 0,
            next_issue: 0,
            scoreboard: [0; 6],
            at_barrier: false,
        })
        .collect();
    let mut arrived = vec![0u32; ctas as usize];
    let mut pipes = [[0u64; 4]; SCHEDULERS];
    let (mut shared_free, mut shfl_free) = (0u64, 0u64);
    let mut last = [usize::MAX; SCHEDULERS];
    // The cycle at which each warp-iteration finished, in order of finishing.
    let mut finished = Vec::with_capacity(n * iters as usize);
    let mut done = 0usize;
    let mut t = 0u64;
    while done < n {
        if t > MAX_CYCLES {
            return Err(format!("replay did not finish in {MAX_CYCLES} cycles"));
        }
        let mut next_event = u64::MAX;
        let mut any_issued = false;
        for s in 0..SCHEDULERS {
            // Greedy: the warp issued last, then the others in order.
            let order = std::iter::once(last[s])
                .filter(|&w| w != usize::MAX)
                .chain((s..n).step_by(SCHEDULERS));
            let mut issued = None;
            for w in order {
                let wp = &warps[w];
                if wp.iter >= iters || wp.at_barrier {
                    continue;
                }
                let op = &body[wp.pc];
                let mut ready = wp.next_issue;
                for (k, &r) in wp.scoreboard.iter().enumerate() {
                    if op.wait & (1 << k) != 0 {
                        ready = ready.max(r);
                    }
                }
                if let Some((p, _)) = m.pipe(op) {
                    ready = ready.max(pipes[s][p]);
                }
                if op.class == Class::Shfl {
                    ready = ready.max(shfl_free);
                }
                if ready <= t {
                    issued = Some(w);
                    break;
                }
                next_event = next_event.min(ready);
            }
            let Some(w) = issued else { continue };
            any_issued = true;
            last[s] = w;
            let op = body[warps[w].pc];
            let mut result_at = t + m.latency(op.class) as u64;
            if let Some((p, c)) = m.pipe(&op) {
                pipes[s][p] = t + c as u64;
            }
            if op.class == Class::Shfl {
                shfl_free = t + 1;
            }
            if op.class.shared() {
                let moved = shared_free.max(t) + op.size.div_ceil(m.shared_bytes_per_clk) as u64;
                shared_free = moved;
                result_at = result_at.max(moved);
            }
            let wp = &mut warps[w];
            wp.next_issue = t + op.stall.max(1) as u64;
            if op.write_sb < 6 {
                let sb = &mut wp.scoreboard[op.write_sb as usize];
                *sb = (*sb).max(result_at);
            }
            if op.read_sb < 6 {
                let sb = &mut wp.scoreboard[op.read_sb as usize];
                *sb = (*sb).max(t + m.read_latency(op.class) as u64);
            }
            wp.pc += 1;
            if wp.pc == body.len() {
                wp.pc = 0;
                finished.push(wp.next_issue);
                wp.iter += 1;
                if wp.iter == iters {
                    done += 1;
                }
            }
            if op.class == Class::Bar {
                let cta = wp.cta;
                wp.at_barrier = true;
                arrived[cta] += 1;
                if arrived[cta] == warps_per_cta {
                    arrived[cta] = 0;
                    let release = t + m.bar_release as u64;
                    for v in warps.iter_mut().filter(|v| v.cta == cta) {
                        v.at_barrier = false;
                        v.next_issue = v.next_issue.max(release);
                    }
                }
            }
        }
        // Step a cycle, or, when no scheduler issued, jump to the next cycle at which
        // some warp can.
        t = if any_issued {
            t + 1
        } else if next_event == u64::MAX {
            return Err("replay deadlocked (a barrier no warp can reach)".into());
        } else {
            next_event.max(t + 1)
        };
    }
    // Steady state: the time between the first `warmup / iters` of all warp-iterations
    // and the last as many, per iteration of one warp (the scheduler's greed lets some
    // warps run ahead, so no single iteration's end stands for all).
    finished.sort_unstable();
    let total = finished.last().copied().unwrap_or(0);
    let skip = warmup.min((iters - 1) / 2) as usize * n;
    let cycles_per_iter = if skip > 0 {
        let (a, b) = (finished[skip - 1], finished[finished.len() - 1 - skip]);
        (b - a) as f64 * n as f64 / (finished.len() - 2 * skip) as f64
    } else {
        total as f64 / iters as f64
    };
    Ok(Replayed {
        cycles_per_iter,
        total_cycles: total,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const M: Machine = Machine {
        fma: 1,
        half: 1,
        imad: 2,
        alu: 2,
        xu: 8,
        hmma: 8,
        shared_bytes_per_clk: 128,
        bar_release: 20,
        global_latency: 1000,
    };

    fn op(class: Class, stall: u32, wb: u8, wait: u8) -> Op {
        Op {
            class,
            size: 0,
            stall,
            write_sb: wb,
            read_sb: 7,
            wait,
        }
    }

    #[test]
    fn stall_counts_bound_one_warp() {
        let body = vec![op(Class::Fma, 4, 7, 0); 10];
        let r = replay(&body, &M, 1, 1, 6, 2).unwrap();
        assert_eq!(r.cycles_per_iter, 40.0);
    }

    #[test]
    fn scoreboard_waits_for_the_latency() {
        // An LDS then a dependent FFMA: one iteration is the LDS's latency plus a stall.
        let body = vec![op(Class::Lds, 1, 0, 0), op(Class::Fma, 1, 7, 1)];
        let r = replay(&body, &M, 1, 1, 6, 2).unwrap();
        assert_eq!(r.cycles_per_iter, 31.0);
    }

    #[test]
    fn warps_hide_latency_until_the_pipe_fills() {
        let body = vec![op(Class::Mufu, 1, 0, 0), op(Class::Fma, 1, 7, 1)];
        let one = replay(&body, &M, 1, 1, 8, 2).unwrap().cycles_per_iter;
        // Eight warps per scheduler: the XU (8 cycles a MUFU) is the limit.
        let many = replay(&body, &M, 8, 4, 8, 2).unwrap().cycles_per_iter;
        assert_eq!(one, 19.0);
        assert!((many - 64.0).abs() <= 2.0, "{many}");
    }

    #[test]
    fn parses_a_trace() {
        let ops = parse_trace("fma.0.4.7.7.0,lds.512.1.0.7.3").unwrap();
        assert_eq!(ops[1].class, Class::Lds);
        assert_eq!(ops[1].size, 512);
        assert_eq!(ops[1].wait, 3);
        assert!(parse_trace("fma.0.4").is_err());
    }
}
