//! Paged prefill attention: the new tokens of a ragged batch, each attending causally
//! to its sequence's cache through the block table (see `pagedkv_kernels::kernels::
//! prefill`). Shapes, validation, launch configuration, and the emulator entry point.
//!
//! The score is decode's ([`crate::ops::attention`]): scale, then soft-cap, then ALiBi
//! `slope * (kpos - qpos)`; new token `i` of sequence `s` sits at position
//! `context_lens[s] - qo_len + i` and sees positions up to its own (the last `window`
//! with a window). A chunk of one token gives decode's answer.
//!
//! ```
//! use pagedkv_host::{DType, HostTensor, emulator::Emulator};
//! use pagedkv_host::ops::attention::{DecodeOptions, DecodeShape};
//! use pagedkv_host::ops::prefill::{PrefillInputs, prefill_emulated};
//!
//! // One sequence: 3 new tokens after 2 cached ones, all in block 1 of 2.
//! let shape = DecodeShape { num_seqs: 1, num_q_heads: 2, num_kv_heads: 1, head_dim: 64,
//!                           block_size: 8, num_blocks: 2, max_blocks_per_seq: 1 };
//! let pool = [2 * 8 * 64];
//! let kc = HostTensor::full(DType::F16, &pool, 0.5);
//! let vc = HostTensor::full(DType::F16, &pool, 3.0);
//! let q = HostTensor::full(DType::F16, &[3, 2, 64], 1.0);
//! let mut out = HostTensor::full(DType::F16, &[3, 2, 64], f64::NAN);
//! let opts = DecodeOptions::new(64);
//! prefill_emulated(&Emulator::new(), PrefillInputs { shape: &shape, opts: &opts, q: &q,
//!     key_cache: &kc, value_cache: &vc, block_tables: &[1], qo_indptr: &[0, 3],
//!     context_lens: &[5] }, &mut out)?;
//! assert!(out.to_f64().iter().all(|&x| x == 3.0));
//! # Ok::<(), pagedkv_host::Error>(())
//! ```

use pagedkv_kernels::kernels::prefill::{
    MMA_THREADS, PagedPrefill, PagedPrefillSimt, PrefillParams, ROWS, SIMT_THREADS,
    mma_shared_bytes,
};
use pagedkv_kernels::{Bf16, Dim3, E4m3, E5m2, F16};

use super::attention::{DecodeOptions, DecodeShape, validate_options};
use super::scales::check_cache_types;
use super::{MAX_GRID_YZ, check_layout, check_tensor, slice_view, view, view_mut};
use crate::emulator::{Emulator, LaunchConfig};
use crate::error::{Error, Result};
use crate::tensor::{DType, HostTensor, TensorDesc};

/// The inputs of one prefill call, by name (`T`: the backend's tensor). `shape.num_seqs`
/// sequences; `q` and the output are `[qo_indptr[num_seqs], num_q_heads, head_dim]`.
#[derive(Debug)]
pub struct PrefillInputs<'a, T> {
    /// The shapes (as for decode; `num_seqs` sequences).
    pub shape: &'a DecodeShape,
    /// Scale, window, soft-cap, ALiBi.
    pub opts: &'a DecodeOptions,
    /// `[total_tokens, num_q_heads, head_dim]`: the new tokens, sequence by sequence.
    pub q: &'a T,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`, the new tokens appended.
    pub key_cache: &'a T,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`, the new tokens appended.
    pub value_cache: &'a T,
    /// `[num_seqs, max_blocks_per_seq]`.
    pub block_tables: &'a [i32],
    /// `[num_seqs + 1]`: sequence `s`'s rows of `q` are `qo_indptr[s]..qo_indptr[s + 1]`;
    /// `qo_indptr[0] = 0`, non-decreasing.
    pub qo_indptr: &'a [i32],
    /// `[num_seqs]`: tokens in each sequence's cache, its new ones included.
    pub context_lens: &'a [i32],
}

impl<T> Clone for PrefillInputs<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for PrefillInputs<'_, T> {}

/// Checks every input of a prefill launch and returns the most query rows of one
/// sequence's KV head (`qo_len * group`), which sizes the grid.
pub fn validate<T: TensorDesc>(inputs: &PrefillInputs<'_, T>, out: &T) -> Result<u32> {
    let sh = inputs.shape;
    let l = sh.layout();
    check_layout(&l)?;
    if sh.num_seqs == 0 || sh.num_seqs > MAX_GRID_YZ {
        return Err(Error::invalid(
            "num_seqs",
            format!("{} (must be 1..={MAX_GRID_YZ})", sh.num_seqs),
        ));
    }
    if sh.num_q_heads == 0 || !sh.num_q_heads.is_multiple_of(sh.num_kv_heads) {
        return Err(Error::invalid(
            "num_q_heads",
            format!(
                "{} is not a positive multiple of num_kv_heads {}",
                sh.num_q_heads, sh.num_kv_heads
            ),
        ));
    }
    validate_options(inputs.opts, sh.num_q_heads)?;
    let max_rows = validate_metadata(
        sh,
        inputs.opts.window,
        inputs.block_tables,
        inputs.qo_indptr,
        inputs.context_lens,
    )?;
    let n = sh.num_seqs as usize;
    let total = inputs.qo_indptr[n] as u64;
    let qn = total * sh.row_elems();
    let (dtype, qd) = (inputs.key_cache.dtype(), inputs.q.dtype());
    check_tensor("key_cache", inputs.key_cache, dtype, l.pool_elems())?;
    check_tensor("value_cache", inputs.value_cache, dtype, l.pool_elems())?;
    check_cache_types(qd, dtype, inputs.opts.kv_scales.as_ref(), sh.num_kv_heads)?;
    check_tensor("q", inputs.q, qd, qn)?;
    check_tensor("out", out, qd, qn)?;
    Ok(max_rows)
}

/// Checks a prefill's metadata against the shapes and returns the most query rows of
/// one sequence's KV head (`qo_len * group`): `qo_indptr` is `[num_seqs + 1]` from 0,
/// non-decreasing; each context holds at least its new tokens (and one token) and fits
/// its table row; every block a sequence reads (from its first new token's `window`
/// start, or from 0) is inside the pool.
pub fn validate_metadata(
    sh: &DecodeShape,
    window: Option<u32>,
    block_tables: &[i32],
    qo_indptr: &[i32],
    context_lens: &[i32],
) -> Result<u32> {
    let n = sh.num_seqs as usize;
    let width = sh.max_blocks_per_seq as usize;
    if qo_indptr.len() != n + 1 || qo_indptr[0] != 0 {
        return Err(Error::invalid(
            "qo_indptr",
            format!(
                "{} entries (expected {}), starting at 0",
                qo_indptr.len(),
                n + 1
            ),
        ));
    }
    if context_lens.len() != n || block_tables.len() != n * width {
        return Err(Error::invalid(
            "context_lens",
            format!(
                "{} lengths and {} table entries for {n} sequences of {width} blocks",
                context_lens.len(),
                block_tables.len()
            ),
        ));
    }
    let capacity = width as u64 * sh.block_size as u64;
    let group = sh.num_q_heads / sh.num_kv_heads;
    let mut max_rows = 0u64;
    for s in 0..n {
        let qo = qo_indptr[s + 1] as i64 - qo_indptr[s] as i64;
        let ctx = context_lens[s] as i64;
        if qo < 0 {
            return Err(Error::invalid(
                "qo_indptr",
                format!("sequence {s}: decreases"),
            ));
        }
        if ctx < qo.max(1) || ctx as u64 > capacity {
            return Err(Error::invalid(
                "context_lens",
                format!(
                    "sequence {s}: {ctx} tokens for {qo} new ones (must be {}..={capacity})",
                    qo.max(1)
                ),
            ));
        }
        max_rows = max_rows.max(qo as u64 * group as u64);
        if qo == 0 {
            continue;
        }
        // The positions the first new token sees start the blocks read.
        let first = (ctx - qo + 1) as u64;
        let first = match window {
            Some(w) if first > w as u64 => first - w as u64,
            _ => 0,
        };
        let row = &block_tables[s * width..(s + 1) * width];
        for lb in first / sh.block_size as u64..(ctx as u64).div_ceil(sh.block_size as u64) {
            let id = row[lb as usize];
            if id < 0 || id as u32 >= sh.num_blocks {
                return Err(Error::invalid(
                    "block_tables",
                    format!(
                        "sequence {s}, logical block {lb}: block id {id} is outside the pool of {} blocks",
                        sh.num_blocks
                    ),
                ));
            }
        }
    }
    if max_rows.div_ceil(ROWS as u64) > MAX_GRID_YZ as u64 {
        return Err(Error::invalid(
            "qo_indptr",
            format!("{max_rows} query rows in one sequence's KV head: too many for one launch"),
        ));
    }
    Ok(max_rows as u32)
}

/// Launch configuration for the sequences' most rows `max_rows` and queries of `q_dtype`:
/// the tensor-core kernel (16 rows a block, one warp) for 16-bit queries (whatever the
/// cache: an fp8 one is decoded into 16-bit tiles), the f32 kernel (a row a thread) else.
pub fn launch_config(shape: &DecodeShape, q_dtype: DType, max_rows: u32) -> LaunchConfig {
    match q_dtype {
        DType::F32 | DType::E4m3 | DType::E5m2 => LaunchConfig {
            grid: Dim3::new(
                shape.num_kv_heads,
                max_rows.div_ceil(SIMT_THREADS).max(1),
                shape.num_seqs,
            ),
            block: Dim3::new(SIMT_THREADS, 1, 1),
            shared_bytes: 0,
        },
        DType::F16 | DType::Bf16 => LaunchConfig {
            grid: Dim3::new(
                shape.num_kv_heads,
                max_rows.div_ceil(ROWS).max(1),
                shape.num_seqs,
            ),
            block: Dim3::new(MMA_THREADS, 1, 1),
            shared_bytes: mma_shared_bytes(shape.head_dim),
        },
    }
}

/// Runs the real prefill kernel in the emulator, after [`validate`].
pub fn prefill_emulated(
    emu: &Emulator,
    inputs: PrefillInputs<'_, HostTensor>,
    out: &mut HostTensor,
) -> Result<()> {
    let max_rows = validate(&inputs, out)?;
    if max_rows == 0 {
        return Ok(());
    }
    let (qd, cache) = (inputs.q.dtype(), inputs.key_cache.dtype());
    let cfg = launch_config(inputs.shape, qd, max_rows);
    macro_rules! launch {
        ($kernel:ty) => {
            // SAFETY: (1) every view covers a tensor or slice borrowed for this call, of
            // the element type its dtype names (the match below is over the validated
            // dtypes); (2) `out` is borrowed mutably; (3) each output element belongs to
            // one (row, column) of one block's thread (validated shapes).
            unsafe {
                emu.launch::<$kernel>(cfg, params(&inputs, out))
                    .map_err(Into::into)
            }
        };
    }
    use DType as D;
    match (qd, cache) {
        (D::F32, D::F32) => launch!(PagedPrefillSimt<f32>),
        (D::F16, D::F16) => launch!(PagedPrefill<F16>),
        (D::Bf16, D::Bf16) => launch!(PagedPrefill<Bf16>),
        (D::F16, D::E4m3) => launch!(PagedPrefill<F16, E4m3>),
        (D::F16, D::E5m2) => launch!(PagedPrefill<F16, E5m2>),
        (D::Bf16, D::E4m3) => launch!(PagedPrefill<Bf16, E4m3>),
        (D::Bf16, D::E5m2) => launch!(PagedPrefill<Bf16, E5m2>),
        (q, c) => Err(Error::invalid(
            "dtype",
            format!("no prefill kernel for {q} queries over {c} caches"),
        )),
    }
}

/// The kernel parameters over host tensors.
///
/// # Safety
/// `T` is the element type of the tensors' dtype; the views must not outlive them.
unsafe fn params<T: Copy, K: Copy>(
    i: &PrefillInputs<'_, HostTensor>,
    out: &mut HostTensor,
) -> PrefillParams<T, K> {
    let o = i.opts;
    let (k_scales, v_scales): (&[f32], &[f32]) = match &o.kv_scales {
        Some(s) => (&s.k, &s.v),
        None => (&[], &[]),
    };
    // SAFETY: the caller's contract.
    unsafe {
        PrefillParams {
            q: view(i.q),
            key_cache: view(i.key_cache),
            value_cache: view(i.value_cache),
            k_scales: slice_view(k_scales),
            v_scales: slice_view(v_scales),
            block_tables: slice_view(i.block_tables),
            qo_indptr: slice_view(i.qo_indptr),
            context_lens: slice_view(i.context_lens),
            alibi_slopes: slice_view(o.alibi_slopes.as_deref().unwrap_or(&[])),
            out: view_mut::<T>(out),
            layout: i.shape.layout(),
            num_q_heads: i.shape.num_q_heads,
            max_blocks_per_seq: i.shape.max_blocks_per_seq,
            scale: o.scale,
            softcap: o.softcap.unwrap_or(0.0),
            inv_softcap: o.softcap.map_or(0.0, |c| 1.0 / c),
            window: o.window.unwrap_or(0),
        }
    }
}
