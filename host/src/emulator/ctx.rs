//! [`EmuCtx`], the kernels' [`Ctx`] in the emulator: a thread's indices, and its
//! view of memory with every access checked.
//!
//! * Shared memory is the block's, filled with `0xFF` (NaN) at block start; an access
//!   out of range, or a 16-byte one that is not 16-byte aligned, panics.
//! * Global memory is reached only through the kernel's views: every access is
//!   bounds-checked, and 16-byte accesses are checked for alignment.
//! * `cp.async` is asynchronous: a copy fills its destination with `0xFF` when issued,
//!   and its bytes land at the `cp_async_wait::<N>()` that retires its commit group (per
//!   thread, oldest group first). A thread may not end with copies pending.
//! * Barriers and shuffles park the thread (see `block`); the fast-math operations
//!   follow the launch's [`MathMode`](super::MathMode) (see `math`).

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::rc::Rc;

use corosensei::Yielder;
use pagedkv_kernels::{Ctx, Dim3, GlobalSlice, GlobalSliceMut};

use super::block::{BlockShared, Event};
use super::warp::WarpOp;

/// One thread's asynchronous copies: `(shared byte offset, the 16 bytes)`.
#[derive(Default)]
pub(super) struct CpAsync {
    /// Copies issued since the last commit.
    open: Vec<(usize, [u8; 16])>,
    /// Committed groups, oldest first.
    committed: VecDeque<Vec<(usize, [u8; 16])>>,
}

/// The emulator's [`Ctx`]: one per emulated thread, living on that thread's stack.
pub struct EmuCtx {
    pub(super) yielder: *const Yielder<[u32; 4], Event>,
    pub(super) block: Rc<BlockShared>,
    pub(super) thread_idx: Dim3,
    pub(super) block_idx: Dim3,
    pub(super) block_dim: Dim3,
    pub(super) grid_dim: Dim3,
    pub(super) cp_async: RefCell<CpAsync>,
    /// `Some(state)` of the perturbation generator in
    /// [`MathMode::Approx`](super::MathMode::Approx).
    pub(super) approx: Cell<Option<u64>>,
}

impl EmuCtx {
    /// Panics (failing the launch) when copies are still in flight at thread exit.
    pub(super) fn check_no_pending_copies(&self) {
        let cp = self.cp_async.borrow();
        let pending: usize = cp.open.len() + cp.committed.iter().map(Vec::len).sum::<usize>();
        if pending > 0 {
            panic!(
                "{pending} cp.async copies still pending at thread exit: a missing commit or cp.async.wait_group (their shared-memory bytes never landed)"
            );
        }
    }

    /// Parks this thread on event `e` until the block's scheduler resumes it; returns
    /// what it resumes with (a shuffle's result).
    fn suspend(&self, e: Event) -> [u32; 4] {
        // SAFETY: an `EmuCtx` is created inside its coroutine's body from the yielder
        // that body received, and never leaves that body, so the yielder outlives it.
        unsafe { (*self.yielder).suspend(e) }
    }

    /// `ldmatrix.x{num}`: a lane whose row is used checks its address (16-byte aligned,
    /// inside shared memory), then the warp executes together.
    fn ldmatrix(&self, num: u8, trans: bool, word: u32) -> [u32; 4] {
        if self.lane() < 8 * num as u32 {
            if !word.is_multiple_of(4) {
                panic!("ldmatrix: shared word {word} is not 16-byte aligned");
            }
            self.smem_check(4 * word as u64, 16);
        }
        self.suspend(Event::Warp(WarpOp::LdMatrix {
            num,
            trans,
            byte: 4 * word,
        }))
    }

    /// `mma.m16n8k16`, executed by the warp together.
    fn mma(&self, bf16: bool, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        self.suspend(Event::Warp(WarpOp::Mma {
            bf16,
            a,
            b,
            c: c.map(f32::to_bits),
        }))
        .map(f32::from_bits)
    }

    /// The byte offset of a `width`-byte shared-memory access at `byte`; panics when
    /// it is out of range.
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

/// Panics unless element `elem` (`width` bytes from its start) of a view of `len_elems`
/// elements of `size` bytes at `ptr` is in bounds, and a 16-byte access is aligned.
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
        })[0]
    }
    fn exp2(&self, x: f32) -> f32 {
        self.math_exp2(x)
    }
    fn tanh(&self, x: f32) -> f32 {
        self.math_tanh(x)
    }
    fn log2(&self, x: f32) -> f32 {
        self.math_log2(x)
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
    fn cp_async_16_or_zero<T>(&self, word: u32, s: &GlobalSlice<T>, i: u64, read: bool) {
        if read {
            return self.cp_async_16(word, s, i);
        }
        if !word.is_multiple_of(4) {
            panic!("cp.async: shared word {word} is not 16-byte aligned");
        }
        let o = self.smem_check(4 * word as u64, 16);
        self.block.smem.borrow_mut()[o..o + 16].fill(0xFF);
        self.cp_async.borrow_mut().open.push((o, [0u8; 16]));
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
    fn ldmatrix_x4<const TRANS: bool>(&self, word: u32) -> [u32; 4] {
        self.ldmatrix(4, TRANS, word)
    }
    fn ldmatrix_x2<const TRANS: bool>(&self, word: u32) -> [u32; 2] {
        let r = self.ldmatrix(2, TRANS, word);
        [r[0], r[1]]
    }
    fn ldmatrix_x1<const TRANS: bool>(&self, word: u32) -> u32 {
        self.ldmatrix(1, TRANS, word)[0]
    }
    fn mma_m16n8k16_f16(&self, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        self.mma(false, a, b, c)
    }
    fn mma_m16n8k16_bf16(&self, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4] {
        self.mma(true, a, b, c)
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
