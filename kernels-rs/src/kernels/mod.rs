//! Kernel bodies: ordinary generic Rust over [`Ctx`](crate::Ctx), no `unsafe`.
//!
//! Each kernel is a zero-sized type implementing [`Kernel`](crate::Kernel), with its
//! `#[repr(C)]` parameter struct next to it. Every pointer field documents its shape.
//! Kernels generic over the element type have one entry point per type
//! (`..._f16`, `..._bf16`, `..._f32`).

pub mod attention;
pub mod copy_blocks;
pub mod kv_append;
pub(crate) mod kv_tiles;
pub mod merge;
pub mod prefill;

pub use attention::{DecodeParams, DecodeReduce, PagedDecode, ReduceParams};
pub use copy_blocks::{CopyBlocks, CopyBlocksParams, PoolView};
pub use kv_append::{KvAppend, KvAppendParams};
pub use merge::{MergeParams, MergeStates};
pub use prefill::{PagedPrefill, PagedPrefillSimt, PrefillParams};

/// Calls `f(i)` for `i` in `0..16`, written out so each `i` is a constant after inlining:
/// an array it indexes stays in registers whatever LLVM's unroller decides (with the
/// `sm_80` software fp8 conversions a 16-step loop body is too large for it to unroll,
/// and a register array indexed in a loop becomes a stack frame).
#[inline(always)]
pub(crate) fn each16(mut f: impl FnMut(u32)) {
    f(0);
    f(1);
    f(2);
    f(3);
    f(4);
    f(5);
    f(6);
    f(7);
    f(8);
    f(9);
    f(10);
    f(11);
    f(12);
    f(13);
    f(14);
    f(15);
}
