//! Arguments from C: shapes, counts and buffers, checked before anything is read.
//!
//! A kernel entry point receives a shape (how many sequences, heads, blocks...) and
//! buffers as pointer + element count. C cannot be trusted to make these agree, and
//! the library must never read past what the caller owns, so every kernel function
//! follows the same order, with the helpers of this module:
//!
//! 1. **Read the shape.** [`pagedkv_decode_shape`] is the C struct both attention
//!    functions take (the CPU reference and CUDA); it converts into the crate's
//!    `DecodeShape`, whose `layout()` the crate's `check_layout` validates (block size,
//!    head size, nonzero counts).
//! 2. **Compute the sizes the shape implies, in checked arithmetic.**
//!    [`checked_elems`] multiplies `u32` factors into a `u64` that also fits in
//!    `usize`; [`pool_elems`] is the one for a KV pool. An overflow is
//!    `PAGEDKV_ERR_INVALID_ARGUMENT` naming the argument and the product, e.g.
//!    ``invalid argument `num_blocks`: num_blocks * num_kv_heads * block_size *
//!    head_dim = ... overflows``.
//! 3. **Check each count the caller passed against those sizes.** [`check_len`]: a
//!    mismatch is `PAGEDKV_ERR_INVALID_ARGUMENT` (``invalid argument `q`: 10 elements,
//!    expected 12``), and nothing has been read yet.
//! 4. **Only then make slices.** [`slice`] / [`slice_mut`] refuse a null pointer
//!    (`PAGEDKV_ERR_NULL`) and a count whose bytes could not be one Rust slice (more
//!    than `isize::MAX`); their `# Safety` is the C caller's contract, that the pointer
//!    is valid for that many elements.
//!
//! Counts the library cannot check (a `kv_append`'s `num_tokens` rows) are taken on
//! the caller's word, after steps 2 and 4; counts it can check against its own state
//! (a step's sequences) are checked the same way, see `pagedkv_on_step_done`.

use pagedkv::host::ops::attention::DecodeShape;
use pagedkv::kernels::PagedLayout;

use crate::pagedkv_status::{self, *};
use crate::status::fail;

/// Shapes of a decode-attention call.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct pagedkv_decode_shape {
    /// Sequences (one query token each).
    pub num_seqs: u32,
    /// Query heads (a multiple of `num_kv_heads`).
    pub num_q_heads: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// 32, 64, 80, 96, 112, 128 or 256.
    pub head_dim: u32,
    /// 8, 16 or 32.
    pub block_size: u32,
    /// Blocks in the cache.
    pub num_blocks: u32,
    /// Row length of the block tables.
    pub max_blocks_per_seq: u32,
    /// Padding (0).
    pub reserved: u32,
}

impl From<pagedkv_decode_shape> for DecodeShape {
    fn from(c: pagedkv_decode_shape) -> Self {
        DecodeShape {
            num_seqs: c.num_seqs,
            num_q_heads: c.num_q_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: c.block_size,
            num_blocks: c.num_blocks,
            max_blocks_per_seq: c.max_blocks_per_seq,
        }
    }
}

/// `n` elements of `T` as a slice length: it must fit in `usize` and the bytes in
/// `isize` (what `from_raw_parts` requires), else an error naming `what`.
fn slice_len<T>(n: u64, what: &str) -> Result<usize, pagedkv_status> {
    usize::try_from(n)
        .ok()
        .filter(|&n| {
            n.checked_mul(size_of::<T>())
                .is_some_and(|b| b <= isize::MAX as usize)
        })
        .ok_or_else(|| {
            fail(
                PAGEDKV_ERR_INVALID_ARGUMENT,
                format!("invalid argument `{what}`: {n} elements do not fit in memory"),
            )
        })
}

/// `n` elements at `p` as a slice; null is `PAGEDKV_ERR_NULL`, a count that cannot be
/// a slice is `PAGEDKV_ERR_INVALID_ARGUMENT`, both naming `what`.
///
/// # Safety
/// `p` is null or valid for `n` reads.
pub(crate) unsafe fn slice<'a, T>(
    p: *const T,
    n: u64,
    what: &str,
) -> Result<&'a [T], pagedkv_status> {
    if p.is_null() {
        return Err(fail(PAGEDKV_ERR_NULL, format!("{what} is null")));
    }
    let n = slice_len::<T>(n, what)?;
    // SAFETY: non-null, a length `from_raw_parts` accepts; the caller's contract makes
    // it valid for `n` reads.
    Ok(unsafe { std::slice::from_raw_parts(p, n) })
}

/// [`slice`] for writing.
///
/// # Safety
/// `p` is null or valid for `n` writes, and not aliased while the slice lives.
pub(crate) unsafe fn slice_mut<'a, T>(
    p: *mut T,
    n: u64,
    what: &str,
) -> Result<&'a mut [T], pagedkv_status> {
    if p.is_null() {
        return Err(fail(PAGEDKV_ERR_NULL, format!("{what} is null")));
    }
    let n = slice_len::<T>(n, what)?;
    // SAFETY: as in `slice`, for writes.
    Ok(unsafe { std::slice::from_raw_parts_mut(p, n) })
}

/// The product of `factors`, or an error naming `what` (with the expression `expr`)
/// when it overflows `u64` or does not fit in `usize`.
pub(crate) fn checked_elems(
    factors: &[u32],
    what: &str,
    expr: &str,
) -> Result<u64, pagedkv_status> {
    factors
        .iter()
        .try_fold(1u64, |acc, &f| acc.checked_mul(f as u64))
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| {
            fail(
                PAGEDKV_ERR_INVALID_ARGUMENT,
                format!(
                    "invalid argument `{what}`: {expr} = {} overflows",
                    factors
                        .iter()
                        .map(|f| f.to_string())
                        .collect::<Vec<_>>()
                        .join(" * ")
                ),
            )
        })
}

/// Elements of one pool of `l` (`num_blocks * num_kv_heads * block_size * head_dim`),
/// with checked arithmetic: a layout whose pool does not fit is an error naming
/// `num_blocks`.
pub(crate) fn pool_elems(l: &PagedLayout) -> Result<u64, pagedkv_status> {
    checked_elems(
        &[l.num_blocks, l.num_kv_heads, l.block_size, l.head_dim],
        "num_blocks",
        "num_blocks * num_kv_heads * block_size * head_dim",
    )
}

/// Elements of `num_tokens` rows of `[num_kv_heads, head_dim]` (new K/V, calibration
/// samples), with checked arithmetic: a product that overflows `u64` or `usize` is an
/// error naming `num_tokens`.
pub(crate) fn token_elems(
    num_tokens: u64,
    num_kv_heads: u32,
    head_dim: u32,
) -> Result<u64, pagedkv_status> {
    num_tokens
        .checked_mul(num_kv_heads as u64 * head_dim as u64)
        .filter(|&n| usize::try_from(n).is_ok())
        .ok_or_else(|| {
            fail(
                PAGEDKV_ERR_INVALID_ARGUMENT,
                format!(
                    "invalid argument `num_tokens`: num_tokens * num_kv_heads * head_dim = {num_tokens} * {num_kv_heads} * {head_dim} overflows"
                ),
            )
        })
}

/// Checks a caller's element count against the one the shapes imply, before any read.
pub(crate) fn check_len(what: &str, got: u64, want: u64) -> Result<(), pagedkv_status> {
    if got != want {
        return Err(fail(
            PAGEDKV_ERR_INVALID_ARGUMENT,
            format!("invalid argument `{what}`: {got} elements, expected {want}"),
        ));
    }
    Ok(())
}
