//! The device layer: everything a kernel body may ask of the machine it runs on.
//!
//! This is the only module of pagedkv with NVPTX intrinsics and inline assembly
//! (in its `nvptx` submodule, compiled for `nvptx64-nvidia-cuda` only). Kernel bodies
//! are generic over [`Ctx`], so the same source runs on the GPU (through `Gpu`) and
//! in `pagedkv-host`'s SIMT emulator (which implements [`Ctx`] with one coroutine per
//! thread).
//!
//! ## Global memory
//! Kernels reach global memory only through [`GlobalSlice`] / [`GlobalSliceMut`]
//! views stored in their parameter structs and the `Ctx` load/store methods. Building a
//! view is `unsafe` (the caller vouches for the pointer and length); using one is safe
//! code in the kernel body. On the GPU the bounds are not checked (the host validated
//! every index before the launch); the emulator checks every access and fails the
//! launch with the slice, index and length on a stray one.
//!
//! Vector accesses move 16 bytes (`[u32; 4]`) and must be 16-byte aligned: that is what
//! `ld.global.v4.u32` needs, and the emulator checks it too.

pub mod convert;
pub mod fp8;
#[cfg(target_arch = "nvptx64")]
mod nvptx;

#[cfg(target_arch = "nvptx64")]
pub use nvptx::{Gpu, trap};

pub use convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
pub use fp8::{
    e4m3_to_f32, e4m3x2_to_f16x2, e5m2_to_f32, e5m2x2_to_f16x2, f32_to_e4m3, f32_to_e5m2,
    f32x2_to_e4m3x2, f32x2_to_e5m2x2,
};

/// Byte `i` of the result is byte `sel >> 4i & 7` of the eight bytes `{b, a}` (`a`'s
/// bytes 0-3, then `b`'s 4-7), or that byte's sign bit in all eight bits when `sel >> 4i
/// & 8` is set: PTX's `prmt.b32` in its default mode, one instruction on the GPU (its
/// pairs of fp8 bytes for one conversion each, where shifts and masks take four).
#[inline(always)]
pub fn byte_perm(a: u32, b: u32, sel: u32) -> u32 {
    #[cfg(target_arch = "nvptx64")]
    {
        nvptx::prmt(a, b, sel)
    }
    #[cfg(not(target_arch = "nvptx64"))]
    {
        let bytes = (b as u64) << 32 | a as u64;
        (0..4).fold(0, |d, i| {
            let s = (sel >> (4 * i)) & 0xf;
            let byte = (bytes >> (8 * (s & 7))) as u8;
            let byte = if s & 8 != 0 {
                if byte & 0x80 != 0 { 0xff } else { 0 }
            } else {
                byte
            };
            d | (byte as u32) << (8 * i)
        })
    }
}

/// Threads in a warp on every NVIDIA GPU pagedkv supports.
pub const WARP_SIZE: u32 = 32;

/// A CUDA-style three-dimensional index or extent.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Dim3 {
    /// Fastest-varying component.
    pub x: u32,
    /// Middle component.
    pub y: u32,
    /// Slowest-varying component.
    pub z: u32,
}

impl Dim3 {
    /// A `Dim3` from its three components.
    pub const fn new(x: u32, y: u32, z: u32) -> Self {
        Self { x, y, z }
    }

    /// The number of elements this extent spans (`x * y * z`).
    pub const fn volume(self) -> u64 {
        self.x as u64 * self.y as u64 * self.z as u64
    }
}

/// A read-only view of `len` elements of type `T` in device (global) memory.
///
/// `#[repr(C)]`: a pointer and a 64-bit length, 16 bytes, so host code can fill a
/// kernel's parameter struct field by field.
#[repr(C)]
pub struct GlobalSlice<T> {
    ptr: *const T,
    len: u64,
}

/// A writable view of `len` elements of type `T` in device (global) memory.
///
/// Same layout as [`GlobalSlice`].
#[repr(C)]
pub struct GlobalSliceMut<T> {
    ptr: *mut T,
    len: u64,
}

// Manual impls: derive would add a `T: Copy` bound the raw pointer does not need.
impl<T> Clone for GlobalSlice<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for GlobalSlice<T> {}
impl<T> Clone for GlobalSliceMut<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for GlobalSliceMut<T> {}

impl<T> core::fmt::Debug for GlobalSlice<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "GlobalSlice({:p}, len {})", self.ptr, self.len)
    }
}
impl<T> core::fmt::Debug for GlobalSliceMut<T> {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(f, "GlobalSliceMut({:p}, len {})", self.ptr, self.len)
    }
}

impl<T> GlobalSlice<T> {
    /// An empty view (null pointer, length 0). Any access through it is out of bounds.
    pub const fn empty() -> Self {
        Self {
            ptr: core::ptr::null(),
            len: 0,
        }
    }

    /// A view of `len` elements starting at `ptr`.
    ///
    /// # Safety
    /// 1. `ptr` is valid for reads of `len` elements of `T` in the address space the
    ///    kernel runs in (device memory for a GPU launch, host memory for the emulator)
    ///    for as long as any kernel using the view runs.
    /// 2. `ptr` is aligned for `T`, and to 16 bytes if the view is used for vector loads.
    /// 3. Nothing writes the memory while a kernel reads it through `ld_nc_v4`
    ///    (the non-coherent read-only path).
    pub const unsafe fn from_raw_parts(ptr: *const T, len: u64) -> Self {
        Self { ptr, len }
    }

    /// The number of elements in the view.
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// Whether the view holds no element.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first element's address.
    pub const fn as_ptr(&self) -> *const T {
        self.ptr
    }
}

impl<T> GlobalSliceMut<T> {
    /// An empty view (null pointer, length 0). Any access through it is out of bounds.
    pub const fn empty() -> Self {
        Self {
            ptr: core::ptr::null_mut(),
            len: 0,
        }
    }

    /// A writable view of `len` elements starting at `ptr`.
    ///
    /// # Safety
    /// As [`GlobalSlice::from_raw_parts`], and `ptr` is also valid for writes, and no two
    /// threads of a launch write the same element unless the kernel documents it.
    pub const unsafe fn from_raw_parts(ptr: *mut T, len: u64) -> Self {
        Self { ptr, len }
    }

    /// The number of elements in the view.
    pub const fn len(&self) -> u64 {
        self.len
    }

    /// Whether the view holds no element.
    pub const fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The first element's address.
    pub const fn as_mut_ptr(&self) -> *mut T {
        self.ptr
    }

    /// The same memory as a read-only view.
    pub const fn as_const(&self) -> GlobalSlice<T> {
        GlobalSlice {
            ptr: self.ptr as *const T,
            len: self.len,
        }
    }
}

/// What a kernel body may ask of the machine: indices, barrier, warp shuffle, fast math,
/// global and shared memory.
///
/// Implemented by `Gpu` (nvptx only, zero-sized, every method inlines to one or two
/// PTX instructions) and by the emulator's per-thread context in `pagedkv-host`.
///
/// Index arguments of memory accesses are element indices of the view's `T`; vector
/// accesses take the index of the first of the 16 bytes' elements.
pub trait Ctx {
    /// `threadIdx`.
    fn thread_idx(&self) -> Dim3;
    /// `blockIdx`.
    fn block_idx(&self) -> Dim3;
    /// `blockDim`.
    fn block_dim(&self) -> Dim3;
    /// `gridDim`.
    fn grid_dim(&self) -> Dim3;

    /// `__syncthreads()`: every thread of the block waits here until all have arrived,
    /// and their shared- and global-memory writes before it are visible after it.
    /// Every thread of the block must reach the same barrier.
    fn sync_threads(&self);

    /// `__shfl_xor_sync(0xffffffff, v, lane_mask)`: returns `v` of lane
    /// `lane ^ lane_mask`. All 32 lanes of the warp must call it together.
    fn shfl_xor_u32(&self, v: u32, lane_mask: u32) -> u32;

    /// [`Ctx::shfl_xor_u32`] for an `f32`.
    #[inline(always)]
    fn shfl_xor_f32(&self, v: f32, lane_mask: u32) -> f32 {
        f32::from_bits(self.shfl_xor_u32(v.to_bits(), lane_mask))
    }

    /// `2^x`, fast (`ex2.approx.ftz.f32` on the GPU: about 2 ulp; `exp2(-inf) = 0`).
    fn exp2(&self, x: f32) -> f32;

    /// `tanh(x)`, fast (`tanh.approx.f32` on the GPU: about 2^-11 relative error).
    fn tanh(&self, x: f32) -> f32;

    /// `log2(x)`, fast (`lg2.approx.ftz.f32` on the GPU: an absolute error of about
    /// 2^-22; `log2(0) = -inf`). The attention kernels take it once per output, for
    /// the log-sum-exp.
    fn log2(&self, x: f32) -> f32;

    /// `a * b + c` with one rounding (`fma.rn.f32`; `mul_add` in the emulator).
    fn fma(&self, a: f32, b: f32, c: f32) -> f32;

    /// Loads element `i` of `s` (a plain, coherent load).
    fn ld<T: Copy>(&self, s: &GlobalSlice<T>, i: u64) -> T;

    /// Stores `v` into element `i` of `s`.
    fn st<T: Copy>(&self, s: &GlobalSliceMut<T>, i: u64, v: T);

    /// Loads the 16 bytes that start at element `i` of `s` (`ld.global.v4.u32`,
    /// coherent: safe on memory the same launch writes elsewhere).
    fn ld_v4<T>(&self, s: &GlobalSlice<T>, i: u64) -> [u32; 4];

    /// Loads the 16 bytes that start at element `i` of `s` through the read-only
    /// non-coherent path (`ld.global.nc.v4.u32`). Only for memory no thread of the
    /// launch writes.
    fn ld_nc_v4<T>(&self, s: &GlobalSlice<T>, i: u64) -> [u32; 4];

    /// Stores 16 bytes at element `i` of `s` (`st.global.v4.u32`).
    fn st_v4<T>(&self, s: &GlobalSliceMut<T>, i: u64, v: [u32; 4]);

    /// Starts an asynchronous copy of the 16 bytes at element `i` of `s` into the
    /// block's dynamic shared memory at 32-bit word `word` (a multiple of 4:
    /// `cp.async.cg.shared.global`, which bypasses L1). `s` is read-only memory of the
    /// launch, as for [`Ctx::ld_nc_v4`].
    ///
    /// The copy joins this thread's open *commit group*. Its bytes are in shared memory
    /// only once [`Ctx::cp_async_commit`] has closed the group and a
    /// [`Ctx::cp_async_wait`] has waited for it, and other threads see them only after
    /// a barrier that follows the wait. Until then the destination is undefined (the
    /// emulator fills it with NaN bytes, and reports a thread that exits with copies
    /// still pending).
    fn cp_async_16<T>(&self, word: u32, s: &GlobalSlice<T>, i: u64);

    /// [`Ctx::cp_async_16`] when `read`; else the same asynchronous copy of 16 zero
    /// bytes, reading nothing (`cp.async`'s `src-size` of 0: `s` and `i` are not
    /// touched). A pipeline fills the rows it must not read (past a context, before a
    /// window) with it, so every row of a stage is defined.
    fn cp_async_16_or_zero<T>(&self, word: u32, s: &GlobalSlice<T>, i: u64, read: bool);

    /// Closes this thread's open commit group (`cp.async.commit_group`); an empty group
    /// is allowed, so every thread can commit once per pipeline stage.
    fn cp_async_commit(&self);

    /// Waits until at most `N` of this thread's committed groups are still in flight
    /// (`cp.async.wait_group N`): the groups are complete in commit order, so with `S`
    /// stages in flight, `wait::<{S - 1}>` makes the oldest one land.
    fn cp_async_wait<const N: u32>(&self);

    /// Reads the 16 bytes at 32-bit word `word` (a multiple of 4) of the block's
    /// dynamic shared memory (`ld.shared.v4.u32`).
    fn smem_ld_v4(&self, word: u32) -> [u32; 4];

    /// Reads 32-bit word number `i` of the block's dynamic shared memory.
    fn smem_ld_u32(&self, i: u32) -> u32;

    /// Writes 32-bit word number `i` of the block's dynamic shared memory.
    fn smem_st_u32(&self, i: u32, v: u32);

    /// Reads word `i` of the block's dynamic shared memory as an `f32`.
    #[inline(always)]
    fn smem_ld_f32(&self, i: u32) -> f32 {
        f32::from_bits(self.smem_ld_u32(i))
    }

    /// Writes word `i` of the block's dynamic shared memory as an `f32`.
    #[inline(always)]
    fn smem_st_f32(&self, i: u32, v: f32) {
        self.smem_st_u32(i, v.to_bits())
    }

    /// `ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16`: the warp loads four 8x8
    /// matrices of 16-bit elements from the block's dynamic shared memory. Lane `l`
    /// gives the byte address `4 * word` (16-byte aligned) of row `l % 8` of matrix
    /// `l / 8`, and receives one 32-bit register per matrix: without `TRANS`, elements
    /// `[l / 4][2 * (l % 4)]` and `[l / 4][2 * (l % 4) + 1]` (low half first); with
    /// `TRANS`, `[2 * (l % 4)][l / 4]` and `[2 * (l % 4) + 1][l / 4]` (`[row][col]`,
    /// rows as addressed). All 32 lanes of the warp call it together.
    fn ldmatrix_x4<const TRANS: bool>(&self, word: u32) -> [u32; 4];

    /// [`Ctx::ldmatrix_x4`] for two matrices (`.x2`): lanes 0-15 give the row
    /// addresses (the others' are ignored).
    fn ldmatrix_x2<const TRANS: bool>(&self, word: u32) -> [u32; 2];

    /// [`Ctx::ldmatrix_x4`] for one matrix (`.x1`): lanes 0-7 give the row addresses
    /// (the others' are ignored).
    fn ldmatrix_x1<const TRANS: bool>(&self, word: u32) -> u32;

    /// `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32`: `D = A B + C` for the warp's
    /// 16x16 `A` (f16, row-major), 16x8 `B` (f16, column-major) and 16x8 `C`/`D` (f32).
    /// With `g = lane / 4`, `t = lane % 4`, lane `l` holds (the PTX ISA's fragments):
    /// * `a[j]`: `A[g + 8 * (j % 2)][2t + 8 * (j / 2) + h]` in half `h` (low first);
    /// * `b[j]`: `B[2t + 8j + h][g]` in half `h`;
    /// * `c[i]`, `D[i]`: `[g + 8 * (i / 2)][2t + i % 2]`.
    ///
    /// All 32 lanes of the warp call it together.
    fn mma_m16n8k16_f16(&self, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4];

    /// [`Ctx::mma_m16n8k16_f16`] with bf16 `A` and `B`
    /// (`mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32`).
    fn mma_m16n8k16_bf16(&self, a: [u32; 4], b: [u32; 2], c: [f32; 4]) -> [f32; 4];

    /// The linear thread index within the block (`x + y*dim.x + z*dim.x*dim.y`).
    #[inline(always)]
    fn linear_thread(&self) -> u32 {
        let t = self.thread_idx();
        let d = self.block_dim();
        t.x + d.x * (t.y + d.y * t.z)
    }

    /// The lane of this thread within its warp.
    #[inline(always)]
    fn lane(&self) -> u32 {
        self.linear_thread() % WARP_SIZE
    }

    /// The warp of this thread within its block.
    #[inline(always)]
    fn warp(&self) -> u32 {
        self.linear_thread() / WARP_SIZE
    }
}

/// A kernel: a name (the PTX entry point), a parameter struct, and a body generic over
/// the execution context.
///
/// The same `run` serves the GPU entry point (`entry.rs`, nvptx only) and the
/// emulator, so what the tests prove is the code that runs on the GPU.
pub trait Kernel {
    /// The `#[repr(C)]` parameter struct, passed by value to the PTX entry point.
    type Params: KernelParams;
    /// The PTX entry point's name (`.visible .entry NAME`).
    const NAME: &'static str;
    /// The kernel body, run by every thread of every block.
    fn run<C: Ctx>(ctx: &C, p: &Self::Params);
}

/// How a kernel may use one [`GlobalRange`] its parameters name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    /// Loads only.
    Read,
    /// Loads and stores.
    ReadWrite,
    /// Loads only, and the range holds [`GlobalSliceMut<u8>`] views (address, length:
    /// two `u64` words each) that name further ranges the kernel loads and stores.
    Views,
}

/// One range of global memory a kernel's parameters name: a view's address and
/// length in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GlobalRange {
    /// The parameter field it comes from (for error messages).
    pub name: &'static str,
    /// First byte.
    pub addr: u64,
    /// Length in bytes.
    pub bytes: u64,
    /// What the kernel may do with it.
    pub access: Access,
}

/// A kernel's `#[repr(C)]` parameter struct: every global range it names.
///
/// A checking device (the PTX interpreter, `ptx-interp/`) lets a launch touch exactly
/// these ranges and fails it on any other address; the emulator and the GPU do not
/// need it. A field left out shows up there as an access outside every range.
///
/// # Safety
/// 1. The type has no padding: every byte of a value is initialised, so a device may
///    read the struct as the bytes the PTX's `.param` holds (add explicit padding
///    fields where `#[repr(C)]` would insert some).
/// 2. `globals` reports every view the struct holds (a view left out only makes a
///    checking device refuse the launch; it is not a soundness hole).
pub unsafe trait KernelParams: Copy + 'static {
    /// Calls `f` once per global view the parameters hold (empty views included).
    fn globals(&self, f: &mut dyn FnMut(GlobalRange));
}

impl<T: 'static> GlobalSlice<T> {
    /// This view as a read-only [`GlobalRange`] named `name`.
    pub fn range(&self, name: &'static str) -> GlobalRange {
        GlobalRange {
            name,
            addr: self.ptr as u64,
            bytes: self.len.saturating_mul(core::mem::size_of::<T>() as u64),
            access: Access::Read,
        }
    }
}

impl<T: 'static> GlobalSliceMut<T> {
    /// This view as a read-write [`GlobalRange`] named `name`.
    pub fn range(&self, name: &'static str) -> GlobalRange {
        GlobalRange {
            access: Access::ReadWrite,
            ..self.as_const().range(name)
        }
    }
}

// SAFETY: zero bytes; no views.
unsafe impl KernelParams for () {
    fn globals(&self, _: &mut dyn FnMut(GlobalRange)) {}
}

// SAFETY: a pointer and a u64 (16 bytes, no padding); one view.
unsafe impl<T: 'static> KernelParams for GlobalSlice<T> {
    fn globals(&self, f: &mut dyn FnMut(GlobalRange)) {
        f(self.range("slice"))
    }
}

// SAFETY: as for `GlobalSlice`.
unsafe impl<T: 'static> KernelParams for GlobalSliceMut<T> {
    fn globals(&self, f: &mut dyn FnMut(GlobalRange)) {
        f(self.range("slice"))
    }
}

#[cfg(test)]
mod tests {
    use super::byte_perm;

    #[test]
    fn byte_perm_picks_bytes_of_both_words_and_replicates_signs() {
        let (a, b) = (0x3322_1100, 0xf7e6_d5c4);
        // Identity and the other word.
        assert_eq!(byte_perm(a, b, 0x3210), a);
        assert_eq!(byte_perm(a, b, 0x7654), b);
        // The fp8 V pairs: a's and b's byte 0, then byte 1; then bytes 2 and 3.
        assert_eq!(byte_perm(a, b, 0x5140), 0xd511_c400);
        assert_eq!(byte_perm(a, b, 0x7362), 0xf733_e622);
        // Bit 3 of a nibble: the selected byte's sign in all eight bits.
        assert_eq!(byte_perm(a, b, 0x8c8c), 0x00ff_00ff);
    }
}
