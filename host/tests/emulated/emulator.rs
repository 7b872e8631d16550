//! The emulator's CUDA semantics and its misuse reports, on small test kernels.

use pagedkv_host::emulator::{BlockOrder, EmuError, Emulator, LaunchConfig};
use pagedkv_kernels::{Ctx, Dim3, GlobalSliceMut, Kernel};

fn cfg(grid: Dim3, block: Dim3, shared_bytes: u32) -> LaunchConfig {
    LaunchConfig {
        grid,
        block,
        shared_bytes,
    }
}

fn out_view(v: &mut [f32]) -> GlobalSliceMut<f32> {
    // SAFETY: the view covers `v`, which each test keeps alive and untouched during
    // the launch.
    unsafe { GlobalSliceMut::from_raw_parts(v.as_mut_ptr(), v.len() as u64) }
}

/// Writes `out[global_linear_thread] = global_linear_thread` from 3-D indices.
struct Indices;
impl Kernel for Indices {
    type Params = GlobalSliceMut<f32>;
    const NAME: &'static str = "indices";
    fn run<C: Ctx>(ctx: &C, out: &Self::Params) {
        let (b, g) = (ctx.block_idx(), ctx.grid_dim());
        let block_linear = b.x + g.x * (b.y + g.y * b.z);
        let i = block_linear as u64 * ctx.block_dim().volume() + ctx.linear_thread() as u64;
        ctx.st(out, i, i as f32);
    }
}

#[test]
fn every_thread_of_a_3d_grid_runs_once_with_its_own_indices() {
    let (grid, block) = (Dim3::new(3, 2, 2), Dim3::new(8, 2, 2));
    let n = (grid.volume() * block.volume()) as usize;
    let mut out = vec![f32::NAN; n];
    unsafe { Emulator::new().launch::<Indices>(cfg(grid, block, 0), out_view(&mut out)) }.unwrap();
    for (i, v) in out.iter().enumerate() {
        assert_eq!(*v, i as f32, "thread {i}");
    }
}

/// Each lane records the value it receives from `shfl_xor(lane * 100 + mask, mask)`.
struct ShuffleAllMasks;
impl Kernel for ShuffleAllMasks {
    type Params = GlobalSliceMut<f32>;
    const NAME: &'static str = "shuffle_all_masks";
    fn run<C: Ctx>(ctx: &C, out: &Self::Params) {
        let t = ctx.linear_thread();
        for mask in 0..32u32 {
            let got = ctx.shfl_xor_u32(t * 100 + mask, mask);
            ctx.st(out, (t * 32 + mask) as u64, got as f32);
        }
    }
}

#[test]
fn shuffle_xor_exchanges_with_lane_xor_mask_within_each_warp() {
    let mut out = vec![f32::NAN; 64 * 32];
    unsafe {
        Emulator::new().launch::<ShuffleAllMasks>(
            cfg(Dim3::new(1, 1, 1), Dim3::new(64, 1, 1), 0),
            out_view(&mut out),
        )
    }
    .unwrap();
    for t in 0..64u32 {
        for mask in 0..32u32 {
            let warp_base = t / 32 * 32;
            let partner = warp_base + ((t % 32) ^ mask);
            assert_eq!(out[(t * 32 + mask) as usize], (partner * 100 + mask) as f32);
        }
    }
}

/// smem[t] = t; (barrier if BARRIER); out[t] = smem[(t + 1) % n].
struct Rotate<const BARRIER: bool>;
impl<const BARRIER: bool> Kernel for Rotate<BARRIER> {
    type Params = GlobalSliceMut<f32>;
    const NAME: &'static str = "rotate";
    fn run<C: Ctx>(ctx: &C, out: &Self::Params) {
        let t = ctx.linear_thread();
        let n = ctx.block_dim().volume() as u32;
        ctx.smem_st_f32(t, t as f32);
        if BARRIER {
            ctx.sync_threads();
        }
        let v = ctx.smem_ld_f32((t + 1) % n);
        ctx.st(out, t as u64, v);
    }
}

#[test]
fn barrier_makes_shared_writes_visible_to_the_whole_block() {
    let mut out = vec![f32::NAN; 96];
    unsafe {
        Emulator::new().launch::<Rotate<true>>(
            cfg(Dim3::new(1, 1, 1), Dim3::new(96, 1, 1), 96 * 4),
            out_view(&mut out),
        )
    }
    .unwrap();
    for (t, v) in out.iter().enumerate() {
        assert_eq!(*v, ((t + 1) % 96) as f32);
    }
}

#[test]
fn a_missing_barrier_is_caught_by_the_result() {
    // The same kernel without its barrier: a thread reads its neighbour's slot before
    // the neighbour wrote it, and sees the 0xFF poison (NaN) the emulator fills
    // shared memory with.
    let mut out = vec![0.0f32; 96];
    unsafe {
        Emulator::new().launch::<Rotate<false>>(
            cfg(Dim3::new(1, 1, 1), Dim3::new(96, 1, 1), 96 * 4),
            out_view(&mut out),
        )
    }
    .unwrap();
    let wrong = out
        .iter()
        .enumerate()
        .filter(|(t, v)| **v != ((t + 1) % 96) as f32)
        .count();
    assert!(wrong > 0, "the race went unnoticed");
    assert!(out.iter().any(|v| v.is_nan()));
}

/// Threads below 16 return early; the rest wait at a barrier.
struct EarlyExitBarrier;
impl Kernel for EarlyExitBarrier {
    type Params = ();
    const NAME: &'static str = "early_exit_barrier";
    fn run<C: Ctx>(ctx: &C, _: &()) {
        if ctx.linear_thread() < 16 {
            return;
        }
        ctx.sync_threads();
    }
}

#[test]
fn a_barrier_not_all_threads_reach_is_an_error_naming_the_block() {
    let e = unsafe {
        Emulator::new()
            .launch::<EarlyExitBarrier>(cfg(Dim3::new(2, 3, 1), Dim3::new(64, 1, 1), 0), ())
    }
    .unwrap_err();
    match e {
        EmuError::BarrierDivergence {
            block,
            waiting,
            exited,
        } => {
            assert_eq!((waiting, exited), (48, 16));
            assert_eq!(block, Dim3::new(0, 0, 0), "the first block in launch order");
        }
        other => panic!("unexpected {other:?}"),
    }
}

/// Only even lanes shuffle.
struct HalfWarpShuffle;
impl Kernel for HalfWarpShuffle {
    type Params = ();
    const NAME: &'static str = "half_warp_shuffle";
    fn run<C: Ctx>(ctx: &C, _: &()) {
        if ctx.lane().is_multiple_of(2) {
            ctx.shfl_xor_u32(1, 2);
        }
    }
}

#[test]
fn a_shuffle_not_all_lanes_join_is_an_error() {
    let e = unsafe {
        Emulator::new()
            .launch::<HalfWarpShuffle>(cfg(Dim3::new(1, 1, 1), Dim3::new(32, 1, 1), 0), ())
    }
    .unwrap_err();
    assert!(
        matches!(e, EmuError::ShuffleDivergence { warp: 0, .. }),
        "{e:?}"
    );
}

/// Thread `n - 1` reads `f32` number `n` of an `n`-float shared buffer: one past the end.
struct SharedOutOfRange;
impl Kernel for SharedOutOfRange {
    type Params = ();
    const NAME: &'static str = "shared_out_of_range";
    fn run<C: Ctx>(ctx: &C, _: &()) {
        let _ = ctx.smem_ld_f32(ctx.thread_idx().x + 1);
    }
}

#[test]
fn shared_memory_out_of_range_fails_with_the_offset() {
    let e = unsafe {
        Emulator::new()
            .launch::<SharedOutOfRange>(cfg(Dim3::new(1, 1, 1), Dim3::new(32, 1, 1), 32 * 4), ())
    }
    .unwrap_err();
    match e {
        EmuError::Panic {
            thread, message, ..
        } => {
            assert_eq!(thread, Dim3::new(31, 0, 0));
            assert!(message.contains("bytes 128..132 of 128"), "{message}");
        }
        other => panic!("unexpected {other:?}"),
    }
}

/// Stores one element past its view.
struct GlobalOutOfRange;
impl Kernel for GlobalOutOfRange {
    type Params = GlobalSliceMut<f32>;
    const NAME: &'static str = "global_out_of_range";
    fn run<C: Ctx>(ctx: &C, out: &Self::Params) {
        ctx.st(out, ctx.linear_thread() as u64 + 1, 0.0);
    }
}

#[test]
fn global_memory_out_of_range_fails_instead_of_corrupting() {
    let mut buf = [1.0f32; 33];
    let view = out_view(&mut buf[..32]);
    let e = unsafe {
        Emulator::new()
            .with_workers(1)
            .launch::<GlobalOutOfRange>(cfg(Dim3::new(1, 1, 1), Dim3::new(32, 1, 1), 0), view)
    }
    .unwrap_err();
    assert!(
        matches!(&e, EmuError::Panic { message, .. } if message.contains("out of bounds")),
        "{e:?}"
    );
    assert_eq!(buf[32], 1.0, "the element past the view was written");
}

#[test]
fn bad_launch_configurations_are_rejected() {
    for c in [
        cfg(Dim3::new(0, 1, 1), Dim3::new(32, 1, 1), 0),
        cfg(Dim3::new(1, 1, 1), Dim3::new(2048, 1, 1), 0),
        cfg(Dim3::new(1, 1, 1), Dim3::new(32, 1, 1), 1 << 20),
    ] {
        let e = unsafe { Emulator::new().launch::<EarlyExitBarrier>(c, ()) }.unwrap_err();
        assert!(matches!(e, EmuError::InvalidConfig(_)), "{c:?}: {e:?}");
    }
}

#[test]
fn results_do_not_depend_on_block_order_or_workers() {
    let (grid, block) = (Dim3::new(7, 3, 1), Dim3::new(32, 1, 1));
    let n = (grid.volume() * block.volume()) as usize;
    let mut reference = vec![f32::NAN; n];
    unsafe {
        Emulator::new()
            .with_workers(1)
            .launch::<Indices>(cfg(grid, block, 0), out_view(&mut reference))
    }
    .unwrap();
    for (workers, order) in [
        (1, BlockOrder::Reverse),
        (3, BlockOrder::Shuffled(7)),
        (4, BlockOrder::Forward),
    ] {
        let mut out = vec![f32::NAN; n];
        unsafe {
            Emulator::new()
                .with_workers(workers)
                .with_order(order)
                .launch::<Indices>(cfg(grid, block, 0), out_view(&mut out))
        }
        .unwrap();
        assert_eq!(out, reference, "{workers} workers, {order:?}");
    }
}

/// `cp.async` pipeline test kernel: every thread copies the 16 bytes of its own
/// `src[4t..4t+4]` into shared memory, waits (or not, per `Mode`), and after a barrier
/// reads its *neighbour's* bytes back into `out`.
#[derive(Clone, Copy)]
struct CpAsyncParams {
    src: pagedkv_kernels::GlobalSlice<f32>,
    out: GlobalSliceMut<f32>,
    mode: u32,
    _pad: u32,
}
// SAFETY: two views and two u32s: 40 bytes, no padding; both views reported.
unsafe impl pagedkv_kernels::KernelParams for CpAsyncParams {
    fn globals(&self, f: &mut dyn FnMut(pagedkv_kernels::GlobalRange)) {
        f(self.src.range("src"));
        f(self.out.range("out"));
    }
}
/// 0: commit + wait<0> (correct); 1: no wait (the copy never lands); 2: wait<1> with
/// one group committed (too early: nothing is retired); 3: wait but no commit.
struct CpAsyncRoundTrip;
impl Kernel for CpAsyncRoundTrip {
    type Params = CpAsyncParams;
    const NAME: &'static str = "cp_async_round_trip";
    fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
        let t = ctx.linear_thread();
        let n = ctx.block_dim().volume() as u32;
        ctx.cp_async_16(4 * t, &p.src, 4 * t as u64);
        match p.mode {
            0 => {
                ctx.cp_async_commit();
                ctx.cp_async_wait::<0>();
            }
            1 => ctx.cp_async_commit(),
            2 => {
                ctx.cp_async_commit();
                ctx.cp_async_wait::<1>();
            }
            _ => ctx.cp_async_wait::<0>(),
        }
        ctx.sync_threads();
        let other = (t + 1) % n;
        let v = ctx.smem_ld_v4(4 * other);
        for (e, w) in v.iter().enumerate() {
            ctx.st(&p.out, (4 * t + e as u32) as u64, f32::from_bits(*w));
        }
        if p.mode != 0 {
            // Every thread has read; now land everything so the launch exits cleanly
            // and the test sees the NaN the early reads got.
            ctx.sync_threads();
            ctx.cp_async_commit();
            ctx.cp_async_wait::<0>();
        }
    }
}

fn cp_async_run(mode: u32) -> (Result<(), EmuError>, Vec<f32>) {
    let n = 64usize;
    let src: Vec<f32> = (0..4 * n).map(|i| i as f32).collect();
    let mut out = vec![0.0f32; 4 * n];
    let p = CpAsyncParams {
        // SAFETY: `src` outlives the launch and nothing writes it.
        src: unsafe {
            pagedkv_kernels::GlobalSlice::from_raw_parts(src.as_ptr(), src.len() as u64)
        },
        out: out_view(&mut out),
        mode,
        _pad: 0,
    };
    let r = unsafe {
        Emulator::new().launch::<CpAsyncRoundTrip>(
            cfg(Dim3::new(1, 1, 1), Dim3::new(n as u32, 1, 1), 16 * n as u32),
            p,
        )
    };
    (r, out)
}

#[test]
fn cp_async_lands_at_its_wait_and_a_missing_or_early_wait_reads_nan() {
    let n = 64;
    let (r, out) = cp_async_run(0);
    r.unwrap();
    for t in 0..n {
        for e in 0..4 {
            assert_eq!(out[4 * t + e], (4 * ((t + 1) % n) + e) as f32);
        }
    }
    for mode in [1, 2, 3] {
        let (r, out) = cp_async_run(mode);
        r.unwrap();
        assert!(
            out.iter().all(|v| v.is_nan()),
            "mode {mode}: a copy was visible before its wait"
        );
    }
}

/// Issues one copy and exits without waiting for it.
struct ForgetsTheWait;
impl Kernel for ForgetsTheWait {
    type Params = CpAsyncParams;
    const NAME: &'static str = "forgets_the_wait";
    fn run<C: Ctx>(ctx: &C, p: &Self::Params) {
        let t = ctx.linear_thread();
        ctx.cp_async_16(4 * t, &p.src, 4 * t as u64);
        ctx.cp_async_commit();
    }
}

#[test]
fn a_thread_that_exits_with_copies_in_flight_fails_the_launch() {
    let src = vec![1.0f32; 4 * 32];
    let mut out = vec![0.0f32; 1];
    let p = CpAsyncParams {
        // SAFETY: `src` outlives the launch and nothing writes it.
        src: unsafe {
            pagedkv_kernels::GlobalSlice::from_raw_parts(src.as_ptr(), src.len() as u64)
        },
        out: out_view(&mut out),
        mode: 0,
        _pad: 0,
    };
    let e = unsafe {
        Emulator::new()
            .launch::<ForgetsTheWait>(cfg(Dim3::new(1, 1, 1), Dim3::new(32, 1, 1), 16 * 32), p)
    }
    .unwrap_err();
    match e {
        EmuError::Panic { message, .. } => {
            assert!(
                message.contains("cp.async copies still pending"),
                "{message}"
            )
        }
        other => panic!("expected a pending-copies report, got {other}"),
    }
}

/// `out[t] = exp2(x_t)` and `out[n + t] = tanh(x_t)` for a spread of `x`.
struct FastMath;
impl Kernel for FastMath {
    type Params = GlobalSliceMut<f32>;
    const NAME: &'static str = "fast_math";
    fn run<C: Ctx>(ctx: &C, out: &Self::Params) {
        let t = ctx.linear_thread();
        let n = ctx.block_dim().x;
        let x = (t as f32 - n as f32 / 2.0) * 0.37;
        ctx.st(out, t as u64, ctx.exp2(x));
        ctx.st(out, (n + t) as u64, ctx.tanh(x));
    }
}

#[test]
fn approximate_math_stays_within_the_documented_error_and_is_seeded() {
    use pagedkv_host::emulator::{EX2_APPROX_REL_ERR, MathMode, TANH_APPROX_REL_ERR};
    let n = 256usize;
    let run = |math| {
        let mut out = vec![f32::NAN; 2 * n];
        unsafe {
            Emulator::new().with_math(math).launch::<FastMath>(
                cfg(Dim3::new(1, 1, 1), Dim3::new(n as u32, 1, 1), 0),
                out_view(&mut out),
            )
        }
        .unwrap();
        out
    };
    let exact = run(MathMode::Exact);
    let a = run(MathMode::Approx { seed: 7 });
    assert_eq!(
        a,
        run(MathMode::Approx { seed: 7 }),
        "same seed, same result"
    );
    assert_ne!(a, run(MathMode::Approx { seed: 8 }), "the seed matters");
    let (mut max_e, mut max_t) = (0.0f64, 0.0f64);
    for t in 0..n {
        let re = |got: f32, want: f32| ((got as f64 - want as f64) / want as f64).abs();
        max_e = max_e.max(re(a[t], exact[t]));
        if exact[n + t] != 0.0 {
            max_t = max_t.max(re(a[n + t], exact[n + t]));
        }
    }
    // Within the bound (plus the f32 rounding of the perturbed result), and not exact.
    assert!(
        max_e <= EX2_APPROX_REL_ERR + 1e-7 && max_e > 0.0,
        "exp2: {max_e:e}"
    );
    assert!(
        max_t <= TANH_APPROX_REL_ERR + 1e-7 && max_t > TANH_APPROX_REL_ERR / 10.0,
        "tanh: {max_t:e}"
    );
}
