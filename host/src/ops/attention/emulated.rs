//! [`decode_emulated`]: the real decode kernel (and its split-K reduce) in the SIMT
//! emulator, the CPU path the proofs run.

use pagedkv_kernels::kernels::{DecodeParams, DecodeReduce, PagedDecode, ReduceParams};
use pagedkv_kernels::{GlobalSlice, GlobalSliceMut};

use super::{DecodeInputs, SplitPlan, decode_launch_config, reduce_launch_config, validate_launch};
use crate::emulator::Emulator;
use crate::error::Result;
use crate::ops::scales::with_kv;
use crate::ops::{slice_view, view, view_mut};
use crate::tensor::HostTensor;

/// Runs the real decode kernel (and, for a split plan, the reduce kernel) in the
/// emulator, after [`validate_launch`](super::validate_launch). Without
/// `inputs.plan` it never splits (split-K exists to fill a GPU's SMs; on the CPU it
/// only adds work). Returns the plan it ran.
pub fn decode_emulated(
    emu: &Emulator,
    inputs: DecodeInputs<'_, HostTensor>,
    out: &mut HostTensor,
) -> Result<SplitPlan> {
    let plan = &validate_launch(&inputs, out, None)?;
    let DecodeInputs {
        shape,
        opts,
        q,
        key_cache,
        value_cache,
        block_tables,
        context_lens,
        plan: _,
    } = inputs;
    let dtype = key_cache.dtype();
    let parts = plan.num_partitions as usize;
    let per_head = shape.num_seqs as usize * shape.num_q_heads as usize;
    let (mut part_out, mut part_ml) = if plan.is_split() {
        (
            vec![f32::NAN; per_head * parts * shape.head_dim as usize],
            vec![f32::NAN; per_head * parts * 2],
        )
    } else {
        (Vec::new(), Vec::new())
    };
    let slopes: &[f32] = opts.alibi_slopes.as_deref().unwrap_or(&[]);
    let (k_scales, v_scales): (&[f32], &[f32]) = match &opts.kv_scales {
        Some(s) => (&s.k, &s.v),
        None => (&[], &[]),
    };
    with_kv!(q.dtype(), dtype, T, K => {
        // SAFETY: every view covers a tensor, slice or vector that lives (borrowed or
        // owned here) until this function returns, of the element type its dtype names.
        let params = unsafe {
            DecodeParams::<T, K> {
                q: view(q),
                key_cache: view(key_cache),
                value_cache: view(value_cache),
                k_scales: slice_view(k_scales),
                v_scales: slice_view(v_scales),
                block_tables: slice_view(block_tables),
                context_lens: slice_view(context_lens),
                alibi_slopes: slice_view(slopes),
                out: if plan.is_split() { GlobalSliceMut::empty() } else { view_mut(out) },
                part_out: GlobalSliceMut::from_raw_parts(part_out.as_mut_ptr(), part_out.len() as u64),
                part_ml: GlobalSliceMut::from_raw_parts(part_ml.as_mut_ptr(), part_ml.len() as u64),
                layout: shape.layout(),
                num_q_heads: shape.num_q_heads,
                max_blocks_per_seq: shape.max_blocks_per_seq,
                heads_per_block: plan.heads_per_block,
                partition_tokens: plan.partition_tokens,
                num_partitions: plan.num_partitions,
                scale: opts.scale,
                softcap: opts.softcap.unwrap_or(0.0),
                inv_softcap: opts.softcap.map_or(0.0, |c| 1.0 / c),
                window: opts.window.unwrap_or(0),
                q_row_stride: shape.row_elems(),
                out_row_stride: shape.row_elems(),
            }
        };
        let cfg = decode_launch_config(shape, dtype, plan);
        // SAFETY: (1) views valid for the launch (above); (2) `out` is borrowed mutably
        // and the partials are owned here; (3) each (sequence, query head, chunk) output
        // element and each partial is written by one thread (validated shapes and plan).
        if plan.is_split() {
            unsafe { emu.launch::<PagedDecode<T, true, K>>(cfg, params)? };
            // SAFETY: as above; the partials are now only read.
            let rp = unsafe {
                ReduceParams::<T> {
                    part_out: GlobalSlice::from_raw_parts(part_out.as_ptr(), part_out.len() as u64),
                    part_ml: GlobalSlice::from_raw_parts(part_ml.as_ptr(), part_ml.len() as u64),
                    out: view_mut(out),
                    num_q_heads: shape.num_q_heads,
                    head_dim: shape.head_dim,
                    num_partitions: plan.num_partitions,
                    out_row_stride: shape.row_elems(),
                }
            };
            // SAFETY: as above: one thread per output chunk.
            let rcfg = reduce_launch_config(shape, q.dtype());
            unsafe { emu.launch::<DecodeReduce<T>>(rcfg, rp)? };
        } else {
            unsafe { emu.launch::<PagedDecode<T, false, K>>(cfg, params)? };
        }
    });
    Ok(*plan)
}
