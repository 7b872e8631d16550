//! Compiles pagedkv next to cudarc as candle-core's `cuda` feature enables it
//! (`dynamic-linking`, the CUDA version from the build system): before pagedkv-host's
//! linking mode was a feature, cudarc's build script refused this graph ("Both
//! `dynamic-loading` and `dynamic-linking` features are active").
//!
//! `CUDARC_CUDA_VERSION=13000 cargo check --manifest-path integrations/cuda-graph-check/Cargo.toml`
//! (`.ci/run` does; nothing is linked or run, so no CUDA is needed).

use cudarc::driver::CudaSlice;
use pagedkv::cuda::CudaDevice;
use pagedkv::host::DType;
use pagedkv::host::step::{TensorView, TensorViewMut};

/// What an engine on candle's CUDA backend does with a tensor: its storage's
/// `CudaSlice<f32>` and its layout's start offset become a pagedkv view, no copy.
pub fn view_of<'a>(
    gpu: &CudaDevice,
    slice: &'a CudaSlice<f32>,
    start_offset: usize,
    len: usize,
) -> pagedkv::host::Result<TensorView<'a>> {
    TensorView::of_cuda_slice(gpu, slice, start_offset, len, DType::F32)
}

/// The writable form, for attention's output.
pub fn view_mut_of<'a>(
    gpu: &CudaDevice,
    slice: &'a mut CudaSlice<f32>,
    start_offset: usize,
    len: usize,
) -> pagedkv::host::Result<TensorViewMut<'a>> {
    TensorViewMut::of_cuda_slice_mut(gpu, slice, start_offset, len, DType::F32)
}

/// pagedkv's backend on the stream of an engine's cudarc context (candle's
/// `CudaDevice::cuda_stream()`), with cuBLAS from the same graph next to it.
pub fn backend_and_blas(
    stream: std::sync::Arc<cudarc::driver::CudaStream>,
) -> Result<(CudaDevice, cudarc::cublas::CudaBlas), Box<dyn std::error::Error>> {
    let gpu = CudaDevice::with_stream(stream.clone(), &pagedkv::cuda::ptx_sources())?;
    let blas = cudarc::cublas::CudaBlas::new(stream)?;
    Ok((gpu, blas))
}
