//! The CUDA backend with the PTX embedded in this crate.
//!
//! Everything of [`pagedkv_host::cuda`] is re-exported; [`backend`] builds a
//! [`CudaBackend`] from [`crate::ptx::ALL`], so an engine writes
//! `let gpu = pagedkv::cuda::backend(0)?;` and gets the newest PTX its GPU can run.
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

/// A backend on device `ordinal` with the embedded PTX.
pub fn backend(ordinal: usize) -> Result<CudaBackend> {
    CudaBackend::new(ordinal, &ptx_sources())
}

/// A backend on device `ordinal` with the embedded PTX, on a raw `CUstream` the caller
/// owns (null: the context's default stream).
///
/// # Safety
/// As [`CudaBackend::on_raw_stream`]: a non-null `stream` is a live stream of device
/// `ordinal`'s primary context, kept alive as long as the backend.
pub unsafe fn backend_on_stream(
    ordinal: usize,
    stream: *mut std::ffi::c_void,
) -> Result<CudaBackend> {
    // SAFETY: the caller's conditions.
    unsafe { CudaBackend::on_raw_stream(ordinal, stream, &ptx_sources()) }
}
