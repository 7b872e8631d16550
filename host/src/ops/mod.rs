//! The host API of each kernel: validation, CPU reference, emulator entry point.
//!
//! Each kernel has one validation function that every backend (the emulator here, the
//! CUDA backend) calls before building the kernel's parameter struct, one launch
//! configuration function, and a reference path that is the ground truth in tests.

pub mod attention;
pub mod cascade;
pub mod copy_blocks;
pub mod kv_append;
pub mod merge;
pub mod prefill;
pub mod scales;

use pagedkv_kernels::PagedLayout;

use crate::error::{Error, Result};
use crate::tensor::{DType, TensorDesc};

/// Head dimensions the kernels support.
pub const SUPPORTED_HEAD_DIMS: [u32; 7] = [32, 64, 80, 96, 112, 128, 256];
/// Block sizes (tokens per block) the kernels support.
pub const SUPPORTED_BLOCK_SIZES: [u32; 3] = [8, 16, 32];
/// CUDA's limit on `gridDim.y` and `gridDim.z`.
pub const MAX_GRID_YZ: u32 = 65_535;

/// Checks that a cache layout is one the kernels support.
pub fn check_layout(l: &PagedLayout) -> Result<()> {
    if !SUPPORTED_HEAD_DIMS.contains(&l.head_dim) {
        return Err(Error::invalid(
            "head_dim",
            format!(
                "{} is not supported (one of {SUPPORTED_HEAD_DIMS:?})",
                l.head_dim
            ),
        ));
    }
    if !SUPPORTED_BLOCK_SIZES.contains(&l.block_size) {
        return Err(Error::invalid(
            "block_size",
            format!(
                "{} is not supported (one of {SUPPORTED_BLOCK_SIZES:?})",
                l.block_size
            ),
        ));
    }
    if l.num_kv_heads == 0 {
        return Err(Error::invalid("num_kv_heads", "must be at least 1"));
    }
    if l.num_blocks == 0 {
        return Err(Error::invalid("num_blocks", "must be at least 1"));
    }
    checked_pool_elems(l)?;
    Ok(())
}

/// Largest element size of a cache dtype, in bytes: a pool is sized for the widest.
const MAX_ELEM_BYTES: u64 = 4;

/// Elements of one K (or V) pool of layout `l`, checked: an error naming
/// `num_blocks` when the pool's bytes (at 4 bytes per element) exceed `isize::MAX`,
/// the most any allocation, host or device, can hold. [`PagedLayout::pool_elems`]
/// itself wraps around for such layouts, so every size a backend allocates goes
/// through here.
pub fn checked_pool_elems(l: &PagedLayout) -> Result<u64> {
    (l.num_blocks as u64)
        .checked_mul(l.num_kv_heads as u64)
        .and_then(|x| x.checked_mul(l.block_size as u64))
        .and_then(|x| x.checked_mul(l.head_dim as u64))
        .filter(|&e| e.checked_mul(MAX_ELEM_BYTES).is_some_and(|b| b <= isize::MAX as u64))
        .ok_or_else(|| {
            Error::invalid(
                "num_blocks",
                format!(
                    "a pool of {} blocks x {} KV heads x {} tokens x {} elements is too large to address",
                    l.num_blocks, l.num_kv_heads, l.block_size, l.head_dim
                ),
            )
        })
}

/// Checks a tensor's element type and element count.
pub(crate) fn check_tensor(
    arg: &'static str,
    t: &impl TensorDesc,
    dtype: DType,
    elems: u64,
) -> Result<()> {
    if t.dtype() != dtype {
        return Err(Error::invalid(
            arg,
            format!("dtype {}, expected {dtype}", t.dtype()),
        ));
    }
    if t.len() as u64 != elems {
        return Err(Error::invalid(
            arg,
            format!("{} elements, expected {elems}", t.len()),
        ));
    }
    Ok(())
}
