//! # pagedkv-kernels: the GPU kernels of pagedkv, in plain Rust
//!
//! This `#![no_std]` crate holds every kernel pagedkv runs on the GPU. It compiles two
//! ways from the same source:
//!
//! * for `nvptx64-nvidia-cuda` with rustc's own NVPTX backend (pinned nightly,
//!   `-Zbuild-std=core`, see `scripts/build-ptx.sh`), producing the PTX committed
//!   under `ptx/` and embedded into the `pagedkv` crate;
//! * for the host on stable Rust, where `pagedkv-host`'s SIMT emulator runs the very
//!   same kernel bodies thread by thread, so `cargo test` proves the real kernel code
//!   against CPU references with no GPU.
//!
//! ## How the crate is cut
//! * [`device`]: the device layer, the *only* module with NVPTX intrinsics and inline
//!   assembly. It defines the [`device::Ctx`] trait (thread indices, barrier, warp
//!   shuffle, shared and global memory, fast math) that kernel bodies are generic over,
//!   its GPU implementation, and the typed global-memory views kernels take.
//! * [`layout`]: [`PagedLayout`], all page-table address arithmetic.
//! * [`elem`]: the element types (f16, bf16, f32) and 16-byte vector packing.
//! * [`softmax`]: [`SoftmaxState`], the online-softmax state with its merge.
//! * [`kernels`]: kernel bodies as ordinary generic Rust (`fn run<C: Ctx>`), each with
//!   its `#[repr(C)]` parameter struct. They contain no `unsafe`.
//! * `entry` (nvptx only): the `extern "ptx-kernel"` entry points, one-line wrappers
//!   that call a body with the GPU context.
//!
//! ## The kernel contract
//! Kernels trust their parameters. A parameter struct holds [`device::GlobalSlice`]s
//! whose constructors are `unsafe`: the host validates every shape, id and length
//! before it builds one, and the emulator checks every access against the slice
//! bounds so a kernel that strays fails its test instead of corrupting memory.
#![no_std]
#![cfg_attr(
    target_arch = "nvptx64",
    feature(abi_ptx, stdarch_nvptx, asm_experimental_arch)
)]

pub mod device;
pub mod elem;
pub mod kernels;
pub mod layout;
pub mod softmax;

#[cfg(target_arch = "nvptx64")]
mod entry;

pub use device::{
    Access, Ctx, Dim3, GlobalRange, GlobalSlice, GlobalSliceMut, Kernel, KernelParams,
};
pub use elem::{Bf16, E4m3, E5m2, Elem, F16, KvElem};
pub use layout::PagedLayout;
pub use softmax::SoftmaxState;

#[cfg(target_arch = "nvptx64")]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo<'_>) -> ! {
    device::trap()
}
