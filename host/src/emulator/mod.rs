//! A CPU SIMT emulator that runs pagedkv's kernel bodies thread by thread.
//!
//! Every thread of a block is a stackful coroutine ([`corosensei`]) with its own
//! indices, running the kernel's real `run` (the same source the PTX comes from).
//! A block's threads run on one OS thread and switch only where CUDA threads
//! synchronise: at `__syncthreads()` and at warp shuffles. That gives exact CUDA
//! semantics for those two operations and makes their misuse a deterministic error
//! instead of a hang:
//!
//! * **Barrier.** A thread that calls `sync_threads` parks; when every live thread of
//!   the block is parked at the barrier they all go on. If some threads of the block
//!   have already exited while others wait, that is [`EmuError::BarrierDivergence`],
//!   naming the block (a barrier not all threads reach: undefined behaviour on a GPU).
//! * **Warp shuffle.** A lane that calls `shfl_xor` parks with its value; when all 32
//!   lanes of its warp have arrived, each gets the value of lane `lane ^ mask`. Lanes of
//!   one warp that disagree (some at a barrier, some exited, different masks) are
//!   [`EmuError::ShuffleDivergence`].
//! * **Shared memory** is per block, filled with `0xFF` bytes (NaN for `f32`) at block
//!   start so a read before any write shows up; an access out of range panics with the
//!   offset, and the launch returns [`EmuError::Panic`] naming block and thread.
//! * **Global memory** goes through the kernel's [`GlobalSlice`] views: every access is
//!   bounds-checked, and 16-byte accesses are checked for alignment.
//! * **`cp.async`** is asynchronous here too: a copy fills its 16 destination bytes with
//!   `0xFF` (NaN) when issued and lands only at the `cp_async_wait::<N>()` that retires
//!   its commit group (per thread, in commit order). A missing or early wait, or a
//!   missing barrier between one thread's wait and another's read, shows as NaN in the
//!   result; a thread that exits with copies pending fails the launch.
//! * **Fast math** is exact by default; [`MathMode::Approx`] perturbs every `exp2` and
//!   `tanh` by up to the hardware instruction's documented error, so a test's tolerance
//!   is a GPU tolerance.
//!
//! Blocks run on a pool of OS threads, in an order you choose ([`BlockOrder`]); a kernel
//! whose result depends on block order is wrong, and tests can run the same launch in
//! several orders to prove it is not.
//!
//! ```
//! use pagedkv_host::emulator::{Emulator, LaunchConfig};
//! use pagedkv_kernels::{Ctx, Dim3, GlobalSliceMut, Kernel};
//!
//! /// out[i] = sum over the warp of i (every lane gets 0+1+..+31 = 496).
//! struct WarpSum;
//! impl Kernel for WarpSum {
//!     type Params = GlobalSliceMut<f32>;
//!     const NAME: &'static str = "warp_sum";
//!     fn run<C: Ctx>(ctx: &C, out: &GlobalSliceMut<f32>) {
//!         let mut v = ctx.lane() as f32;
//!         for m in [16, 8, 4, 2, 1] {
//!             v += ctx.shfl_xor_f32(v, m);
//!         }
//!         ctx.st(out, ctx.linear_thread() as u64, v);
//!     }
//! }
//!
//! let mut out = vec![0.0f32; 64];
//! // SAFETY: the view covers `out`, which lives across the launch and nothing else uses.
//! let view = unsafe { GlobalSliceMut::from_raw_parts(out.as_mut_ptr(), 64) };
//! let cfg = LaunchConfig { grid: Dim3::new(1, 1, 1), block: Dim3::new(64, 1, 1), shared_bytes: 0 };
//! unsafe { Emulator::new().launch::<WarpSum>(cfg, view) }.unwrap();
//! assert!(out.iter().all(|&v| v == 496.0));
//! ```

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::rc::Rc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult, Yielder};
use pagedkv_kernels::device::WARP_SIZE;
use pagedkv_kernels::{Ctx, Dim3, GlobalSlice, GlobalSliceMut, Kernel};

/// Most threads a block may have (CUDA's limit).
pub const MAX_THREADS_PER_BLOCK: u64 = 1024;
/// Most dynamic shared memory a block may ask for (sm_90's opt-in limit, 227 KiB).
pub const MAX_SHARED_BYTES: u32 = 227 * 1024;
/// Stack size of one emulated thread.
const THREAD_STACK_BYTES: usize = 256 * 1024;

/// Grid, block and dynamic shared memory of one launch, as in CUDA.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Blocks in the grid.
    pub grid: Dim3,
    /// Threads in a block.
    pub block: Dim3,
    /// Dynamic shared memory per block, in bytes.
    pub shared_bytes: u32,
}

/// The order in which the emulator hands out blocks to its worker threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum BlockOrder {
    /// Linear block index 0, 1, 2, ... (x fastest).
    #[default]
    Forward,
    /// The last block first.
    Reverse,
    /// A pseudo-random permutation drawn from this seed.
    Shuffled(u64),
}

/// Why an emulated launch failed.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum EmuError {
    /// The launch configuration is not one CUDA would accept.
    #[error("invalid launch configuration: {0}")]
    InvalidConfig(String),
    /// Some threads of a block wait at a barrier that others never reach.
    #[error(
        "block {block:?}: barrier not reached by all threads ({waiting} waiting, {exited} already exited)"
    )]
    BarrierDivergence {
        /// The block.
        block: Dim3,
        /// Threads parked at the barrier.
        waiting: u32,
        /// Threads that returned from the kernel without reaching it.
        exited: u32,
    },
    /// The lanes of a warp did not all take part in the same shuffle.
    #[error("block {block:?}, warp {warp}: divergent warp shuffle: {detail}")]
    ShuffleDivergence {
        /// The block.
        block: Dim3,
        /// The warp within the block.
        warp: u32,
        /// What the lanes were doing.
        detail: String,
    },
    /// A thread panicked: an out-of-bounds global or shared access, or a bug.
    #[error("block {block:?}, thread {thread:?}: {message}")]
    Panic {
        /// The block.
        block: Dim3,
        /// The thread.
        thread: Dim3,
        /// The panic message.
        message: String,
    },
    /// The emulator could not allocate a thread stack.
    #[error("emulator resources: {0}")]
    Resources(String),
}

/// How the emulator computes the fast-math operations ([`Ctx::exp2`], [`Ctx::tanh`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum MathMode {
    /// Correctly rounded `f32` results (the Rust standard library's).
    #[default]
    Exact,
    /// The GPU's error model: each result is perturbed by a relative error drawn
    /// uniformly from the instruction's documented worst case ([`EX2_APPROX_REL_ERR`]
    /// for `ex2.approx.ftz.f32`, which also flushes subnormal results to zero;
    /// [`TANH_APPROX_REL_ERR`] for `tanh.approx.f32`), from this seed, per thread. A
    /// tolerance that holds here holds for any result the hardware may return.
    Approx {
        /// Seed of the perturbations (mixed with block and thread indices).
        seed: u64,
    },
}

/// Worst-case relative error of `ex2.approx.ftz.f32` assumed by [`MathMode::Approx`]
/// (2 ulp of `f32`: 2^-22).
pub const EX2_APPROX_REL_ERR: f64 = 1.0 / (1u64 << 22) as f64;
/// Worst-case relative error of `tanh.approx.f32` (2^-10.987, per the PTX ISA).
pub const TANH_APPROX_REL_ERR: f64 = 4.9e-4;

/// The SIMT emulator. Cheap to create; holds only its scheduling and math options.
#[derive(Clone, Debug)]
pub struct Emulator {
    workers: usize,
    order: BlockOrder,
    math: MathMode,
}

impl Default for Emulator {
    fn default() -> Self {
        Self::new()
    }
}

/// What a parked thread is waiting for.
#[derive(Clone, Copy, Debug)]
enum Event {
    Barrier,
    Shuffle { value: u32, lane_mask: u32 },
}

#[derive(Clone, Copy, Debug)]
enum State {
    Ready(u32),
    AtBarrier,
    AtShuffle { value: u32, lane_mask: u32 },
    Done,
}

type ThreadCo = Coroutine<u32, Event, (), DefaultStack>;

/// Per-block state shared by the block's threads (all on one OS thread).
struct BlockShared {
    smem: RefCell<Vec<u8>>,
}

/// One thread's asynchronous copies: `(shared byte offset, the 16 bytes)`.
#[derive(Default)]
struct CpAsync {
    /// Copies issued since the last commit.
    open: Vec<(usize, [u8; 16])>,
    /// Committed groups, oldest first.
    committed: VecDeque<Vec<(usize, [u8; 16])>>,
}

/// The emulator's [`Ctx`]: one per emulated thread, living on that thread's stack.
pub struct EmuCtx {
    yielder: *const Yielder<u32, Event>,
    block: Rc<BlockShared>,
    thread_idx: Dim3,
    block_idx: Dim3,
    block_dim: Dim3,
    grid_dim: Dim3,
    cp_async: RefCell<CpAsync>,
    /// `Some(state)` of the perturbation generator in [`MathMode::Approx`].
    approx: Cell<Option<u64>>,
}

impl EmuCtx {
    /// A relative perturbation uniform in `[-max, max]` (approximate math), else 0.
    fn perturbation(&self, max: f64) -> f64 {
        let Some(mut s) = self.approx.get() else {
            return 0.0;
        };
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        self.approx.set(Some(s));
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        let u = (z >> 11) as f64 / (1u64 << 53) as f64; // [0, 1)
        (2.0 * u - 1.0) * max
    }

    /// Panics (failing the launch) when copies are still in flight at thread exit.
    fn check_no_pending_copies(&self) {
        let cp = self.cp_async.borrow();
        let pending: usize = cp.open.len() + cp.committed.iter().map(Vec::len).sum::<usize>();
        if pending > 0 {
            panic!(
                "{pending} cp.async copies still pending at thread exit: a missing commit or cp.async.wait_group (their shared-memory bytes never landed)"
            );
        }
    }

    fn suspend(&self, e: Event) -> u32 {
        // SAFETY: an `EmuCtx` is created inside its coroutine's body from the yielder
        // that body received, and never leaves that body, so the yielder outlives it.
        unsafe { (*self.yielder).suspend(e) }
    }

    fn smem_check(&self, byte: u64, width: u64) -> usize {
        let len = self.block.smem.borrow().len() as u64;
        if byte + width > len {
            panic!(
                "shared memory access out of range: bytes {byte}..{} of {len}",
                byte + width
            );
        }
        byte as usize
    }
}

fn global_check(what: &str, ptr: *const u8, len_elems: u64, elem: u64, size: u64, width: u64) {
    let end = elem.checked_mul(size).and_then(|b| b.checked_add(width));
    match end {
        Some(end) if end <= len_elems * size => {}
        _ => panic!(
            "global {what} out of bounds: element {elem} ({width} bytes) of a view of {len_elems} elements at {ptr:p}"
        ),
    }
    if width == 16 {
        let addr = ptr as u64 + elem * size;
        if !addr.is_multiple_of(16) {
            panic!("global {what}: 16-byte access at {addr:#x} is not 16-byte aligned");
        }
    }
}

impl Ctx for EmuCtx {
    fn thread_idx(&self) -> Dim3 {
        self.thread_idx
    }
    fn block_idx(&self) -> Dim3 {
        self.block_idx
    }
    fn block_dim(&self) -> Dim3 {
        self.block_dim
    }
    fn grid_dim(&self) -> Dim3 {
        self.grid_dim
    }
    fn sync_threads(&self) {
        self.suspend(Event::Barrier);
    }
    fn shfl_xor_u32(&self, v: u32, lane_mask: u32) -> u32 {
        self.suspend(Event::Shuffle {
            value: v,
            lane_mask,
        })
    }
    fn exp2(&self, x: f32) -> f32 {
        let r = x.exp2();
        if self.approx.get().is_none() {
            return r;
        }
        let r = (r as f64 * (1.0 + self.perturbation(EX2_APPROX_REL_ERR))) as f32;
        if r.is_subnormal() { 0.0 } else { r }
    }
    fn tanh(&self, x: f32) -> f32 {
        let r = x.tanh();
        if self.approx.get().is_none() {
            return r;
        }
        (r as f64 * (1.0 + self.perturbation(TANH_APPROX_REL_ERR))) as f32
    }
    fn fma(&self, a: f32, b: f32, c: f32) -> f32 {
        a.mul_add(b, c)
    }
    fn cp_async_16<T>(&self, word: u32, s: &GlobalSlice<T>, i: u64) {
        let bytes = self.ld_nc_v4(s, i);
        if !word.is_multiple_of(4) {
            panic!("cp.async: shared word {word} is not 16-byte aligned");
        }
        let o = self.smem_check(4 * word as u64, 16);
        // Undefined until the wait that covers it: NaN in every element type.
        self.block.smem.borrow_mut()[o..o + 16].fill(0xFF);
        let mut data = [0u8; 16];
        for (d, w) in data.chunks_exact_mut(4).zip(bytes) {
            d.copy_from_slice(&w.to_le_bytes());
        }
        self.cp_async.borrow_mut().open.push((o, data));
    }
    fn cp_async_commit(&self) {
        let mut cp = self.cp_async.borrow_mut();
        let group = std::mem::take(&mut cp.open);
        cp.committed.push_back(group);
    }
    fn cp_async_wait<const N: u32>(&self) {
        let mut cp = self.cp_async.borrow_mut();
        let mut smem = self.block.smem.borrow_mut();
        while cp.committed.len() > N as usize {
            for (o, data) in cp.committed.pop_front().unwrap_or_default() {
                smem[o..o + 16].copy_from_slice(&data);
            }
        }
    }
    fn smem_ld_v4(&self, word: u32) -> [u32; 4] {
        if !word.is_multiple_of(4) {
            panic!("ld.shared.v4: shared word {word} is not 16-byte aligned");
        }
        let o = self.smem_check(4 * word as u64, 16);
        let s = self.block.smem.borrow();
        let w = |k: usize| u32::from_le_bytes(s[o + 4 * k..o + 4 * k + 4].try_into().unwrap());
        [w(0), w(1), w(2), w(3)]
    }
    fn ld<T: Copy>(&self, s: &GlobalSlice<T>, i: u64) -> T {
        let size = size_of::<T>() as u64;
        global_check("load", s.as_ptr().cast(), s.len(), i, size, size);
        // SAFETY: in bounds (checked above) of a view whose constructor's contract makes
        // it valid for reads during the launch.
        unsafe { s.as_ptr().add(i as usize).read_unaligned() }
    }
    fn st<T: Copy>(&self, s: &GlobalSliceMut<T>, i: u64, v: T) {
        let size = size_of::<T>() as u64;
        global_check("store", s.as_mut_ptr().cast(), s.len(), i, size, size);
        // SAFETY: in bounds of a view valid for writes during the launch.
        unsafe { s.as_mut_ptr().add(i as usize).write_unaligned(v) }
    }
    fn ld_v4<T>(&self, s: &GlobalSlice<T>, i: u64) -> [u32; 4] {
        let size = size_of::<T>() as u64;
        global_check("load", s.as_ptr().cast(), s.len(), i, size, 16);
        // SAFETY: 16 in-bounds bytes of a view valid for reads during the launch.
        unsafe {
            s.as_ptr()
                .add(i as usize)
                .cast::<[u32; 4]>()
                .read_unaligned()
        }
    }
    fn ld_nc_v4<T>(&self, s: &GlobalSlice<T>, i: u64) -> [u32; 4] {
        self.ld_v4(s, i)
    }
    fn st_v4<T>(&self, s: &GlobalSliceMut<T>, i: u64, v: [u32; 4]) {
        let size = size_of::<T>() as u64;
        global_check("store", s.as_mut_ptr().cast(), s.len(), i, size, 16);
        // SAFETY: 16 in-bounds bytes of a view valid for writes during the launch.
        unsafe {
            s.as_mut_ptr()
                .add(i as usize)
                .cast::<[u32; 4]>()
                .write_unaligned(v)
        }
    }
    fn smem_ld_u32(&self, i: u32) -> u32 {
        let o = self.smem_check(4 * i as u64, 4);
        let s = self.block.smem.borrow();
        u32::from_le_bytes(s[o..o + 4].try_into().unwrap())
    }
    fn smem_st_u32(&self, i: u32, v: u32) {
        let o = self.smem_check(4 * i as u64, 4);
        self.block.smem.borrow_mut()[o..o + 4].copy_from_slice(&v.to_le_bytes());
    }
}

/// Moves a kernel's parameters to the worker threads.
struct SendParams<P>(P);
// SAFETY: `Emulator::launch`'s contract makes the memory behind the parameters valid
// for the whole launch and free of other users; blocks write disjoint memory by the
// kernel contract, so sharing the (Copy) parameters between workers is sound.
unsafe impl<P> Send for SendParams<P> {}
// SAFETY: as above.
unsafe impl<P> Sync for SendParams<P> {}

fn dim_of(linear: u64, extent: Dim3) -> Dim3 {
    let x = linear % extent.x as u64;
    let y = (linear / extent.x as u64) % extent.y as u64;
    let z = linear / (extent.x as u64 * extent.y as u64);
    Dim3::new(x as u32, y as u32, z as u32)
}

fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "kernel thread panicked".to_string()
    }
}

/// A small deterministic permutation (splitmix64-driven Fisher-Yates).
fn permutation(n: u64, seed: u64) -> Vec<u64> {
    let mut v: Vec<u64> = (0..n).collect();
    let mut s = seed;
    for i in (1..v.len()).rev() {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        v.swap(i, (z % (i as u64 + 1)) as usize);
    }
    v
}

impl Emulator {
    /// An emulator that runs blocks on every available core, in forward order.
    pub fn new() -> Self {
        let workers = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1);
        Self {
            workers,
            order: BlockOrder::Forward,
            math: MathMode::Exact,
        }
    }

    /// Sets how `exp2` and `tanh` are computed (see [`MathMode`]).
    pub fn with_math(mut self, math: MathMode) -> Self {
        self.math = math;
        self
    }

    /// The math mode.
    pub fn math(&self) -> MathMode {
        self.math
    }

    /// Sets the number of OS worker threads that run blocks (at least 1).
    pub fn with_workers(mut self, workers: usize) -> Self {
        self.workers = workers.max(1);
        self
    }

    /// Sets the order in which blocks are handed out.
    pub fn with_order(mut self, order: BlockOrder) -> Self {
        self.order = order;
        self
    }

    /// Checks a launch configuration the way the CUDA driver would.
    pub fn check_config(cfg: &LaunchConfig) -> Result<(), EmuError> {
        let threads = cfg.block.volume();
        if cfg.grid.volume() == 0 || threads == 0 {
            return Err(EmuError::InvalidConfig(format!(
                "empty grid {:?} or block {:?}",
                cfg.grid, cfg.block
            )));
        }
        if threads > MAX_THREADS_PER_BLOCK {
            return Err(EmuError::InvalidConfig(format!(
                "{threads} threads per block (at most {MAX_THREADS_PER_BLOCK})"
            )));
        }
        if cfg.shared_bytes > MAX_SHARED_BYTES {
            return Err(EmuError::InvalidConfig(format!(
                "{} bytes of shared memory (at most {MAX_SHARED_BYTES})",
                cfg.shared_bytes
            )));
        }
        Ok(())
    }

    /// Runs kernel `K` over the grid, every thread of every block, and returns when all
    /// blocks are done or the first block fails.
    ///
    /// # Safety
    /// 1. Every [`GlobalSlice`] / [`GlobalSliceMut`] reachable from `params` (directly,
    ///    or stored in memory a view covers) points to host memory valid for reads
    ///    (and writes, for the mutable ones) of its whole length for the duration of
    ///    the call, as its constructor's contract says.
    /// 2. Nothing outside the launch reads or writes memory the kernel writes while the
    ///    call runs.
    /// 3. The kernel writes each element from at most one thread (blocks run
    ///    concurrently on several OS threads).
    pub unsafe fn launch<K: Kernel>(
        &self,
        cfg: LaunchConfig,
        params: K::Params,
    ) -> Result<(), EmuError> {
        Self::check_config(&cfg)?;
        let nblocks = cfg.grid.volume();
        let order: Vec<u64> = match self.order {
            BlockOrder::Forward => (0..nblocks).collect(),
            BlockOrder::Reverse => (0..nblocks).rev().collect(),
            BlockOrder::Shuffled(seed) => permutation(nblocks, seed),
        };
        let next = AtomicUsize::new(0);
        let stop = AtomicBool::new(false);
        let first_error: Mutex<Option<(usize, EmuError)>> = Mutex::new(None);
        let params = SendParams(params);
        let workers = self.workers.min(nblocks as usize).max(1);

        let work = || {
            let params = &params;
            let mut stacks: Vec<DefaultStack> = Vec::new();
            loop {
                if stop.load(Ordering::Relaxed) {
                    break;
                }
                let k = next.fetch_add(1, Ordering::Relaxed);
                if k >= order.len() {
                    break;
                }
                let block_idx = dim_of(order[k], cfg.grid);
                if let Err(e) = run_block::<K>(&cfg, block_idx, self.math, params.0, &mut stacks) {
                    stop.store(true, Ordering::Relaxed);
                    let mut slot = first_error.lock().unwrap_or_else(|p| p.into_inner());
                    // Keep the error of the earliest block in launch order, so the
                    // reported failure does not depend on thread timing.
                    if slot.as_ref().is_none_or(|(kk, _)| k < *kk) {
                        *slot = Some((k, e));
                    }
                }
            }
        };
        if workers == 1 {
            work();
        } else {
            std::thread::scope(|s| {
                for _ in 0..workers {
                    s.spawn(work);
                }
            });
        }
        match first_error.into_inner().unwrap_or_else(|p| p.into_inner()) {
            Some((_, e)) => Err(e),
            None => Ok(()),
        }
    }
}

fn run_block<K: Kernel>(
    cfg: &LaunchConfig,
    block_idx: Dim3,
    math: MathMode,
    params: K::Params,
    stacks: &mut Vec<DefaultStack>,
) -> Result<(), EmuError> {
    let n = cfg.block.volume() as usize;
    let shared = Rc::new(BlockShared {
        smem: RefCell::new(vec![0xFF; cfg.shared_bytes as usize]),
    });
    let mut threads: Vec<ThreadCo> = Vec::with_capacity(n);
    for t in 0..n {
        let stack = match stacks.pop() {
            Some(s) => s,
            None => DefaultStack::new(THREAD_STACK_BYTES)
                .map_err(|e| EmuError::Resources(format!("thread stack: {e}")))?,
        };
        let block = Rc::clone(&shared);
        let thread_idx = dim_of(t as u64, cfg.block);
        let (block_dim, grid_dim) = (cfg.block, cfg.grid);
        let approx = match math {
            MathMode::Exact => None,
            MathMode::Approx { seed } => Some(
                seed ^ (block_idx.x as u64) << 40
                    ^ (block_idx.y as u64) << 20
                    ^ block_idx.z as u64
                    ^ (t as u64).wrapping_mul(0xD6E8_FEB8_6659_FD93),
            ),
        };
        threads.push(Coroutine::with_stack(
            stack,
            move |y: &Yielder<u32, Event>, _first: u32| {
                let ctx = EmuCtx {
                    yielder: y as *const _,
                    block,
                    thread_idx,
                    block_idx,
                    block_dim,
                    grid_dim,
                    cp_async: RefCell::new(CpAsync::default()),
                    approx: Cell::new(approx),
                };
                K::run(&ctx, &params);
                ctx.check_no_pending_copies();
            },
        ));
    }
    let mut state = vec![State::Ready(0); n];
    let warps = n.div_ceil(WARP_SIZE as usize);

    loop {
        // Run every ready thread until it parks or exits.
        for t in 0..n {
            if let State::Ready(input) = state[t] {
                let co = &mut threads[t];
                match catch_unwind(AssertUnwindSafe(|| co.resume(input))) {
                    Ok(CoroutineResult::Yield(Event::Barrier)) => state[t] = State::AtBarrier,
                    Ok(CoroutineResult::Yield(Event::Shuffle { value, lane_mask })) => {
                        state[t] = State::AtShuffle { value, lane_mask }
                    }
                    Ok(CoroutineResult::Return(())) => state[t] = State::Done,
                    Err(p) => {
                        return Err(EmuError::Panic {
                            block: block_idx,
                            thread: dim_of(t as u64, cfg.block),
                            message: panic_message(p.as_ref()),
                        });
                    }
                }
            }
        }
        if state.iter().all(|s| matches!(s, State::Done)) {
            break;
        }
        // Every thread is parked or done: resolve shuffles warp by warp.
        let mut progressed = false;
        for w in 0..warps {
            let lanes = w * WARP_SIZE as usize..((w + 1) * WARP_SIZE as usize).min(n);
            let at_shuffle = lanes
                .clone()
                .filter(|&t| matches!(state[t], State::AtShuffle { .. }))
                .count();
            if at_shuffle == 0 {
                continue;
            }
            let divergence = |detail: String| EmuError::ShuffleDivergence {
                block: block_idx,
                warp: w as u32,
                detail,
            };
            if at_shuffle < WARP_SIZE as usize {
                return Err(divergence(format!(
                    "{at_shuffle} of {} lanes at the shuffle, the others at a barrier or exited",
                    if lanes.len() < WARP_SIZE as usize {
                        format!("32 (the warp is partial: {} threads)", lanes.len())
                    } else {
                        "32".to_string()
                    }
                )));
            }
            let mut values = [0u32; WARP_SIZE as usize];
            let mut mask0 = None;
            for (lane, t) in lanes.clone().enumerate() {
                if let State::AtShuffle { value, lane_mask } = state[t] {
                    values[lane] = value;
                    match mask0 {
                        None => mask0 = Some(lane_mask),
                        Some(m) if m != lane_mask => {
                            return Err(divergence(format!(
                                "lanes use different lane masks ({m} and {lane_mask})"
                            )));
                        }
                        Some(_) => {}
                    }
                }
            }
            let mask = mask0.unwrap_or(0) & (WARP_SIZE - 1);
            for (lane, t) in lanes.enumerate() {
                state[t] = State::Ready(values[lane ^ mask as usize]);
            }
            progressed = true;
        }
        if progressed {
            continue;
        }
        // No shuffle pending: everyone left must be at the barrier.
        let waiting = state
            .iter()
            .filter(|s| matches!(s, State::AtBarrier))
            .count();
        let exited = state.iter().filter(|s| matches!(s, State::Done)).count();
        if exited > 0 {
            return Err(EmuError::BarrierDivergence {
                block: block_idx,
                waiting: waiting as u32,
                exited: exited as u32,
            });
        }
        for s in state.iter_mut() {
            *s = State::Ready(0);
        }
    }
    for co in threads {
        stacks.push(co.into_stack());
    }
    Ok(())
}
