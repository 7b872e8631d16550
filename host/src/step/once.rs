//! The per-call conveniences as one-shot uses of the step path: a [`StepRunner`] sized
//! for one call, planned once, run once, dropped, on any [`StepDevice`]. The emulator's
//! `ops::*_emulated`, the CUDA device's per-call methods and the tests that run one
//! call on several devices (the emulator, the PTX interpreter) go through here, so every kernel has one place
//! that builds its parameters and issues its launches ([`StepRunner`]'s runs) whatever
//! the device, and a test of a per-call function is a test of the path engines use.
//!
//! Each function first runs the operation's own argument checks (`ops::*::validate`:
//! the tensors' shapes and dtypes, the fp8 scales), which the runner cannot see in its
//! views, then lets the runner validate the metadata and the views as it does for every
//! step.

use super::device::{DeviceAddr, StepDevice, TensorView};
use super::prefill::PrefillMeta;
use super::runner::{DecodeIo, KvAppendIo, StepCapacity, StepMeta, StepRunner, StepShape};
use crate::backend::AsView;
use crate::error::Result;
use crate::ops::attention::{self, AttentionOut, DecodeInputs, SplitPlan, SplitTarget};
use crate::ops::kv_append::{self, KvAppendInputs};
use crate::ops::merge::{self, MergeInputs};
use crate::ops::prefill::{self, PrefillInputs};
use crate::ops::scales::KvScales;
use crate::step::{MergeIo, PrefillIo};
use crate::tensor::{DType, TensorDesc};

/// Scales uploaded into a runner's device by [`upload_scales`]: their address and f32
/// count, viewed by [`Uploaded::view`] for no longer than the runner is borrowed.
#[derive(Clone, Copy, Debug)]
struct Uploaded {
    addr: DeviceAddr,
    elems: u64,
}

impl Uploaded {
    /// A view of the scales, borrowing the runner whose device holds them.
    fn view<D: StepDevice>(self, runner: &StepRunner<D>) -> TensorView<'_> {
        // SAFETY: `addr` holds `elems` f32 uploaded into a buffer of the runner's
        // device, which keeps it as long as the device (and so the borrowed runner)
        // lives; nothing writes it after the upload.
        unsafe {
            TensorView::from_raw(
                self.addr.get(),
                self.elems,
                DType::F32,
                runner.device().space(),
            )
        }
    }
}

/// Uploads an fp8 cache's scales (`[2, num_kv_heads]` f32: K's, then V's) into a
/// buffer of the runner's device.
fn upload_scales<D: StepDevice>(
    runner: &mut StepRunner<D>,
    scales: Option<&KvScales>,
) -> Result<Option<Uploaded>> {
    let Some(s) = scales else {
        return Ok(None);
    };
    upload_f32(runner, s.k.iter().chain(&s.v)).map(Some)
}

/// Uploads attention-sink logits (`[num_q_heads]` f32) into a buffer of the runner's
/// device.
fn upload_sinks<D: StepDevice>(
    runner: &mut StepRunner<D>,
    sinks: Option<&[f32]>,
) -> Result<Option<Uploaded>> {
    sinks.map(|s| upload_f32(runner, s.iter())).transpose()
}

/// Uploads f32 values into a new buffer of the runner's device.
fn upload_f32<'a, D: StepDevice>(
    runner: &mut StepRunner<D>,
    values: impl Iterator<Item = &'a f32>,
) -> Result<Uploaded> {
    let bytes: Vec<u8> = values.flat_map(|x| x.to_le_bytes()).collect();
    let dev = runner.device_mut();
    dev.reserve_upload(bytes.len())?;
    let addr = dev.alloc(bytes.len())?;
    dev.upload(addr, &bytes)?;
    Ok(Uploaded {
        addr,
        elems: bytes.len() as u64 / 4,
    })
}

/// One decode call on `dev` (whose GPU is `target`; `None`: never split): the
/// inputs checked, the plan made (or `inputs.plan` taken) and validated, then one step
/// of a runner with room for exactly that plan. Returns the plan it ran.
pub fn decode<'o, D: StepDevice, T: AsView + TensorDesc + 'o>(
    dev: D,
    target: Option<SplitTarget>,
    inputs: DecodeInputs<'_, T>,
    out: impl Into<AttentionOut<'o, T>>,
) -> Result<SplitPlan> {
    let AttentionOut { out, lse } = out.into();
    let p = attention::validate_launch(&inputs, out, target)?;
    let s = inputs.shape;
    attention::check_lse(lse.as_deref(), s.num_seqs as u64, s.num_q_heads)?;
    let cap = StepCapacity {
        max_seqs: s.num_seqs,
        max_blocks_per_seq: s.max_blocks_per_seq,
        max_tokens: 1,
        max_partitions: p.num_partitions,
    };
    let rows = if p.is_split() {
        s.num_seqs as u64 * s.num_q_heads as u64 * p.num_partitions as u64
    } else {
        0
    };
    let shape = s.with_dtypes(inputs.q.dtype(), inputs.key_cache.dtype());
    let mut runner = StepRunner::with_workspace(dev, shape, cap, None, rows)?;
    runner.set_alibi_slopes(inputs.opts.alibi_slopes.as_deref())?;
    let scales = upload_scales(&mut runner, inputs.kv_scales)?;
    let sinks = upload_sinks(&mut runner, inputs.sinks)?;
    runner.plan_split(
        &StepMeta {
            block_tables: inputs.block_tables,
            max_blocks_per_seq: s.max_blocks_per_seq,
            context_lens: inputs.context_lens,
            slot_mapping: &[],
            window: inputs.opts.window,
        },
        Some(p),
    )?;
    runner.decode(
        inputs.opts,
        DecodeIo {
            lse: lse.map(|l| l.view_mut()),
            q: inputs.q.view(),
            key_cache: inputs.key_cache.view(),
            value_cache: inputs.value_cache.view(),
            kv_scales: scales.map(|s| s.view(&runner)),
            sinks: sinks.map(|s| s.view(&runner)),
            group: 0,
            out: out.view_mut(),
        },
    )?;
    Ok(p)
}

/// One merge of attention states on `dev`: the inputs checked
/// ([`merge::validate`]), the sinks uploaded, one launch of a runner of the merge's
/// heads, head_dim and dtype.
pub fn merge<'o, D: StepDevice, T: AsView + TensorDesc + 'o>(
    dev: D,
    inputs: MergeInputs<'_, T>,
    out: impl Into<AttentionOut<'o, T>>,
) -> Result<()> {
    let out = out.into();
    merge::validate(&inputs, &out)?;
    let s = inputs.shape;
    let dtype = inputs.v.dtype();
    let shape = StepShape {
        num_q_heads: s.num_heads,
        num_kv_heads: s.num_heads,
        head_dim: s.head_dim,
        block_size: 16,
        num_blocks: 1,
        dtype,
        kv_dtype: dtype,
    };
    let cap = StepCapacity {
        max_seqs: 1,
        max_blocks_per_seq: 1,
        max_tokens: 1,
        max_partitions: 1,
    };
    let mut runner = StepRunner::with_split(dev, shape, cap, None)?;
    let sinks = upload_sinks(&mut runner, inputs.sinks)?;
    let AttentionOut { out, lse } = out;
    runner.merge(MergeIo {
        num_states: s.num_states,
        v: inputs.v.view(),
        lse: inputs.lse.view(),
        sinks: sinks.map(|s| s.view(&runner)),
        out: out.view_mut(),
        lse_out: lse.map(|l| l.view_mut()),
    })
}

/// One `kv_append` call on `dev`: the arguments checked, then one step of a runner
/// whose metadata is the slot mapping alone.
pub fn kv_append<D: StepDevice, T: AsView + TensorDesc>(
    dev: D,
    io: KvAppendInputs<'_, T>,
) -> Result<()> {
    kv_append::validate(&io)?;
    if io.slot_mapping.is_empty() {
        return Ok(());
    }
    let l = io.layout;
    let shape = StepShape {
        num_q_heads: l.num_kv_heads,
        num_kv_heads: l.num_kv_heads,
        head_dim: l.head_dim,
        block_size: l.block_size,
        num_blocks: l.num_blocks,
        dtype: io.key.dtype(),
        kv_dtype: io.key_cache.dtype(),
    };
    let cap = StepCapacity {
        max_seqs: 1,
        max_blocks_per_seq: 1,
        max_tokens: u32::try_from(io.slot_mapping.len()).unwrap_or(u32::MAX),
        max_partitions: 1,
    };
    let mut runner = StepRunner::with_split(dev, shape, cap, None)?;
    let scales = upload_scales(&mut runner, io.scales)?;
    runner.plan(&StepMeta {
        block_tables: &[],
        max_blocks_per_seq: 0,
        context_lens: &[],
        slot_mapping: io.slot_mapping,
        window: None,
    })?;
    runner.kv_append(KvAppendIo {
        key: io.key.view(),
        value: io.value.view(),
        key_cache: io.key_cache.view_mut(),
        value_cache: io.value_cache.view_mut(),
        kv_scales: scales.map(|s| s.view(&runner)),
        group: 0,
    })
}

/// One prefill call on `dev`: the inputs checked, then one step of a runner that
/// prefills every sequence of the call.
pub fn prefill<'o, D: StepDevice, T: AsView + TensorDesc + 'o>(
    dev: D,
    inputs: PrefillInputs<'_, T>,
    out: impl Into<AttentionOut<'o, T>>,
) -> Result<()> {
    let AttentionOut { out, lse } = out.into();
    let max_rows = prefill::validate(&inputs, out)?;
    let tokens = inputs.qo_indptr[inputs.shape.num_seqs as usize];
    attention::check_lse(lse.as_deref(), tokens as u64, inputs.shape.num_q_heads)?;
    if max_rows == 0 {
        return Ok(());
    }
    let s = inputs.shape;
    let cap = StepCapacity {
        max_seqs: s.num_seqs,
        max_blocks_per_seq: s.max_blocks_per_seq,
        max_tokens: (tokens as u32).max(1),
        max_partitions: 1,
    };
    let shape = s.with_dtypes(inputs.q.dtype(), inputs.key_cache.dtype());
    let mut runner = StepRunner::with_split(dev, shape, cap, None)?;
    runner.set_alibi_slopes(inputs.opts.alibi_slopes.as_deref())?;
    let scales = upload_scales(&mut runner, inputs.kv_scales)?;
    let sinks = upload_sinks(&mut runner, inputs.sinks)?;
    runner.plan(&StepMeta {
        block_tables: &[],
        max_blocks_per_seq: 0,
        context_lens: &[],
        slot_mapping: &[],
        window: None,
    })?;
    runner.plan_prefill(&PrefillMeta {
        block_tables: inputs.block_tables,
        max_blocks_per_seq: s.max_blocks_per_seq,
        qo_indptr: inputs.qo_indptr,
        context_lens: inputs.context_lens,
        window: inputs.opts.window,
        tree_mask: inputs.tree_mask,
    })?;
    runner.prefill(
        inputs.opts,
        PrefillIo {
            lse: lse.map(|l| l.view_mut()),
            q: inputs.q.view(),
            key_cache: inputs.key_cache.view(),
            value_cache: inputs.value_cache.view(),
            kv_scales: scales.map(|s| s.view(&runner)),
            sinks: sinks.map(|s| s.view(&runner)),
            group: 0,
            out: out.view_mut(),
        },
    )
}

/// One `copy_blocks` launch on `dev` over `pools` (`(address, bytes)` of each, every
/// pool the pairs apply to): the pools and pairs checked
/// ([`copy_blocks::validate`](crate::ops::copy_blocks::validate)), the pool views and
/// the pairs uploaded into buffers of `dev`, one launch. The only place its
/// parameters are built, for the emulator and CUDA alike.
///
/// # Safety
/// 1. Each `(addr, bytes)` is `bytes` bytes of `dev`'s [`Space`](super::Space),
///    16-byte aligned and writable until the launch completes.
/// 2. Until then nothing else reads or writes them, and no two pools overlap.
pub unsafe fn copy_blocks<D: StepDevice>(
    dev: &mut D,
    pools: &[(u64, u64)],
    block_bytes: u64,
    pairs: &[(u32, u32)],
) -> Result<()> {
    use crate::ops::copy_blocks as ops;
    use pagedkv_kernels::kernels::{CopyBlocks, CopyBlocksParams, PoolView};
    use pagedkv_kernels::{GlobalSlice, GlobalSliceMut};

    let lens: Vec<u64> = pools.iter().map(|p| p.1).collect();
    let num_blocks = ops::pool_blocks(&lens, block_bytes)?;
    ops::validate(num_blocks, block_bytes, pairs)?;
    if pairs.is_empty() || pools.is_empty() {
        return Ok(());
    }
    // Each PoolView is `#[repr(C)] { ptr, len }`: two u64 words.
    let views: Vec<u8> = pools
        .iter()
        .flat_map(|&(a, n)| [a, n])
        .flat_map(u64::to_le_bytes)
        .collect();
    let flat: Vec<u8> = pairs
        .iter()
        .flat_map(|&(s, d)| [s as i64, d as i64])
        .flat_map(i64::to_le_bytes)
        .collect();
    dev.reserve_upload(views.len().max(flat.len()))?;
    let views_at = dev.alloc(views.len())?;
    dev.upload(views_at, &views)?;
    let pairs_at = dev.alloc(flat.len())?;
    dev.upload(pairs_at, &flat)?;
    const _: () = assert!(size_of::<PoolView>() == 16);
    // SAFETY: both buffers are the device's, live as long as it, and hold `pools.len()`
    // PoolViews (the layout of GlobalSliceMut<u8>: address, length) and the flattened
    // pairs.
    let params = unsafe {
        CopyBlocksParams {
            pools: GlobalSlice::from_raw_parts(
                views_at.get() as *const GlobalSliceMut<u8>,
                pools.len() as u64,
            ),
            pairs: GlobalSlice::from_raw_parts(
                pairs_at.get() as *const i64,
                2 * pairs.len() as u64,
            ),
            block_bytes,
        }
    };
    let cfg = ops::launch_config(pairs.len(), pools.len());
    // SAFETY: (1) the caller's 1 for the pools, the device's own buffers above; (2)
    // validated: ids in range, destinations distinct and never sources, so each
    // destination block is written by one thread block; (3) the caller's 2; (4) the
    // kernel's own configuration.
    unsafe { dev.launch::<CopyBlocks>(cfg, params) }
}

/// [`copy_blocks`] over pools in host memory, borrowed for the call, on a device whose
/// memory is host memory (the emulator's, the PTX interpreter's): the safe form every
/// host-memory caller uses.
pub fn copy_blocks_in_host<D: StepDevice>(
    dev: &mut D,
    pools: &mut [crate::buffer::AlignedBuf],
    block_bytes: u64,
    pairs: &[(u32, u32)],
) -> Result<()> {
    if dev.space() != super::Space::Host {
        return Err(crate::error::Error::invalid(
            "device",
            format!("{:?} memory is not host memory", dev.space()),
        ));
    }
    let raw: Vec<(u64, u64)> = pools
        .iter_mut()
        .map(|p| {
            let b = p.as_bytes_mut();
            (b.as_mut_ptr() as u64, b.len() as u64)
        })
        .collect();
    // SAFETY: (1) each pool is an AlignedBuf (16-byte aligned host memory, the device's
    // space, checked above) borrowed mutably for this call, so (2) nothing else touches
    // it and no two overlap.
    unsafe { copy_blocks(dev, &raw, block_bytes, pairs) }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::step::{DeviceOp, Recorder};

    /// `copy_blocks` reserves staging room for what it uploads (the pool views, the
    /// pairs), as a GPU's pinned staging requires: the recorder, like the CUDA device,
    /// refuses an upload beyond the reservation.
    #[test]
    fn copy_blocks_reserves_its_uploads_and_launches_once() {
        let mut dev = Recorder::new();
        let pools: Vec<(u64, u64)> = (0..6).map(|i| ((i + 1) << 24, 4 * 256)).collect();
        // SAFETY: the recorder never dereferences an address.
        unsafe { copy_blocks(&mut dev, &pools, 256, &[(0, 3), (1, 2)]) }.unwrap();
        let ops = dev.take();
        assert_eq!(
            ops.iter()
                .filter(|o| matches!(o, DeviceOp::Upload(_)))
                .count(),
            2
        );
        assert!(
            matches!(ops.last(), Some(DeviceOp::Launch("copy_blocks", _))),
            "{ops:?}"
        );
        // Bad pairs are refused before anything reaches the device.
        // SAFETY: as above.
        assert!(unsafe { copy_blocks(&mut dev, &pools, 256, &[(0, 9)]) }.is_err());
        assert!(dev.take().is_empty());
    }

    /// The fp8 scales of a one-shot call fit the staging room even where they are
    /// larger than the step's metadata (one token, 32 KV heads: 256 bytes of scales).
    #[test]
    fn scales_larger_than_the_metadata_are_uploaded() {
        let shape = StepShape {
            num_q_heads: 32,
            num_kv_heads: 32,
            head_dim: 64,
            block_size: 16,
            num_blocks: 2,
            dtype: DType::F16,
            kv_dtype: DType::E4m3,
        };
        let cap = StepCapacity {
            max_seqs: 1,
            max_blocks_per_seq: 1,
            max_tokens: 1,
            max_partitions: 1,
        };
        let mut runner = StepRunner::with_split(Recorder::new(), shape, cap, None).unwrap();
        let s = upload_scales(&mut runner, Some(&KvScales::per_tensor(32, 0.5, 2.0)))
            .unwrap()
            .unwrap();
        let v = s.view(&runner);
        assert_eq!((v.elems(), v.dtype()), (64, DType::F32));
    }
}
