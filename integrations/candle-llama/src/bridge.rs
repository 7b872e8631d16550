//! [`CandleBackend`]: how candle tensors reach a pagedkv backend.
//!
//! On the CPU ([`CpuBackend`]), K, V and q are views of the candle tensors' own
//! storage ([`TensorView::from_host_bytes`] over the `CpuStorage` slice from the
//! layout's start offset, f32, f16 or bf16) and decode and prefill write straight into
//! the `Vec` that becomes the output tensor: no copy, unless a buffer is not 16-byte
//! aligned (the kernels read 16-byte vectors), in which case that one tensor is copied
//! once into an aligned buffer. [`Copies`] counts both, so a test can tell.
//!
//! On a GPU the same would go through `TensorView::of_cuda_slice` on the candle
//! tensor's `CudaStorage` slice and layout offset, with the backend built on candle's
//! stream; this crate builds candle for the CPU only (candle's CUDA build needs nvcc).

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, Device, Layout, Storage, Tensor};
use half::{bf16, f16};
use pagedkv::host::backend::{
    AttentionBackend, CpuBackend, DecodeArgs, KvAppendArgs, LayerCache, PrefillArgs,
};
use pagedkv::host::ops::attention::AttentionOptions;
use pagedkv::host::step::{TensorView, TensorViewMut};
use pagedkv::host::{DType, HostTensor};

use crate::Result;

/// How the tensors handed to the backend got there, and the time its kernels took.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Copies {
    /// Tensors passed as views of candle's own storage.
    pub borrowed: u64,
    /// Tensors copied once (their storage was not 16-byte aligned).
    pub copied: u64,
    /// Wall time inside the backend's `kv_append`, `decode` and `prefill` (the
    /// emulated kernels on the CPU backend).
    pub kernel_time: std::time::Duration,
}

/// A backend candle tensors can be handed to: the layer loop of [`crate::PagedLlama`]
/// is written over it. Tensors are contiguous, of the backend's query dtype (f32, f16
/// or bf16: [`candle_dtype`] of `config().shape.dtype`).
pub trait CandleBackend: AttentionBackend {
    /// Appends the step's new tokens' `k` and `v` (`[tokens, kv_heads, head_dim]`) to
    /// one layer's cache, at the step's slots of the layer's layer `group` (0 for a
    /// model of one group).
    fn append_kv(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        layer: (&mut LayerCache<Self::Tensor>, usize),
        copies: &mut Copies,
    ) -> Result<()>;

    /// Decode attention ([`AttentionBackend::decode`]) of the step's decoding rows:
    /// `q` is `[rows, q_heads, head_dim]`, one token per row; returns the output of
    /// the same shape and dtype.
    fn decode_q(
        &mut self,
        opts: &AttentionOptions,
        q: &Tensor,
        layer: (&LayerCache<Self::Tensor>, usize),
        copies: &mut Copies,
    ) -> Result<Tensor>;

    /// Prefill attention ([`AttentionBackend::prefill`]) of the step's prefilling
    /// rows over the paged cache (causal, after each row's cached tokens): `q` is
    /// `[tokens, q_heads, head_dim]`, the rows' new tokens row after row; returns the
    /// output of the same shape and dtype.
    fn prefill_q(
        &mut self,
        opts: &AttentionOptions,
        q: &Tensor,
        layer: (&LayerCache<Self::Tensor>, usize),
        copies: &mut Copies,
    ) -> Result<Tensor>;
}

/// candle's dtype for pagedkv's `dtype` (the query and output type of a backend).
pub fn candle_dtype(dtype: DType) -> Result<candle_core::DType> {
    Ok(match dtype {
        DType::F32 => candle_core::DType::F32,
        DType::F16 => candle_core::DType::F16,
        DType::Bf16 => candle_core::DType::BF16,
        other => return Err(format!("no candle tensors of {other:?} here").into()),
    })
}

/// The bytes a contiguous CPU tensor covers in its own storage, and their dtype.
fn cpu_bytes<'a>(storage: &'a Storage, layout: &Layout) -> Result<(&'a [u8], DType)> {
    let Storage::Cpu(cpu) = storage else {
        return Err("a CPU tensor was expected".into());
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or("the tensor must be contiguous")?;
    Ok(match cpu {
        CpuStorage::F32(s) => (bytemuck::cast_slice(&s[start..end]), DType::F32),
        CpuStorage::F16(s) => (bytemuck::cast_slice(&s[start..end]), DType::F16),
        CpuStorage::BF16(s) => (bytemuck::cast_slice(&s[start..end]), DType::Bf16),
        other => {
            return Err(format!("a {:?} tensor: f32, f16 or bf16 expected", other.dtype()).into());
        }
    })
}

fn aligned(s: &[u8]) -> bool {
    (s.as_ptr() as usize).is_multiple_of(16)
}

/// A view of `s`, or of the aligned copy kept in `keep` when `s` is not aligned.
fn host_view<'a>(
    (s, dtype): (&'a [u8], DType),
    keep: &'a mut Option<HostTensor>,
    copies: &mut Copies,
) -> Result<TensorView<'a>> {
    if aligned(s) {
        copies.borrowed += 1;
        return Ok(TensorView::from_host_bytes(s, dtype)?);
    }
    copies.copied += 1;
    let elems = s.len() / dtype.size();
    let t = keep.insert(HostTensor::from_bytes(dtype, &[elems], s)?);
    Ok(TensorView::of_host(t))
}

/// Elements a kernel writes into: a `Vec` that becomes the output tensor.
trait OutElement: candle_core::WithDType + bytemuck::Pod {}
impl OutElement for f32 {}
impl OutElement for f16 {}
impl OutElement for bf16 {}

/// Runs `run` with `q` as a view and an output of `q`'s shape and dtype, written in
/// place into the `Vec` that becomes the returned tensor (through an aligned copy when
/// the `Vec` is not 16-byte aligned).
fn attend<E: OutElement>(
    q: &Tensor,
    copies: &mut Copies,
    run: impl FnOnce(TensorView<'_>, TensorViewMut<'_>) -> Result<()>,
) -> Result<Tensor> {
    let (qs, ql) = q.storage_and_layout();
    let mut qc = None;
    let qv = host_view(cpu_bytes(&qs, ql)?, &mut qc, copies)?;
    let dtype = qv.dtype();
    let mut out = vec![E::zeroed(); q.elem_count()];
    let t = std::time::Instant::now();
    let bytes: &mut [u8] = bytemuck::cast_slice_mut(&mut out);
    if aligned(bytes) {
        copies.borrowed += 1;
        run(qv, TensorViewMut::from_host_bytes_mut(bytes, dtype)?)?;
    } else {
        copies.copied += 1;
        let mut o = HostTensor::full(dtype, &[q.elem_count()], 0.0);
        run(qv, TensorViewMut::of_host(&mut o))?;
        bytes.copy_from_slice(o.buf().as_bytes());
    }
    copies.kernel_time += t.elapsed();
    Ok(Tensor::from_vec(out, q.shape(), &Device::Cpu)?)
}

/// [`attend`] at `q`'s dtype.
fn attend_any(
    q: &Tensor,
    copies: &mut Copies,
    run: impl FnOnce(TensorView<'_>, TensorViewMut<'_>) -> Result<()>,
) -> Result<Tensor> {
    match q.dtype() {
        candle_core::DType::F32 => attend::<f32>(q, copies, run),
        candle_core::DType::F16 => attend::<f16>(q, copies, run),
        candle_core::DType::BF16 => attend::<bf16>(q, copies, run),
        other => Err(format!("a {other:?} query: f32, f16 or bf16 expected").into()),
    }
}

impl CandleBackend for CpuBackend {
    fn append_kv(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        (cache, group): (&mut LayerCache<HostTensor>, usize),
        copies: &mut Copies,
    ) -> Result<()> {
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (mut kc, mut vc) = (None, None);
        let key = host_view(cpu_bytes(&ks, kl)?, &mut kc, copies)?;
        let value = host_view(cpu_bytes(&vs, vl)?, &mut vc, copies)?;
        let t = std::time::Instant::now();
        self.kv_append(KvAppendArgs {
            key,
            value,
            cache,
            group,
        })?;
        copies.kernel_time += t.elapsed();
        Ok(())
    }

    fn decode_q(
        &mut self,
        opts: &AttentionOptions,
        q: &Tensor,
        (cache, group): (&LayerCache<HostTensor>, usize),
        copies: &mut Copies,
    ) -> Result<Tensor> {
        attend_any(q, copies, |q, out| {
            Ok(self.decode(DecodeArgs {
                opts,
                q,
                cache,
                sinks: None,
                group,
                out,
                lse: None,
            })?)
        })
    }

    fn prefill_q(
        &mut self,
        opts: &AttentionOptions,
        q: &Tensor,
        (cache, group): (&LayerCache<HostTensor>, usize),
        copies: &mut Copies,
    ) -> Result<Tensor> {
        attend_any(q, copies, |q, out| {
            Ok(self.prefill(PrefillArgs {
                opts,
                q,
                cache,
                sinks: None,
                group,
                out,
                lse: None,
            })?)
        })
    }
}
