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
//!
//! # Where the code lives
//! * this file: the launch (its checks, the worker threads, the block order) and
//!   the public types;
//! * `block`: one block's threads as coroutines, and their scheduling at barriers and
//!   shuffles (the divergence errors);
//! * `ctx`: [`EmuCtx`], the kernels' view of the machine: indices, shared and global
//!   memory with their checks, `cp.async`;
//! * `math`: [`MathMode`] and the approximate-math error model;
//! * [`fp8`]: a model of the GPU's FP8 `cvt` instructions, written from the PTX ISA,
//!   that the tests hold the device layer's software FP8 conversion to.
//!
//! [`GlobalSlice`]: pagedkv_kernels::GlobalSlice

mod block;
mod ctx;
pub mod fp8;
mod math;
mod warp;

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use corosensei::stack::DefaultStack;
use pagedkv_kernels::{Dim3, Kernel};

use block::run_block;
pub use ctx::EmuCtx;
pub use math::{EX2_APPROX_REL_ERR, LG2_APPROX_ABS_ERR, MathMode, TANH_APPROX_REL_ERR};

/// Most threads a block may have (CUDA's limit).
pub const MAX_THREADS_PER_BLOCK: u64 = 1024;
/// Most dynamic shared memory a block may ask for (sm_90's opt-in limit, 227 KiB).
pub const MAX_SHARED_BYTES: u32 = 227 * 1024;

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

/// Moves a kernel's parameters to the worker threads.
struct SendParams<P>(P);
// SAFETY: `Emulator::launch`'s contract makes the memory behind the parameters valid
// for the whole launch and free of other users; blocks write disjoint memory by the
// kernel contract, so sharing the (Copy) parameters between workers is sound.
unsafe impl<P> Send for SendParams<P> {}
// SAFETY: as above.
unsafe impl<P> Sync for SendParams<P> {}

/// The coordinates of index `linear` in `extent` (x fastest), as CUDA numbers blocks
/// and threads.
fn dim_of(linear: u64, extent: Dim3) -> Dim3 {
    let x = linear % extent.x as u64;
    let y = (linear / extent.x as u64) % extent.y as u64;
    let z = linear / (extent.x as u64 * extent.y as u64);
    Dim3::new(x as u32, y as u32, z as u32)
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
    ///
    /// [`GlobalSlice`]: pagedkv_kernels::GlobalSlice
    /// [`GlobalSliceMut`]: pagedkv_kernels::GlobalSliceMut
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
