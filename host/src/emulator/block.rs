//! One block of a launch: its threads as stackful coroutines on one OS thread, run
//! until each parks (at a barrier or a shuffle) or ends, then released together.
//!
//! The scheduler of a block keeps CUDA's rules for the two synchronising operations
//! and turns their misuse into errors, never a hang:
//! * a warp shuffle completes only when all 32 lanes of the warp are at it with the
//!   same lane mask ([`EmuError::ShuffleDivergence`] otherwise);
//! * a barrier completes only when every thread of the block is at it; a thread that
//!   has already exited while others wait is [`EmuError::BarrierDivergence`];
//! * a panic in a thread (an out-of-bounds access, a `cp.async` left pending) fails
//!   the block with [`EmuError::Panic`], naming block and thread.
//!
//! Shuffles are resolved before barriers: a round in which some warp completes a
//! shuffle runs again before the barrier is considered.

use std::any::Any;
use std::cell::{Cell, RefCell};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::rc::Rc;

use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult, Yielder};
use pagedkv_kernels::device::WARP_SIZE;

use super::warp::{self, WarpOp};
use pagedkv_kernels::{Dim3, Kernel};

use super::ctx::{CpAsync, EmuCtx};
use super::{EmuError, LaunchConfig, MathMode, dim_of};

/// Stack size of one emulated thread.
const THREAD_STACK_BYTES: usize = 256 * 1024;

/// What a parked thread is waiting for.
#[derive(Clone, Copy, Debug)]
pub(super) enum Event {
    /// `__syncthreads()`.
    Barrier,
    /// A warp shuffle: this lane's value, and the xor of the lane to read from.
    Shuffle { value: u32, lane_mask: u32 },
    /// A warp-collective tensor-core instruction (`ldmatrix`, `mma`): this lane's part.
    Warp(WarpOp),
}

/// Where a thread of the block is, between two rounds of the block's scheduler.
#[derive(Clone, Copy, Debug)]
enum State {
    Ready([u32; 4]),
    AtBarrier,
    AtShuffle { value: u32, lane_mask: u32 },
    AtWarp(WarpOp),
    Done,
}

/// An emulated thread: resumed with the registers its last event returns (a shuffle's
/// value in the first, a warp instruction's results), it runs until its next event or
/// its end.
type ThreadCo = Coroutine<[u32; 4], Event, (), DefaultStack>;

/// Per-block state shared by the block's threads (all on one OS thread).
pub(super) struct BlockShared {
    /// The block's shared memory, bytes.
    pub(super) smem: RefCell<Vec<u8>>,
}

/// The message of a caught panic.
fn panic_message(p: &(dyn Any + Send)) -> String {
    if let Some(s) = p.downcast_ref::<&str>() {
        (*s).to_string()
    } else if let Some(s) = p.downcast_ref::<String>() {
        s.clone()
    } else {
        "kernel thread panicked".to_string()
    }
}

/// Runs every thread of block `block_idx` to its end, parking them at barriers and
/// shuffles and releasing them together; reuses (and returns) thread stacks from
/// `stacks`.
pub(super) fn run_block<K: Kernel>(
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
        let approx = math.thread_state(block_idx, t);
        threads.push(Coroutine::with_stack(
            stack,
            move |y: &Yielder<[u32; 4], Event>, _first: [u32; 4]| {
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
    let mut state = vec![State::Ready([0; 4]); n];
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
                    Ok(CoroutineResult::Yield(Event::Warp(op))) => state[t] = State::AtWarp(op),
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
                .filter(|&t| matches!(state[t], State::AtShuffle { .. } | State::AtWarp(_)))
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
            let warp_ops = lanes
                .clone()
                .filter(|&t| matches!(state[t], State::AtWarp(_)))
                .count();
            if warp_ops > 0 {
                if warp_ops < WARP_SIZE as usize {
                    return Err(divergence(format!(
                        "{warp_ops} of 32 lanes at a tensor-core instruction, the others at a shuffle"
                    )));
                }
                let mut ops = [None; WARP_SIZE as usize];
                for (lane, t) in lanes.clone().enumerate() {
                    if let State::AtWarp(op) = state[t] {
                        ops[lane] = Some(op);
                    }
                }
                let ops = ops.map(|o| o.expect("every lane is at the instruction"));
                let regs = warp::execute(&ops, &shared.smem.borrow()).map_err(divergence)?;
                for (lane, t) in lanes.enumerate() {
                    state[t] = State::Ready(regs[lane]);
                }
                progressed = true;
                continue;
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
                state[t] = State::Ready([values[lane ^ mask as usize], 0, 0, 0]);
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
            *s = State::Ready([0; 4]);
        }
    }
    for co in threads {
        stacks.push(co.into_stack());
    }
    Ok(())
}
