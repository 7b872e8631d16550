//! A PTX interpreter for pagedkv's committed kernels: it runs the PTX that engines
//! load onto a GPU, on the CPU, so every test that launches through it also proves
//! the shipped artifact (rustc's NVPTX code generation, the device layer's inline
//! assembly, the params layout, address spaces, the shared-memory size).
//!
//! A test tool of the workspace, not a dependency of the library.
//!
//! * **Parser** ([`Module::parse`]): its own lexer and parser for the subset rustc
//!   emits for pagedkv (one by-value `.param` struct per entry, `.reg` files, the
//!   dynamic `smem[]`, `.global` panic-location data). Anything else is an error
//!   naming the file, line and construct, never skipped.
//! * **Execution**: a CTA at a time; each thread runs alone until a collective
//!   (`bar.sync`, `shfl.sync`, `ldmatrix`, `mma`) or `exit`. A warp collective needs
//!   every lane it names parked at that same instruction, else the launch fails
//!   naming kernel, line and lanes; a barrier some threads reach while others exited
//!   fails too.
//! * **Memory**: global memory is exactly the ranges the kernel's parameters name
//!   ([`pagedkv_kernels::KernelParams`]); every access is bounds- and
//!   alignment-checked, generic addresses must resolve to one of them (the PTX has no
//!   `cvta.shared`), `ld.global.nc` of a range the launch writes is an error. Shared
//!   memory is exactly the launch's dynamic size, filled with `0xFF` (NaN) per CTA,
//!   with a race check: a byte written by one thread and read or written by another
//!   in the same barrier interval fails the launch. `cp.async` is asynchronous: its
//!   bytes are unreadable until the `wait_group` that retires their group; exiting
//!   with copies pending, or storing to a pending copy's source, is an error.
//! * **Numerics** ([`num`](crate) module, private) written from the PTX ISA: f16 /
//!   bf16 / fp8 conversions (round to nearest even, `satfinite`), ordered and
//!   unordered `setp`, `.ftz`; `ex2.approx` / `tanh.approx` / `lg2.approx` exact or perturbed within
//!   the ISA's bounds ([`MathMode`]); the m8n8 and m16n8k16 fragment layouts.
//! * **Trap and panic**: `trap`, and calls of the Rust panic functions, stop the
//!   launch; a panic reports its Rust location decoded from the PTX's `.global` data.
//! * **Counters** ([`LaunchStats`]): lane-instructions by class, global bytes, `cp.async`
//!   bytes and the most in flight per CTA, barriers, `mma`s, and hits per
//!   instruction for the basic-block coverage ([`Module::coverage`]).
//!
//! [`PtxDevice`] is a `StepDevice`: the step runner, and every test body generic over
//! it, launches on the interpreter as it does on the emulator or a GPU.
//!
//! `mma` forms the products of its 16-bit inputs exactly in f64, sums them in k order
//! (exact unless their exponents spread over more than f64's 53 bits, e.g. bf16 extremes:
//! then it rounds twice), adds C and rounds to f32. The ISA leaves the hardware's
//! internal order and precision unspecified; this model matched the emulator bit for
//! bit in every test.
//!
//! `ld.global.nc` is checked per range: an `nc` load from a range the launch stores to
//! anywhere (or a store to a range it `nc`-loads) fails, even at different bytes, which
//! is stricter than the hardware needs (no kernel here mixes the two on one buffer).
//!
//! **Speed**: 196 M lane-instructions per second on one core of the 2-core development
//! VM, for the sm_90 f16 decode kernel at batch 17, head_dim 128 (`cargo bench -p
//! pagedkv-ptx-interp --bench decode`, 2026-12-03): CTAs run one after another on the
//! calling thread.
//!
//! ```
//! use pagedkv_ptx_interp::{Error, Module};
//!
//! let ptx = ".version 7.8\n.target sm_90\n.address_size 64\n\
//!            .visible .entry k(\n.param .align 8 .b8 k_param_0[8]\n)\n{\nret;\n}\n";
//! let m = Module::parse("k.ptx", ptx)?;
//! assert_eq!((m.target(), m.entry_points()), ("sm_90", vec!["k"]));
//! // What it does not know is an error naming the line.
//! let bad = ptx.replace("ret;", "atom.global.add.u32 %r1, [%rd1], 1;");
//! let e = Module::parse("k.ptx", &bad).unwrap_err();
//! assert!(e.to_string().contains("unsupported instruction `atom.global.add.u32`"), "{e}");
//! # Ok::<(), Error>(())
//! ```

mod device;
mod error;
mod exec;
mod ir;
mod lex;
mod num;
mod parse;

use std::collections::HashMap;
use std::sync::Mutex;

use pagedkv_host::emulator::{LaunchConfig, MAX_SHARED_BYTES, MAX_THREADS_PER_BLOCK};
use pagedkv_kernels::{GlobalRange, Kernel, KernelParams};

pub use device::{LaunchLog, LaunchRecord, PtxDevice};
pub use error::{Error, Result, Site};
pub use exec::{LaunchStats, MathMode};
pub use ir::InstClass;
pub use num::{EX2_MAX_REL_ERR, LG2_MAX_ABS_ERR, TANH_MAX_REL_ERR};

/// A parsed PTX module, ready to launch its entry points.
#[derive(Debug)]
pub struct Module {
    name: String,
    parsed: parse::Parsed,
    entries: HashMap<String, usize>,
    /// Per function: lanes that issued each instruction, over every launch so far.
    hits: Mutex<HashMap<usize, Vec<u64>>>,
}

/// Basic-block coverage of one entry point over the launches so far.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Coverage {
    /// The entry point.
    pub kernel: String,
    /// Basic blocks (straight-line runs between labels and branches).
    pub blocks: usize,
    /// PTX lines of the first instruction of every block no launch reached.
    pub missed: Vec<u32>,
    /// The subset of `missed` inside a loop (between a backward branch's target and
    /// the branch) that is not a panic path (a block that traps or calls a panic
    /// function, or from which every path leads to one, e.g. the branch to a division's
    /// zero check): the main-loop blocks the tests never ran.
    pub missed_in_loops: Vec<u32>,
    /// PTX lines of every loop's first block (a backward branch's target).
    pub loop_headers: Vec<u32>,
}

impl Module {
    /// Parses the PTX text `src`; `name` (e.g. the file name) appears in errors.
    pub fn parse(name: &str, src: &str) -> Result<Self> {
        let parsed = parse::parse(name, src)?;
        let entries = parsed
            .funcs
            .iter()
            .enumerate()
            .filter(|(_, f)| f.is_entry)
            .map(|(i, f)| (f.name.clone(), i))
            .collect();
        Ok(Self {
            name: name.to_string(),
            parsed,
            entries,
            hits: Mutex::new(HashMap::new()),
        })
    }

    /// The module's `.target` (e.g. `sm_90`).
    pub fn target(&self) -> &str {
        &self.parsed.target
    }

    /// Its name, as given to [`Module::parse`].
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The names of its entry points, sorted.
    pub fn entry_points(&self) -> Vec<&str> {
        let mut v: Vec<&str> = self.entries.keys().map(String::as_str).collect();
        v.sort_unstable();
        v
    }

    /// Instructions of entry point `kernel` (None: no such entry).
    pub fn instruction_count(&self, kernel: &str) -> Option<usize> {
        self.entries
            .get(kernel)
            .map(|&i| self.parsed.funcs[i].code.len())
    }

    /// The by-value parameter of entry point `kernel`: its size and alignment in bytes
    /// (None: no such entry, or not exactly one parameter).
    pub fn param_layout(&self, kernel: &str) -> Option<(u64, u64)> {
        let f = &self.parsed.funcs[*self.entries.get(kernel)?];
        match f.params.as_slice() {
            [p] => Some((p.size, p.align)),
            _ => None,
        }
    }

    /// Every `ld.param` of entry point `kernel`: its byte offset in the parameter and
    /// bytes loaded, in program order.
    pub fn param_loads(&self, kernel: &str) -> Vec<(i64, u64)> {
        let Some(&fi) = self.entries.get(kernel) else {
            return Vec::new();
        };
        self.parsed.funcs[fi]
            .code
            .iter()
            .filter_map(|i| match i.op {
                ir::Op::Ld {
                    space: ir::Space::Param,
                    bytes,
                    n,
                    addr,
                    ..
                } => Some((addr.off, bytes as u64 * n as u64)),
                _ => None,
            })
            .collect()
    }

    /// The `.maxntid` an entry point declares, if any.
    pub fn maxntid(&self, kernel: &str) -> Option<[u32; 3]> {
        self.entries
            .get(kernel)
            .and_then(|&i| self.parsed.funcs[i].maxntid)
    }

    /// Launches entry point `K::NAME` with `params` (its bytes are the `.param`
    /// struct: size and alignment are checked against the declaration).
    ///
    /// # Safety
    /// 1. Every view in `params` ([`KernelParams::globals`]) is valid, initialised host
    ///    memory for the launch: readable, and writable where it is a mutable view.
    /// 2. A range of [`pagedkv_kernels::Access::Views`] holds views that are valid,
    ///    initialised and writable host memory too (the interpreter registers them).
    /// 3. Nothing else reads or writes any of that memory during the launch.
    pub unsafe fn launch<K: Kernel>(
        &self,
        cfg: LaunchConfig,
        params: &K::Params,
        math: MathMode,
    ) -> Result<LaunchStats> {
        let mut ranges: Vec<GlobalRange> = Vec::new();
        params.globals(&mut |r| ranges.push(r));
        // SAFETY: `KernelParams` promises no padding, so all `size_of` bytes are
        // initialised; the slice borrows `params` for this statement only.
        let bytes = unsafe {
            std::slice::from_raw_parts(
                (params as *const K::Params).cast::<u8>(),
                size_of::<K::Params>(),
            )
        }
        .to_vec();
        // SAFETY: the caller's conditions 1-3 are `launch_bytes`'s for `ranges`.
        unsafe { self.launch_bytes(K::NAME, cfg, &bytes, align_of::<K::Params>(), &ranges, math) }
    }

    /// [`Module::launch`] with the parameter bytes and global ranges given directly.
    ///
    /// # Safety
    /// 1. Every range in `ranges` is valid, initialised host memory for the launch
    ///    (readable; writable where its access says so).
    /// 2. A [`pagedkv_kernels::Access::Views`] range holds views that are valid,
    ///    initialised, writable host memory too.
    /// 3. Nothing else reads or writes any of it meanwhile.
    pub unsafe fn launch_bytes(
        &self,
        kernel: &str,
        cfg: LaunchConfig,
        params: &[u8],
        params_align: usize,
        ranges: &[GlobalRange],
        math: MathMode,
    ) -> Result<LaunchStats> {
        let Some(&fi) = self.entries.get(kernel) else {
            return Err(Error::Config(format!(
                "`{kernel}` is not an entry point of {}",
                self.name
            )));
        };
        let func = &self.parsed.funcs[fi];
        let [p] = func.params.as_slice() else {
            return Err(Error::Config(format!(
                "`{kernel}` takes {} parameters; one by-value struct is supported",
                func.params.len()
            )));
        };
        if p.size != params.len() as u64 || p.align != params_align as u64 {
            return Err(Error::Config(format!(
                "`{kernel}`: the PTX's `.param` is {} bytes aligned to {}, the host's struct \
                 {} bytes aligned to {params_align}",
                p.size,
                p.align,
                params.len()
            )));
        }
        let (g, b) = (cfg.grid, cfg.block);
        if g.volume() == 0 || b.volume() == 0 || b.volume() > MAX_THREADS_PER_BLOCK {
            return Err(Error::Config(format!(
                "`{kernel}`: grid {g:?}, block {b:?} (1 to {MAX_THREADS_PER_BLOCK} threads a block)"
            )));
        }
        if let Some(m) = func.maxntid
            && (b.x > m[0] || b.y > m[1] || b.z > m[2])
        {
            return Err(Error::Config(format!(
                "`{kernel}`: block {b:?} above its `.maxntid` {m:?}"
            )));
        }
        if cfg.shared_bytes > MAX_SHARED_BYTES {
            return Err(Error::Config(format!(
                "`{kernel}`: {} bytes of dynamic shared memory (at most {MAX_SHARED_BYTES})",
                cfg.shared_bytes
            )));
        }
        let launch = exec::Launch {
            func,
            funcs: &self.parsed.funcs,
            globals: &self.parsed.globals,
            grid: g,
            block: b,
            shared_bytes: cfg.shared_bytes,
            params: params.to_vec(),
            math,
        };
        // SAFETY: the caller's condition.
        let stats = unsafe { launch.run(ranges) }?;
        let mut hits = self.hits.lock().unwrap_or_else(|e| e.into_inner());
        let h = hits.entry(fi).or_insert_with(|| vec![0; func.code.len()]);
        for (a, b) in h.iter_mut().zip(&stats.hits) {
            *a += b;
        }
        Ok(stats)
    }

    /// Basic-block coverage of every entry point, over the launches so far.
    pub fn coverage(&self) -> Vec<Coverage> {
        let hits = self.hits.lock().unwrap_or_else(|e| e.into_inner());
        let mut out: Vec<Coverage> = self
            .entries
            .iter()
            .map(|(name, &fi)| {
                let f = &self.parsed.funcs[fi];
                let h = hits.get(&fi);
                let loops: Vec<(u32, u32)> = f
                    .code
                    .iter()
                    .enumerate()
                    .filter_map(|(i, inst)| match inst.op {
                        ir::Op::Bra(t) if t as usize <= i => Some((t, i as u32)),
                        _ => None,
                    })
                    .collect();
                let doomed = panic_paths(f);
                let (mut missed, mut missed_in_loops) = (Vec::new(), Vec::new());
                for (k, &b) in f.blocks.iter().enumerate() {
                    if h.is_some_and(|h| h[b as usize] > 0) {
                        continue;
                    }
                    let line = f.code[b as usize].line;
                    missed.push(line);
                    if !doomed[k] && loops.iter().any(|&(lo, hi)| lo <= b && b <= hi) {
                        missed_in_loops.push(line);
                    }
                }
                let mut loop_headers: Vec<u32> = loops
                    .iter()
                    .map(|&(t, _)| f.code[t as usize].line)
                    .collect();
                loop_headers.sort_unstable();
                loop_headers.dedup();
                Coverage {
                    kernel: name.clone(),
                    blocks: f.blocks.len(),
                    missed,
                    missed_in_loops,
                    loop_headers,
                }
            })
            .collect();
        out.sort_by(|a, b| a.kernel.cmp(&b.kernel));
        out
    }
}

/// For each basic block of `f`, whether it is a panic path: it traps or calls a (panic,
/// `.noreturn`) function unconditionally, or it cannot end the thread itself (no
/// `exit` or `ret`, guarded or not), has successors, and every one of them is a panic
/// path.
fn panic_paths(f: &parse::Function) -> Vec<bool> {
    let n = f.blocks.len();
    let block_of = |i: u32| f.blocks.partition_point(|&b| b <= i) - 1;
    let ends = |k: usize| f.blocks.get(k + 1).map_or(f.code.len(), |&e| e as usize);
    let mut panics = vec![false; n];
    let mut exits = vec![false; n];
    let mut succ: Vec<Vec<usize>> = vec![Vec::new(); n];
    for k in 0..n {
        let (start, end) = (f.blocks[k] as usize, ends(k));
        let code = &f.code[start..end];
        panics[k] = code
            .iter()
            .any(|i| i.guard.is_none() && matches!(i.op, ir::Op::Trap | ir::Op::Call { .. }));
        // A block that may end the thread normally (an `exit` or `ret`, guarded or not)
        // is never a panic path.
        exits[k] = code
            .iter()
            .any(|i| matches!(i.op, ir::Op::Exit | ir::Op::Ret));
        let Some(last) = code.last() else { continue };
        let falls = last.guard.is_some()
            || !matches!(
                last.op,
                ir::Op::Bra(_) | ir::Op::Exit | ir::Op::Ret | ir::Op::Trap | ir::Op::Call { .. }
            );
        if let ir::Op::Bra(t) = last.op {
            succ[k].push(block_of(t));
        }
        if falls && k + 1 < n {
            succ[k].push(k + 1);
        }
    }
    let mut doomed = panics;
    loop {
        let mut changed = false;
        for k in 0..n {
            if !doomed[k] && !exits[k] && !succ[k].is_empty() && succ[k].iter().all(|&s| doomed[s])
            {
                doomed[k] = true;
                changed = true;
            }
        }
        if !changed {
            return doomed;
        }
    }
}
