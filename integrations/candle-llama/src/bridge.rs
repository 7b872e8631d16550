//! [`CandleBackend`]: how candle tensors reach a pagedkv backend.
//!
//! On the CPU ([`CpuBackend`]), K, V and q are views of the candle tensors' own
//! storage ([`TensorView::from_slice`] over the `CpuStorage` slice from the layout's
//! start offset) and decode writes straight into the `Vec<f32>` that becomes the output
//! tensor: no copy, unless a buffer is not 16-byte aligned (the kernels read 16-byte
//! vectors), in which case that one tensor is copied once into an aligned buffer.
//! [`Copies`] counts both, so a test can tell.
//!
//! On a GPU the same would go through `TensorView::of_cuda_slice` on the candle
//! tensor's `CudaStorage` slice and layout offset, with the backend built on candle's
//! stream; this crate builds candle for the CPU only (candle's CUDA build needs nvcc).

use candle_core::{Device, Layout, Storage, Tensor};
use pagedkv::host::backend::{AttentionBackend, CpuBackend, DecodeArgs, KvAppendArgs, LayerCache};
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
    /// Wall time inside the backend's `kv_append` and `decode` (the emulated kernels on
    /// the CPU backend).
    pub kernel_time: std::time::Duration,
}

/// A backend candle tensors can be handed to: the layer loop of [`crate::PagedLlama`]
/// is written over it.
pub trait CandleBackend: AttentionBackend {
    /// Appends the step's new tokens' `k` and `v` (`[tokens, kv_heads, head_dim]`,
    /// f32) to one layer's cache, at the step's slots.
    fn append_kv(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        cache: &mut LayerCache<Self::Tensor>,
        copies: &mut Copies,
    ) -> Result<()>;

    /// Decode attention of the step's decoding rows: `q` is `[rows, q_heads,
    /// head_dim]`; returns the output of the same shape.
    fn decode_q(
        &mut self,
        opts: &AttentionOptions,
        q: &Tensor,
        cache: &LayerCache<Self::Tensor>,
        copies: &mut Copies,
    ) -> Result<Tensor>;

    /// A sequence's K and V, `[1, kv_heads, len, head_dim]` each, gathered from the
    /// layer's cache through its block-table row (for a prefill's attention).
    fn gather_kv(
        &self,
        cache: &LayerCache<Self::Tensor>,
        table: &[i32],
        len: usize,
    ) -> Result<(Tensor, Tensor)>;
}

/// The f32 elements a contiguous CPU tensor covers, in its own storage.
fn cpu_f32<'a>(storage: &'a Storage, layout: &Layout) -> Result<&'a [f32]> {
    let Storage::Cpu(cpu) = storage else {
        return Err("a CPU tensor was expected".into());
    };
    let all = cpu.as_slice::<f32>()?;
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or("the tensor must be contiguous")?;
    Ok(&all[start..end])
}

fn aligned(s: &[f32]) -> bool {
    (s.as_ptr() as usize).is_multiple_of(16)
}

/// A view of `s`, or of the aligned copy kept in `keep` when `s` is not aligned.
fn host_view<'a>(
    s: &'a [f32],
    keep: &'a mut Option<HostTensor>,
    copies: &mut Copies,
) -> Result<TensorView<'a>> {
    if aligned(s) {
        copies.borrowed += 1;
        return Ok(TensorView::from_slice(s));
    }
    copies.copied += 1;
    let t = keep.insert(HostTensor::from_bytes(
        DType::F32,
        &[s.len()],
        bytemuck::cast_slice(s),
    )?);
    Ok(TensorView::of_host(t))
}

impl CandleBackend for CpuBackend {
    fn append_kv(
        &mut self,
        k: &Tensor,
        v: &Tensor,
        cache: &mut LayerCache<HostTensor>,
        copies: &mut Copies,
    ) -> Result<()> {
        let (ks, kl) = k.storage_and_layout();
        let (vs, vl) = v.storage_and_layout();
        let (mut kc, mut vc) = (None, None);
        let key = host_view(cpu_f32(&ks, kl)?, &mut kc, copies)?;
        let value = host_view(cpu_f32(&vs, vl)?, &mut vc, copies)?;
        let t = std::time::Instant::now();
        self.kv_append(KvAppendArgs { key, value, cache })?;
        copies.kernel_time += t.elapsed();
        Ok(())
    }

    fn decode_q(
        &mut self,
        opts: &AttentionOptions,
        q: &Tensor,
        cache: &LayerCache<HostTensor>,
        copies: &mut Copies,
    ) -> Result<Tensor> {
        let (qs, ql) = q.storage_and_layout();
        let mut qc = None;
        let qv = host_view(cpu_f32(&qs, ql)?, &mut qc, copies)?;
        let mut out = vec![0f32; q.elem_count()];
        let t = std::time::Instant::now();
        if aligned(&out) {
            copies.borrowed += 1;
            self.decode(DecodeArgs {
                opts,
                q: qv,
                cache,
                out: TensorViewMut::from_slice_mut(&mut out),
            })?;
        } else {
            copies.copied += 1;
            let mut t = HostTensor::full(DType::F32, &[out.len()], 0.0);
            self.decode(DecodeArgs {
                opts,
                q: qv,
                cache,
                out: TensorViewMut::of_host(&mut t),
            })?;
            out.copy_from_slice(bytemuck::cast_slice(t.buf().as_bytes()));
        }
        copies.kernel_time += t.elapsed();
        Ok(Tensor::from_vec(out, q.shape(), &Device::Cpu)?)
    }

    fn gather_kv(
        &self,
        cache: &LayerCache<HostTensor>,
        table: &[i32],
        len: usize,
    ) -> Result<(Tensor, Tensor)> {
        let s = self.config().shape;
        let (heads, bs, d) = (
            s.num_kv_heads as usize,
            s.block_size as usize,
            s.head_dim as usize,
        );
        if len.div_ceil(bs) > table.len() {
            return Err(format!("{len} tokens but {} table entries", table.len()).into());
        }
        let one = |pool: &HostTensor| -> Result<Tensor> {
            let pool: &[f32] = bytemuck::cast_slice(pool.buf().as_bytes());
            let mut out = Vec::with_capacity(heads * len * d);
            for h in 0..heads {
                for t in 0..len {
                    let block = table[t / bs] as usize;
                    let at = ((block * heads + h) * bs + t % bs) * d;
                    out.extend_from_slice(&pool[at..at + d]);
                }
            }
            Ok(Tensor::from_vec(out, (1, heads, len, d), &Device::Cpu)?)
        };
        Ok((one(&cache.key)?, one(&cache.value)?))
    }
}
