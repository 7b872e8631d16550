//! The merge of attention states for C: partial attention outputs of the same query
//! rows over disjoint keys, each with its log-sum-exp (base 2), merged into the
//! attention over all their keys (see `pagedkv::host::ops::merge`).
//!
//! ```c
//! pagedkv_merge_shape sh = {.num_rows = 4, .num_states = 2, .num_heads = 8, .head_dim = 64};
//! /* v: 4 * 2 * 8 * 64 partial outputs; lse: 4 * 2 * 8; out: 4 * 8 * 64; lse_out: 4 * 8 */
//! pagedkv_merge_states(&sh, v, 4096, lse, 64, NULL, 0, out, 2048, lse_out, 32);
//! ```
//!
//! [`pagedkv_merge_states`] runs the real kernel on the CPU (the emulator) over host
//! `f32` buffers; [`pagedkv_cuda_merge_states`](crate::pagedkv_cuda_merge_states) runs
//! it on the GPU over device buffers. Both check every length against the shape (in
//! checked arithmetic) before reading anything, in the order of [`crate::args`].

use pagedkv::host::emulator::Emulator;
use pagedkv::host::ops::attention::AttentionOut;
use pagedkv::host::ops::merge::{MergeInputs, MergeShape, merge_emulated};
use pagedkv::host::{DType, HostTensor};

use crate::args::{check_len, checked_elems, slice, slice_mut};
use crate::guard::guard;
use crate::pagedkv_status::{self, *};
use crate::reference::tensor;
use crate::status::{fail, from_error};

/// Shapes of a merge of attention states.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct pagedkv_merge_shape {
    /// Query rows (1..=65535).
    pub num_rows: u32,
    /// Partial states per row (at least 1).
    pub num_states: u32,
    /// Heads per row.
    pub num_heads: u32,
    /// 32, 64, 80, 96, 112, 128 or 256.
    pub head_dim: u32,
}

impl From<pagedkv_merge_shape> for MergeShape {
    fn from(c: pagedkv_merge_shape) -> Self {
        MergeShape {
            num_rows: c.num_rows,
            num_states: c.num_states,
            num_heads: c.num_heads,
            head_dim: c.head_dim,
        }
    }
}

/// Reads and checks a merge shape; returns it with the element counts of `v`, `lse`,
/// `out` and `lse_out`.
///
/// # Safety
/// `shape` is null or valid for a read.
pub(crate) unsafe fn read_merge_shape(
    shape: *const pagedkv_merge_shape,
) -> Result<(MergeShape, [u64; 4]), pagedkv_status> {
    if shape.is_null() {
        return Err(fail(PAGEDKV_ERR_NULL, "shape is null"));
    }
    // SAFETY: non-null, the caller's contract.
    let c = unsafe { shape.read() };
    let s = MergeShape::from(c);
    s.check().map_err(|e| from_error(&e))?;
    let v = checked_elems(
        &[c.num_rows, c.num_states, c.num_heads, c.head_dim],
        "num_states",
        "num_rows * num_states * num_heads * head_dim",
    )?;
    let lse = checked_elems(
        &[c.num_rows, c.num_states, c.num_heads],
        "num_states",
        "num_rows * num_states * num_heads",
    )?;
    let out = checked_elems(
        &[c.num_rows, c.num_heads, c.head_dim],
        "num_rows",
        "num_rows * num_heads * head_dim",
    )?;
    let lse_out = checked_elems(
        &[c.num_rows, c.num_heads],
        "num_rows",
        "num_rows * num_heads",
    )?;
    Ok((s, [v, lse, out, lse_out]))
}

/// An optional host array: null with length 0 is `None`; null with a length, or a
/// length other than `want`, is an error naming `what`.
///
/// # Safety
/// `p` is null or valid for `n` reads.
pub(crate) unsafe fn optional<'a>(
    p: *const f32,
    n: u64,
    want: u64,
    what: &str,
) -> Result<Option<&'a [f32]>, pagedkv_status> {
    if p.is_null() && n == 0 {
        return Ok(None);
    }
    check_len(what, n, want)?;
    // SAFETY: the caller's contract.
    unsafe { slice(p, n, what) }.map(Some)
}

/// Merges partial attention states on the CPU (the real kernel, in the emulator), f32
/// host buffers: `v` `[num_rows, num_states, num_heads, head_dim]` partial outputs, each
/// normalised over its own keys; `lse` `[num_rows, num_states, num_heads]` their
/// log-sum-exp in base 2 (`-inf`: a part of no keys, whose `v` is never read);
/// `sinks` `[num_heads]` attention-sink logits joined once (null with `sinks_len` 0:
/// none); `out` `[num_rows, num_heads, head_dim]` written; `lse_out` `[num_rows,
/// num_heads]` the merged log-sum-exp (null with length 0: not written). Each `*_len`
/// is the buffer's element count and must match the shape.
///
/// # Safety
/// 1. Each pointer is null or valid for its `*_len` elements (`out`, `lse_out` for
///    writes).
/// 2. `out` and `lse_out` overlap no other buffer of the call.
#[unsafe(no_mangle)]
#[allow(clippy::too_many_arguments)]
pub unsafe extern "C" fn pagedkv_merge_states(
    shape: *const pagedkv_merge_shape,
    v: *const f32,
    v_len: u64,
    lse: *const f32,
    lse_len: u64,
    sinks: *const f32,
    sinks_len: u64,
    out: *mut f32,
    out_len: u64,
    lse_out: *mut f32,
    lse_out_len: u64,
) -> pagedkv_status {
    guard(|| {
        let run = || -> Result<pagedkv_status, pagedkv_status> {
            // SAFETY: the caller's contract.
            let (s, [vn, ln, on, lon]) = unsafe { read_merge_shape(shape)? };
            check_len("v", v_len, vn)?;
            check_len("lse", lse_len, ln)?;
            check_len("out", out_len, on)?;
            let want_lse_out = if lse_out.is_null() && lse_out_len == 0 {
                0
            } else {
                lon
            };
            check_len("lse_out", lse_out_len, want_lse_out)?;
            // SAFETY: the caller's contract for each pointer and length.
            let (vs, ls, ss, o, lo) = unsafe {
                (
                    slice(v, v_len, "v")?,
                    slice(lse, lse_len, "lse")?,
                    optional(sinks, sinks_len, s.num_heads as u64, "sinks")?,
                    slice_mut(out, out_len, "out")?,
                    if want_lse_out > 0 {
                        Some(slice_mut(lse_out, lse_out_len, "lse_out")?)
                    } else {
                        None
                    },
                )
            };
            let (vt, lt) = (tensor(vs, &[vs.len()]), tensor(ls, &[ls.len()]));
            let mut ot = HostTensor::full(DType::F32, &[o.len()], 0.0);
            let mut lot =
                (want_lse_out > 0).then(|| HostTensor::full(DType::F32, &[lon as usize], 0.0));
            let inputs = MergeInputs {
                shape: &s,
                v: &vt,
                lse: &lt,
                sinks: ss,
            };
            let to = AttentionOut {
                out: &mut ot,
                lse: lot.as_mut(),
            };
            merge_emulated(&Emulator::new(), inputs, to).map_err(|e| from_error(&e))?;
            o.copy_from_slice(ot.buf().as_slice::<f32>());
            if let (Some(l), Some(lo)) = (lot, lo) {
                lo.copy_from_slice(l.buf().as_slice::<f32>());
            }
            Ok(PAGEDKV_OK)
        };
        run().unwrap_or_else(|s| s)
    })
}
