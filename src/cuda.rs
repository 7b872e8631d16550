//! The CUDA device and backend with the PTX embedded in this crate.
//!
//! Everything of [`pagedkv_host::cuda`] is re-exported; [`device`] opens a
//! [`CudaDevice`] with [`crate::ptx::ALL`] loaded, so an engine writes
//! `let gpu = pagedkv::cuda::device(0)?;` and gets the newest PTX its GPU can run,
//! then `CudaBackend::new(&gpu, config)` for the attention backend on it.
//! Without an NVIDIA driver or device it returns `Error::NoCudaDriver` /
//! `Error::NoCudaDevice` instead of panicking.

pub use pagedkv_host::cuda::*;

use pagedkv_host::Result;

/// The embedded PTX modules, as the backend takes them.
pub fn ptx_sources() -> Vec<PtxSource> {
    crate::ptx::ALL
        .iter()
        .map(|m| PtxSource {
            arch: m.arch,
            compute_capability: m.compute_capability,
            ptx: m.ptx,
        })
        .collect()
}

/// Device `ordinal` with the embedded PTX loaded.
pub fn device(ordinal: usize) -> Result<CudaDevice> {
    CudaDevice::new(ordinal, &ptx_sources())
}

/// Device `ordinal` with the embedded PTX loaded, on a raw `CUstream` the caller
/// owns (null: the context's default stream).
///
/// # Safety
/// As [`CudaDevice::on_raw_stream`]: a non-null `stream` is a live stream of device
/// `ordinal`'s primary context, kept alive as long as the device.
pub unsafe fn device_on_stream(
    ordinal: usize,
    stream: *mut std::ffi::c_void,
) -> Result<CudaDevice> {
    // SAFETY: the caller's conditions.
    unsafe { CudaDevice::on_raw_stream(ordinal, stream, &ptx_sources()) }
}
