//! The executor: one CTA at a time, each thread run on its own until it reaches a
//! collective (`bar.sync`, `shfl.sync`, `ldmatrix`, `mma`) or exits; a warp's
//! collective runs once every lane it names has parked at that same instruction, a
//! barrier once every thread of the CTA has.

// Lane and fragment indices address several arrays at once (registers, fragments,
// masks): index loops say that more plainly than zipped iterators.
#![allow(clippy::needless_range_loop)]

use pagedkv_kernels::{Access, Dim3, GlobalRange};

use crate::error::{Error, Result, Site};
use crate::ir::*;
use crate::num::{self, E4M3, E5M2};
use crate::parse::{Function, GlobalData};

/// How `ex2.approx`, `tanh.approx` and `lg2.approx` compute.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum MathMode {
    /// `f32::exp2` / `f32::tanh` / `f32::log2` (with `.ftz`): the emulator's exact mode,
    /// bit for bit.
    #[default]
    Exact,
    /// Each result computed in f64, perturbed by a deterministic function of (seed,
    /// instruction, input) and rounded once to f32: within the ISA's documented
    /// maximum error ([`crate::EX2_MAX_REL_ERR`], [`crate::TANH_MAX_REL_ERR`],
    /// [`crate::LG2_MAX_ABS_ERR`]) of the exact value.
    Approx {
        /// The perturbation's seed.
        seed: u64,
    },
}

/// What one launch did, summed over its threads.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct LaunchStats {
    /// Lane-instructions issued, by [`InstClass`] (in [`InstClass::ALL`] order),
    /// guarded-off ones included.
    pub instructions: [u64; 7],
    /// Bytes loaded from global memory (`ld.global`, generic loads, `cp.async` sources),
    /// every load counted.
    pub global_read: u64,
    /// Per global range (by name): the distinct bytes each CTA read, summed over CTAs
    /// (what a CTA needs from memory if its re-reads hit a cache).
    pub unique_read: std::collections::BTreeMap<&'static str, u64>,
    /// Per global range (by name): every byte loaded, re-reads included.
    pub read: std::collections::BTreeMap<&'static str, u64>,
    /// Bytes stored to global memory.
    pub global_written: u64,
    /// Bytes copied by `cp.async`.
    pub cp_async_bytes: u64,
    /// The most `cp.async` bytes one CTA had in flight at once.
    pub max_in_flight: u64,
    /// Barriers completed (per CTA, summed).
    pub barriers: u64,
    /// Warp-wide `mma` operations.
    pub mma: u64,
    /// Per instruction of the kernel: how many lanes issued it.
    pub hits: Vec<u64>,
}

impl LaunchStats {
    /// All lane-instructions.
    pub fn total_instructions(&self) -> u64 {
        self.instructions.iter().sum()
    }
}

/// A global range of one launch, with what the launch did to it.
struct Range {
    name: &'static str,
    start: u64,
    end: u64,
    write: bool,
    written: bool,
    nc_read: bool,
}

/// A `cp.async` not yet landed.
#[derive(Clone, Copy, Debug)]
struct Pending {
    dst: u32,
    src: u64,
    bytes: u32,
    /// Bytes read from `src` (`bytes`, or 0: zero-fill).
    read: u32,
    /// The commit group (per thread), once committed.
    group: Option<u64>,
    line: u32,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Run,
    /// At a collective (the instruction at `pc`).
    Parked,
    Exited,
}

#[derive(Clone, Debug)]
struct Thread {
    pc: u32,
    state: State,
    committed: u64,
    pending: Vec<Pending>,
}

const NO_THREAD: u64 = 0xFFFF;
/// Most backward branches a thread takes between two collectives (or to its exit): a
/// thread that waits for another by spinning on memory never finishes on this
/// one-thread-at-a-time machine, so it fails instead of hanging.
const MAX_RUN: u64 = 1 << 26;
const MANY: u64 = 0xFFFE;

/// Everything one launch needs, shared by its CTAs.
pub(crate) struct Launch<'m> {
    pub(crate) func: &'m Function,
    pub(crate) funcs: &'m [Function],
    pub(crate) globals: &'m [GlobalData],
    pub(crate) grid: Dim3,
    pub(crate) block: Dim3,
    pub(crate) shared_bytes: u32,
    pub(crate) params: Vec<u8>,
    pub(crate) math: MathMode,
}

/// One CTA's machine state.
struct Cta<'l, 'm> {
    l: &'l Launch<'m>,
    ranges: &'l mut Vec<Range>,
    stats: &'l mut LaunchStats,
    ctaid: Dim3,
    nregs: usize,
    regs: Vec<u64>,
    threads: Vec<Thread>,
    shared: Vec<u8>,
    /// Per shared byte: `epoch << 16 | thread` of its last write and read in this
    /// barrier interval (`MANY`: read by several).
    last_write: Vec<u64>,
    last_read: Vec<u64>,
    /// Per shared byte: a `cp.async` into it is in flight.
    pending_bytes: Vec<u8>,
    in_flight: u64,
    epoch: u64,
    /// The range of the last global access (most accesses hit the same one).
    last_range: usize,
    /// This CTA's global reads: address, bytes, range.
    reads: Vec<(u64, u32, u32)>,
}

impl Launch<'_> {
    /// Runs every CTA in order, with `ranges` the global memory it may touch.
    ///
    /// # Safety
    /// Every range, and every view a [`Access::Views`] range holds, is valid,
    /// initialised host memory for the launch (readable; writable where its access
    /// says so), not used by anything else meanwhile.
    pub(crate) unsafe fn run(&self, ranges: &[GlobalRange]) -> Result<LaunchStats> {
        let mut rs: Vec<Range> = Vec::new();
        for r in ranges {
            let end = r.addr.checked_add(r.bytes).ok_or_else(|| {
                Error::Config(format!("range `{}` wraps the address space", r.name))
            })?;
            if r.bytes == 0 {
                continue;
            }
            match r.access {
                Access::Read | Access::ReadWrite => rs.push(Range {
                    name: r.name,
                    start: r.addr,
                    end,
                    write: r.access == Access::ReadWrite,
                    written: false,
                    nc_read: false,
                }),
                Access::Views => {
                    if r.bytes % 16 != 0 || r.addr % 8 != 0 {
                        return Err(Error::Config(format!(
                            "range `{}` of views is not whole 16-byte views",
                            r.name
                        )));
                    }
                    rs.push(Range {
                        name: r.name,
                        start: r.addr,
                        end,
                        write: false,
                        written: false,
                        nc_read: false,
                    });
                    for i in 0..r.bytes / 16 {
                        // SAFETY: inside this readable range (the caller's condition).
                        let (a, n) = unsafe {
                            let p = (r.addr + 16 * i) as *const u64;
                            (p.read_unaligned(), p.add(1).read_unaligned())
                        };
                        if n == 0 {
                            continue;
                        }
                        let e = a.checked_add(n).ok_or_else(|| {
                            Error::Config(format!("view {i} of `{}` wraps", r.name))
                        })?;
                        rs.push(Range {
                            name: r.name,
                            start: a,
                            end: e,
                            write: true,
                            written: false,
                            nc_read: false,
                        });
                    }
                }
            }
        }
        // The module's own `.global` data (panic locations): read-only.
        for g in self.globals {
            if g.bytes > 0 {
                rs.push(Range {
                    name: "module .global data",
                    start: g.addr(),
                    end: g.addr() + g.bytes,
                    write: false,
                    written: false,
                    nc_read: false,
                });
            }
        }
        let mut stats = LaunchStats {
            hits: vec![0; self.func.code.len()],
            ..LaunchStats::default()
        };
        let nthreads = self.block.volume() as usize;
        let shared = self.shared_bytes as usize;
        let mut cta = Cta {
            l: self,
            ranges: &mut rs,
            stats: &mut stats,
            ctaid: Dim3::new(0, 0, 0),
            nregs: self.func.nregs as usize,
            regs: vec![0; nthreads * self.func.nregs as usize],
            threads: Vec::with_capacity(nthreads),
            shared: vec![0xFF; shared],
            last_write: vec![0; shared],
            last_read: vec![0; shared],
            pending_bytes: vec![0; shared],
            in_flight: 0,
            epoch: 0,
            last_range: 0,
            reads: Vec::new(),
        };
        for z in 0..self.grid.z {
            for y in 0..self.grid.y {
                for x in 0..self.grid.x {
                    cta.ctaid = Dim3::new(x, y, z);
                    cta.run()?;
                }
            }
        }
        for (&h, inst) in stats.hits.iter().zip(&self.func.code) {
            stats.instructions[inst.op.class() as usize] += h;
        }
        Ok(stats)
    }
}

#[inline(always)]
fn val(r: &[u64], s: Src) -> u64 {
    match s {
        Src::R(i) => r[i as usize],
        Src::I(v) => v,
    }
}

#[inline(always)]
fn f(x: u64) -> f32 {
    f32::from_bits(x as u32)
}

#[inline(always)]
fn fb(x: f32) -> u64 {
    x.to_bits() as u64
}

fn cmp(ty: CmpTy, op: CmpOp, a: u64, b: u64) -> bool {
    use std::cmp::Ordering;
    let ord = match ty {
        CmpTy::U16 | CmpTy::U32 | CmpTy::U64 => a.cmp(&b),
        CmpTy::S16 => (a as i16).cmp(&(b as i16)),
        CmpTy::S32 => (a as i32).cmp(&(b as i32)),
        CmpTy::S64 => (a as i64).cmp(&(b as i64)),
        CmpTy::F32 => {
            let (x, y) = (f(a), f(b));
            let Some(o) = x.partial_cmp(&y) else {
                // Unordered: only the `u` forms hold.
                return matches!(
                    op,
                    CmpOp::Equ | CmpOp::Neu | CmpOp::Ltu | CmpOp::Leu | CmpOp::Gtu | CmpOp::Geu
                );
            };
            o
        }
    };
    match op {
        CmpOp::Eq | CmpOp::Equ => ord == Ordering::Equal,
        CmpOp::Ne | CmpOp::Neu => ord != Ordering::Equal,
        CmpOp::Lt | CmpOp::Ltu => ord == Ordering::Less,
        CmpOp::Le | CmpOp::Leu => ord != Ordering::Greater,
        CmpOp::Gt | CmpOp::Gtu => ord == Ordering::Greater,
        CmpOp::Ge | CmpOp::Geu => ord != Ordering::Less,
    }
}

fn shl(a: u64, b: u64, bits: u32) -> u64 {
    if b >= bits as u64 {
        0
    } else {
        let m = if bits == 64 {
            u64::MAX
        } else {
            (1 << bits) - 1
        };
        (a << b) & m
    }
}

fn shr(a: u64, b: u64, bits: u32) -> u64 {
    if b >= bits as u64 { 0 } else { a >> b }
}

impl Cta<'_, '_> {
    fn site(&self, thread: Option<usize>, line: u32) -> Site {
        Site {
            kernel: self.l.func.name.clone(),
            block: [self.ctaid.x, self.ctaid.y, self.ctaid.z],
            thread: thread.map(|t| t as u32),
            line,
        }
    }

    fn fault<T>(&self, t: Option<usize>, line: u32, msg: impl Into<String>) -> Result<T> {
        Err(Error::Fault {
            site: self.site(t, line),
            msg: msg.into(),
        })
    }

    fn run(&mut self) -> Result<()> {
        let n = self.threads.capacity();
        self.threads.clear();
        self.threads.resize(
            n,
            Thread {
                pc: 0,
                state: State::Run,
                committed: 0,
                pending: Vec::new(),
            },
        );
        self.regs.fill(0);
        // Shared memory starts as 0xFF bytes (NaN as f32): a read before any write
        // shows. The epoch moves on, so the last CTA's accesses are not this one's.
        self.shared.fill(0xFF);
        self.epoch += 1;
        self.in_flight = 0;
        let nwarps = n.div_ceil(32);
        loop {
            for w in 0..nwarps {
                self.run_warp(w)?;
            }
            // Every thread is at a barrier or has exited.
            let exited = self
                .threads
                .iter()
                .filter(|t| t.state == State::Exited)
                .count();
            if exited == n {
                self.count_unique_reads();
                return Ok(());
            }
            if exited > 0 {
                let (waiting, line) = self
                    .threads
                    .iter()
                    .enumerate()
                    .find(|(_, t)| t.state == State::Parked)
                    .map(|(i, t)| (i, self.l.func.code[t.pc as usize].line))
                    .expect("some thread waits");
                return self.fault(
                    Some(waiting),
                    line,
                    format!(
                        "bar.sync reached by {} threads while {exited} exited",
                        n - exited
                    ),
                );
            }
            // `bar.sync` is `barrier.sync.aligned`: a warp's threads must all be at the
            // same barrier instruction (different warps may use different ones).
            for w in 0..nwarps {
                let lanes = &self.threads[32 * w..(32 * w + 32).min(n)];
                if let Some(other) = lanes.iter().position(|t| t.pc != lanes[0].pc) {
                    let line = |t: &Thread| self.l.func.code[t.pc as usize].line;
                    return self.fault(
                        Some(32 * w + other),
                        line(&lanes[other]),
                        format!(
                            "warp {w} is at two barriers: lane 0 at PTX line {}, lane {other} at \
                             line {} (bar.sync is .aligned)",
                            line(&lanes[0]),
                            line(&lanes[other])
                        ),
                    );
                }
            }
            self.epoch += 1;
            self.stats.barriers += 1;
            for t in &mut self.threads {
                t.pc += 1;
                t.state = State::Run;
            }
        }
    }

    /// Runs warp `w` until each of its threads is at a barrier or has exited.
    fn run_warp(&mut self, w: usize) -> Result<()> {
        let n = self.threads.len();
        let lanes = (32 * w)..(32 * w + 32).min(n);
        loop {
            for t in lanes.clone() {
                if self.threads[t].state == State::Run {
                    self.run_thread(t)?;
                }
            }
            // Which lanes wait at a warp collective?
            let mut first = None;
            for t in lanes.clone() {
                let th = &self.threads[t];
                if th.state == State::Parked {
                    let op = &self.l.func.code[th.pc as usize].op;
                    if !matches!(op, Op::Bar) {
                        first = Some(t);
                        break;
                    }
                }
            }
            let Some(t0) = first else { return Ok(()) };
            self.warp_collective(w, t0)?;
        }
    }

    /// Runs the warp collective lane `t0` waits at, with every lane that waits there.
    fn warp_collective(&mut self, w: usize, t0: usize) -> Result<()> {
        let n = self.threads.len();
        let base = 32 * w;
        let pc = self.threads[t0].pc;
        let inst = &self.l.func.code[pc as usize];
        let mut here = 0u32;
        for lane in 0..32 {
            let t = base + lane;
            if t < n && self.threads[t].state == State::Parked && self.threads[t].pc == pc {
                here |= 1 << lane;
            }
        }
        let describe = |mask: u32| -> String {
            (0..32)
                .filter(|l| mask & (1 << l) != 0)
                .map(|l| l.to_string())
                .collect::<Vec<_>>()
                .join(",")
        };
        match inst.op {
            Op::Shfl {
                d,
                a,
                lane,
                clamp,
                mask,
            } => {
                // Every lane here names a member mask that contains itself, and every
                // lane of that mask is here with the same mask (several disjoint groups
                // may shuffle at one instruction).
                let mut masks = [0u32; 32];
                for l in 0..32 {
                    if here & (1 << l) != 0 {
                        let r = &self.regs[(base + l) * self.nregs..][..self.nregs];
                        masks[l] = val(r, mask) as u32;
                    }
                }
                // The common case first: every lane here names exactly the lanes here.
                let uniform = (0..32).all(|l| here & (1 << l) == 0 || masks[l] == here);
                for l in 0..32 {
                    if uniform || here & (1 << l) == 0 {
                        continue;
                    }
                    let m = masks[l];
                    let same = (0..32)
                        .filter(|&j| m & (1 << j) != 0)
                        .all(|j| here & (1 << j) != 0 && masks[j] == m);
                    if m & (1 << l) == 0 || !same {
                        return self.fault(
                            Some(base + l),
                            inst.line,
                            format!(
                                "shfl.sync: lane {l}'s member mask {m:#010x} (lanes [{}]) is not \
                                 the set of lanes here with that mask (lanes [{}] are at this \
                                 instruction)",
                                describe(m),
                                describe(here)
                            ),
                        );
                    }
                }
                let mut out = [0u64; 32];
                for l in 0..32 {
                    if here & (1 << l) == 0 {
                        continue;
                    }
                    let r = &self.regs[(base + l) * self.nregs..][..self.nregs];
                    let (b, c) = (val(r, lane) as u32 & 0x1F, val(r, clamp) as u32);
                    let seg = (c >> 8) & 0x1F;
                    let max_lane = (l as u32 & seg) | (c & 0x1F & !seg);
                    let mut j = l as u32 ^ b;
                    if j > max_lane {
                        j = l as u32;
                    }
                    if masks[l] & (1 << j) == 0 {
                        return self.fault(
                            Some(base + l),
                            inst.line,
                            format!("shfl.sync reads lane {j}, not in lane {l}'s member mask"),
                        );
                    }
                    let src = &self.regs[(base + j as usize) * self.nregs..][..self.nregs];
                    out[l] = val(src, a) & 0xFFFF_FFFF;
                }
                for l in 0..32 {
                    if here & (1 << l) != 0 {
                        self.regs[(base + l) * self.nregs + d as usize] = out[l];
                    }
                }
            }
            Op::Ldmatrix {
                n: nm,
                trans,
                d,
                addr,
            } => {
                self.need_full_warp(base, here, inst.line, "ldmatrix")?;
                let mut m = [[[0u16; 8]; 8]; 4];
                for (mi, mat) in m.iter_mut().enumerate().take(nm as usize) {
                    for (row, elems) in mat.iter_mut().enumerate() {
                        let t = base + 8 * mi + row;
                        let r = &self.regs[t * self.nregs..][..self.nregs];
                        let at = val(r, addr.base.map_or(Src::I(0), Src::R))
                            .wrapping_add(addr.off as u64);
                        let bytes = self.shared_read(t, inst.line, at, 16, 16)?;
                        for (c, e) in elems.iter_mut().enumerate() {
                            *e = u16::from_le_bytes([bytes[2 * c], bytes[2 * c + 1]]);
                        }
                    }
                }
                for l in 0..32 {
                    let (g, tq) = (l / 4, l % 4);
                    for (mi, mat) in m.iter().enumerate().take(nm as usize) {
                        let (lo, hi) = if trans {
                            (mat[2 * tq][g], mat[2 * tq + 1][g])
                        } else {
                            (mat[g][2 * tq], mat[g][2 * tq + 1])
                        };
                        self.regs[(base + l) * self.nregs + d[mi] as usize] =
                            lo as u64 | (hi as u64) << 16;
                    }
                }
            }
            Op::Mma { bf16, d, a, b, c } => {
                self.need_full_warp(base, here, inst.line, "mma.sync")?;
                let half = |reg: u64, h: usize| -> f64 {
                    let bits = (reg >> (16 * h)) as u16;
                    if bf16 {
                        num::bf16_to_f32(bits) as f64
                    } else {
                        num::f16_to_f32(bits) as f64
                    }
                };
                let (mut ma, mut mb, mut mc) = ([[0f64; 16]; 16], [[0f64; 8]; 16], [[0f64; 8]; 16]);
                for l in 0..32 {
                    let r = &self.regs[(base + l) * self.nregs..][..self.nregs];
                    for j in 0..4 {
                        for h in 0..2 {
                            let (row, k) = num::frag_a(l, j, h);
                            ma[row][k] = half(val(r, a[j]), h);
                        }
                        let (row, col) = num::frag_c(l, j);
                        mc[row][col] = f(val(r, c[j])) as f64;
                    }
                    for j in 0..2 {
                        for h in 0..2 {
                            let (k, col) = num::frag_b(l, j, h);
                            mb[k][col] = half(val(r, b[j]), h);
                        }
                    }
                }
                for l in 0..32 {
                    for (j, &dj) in d.iter().enumerate() {
                        let (row, col) = num::frag_c(l, j);
                        // The products of 16-bit floats are exact in f64; their sum is
                        // exact unless the exponents spread past 53 bits; + C, then f32.
                        let s: f64 = (0..16).map(|k| ma[row][k] * mb[k][col]).sum::<f64>();
                        self.regs[(base + l) * self.nregs + dj as usize] =
                            fb((s + mc[row][col]) as f32);
                    }
                }
                self.stats.mma += 1;
            }
            _ => unreachable!("only warp collectives park here"),
        }
        for l in 0..32 {
            if here & (1 << l) != 0 {
                let t = &mut self.threads[base + l];
                t.pc += 1;
                t.state = State::Run;
            }
        }
        Ok(())
    }

    fn need_full_warp(&self, base: usize, here: u32, line: u32, what: &str) -> Result<()> {
        if here != u32::MAX {
            let missing: Vec<String> = (0..32)
                .filter(|l| here & (1 << l) == 0)
                .map(|l: usize| {
                    let t = base + l;
                    match self.threads.get(t) {
                        None => format!("{l} (no such thread)"),
                        Some(th) if th.state == State::Exited => format!("{l} (exited)"),
                        Some(th) => format!(
                            "{l} (at PTX line {})",
                            self.l.func.code[th.pc as usize].line
                        ),
                    }
                })
                .collect();
            return self.fault(
                Some(base + here.trailing_zeros() as usize),
                line,
                format!(
                    "{what}.aligned needs all 32 lanes; missing {}",
                    missing.join(", ")
                ),
            );
        }
        Ok(())
    }

    /// Adds this CTA's distinct bytes read, per range, to the stats.
    fn count_unique_reads(&mut self) {
        let mut reads = std::mem::take(&mut self.reads);
        reads.sort_unstable_by_key(|&(a, n, r)| (r, a, n));
        let mut i = 0;
        while i < reads.len() {
            let r = reads[i].2;
            let (mut total, mut end, mut all) = (0u64, 0u64, 0u64);
            while i < reads.len() && reads[i].2 == r {
                let (a, n, _) = reads[i];
                all += n as u64;
                let e = a + n as u64;
                if e > end {
                    total += e - a.max(end);
                    end = e;
                }
                i += 1;
            }
            let name = self.ranges[r as usize].name;
            *self.stats.unique_read.entry(name).or_default() += total;
            *self.stats.read.entry(name).or_default() += all;
        }
        reads.clear();
        self.reads = reads;
    }

    fn find_range(&mut self, t: usize, line: u32, addr: u64, n: u64, write: bool) -> Result<usize> {
        let end = addr.checked_add(n);
        let fits =
            |r: &Range| end.is_some_and(|e| addr >= r.start && e <= r.end) && (!write || r.write);
        if let Some(r) = self.ranges.get(self.last_range)
            && fits(r)
        {
            return Ok(self.last_range);
        }
        match self.ranges.iter().position(fits) {
            Some(i) => {
                self.last_range = i;
                Ok(i)
            }
            None => {
                let end = addr.saturating_add(n);
                let why = if let Some(r) = self
                    .ranges
                    .iter()
                    .find(|r| !r.write && addr >= r.start && end <= r.end)
                {
                    format!("inside `{}`, a read-only range", r.name)
                } else {
                    let near = self
                        .ranges
                        .iter()
                        .filter(|r| addr >= r.start && addr < r.end)
                        .map(|r| format!("`{}` [{:#x}, {:#x})", r.name, r.start, r.end))
                        .collect::<Vec<_>>();
                    if near.is_empty() {
                        "inside no range of the launch".to_string()
                    } else {
                        format!("overruns {}", near.join(", "))
                    }
                };
                self.fault(
                    Some(t),
                    line,
                    format!(
                        "global {} of {n} bytes at {addr:#x}: {why}",
                        if write { "store" } else { "load" },
                    ),
                )
            }
        }
    }

    fn global_load(
        &mut self,
        t: usize,
        line: u32,
        addr: u64,
        n: u64,
        align: u64,
        nc: bool,
    ) -> Result<[u8; 16]> {
        if !addr.is_multiple_of(align) {
            return self.fault(
                Some(t),
                line,
                format!("global load of {n} bytes at {addr:#x}: not {align}-byte aligned"),
            );
        }
        let i = self.find_range(t, line, addr, n, false)?;
        if nc {
            if self.ranges[i].written {
                return self.fault(
                    Some(t),
                    line,
                    format!(
                        "ld.global.nc from `{}`, which this launch writes",
                        self.ranges[i].name
                    ),
                );
            }
            self.ranges[i].nc_read = true;
        }
        self.reads.push((addr, n as u32, i as u32));
        let mut out = [0u8; 16];
        // SAFETY: `addr..addr + n` lies inside a range of the launch, valid for reads
        // (the launch's condition); n <= 16.
        unsafe { std::ptr::copy_nonoverlapping(addr as *const u8, out.as_mut_ptr(), n as usize) };
        self.stats.global_read += n;
        Ok(out)
    }

    fn global_store(&mut self, t: usize, line: u32, addr: u64, bytes: &[u8]) -> Result<()> {
        let n = bytes.len() as u64;
        if !addr.is_multiple_of(n) {
            return self.fault(
                Some(t),
                line,
                format!("global store of {n} bytes at {addr:#x}: not {n}-byte aligned"),
            );
        }
        let i = self.find_range(t, line, addr, n, true)?;
        if self.ranges[i].nc_read {
            return self.fault(
                Some(t),
                line,
                format!(
                    "store to `{}`, which this launch reads with ld.global.nc",
                    self.ranges[i].name
                ),
            );
        }
        self.ranges[i].written = true;
        if self.in_flight > 0 {
            for (u, th) in self.threads.iter().enumerate() {
                for p in &th.pending {
                    if p.src < addr + n && addr < p.src + p.bytes as u64 {
                        return self.fault(
                            Some(t),
                            line,
                            format!(
                                "store to {addr:#x}, the source of thread {u}'s cp.async (PTX line {}) not yet waited for",
                                p.line
                            ),
                        );
                    }
                }
            }
        }
        // SAFETY: inside a writable range of the launch (checked above).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), addr as *mut u8, bytes.len()) };
        self.stats.global_written += n;
        Ok(())
    }

    fn shared_check(
        &self,
        t: usize,
        line: u32,
        at: u64,
        n: u64,
        align: u64,
        what: &str,
    ) -> Result<usize> {
        if !at.is_multiple_of(align) {
            return self.fault(
                Some(t),
                line,
                format!("shared {what} of {n} bytes at {at:#x}: not {align}-byte aligned"),
            );
        }
        if at
            .checked_add(n)
            .is_none_or(|e| e > self.shared.len() as u64)
        {
            return self.fault(
                Some(t),
                line,
                format!(
                    "shared {what} of {n} bytes at {at:#x}: outside the {} bytes of shared memory",
                    self.shared.len()
                ),
            );
        }
        Ok(at as usize)
    }

    fn shared_read(
        &mut self,
        t: usize,
        line: u32,
        at: u64,
        n: u64,
        align: u64,
    ) -> Result<[u8; 16]> {
        let a = self.shared_check(t, line, at, n, align, "load")?;
        let me = self.epoch << 16 | t as u64;
        for i in a..a + n as usize {
            if self.pending_bytes[i] != 0 {
                return self.fault(
                    Some(t),
                    line,
                    format!("shared load at {i:#x}: a cp.async into it is not yet waited for"),
                );
            }
            let w = self.last_write[i];
            if w >> 16 == self.epoch && w != me {
                return self.fault(
                    Some(t),
                    line,
                    format!("shared load at {i:#x}: thread {} wrote it since the last bar.sync (a race)", w & 0xFFFF),
                );
            }
            let r = self.last_read[i];
            self.last_read[i] = if r >> 16 == self.epoch && r != me {
                self.epoch << 16 | MANY
            } else {
                me
            };
        }
        let mut out = [0u8; 16];
        out[..n as usize].copy_from_slice(&self.shared[a..a + n as usize]);
        Ok(out)
    }

    fn shared_write(&mut self, t: usize, line: u32, at: u64, bytes: &[u8]) -> Result<()> {
        let n = bytes.len() as u64;
        let a = self.shared_check(t, line, at, n, n, "store")?;
        self.shared_mark_written(t, line, a, n as usize)?;
        self.shared[a..a + bytes.len()].copy_from_slice(bytes);
        Ok(())
    }

    fn shared_mark_written(&mut self, t: usize, line: u32, a: usize, n: usize) -> Result<()> {
        let me = self.epoch << 16 | t as u64;
        for i in a..a + n {
            if self.pending_bytes[i] != 0 {
                return self.fault(
                    Some(t),
                    line,
                    format!("shared store at {i:#x}: a cp.async into it is in flight"),
                );
            }
            let w = self.last_write[i];
            let r = self.last_read[i];
            let other = |x: u64| x >> 16 == self.epoch && x != me && x & 0xFFFF != NO_THREAD;
            if other(w) || other(r) {
                return self.fault(
                    Some(t),
                    line,
                    format!(
                        "shared store at {i:#x}: {} since the last bar.sync (a race)",
                        if other(w) {
                            format!("thread {} wrote it", w & 0xFFFF)
                        } else if r & 0xFFFF == MANY {
                            "other threads read it".to_string()
                        } else {
                            format!("thread {} read it", r & 0xFFFF)
                        }
                    ),
                );
            }
            self.last_write[i] = me;
        }
        Ok(())
    }

    /// Lands thread `t`'s copies of groups older than the newest `keep`.
    fn retire(&mut self, t: usize, keep: u64) -> Result<()> {
        let limit = self.threads[t].committed.saturating_sub(keep);
        let pending = std::mem::take(&mut self.threads[t].pending);
        let mut left = Vec::with_capacity(pending.len());
        for p in pending {
            match p.group {
                Some(g) if g < limit => {
                    let n = p.bytes as usize;
                    let d = p.dst as usize;
                    self.pending_bytes[d..d + n].fill(0);
                    self.in_flight -= p.bytes as u64;
                    self.shared_mark_written(t, p.line, d, n)?;
                    let r = p.read as usize;
                    if r > 0 {
                        // SAFETY: a source that is read was checked against a readable
                        // range when the copy was issued.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                p.src as *const u8,
                                self.shared[d..].as_mut_ptr(),
                                r,
                            )
                        };
                    }
                    self.shared[d + r..d + n].fill(0);
                }
                _ => left.push(p),
            }
        }
        self.threads[t].pending = left;
        Ok(())
    }

    fn special(&self, t: usize, s: Special) -> u64 {
        let b = self.l.block;
        let idx = t as u32;
        let pick = |d: Dim3, c: u8| match c {
            0 => d.x,
            1 => d.y,
            _ => d.z,
        };
        (match s {
            Special::Tid(c) => pick(
                Dim3::new(idx % b.x, (idx / b.x) % b.y, idx / (b.x * b.y)),
                c,
            ),
            Special::Ntid(c) => pick(b, c),
            Special::Ctaid(c) => pick(self.ctaid, c),
            Special::Nctaid(c) => pick(self.l.grid, c),
        }) as u64
    }

    fn panic(&self, t: usize, line: u32, func: u32, arg: Option<u64>) -> Error {
        let name = self.l.funcs[func as usize].name.clone();
        let site = self.site(Some(t), line);
        let global = |addr: u64, n: u64| -> Option<&[u8]> {
            self.l.globals.iter().find_map(|g| {
                let off = addr.checked_sub(g.addr())?;
                if off.checked_add(n)? > g.bytes {
                    return None;
                }
                // SAFETY: the module's own storage, `off + n` within it.
                let all = unsafe {
                    std::slice::from_raw_parts(g.words.as_ptr() as *const u8, g.bytes as usize)
                };
                Some(&all[off as usize..(off + n) as usize])
            })
        };
        let loc = arg.and_then(|a| {
            let b = global(a, 24)?;
            let word =
                |i: usize| u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"));
            let (file_at, file_len, lc) = (word(0), word(1), word(2));
            let file = String::from_utf8_lossy(global(file_at, file_len)?).into_owned();
            Some((file, lc as u32, (lc >> 32) as u32))
        });
        match loc {
            Some((file, line, col)) => Error::Panic {
                site,
                func: name,
                file,
                line,
                col,
            },
            None => Error::Panic {
                site,
                func: name,
                file: "(no location)".into(),
                line: 0,
                col: 0,
            },
        }
    }

    /// Runs thread `t` until it parks at a collective or exits.
    fn run_thread(&mut self, t: usize) -> Result<()> {
        let l = self.l;
        let code = &l.func.code[..];
        let nregs = self.nregs;
        let mut pc = self.threads[t].pc as usize;
        let base = t * nregs;
        macro_rules! r {
            () => {
                &mut self.regs[base..base + nregs]
            };
        }
        let mut budget = MAX_RUN;
        loop {
            let Some(inst) = code.get(pc) else {
                return self.fault(Some(t), 0, "ran past the end of the kernel");
            };
            self.stats.hits[pc] += 1;
            if let Some((p, neg)) = inst.guard
                && (self.regs[base + p as usize] & 1 != 0) == neg
            {
                pc += 1;
                continue;
            }
            let line = inst.line;
            match inst.op {
                Op::Bin { op, d, a, b } => {
                    let rr = r!();
                    let (x, y) = (val(rr, a), val(rr, b));
                    use BinOp::*;
                    let v = match op {
                        Add16 => x.wrapping_add(y) & 0xFFFF,
                        Add32 => (x as u32).wrapping_add(y as u32) as u64,
                        Add64 => x.wrapping_add(y),
                        Sub16 => x.wrapping_sub(y) & 0xFFFF,
                        Sub32 => (x as u32).wrapping_sub(y as u32) as u64,
                        Sub64 => x.wrapping_sub(y),
                        MulLo16 => x.wrapping_mul(y) & 0xFFFF,
                        MulLo32 => (x as u32).wrapping_mul(y as u32) as u64,
                        MulLo64 => x.wrapping_mul(y),
                        MulWideU16 => (x & 0xFFFF) * (y & 0xFFFF),
                        MulWideU32 => (x as u32 as u64) * (y as u32 as u64),
                        And16 | And32 | And64 | AndPred => x & y,
                        Or16 | Or32 | Or64 | OrPred => x | y,
                        Xor16 => x ^ y,
                        Xor32 => ((x as u32) ^ (y as u32)) as u64,
                        Shl16 => shl(x, y & 0xFFFF_FFFF, 16),
                        Shl32 => shl(x, y & 0xFFFF_FFFF, 32),
                        Shl64 => shl(x, y & 0xFFFF_FFFF, 64),
                        ShrU16 => shr(x, y & 0xFFFF_FFFF, 16),
                        ShrU32 => shr(x, y & 0xFFFF_FFFF, 32),
                        ShrU64 => shr(x, y & 0xFFFF_FFFF, 64),
                        MinU32 => (x as u32).min(y as u32) as u64,
                        MaxU32 => (x as u32).max(y as u32) as u64,
                        DivU16 | DivU32 | DivU64 | RemU32 | RemU64 => {
                            if y == 0 {
                                self.threads[t].pc = pc as u32;
                                return self.fault(Some(t), line, "integer division by zero");
                            }
                            if matches!(op, RemU32 | RemU64) {
                                x % y
                            } else {
                                x / y
                            }
                        }
                        AddF32 => fb(f(x) + f(y)),
                        SubF32 => fb(f(x) - f(y)),
                        MulF32 => fb(f(x) * f(y)),
                        MulF16x2 => num::mul_f16x2(x as u32, y as u32) as u64,
                        DivF32 => fb(f(x) / f(y)),
                        E4m3x2FromF32 => num::f32x2_to_fp8x2(E4M3, f(x), f(y)) as u64,
                        E5m2x2FromF32 => num::f32x2_to_fp8x2(E5M2, f(x), f(y)) as u64,
                    };
                    rr[d as usize] = v;
                }
                Op::Un { op, d, a, mask } => {
                    let rr = r!();
                    let x = val(rr, a);
                    let v = match op {
                        UnOp::Mov | UnOp::Trunc16 | UnOp::Trunc32 => x,
                        UnOp::Not16 | UnOp::Not32 => !x,
                        UnOp::NotPred => x ^ 1,
                        UnOp::Neg32 => (x as u32).wrapping_neg() as u64,
                        UnOp::Popc32 => (x as u32).count_ones() as u64,
                        UnOp::Clz32 => (x as u32).leading_zeros() as u64,
                        UnOp::F32FromU32 => fb(x as u32 as f32),
                        UnOp::F32FromF16 => fb(num::f16_to_f32(x as u16)),
                        UnOp::F16FromF32 => num::f32_to_f16(f(x)) as u64,
                        UnOp::Bf16FromF32 => num::f32_to_bf16(f(x)) as u64,
                        UnOp::RcpF32 => fb(1.0 / f(x)),
                        UnOp::Ex2ApproxFtz => {
                            let x = num::ftz(f(x));
                            let y = match l.math {
                                MathMode::Exact => x.exp2(),
                                // In f64, perturbed, rounded once: within the bound.
                                MathMode::Approx { seed } => {
                                    ((x as f64).exp2()
                                        * (1.0
                                            + num::EX2_PERTURBATION
                                                * num::unit_noise(seed, line, x)))
                                        as f32
                                }
                            };
                            fb(num::ftz(y))
                        }
                        UnOp::TanhApprox => fb(match l.math {
                            MathMode::Exact => f(x).tanh(),
                            MathMode::Approx { seed } => {
                                ((f(x) as f64).tanh()
                                    * (1.0
                                        + num::TANH_PERTURBATION
                                            * num::unit_noise(seed, line, f(x))))
                                    as f32
                            }
                        }),
                        UnOp::Lg2ApproxFtz => {
                            let x = num::ftz(f(x));
                            fb(match l.math {
                                MathMode::Exact => x.log2(),
                                // In f64, perturbed by up to the absolute bound,
                                // rounded once.
                                MathMode::Approx { seed } if x.log2().is_finite() => {
                                    ((x as f64).log2()
                                        + num::LG2_MAX_ABS_ERR * num::unit_noise(seed, line, x))
                                        as f32
                                }
                                MathMode::Approx { .. } => x.log2(),
                            })
                        }
                        UnOp::F16x2FromE4m3x2 => num::fp8x2_to_f16x2(E4M3, x as u16) as u64,
                        UnOp::F16x2FromE5m2x2 => num::fp8x2_to_f16x2(E5M2, x as u16) as u64,
                    };
                    rr[d as usize] = v & mask;
                }
                Op::Tern { op, d, a, b, c } => {
                    let rr = r!();
                    let (x, y, z) = (val(rr, a), val(rr, b), val(rr, c));
                    rr[d as usize] = match op {
                        TernOp::MadLo32 => {
                            (x as u32).wrapping_mul(y as u32).wrapping_add(z as u32) as u64
                        }
                        TernOp::MadLo64 => x.wrapping_mul(y).wrapping_add(z),
                        TernOp::FmaF32 => fb(f(x).mul_add(f(y), f(z))),
                        TernOp::BfeU32 => {
                            let (pos, len) = (y & 0xFF, z & 0xFF);
                            if len == 0 || pos >= 32 {
                                0
                            } else {
                                let v = (x as u32 as u64) >> pos;
                                if len >= 32 { v } else { v & ((1 << len) - 1) }
                            }
                        }
                        TernOp::ShfLWrap32 => {
                            // PTX ISA, shf: the 64-bit {b (bits 63:32), a (31:0)}
                            // shifted left by n = c & 0x1f; d is its upper 32 bits.
                            let wide = ((y as u32 as u64) << 32) | x as u32 as u64;
                            ((wide << (z as u32 & 0x1f)) >> 32) & 0xFFFF_FFFF
                        }
                        TernOp::PrmtB32 => {
                            // PTX ISA, prmt (default mode): the bytes of {b, a}
                            // indexed 0-7, four selector nibbles, bit 3 of each a
                            // sign replication.
                            let bytes = ((y as u32 as u64) << 32) | x as u32 as u64;
                            (0..4).fold(0u64, |d, i| {
                                let s = (z >> (4 * i)) & 0xf;
                                let byte = (bytes >> (8 * (s & 7))) & 0xff;
                                let byte = if s & 8 == 0 {
                                    byte
                                } else if byte & 0x80 != 0 {
                                    0xff
                                } else {
                                    0
                                };
                                d | byte << (8 * i)
                            })
                        }
                    };
                }
                Op::Setp {
                    ty,
                    cmp: c,
                    d,
                    a,
                    b,
                } => {
                    let rr = r!();
                    rr[d as usize] = cmp(ty, c, val(rr, a), val(rr, b)) as u64;
                }
                Op::Selp { d, a, b, p } => {
                    let rr = r!();
                    rr[d as usize] = if rr[p as usize] & 1 != 0 {
                        val(rr, a)
                    } else {
                        val(rr, b)
                    };
                }
                Op::Unpack { lo, hi, a, half } => {
                    let rr = r!();
                    let x = val(rr, a);
                    let m = (1u64 << half) - 1;
                    if let Some(lo) = lo {
                        rr[lo as usize] = x & m;
                    }
                    if let Some(hi) = hi {
                        rr[hi as usize] = (x >> half) & m;
                    }
                }
                Op::Pack { d, lo, hi, half } => {
                    let rr = r!();
                    let m = (1u64 << half) - 1;
                    rr[d as usize] = (val(rr, lo) & m) | (val(rr, hi) & m) << half;
                }
                Op::Special { d, s } => {
                    let v = self.special(t, s);
                    self.regs[base + d as usize] = v;
                }
                Op::Ld {
                    space,
                    bytes,
                    n,
                    nc,
                    d,
                    addr,
                } => {
                    let total = bytes as u64 * n as u64;
                    let rr = &self.regs[base..base + nregs];
                    let at = addr
                        .base
                        .map_or(0, |b| rr[b as usize])
                        .wrapping_add(addr.off as u64);
                    self.threads[t].pc = pc as u32;
                    let raw = match space {
                        Space::Param => {
                            let p = &l.params;
                            if at % bytes as u64 != 0
                                || at.checked_add(total).is_none_or(|e| e > p.len() as u64)
                            {
                                return self.fault(
                                    Some(t),
                                    line,
                                    format!("ld.param of {total} bytes at offset {at}: outside the {}-byte parameter struct or misaligned", p.len()),
                                );
                            }
                            let mut o = [0u8; 16];
                            o[..total as usize]
                                .copy_from_slice(&p[at as usize..(at + total) as usize]);
                            o
                        }
                        Space::Global | Space::Generic => {
                            self.global_load(t, line, at, total, total, nc)?
                        }
                        Space::Shared => self.shared_read(t, line, at, total, total)?,
                    };
                    let rr = r!();
                    for (i, &dr) in d.iter().enumerate().take(n as usize) {
                        let s = i * bytes as usize;
                        let mut w = [0u8; 8];
                        w[..bytes as usize].copy_from_slice(&raw[s..s + bytes as usize]);
                        rr[dr as usize] = u64::from_le_bytes(w);
                    }
                }
                Op::St {
                    space,
                    bytes,
                    n,
                    v,
                    addr,
                } => {
                    let rr = &self.regs[base..base + nregs];
                    let at = addr
                        .base
                        .map_or(0, |b| rr[b as usize])
                        .wrapping_add(addr.off as u64);
                    let mut raw = [0u8; 16];
                    for (i, &s) in v.iter().enumerate().take(n as usize) {
                        let b = val(rr, s).to_le_bytes();
                        raw[i * bytes as usize..(i + 1) * bytes as usize]
                            .copy_from_slice(&b[..bytes as usize]);
                    }
                    let total = bytes as usize * n as usize;
                    self.threads[t].pc = pc as u32;
                    match space {
                        Space::Global | Space::Generic => {
                            self.global_store(t, line, at, &raw[..total])?
                        }
                        Space::Shared => self.shared_write(t, line, at, &raw[..total])?,
                        Space::Param => {
                            return self.fault(Some(t), line, "st.param to the entry's parameters");
                        }
                    }
                }
                Op::CpAsync {
                    dst,
                    src,
                    bytes,
                    src_size,
                } => {
                    let rr = &self.regs[base..base + nregs];
                    let read = src_size.map_or(bytes as u64, |v| val(rr, v) & 0xFFFF_FFFF);
                    let d = dst
                        .base
                        .map_or(0, |b| rr[b as usize])
                        .wrapping_add(dst.off as u64);
                    let s = src
                        .base
                        .map_or(0, |b| rr[b as usize])
                        .wrapping_add(src.off as u64);
                    self.threads[t].pc = pc as u32;
                    let n = bytes as u64;
                    if read != 0 && read != n {
                        return self.fault(
                            Some(t),
                            line,
                            format!("cp.async src-size {read}: only 0 or {n} is supported"),
                        );
                    }
                    if read != 0 && s % n != 0 {
                        return self.fault(
                            Some(t),
                            line,
                            format!("cp.async source {s:#x} not {n}-byte aligned"),
                        );
                    }
                    // A src-size of 0 reads nothing (the destination is zero-filled).
                    let i = if read == 0 {
                        None
                    } else {
                        Some(self.find_range(t, line, s, n, false)?)
                    };
                    if let Some(i) = i {
                        self.reads.push((s, bytes, i as u32));
                    }
                    if i.is_some_and(|i| self.ranges[i].written) {
                        return self.fault(
                            Some(t),
                            line,
                            format!(
                                "cp.async from `{}`, which this launch writes",
                                self.ranges[i.unwrap_or(0)].name
                            ),
                        );
                    }
                    let a = self.shared_check(t, line, d, n, n, "cp.async destination")?;
                    if self.pending_bytes[a..a + n as usize]
                        .iter()
                        .any(|&p| p != 0)
                    {
                        return self.fault(
                            Some(t),
                            line,
                            format!("cp.async into {d:#x}, where another copy is in flight"),
                        );
                    }
                    // The copy may land any time from now to its wait: as a write, it races
                    // with other threads' accesses since the last barrier.
                    self.shared_mark_written(t, line, a, n as usize)?;
                    self.pending_bytes[a..a + n as usize].fill(1);
                    self.shared[a..a + n as usize].fill(0xFF);
                    self.threads[t].pending.push(Pending {
                        dst: a as u32,
                        src: s,
                        bytes,
                        read: read as u32,
                        group: None,
                        line,
                    });
                    self.in_flight += n;
                    self.stats.max_in_flight = self.stats.max_in_flight.max(self.in_flight);
                    self.stats.cp_async_bytes += read;
                    self.stats.global_read += read;
                }
                Op::CpCommit => {
                    let th = &mut self.threads[t];
                    let g = th.committed;
                    for p in th.pending.iter_mut().filter(|p| p.group.is_none()) {
                        p.group = Some(g);
                    }
                    th.committed += 1;
                }
                Op::CpWait(keep) => {
                    self.threads[t].pc = pc as u32;
                    self.retire(t, keep as u64)?;
                }
                Op::Bra(target) => {
                    if target as usize <= pc {
                        budget -= 1;
                        if budget == 0 {
                            self.threads[t].pc = pc as u32;
                            return self.fault(
                                Some(t),
                                line,
                                format!(
                                    "{MAX_RUN} backward branches without reaching a collective \
                                     or exit (a spin-wait on another thread?)"
                                ),
                            );
                        }
                    }
                    pc = target as usize;
                    continue;
                }
                Op::Exit | Op::Ret => {
                    self.threads[t].pc = pc as u32;
                    if let Some(p) = self.threads[t].pending.first() {
                        return self.fault(
                            Some(t),
                            line,
                            format!("exit with a cp.async (PTX line {}) not waited for", p.line),
                        );
                    }
                    self.threads[t].state = State::Exited;
                    return Ok(());
                }
                Op::Trap => {
                    return Err(Error::Trap {
                        site: self.site(Some(t), line),
                    });
                }
                Op::Call { func, arg } => {
                    let a = arg.map(|a| val(&self.regs[base..base + nregs], a));
                    return Err(self.panic(t, line, func, a));
                }
                Op::Bar | Op::Shfl { .. } | Op::Ldmatrix { .. } | Op::Mma { .. } => {
                    let th = &mut self.threads[t];
                    th.pc = pc as u32;
                    th.state = State::Parked;
                    return Ok(());
                }
            }
            pc += 1;
        }
    }
}
