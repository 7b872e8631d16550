//! candle-core with `cuda` and pagedkv in one build graph: what an engine on candle's
//! CUDA backend writes to hand candle tensors to pagedkv with no copy. `check.sh` runs
//! `cargo check` with nvcc from PyPI wheels (not in CI: about 15 minutes cold on the
//! 2-core dev machine, most of it nvcc on candle's kernels);
//! `integrations/cuda-graph-check` is the cheap form CI runs.

use candle_core::{CudaDevice, Storage, Tensor};
use pagedkv::cuda::CudaDevice as PagedkvDevice;
use pagedkv::host::DType;
use pagedkv::host::step::TensorView;

/// An error of candle or pagedkv.
pub type Error = Box<dyn std::error::Error + Send + Sync>;

/// pagedkv's device on candle's stream, so pagedkv's launches order with candle's
/// work and views of candle's buffers are allowed ([`TensorView::of_cuda_slice`]
/// refuses a slice of another stream).
pub fn device_on(dev: &CudaDevice) -> Result<PagedkvDevice, Error> {
    Ok(PagedkvDevice::with_stream(
        dev.cuda_stream(),
        &pagedkv::cuda::ptx_sources(),
    )?)
}

/// Runs `f` on a view of a contiguous f32 candle CUDA tensor: its `CudaStorage`'s
/// `CudaSlice<f32>` from its layout's start offset, no copy. The storage's read lock is
/// held while `f` runs.
pub fn with_view<R>(
    gpu: &PagedkvDevice,
    t: &Tensor,
    f: impl FnOnce(TensorView<'_>) -> R,
) -> Result<R, Error> {
    let (storage, layout) = t.storage_and_layout();
    let Storage::Cuda(cuda) = &*storage else {
        return Err("not a CUDA tensor".into());
    };
    let (start, end) = layout
        .contiguous_offsets()
        .ok_or("the tensor must be contiguous")?;
    let view = TensorView::of_cuda_slice(
        gpu,
        cuda.as_cuda_slice::<f32>()?,
        start,
        end - start,
        DType::F32,
    )?;
    Ok(f(view))
}
