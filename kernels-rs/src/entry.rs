//! PTX entry points: one-line wrappers that run a kernel body with the GPU context.
//!
//! Each takes its kernel's `#[repr(C)]` parameter struct by value (one `.param` of the
//! struct's size), so the host launch passes exactly one argument.

use crate::device::{Gpu, Kernel};
use crate::kernels::{CopyBlocks, CopyBlocksParams};

/// `copy_blocks(CopyBlocksParams)`, see [`CopyBlocks`].
#[unsafe(no_mangle)]
pub unsafe extern "ptx-kernel" fn copy_blocks(p: CopyBlocksParams) {
    CopyBlocks::run(&Gpu, &p)
}
