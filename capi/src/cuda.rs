//! The CUDA backend handle: a context, a stream and the loaded kernels, for C.
//!
//! A [`pagedkv_cuda_backend`] wraps the crate's `CudaDevice`: device `ordinal`'s
//! primary context, a stream, and the PTX embedded in the library, loaded. The driver
//! is loaded at run time, so the same library works on machines without a GPU: there
//! creation fails cleanly with `PAGEDKV_ERR_CUDA` ("no CUDA driver found ..." or "no
//! CUDA device: ...").
//!
//! ```c
//! pagedkv_cuda_backend *gpu = NULL;
//! if (pagedkv_cuda_backend_create(0, &gpu) != PAGEDKV_OK) {
//!     /* no driver or device: fall back, or report pagedkv_last_error_message() */
//! }
//! /* ... pagedkv_cuda_kv_append / pagedkv_cuda_decode_attention (cuda_ops.rs) ... */
//! pagedkv_cuda_synchronize(gpu);       /* wait for the queued work */
//! pagedkv_cuda_backend_destroy(gpu);   /* waits for the stream, then frees */
//! ```
//!
//! [`pagedkv_cuda_backend_create_on_stream`] puts every copy and launch on a stream the
//! caller owns (null: the context's default stream), so the library's work is ordered
//! with the engine's own. Device buffers are never allocated for the caller: every
//! kernel function takes `CUdeviceptr`s (as `uint64_t`) to memory the caller owns, and
//! queues its work asynchronously on the backend's stream.
//!
//! The element type travels as an `int32_t` with the values of [`pagedkv_dtype`];
//! [`dtype_of`] refuses any other value. Which types may pair (an fp8 cache under f16
//! or bf16 queries, never fp8 queries) is checked by each function: see
//! `scales.rs`. The handle lives in the registry of
//! [`crate::handle`] like the scheduler's, and every call on it goes through
//! [`with_cuda`], which also turns the `Result` style of the kernel functions into a
//! status.

use pagedkv::host::DType;

use crate::guard::guard;
use crate::handle::{Handle, Registry, destroy, enter, register};
use crate::pagedkv_status::{self, *};
use crate::status::{fail, from_error};

/// Element type of device buffers. The fp8 types are cache types only: a cache of them
/// serves f16 or bf16 queries through the `_fp8` functions, with per-KV-head scales
/// ([`crate::pagedkv_kv_scales`]).
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum pagedkv_dtype {
    /// IEEE half precision.
    PAGEDKV_F16 = 0,
    /// bfloat16.
    PAGEDKV_BF16 = 1,
    /// IEEE single precision.
    PAGEDKV_F32 = 2,
    /// OCP fp8 e4m3 (finite to ±448, no infinity): a cache type only.
    PAGEDKV_E4M3 = 3,
    /// OCP fp8 e5m2 (finite to ±57344): a cache type only.
    PAGEDKV_E5M2 = 4,
}

/// The crate's element type for a C `dtype` value ([`pagedkv_dtype`]); any other value
/// is `PAGEDKV_ERR_INVALID_ARGUMENT`.
pub(crate) fn dtype_of(d: i32) -> Result<DType, pagedkv_status> {
    match d {
        0 => Ok(DType::F16),
        1 => Ok(DType::Bf16),
        2 => Ok(DType::F32),
        3 => Ok(DType::E4m3),
        4 => Ok(DType::E5m2),
        other => Err(fail(
            PAGEDKV_ERR_INVALID_ARGUMENT,
            format!("dtype {other} (0 f16, 1 bf16, 2 f32, 3 e4m3, 4 e5m2)"),
        )),
    }
}

/// An opaque CUDA backend handle (a context, a stream, the loaded kernels).
pub struct pagedkv_cuda_backend {
    inner: pagedkv::cuda::CudaDevice,
}

static CUDA_BACKENDS: Registry = Registry::new();

impl Handle for pagedkv_cuda_backend {
    const WHAT: &'static str = "backend";
    fn registry() -> &'static Registry {
        &CUDA_BACKENDS
    }
}

pub(crate) fn with_cuda(
    b: *mut pagedkv_cuda_backend,
    f: impl FnOnce(&pagedkv::cuda::CudaDevice) -> Result<(), pagedkv_status>,
) -> pagedkv_status {
    enter(b, |h| f(&h.inner).err().unwrap_or(PAGEDKV_OK))
}

/// Creates a CUDA backend on device `ordinal` with the embedded PTX. Without an NVIDIA
/// driver or device this is `PAGEDKV_ERR_CUDA` ("no CUDA driver found" / "no CUDA
/// device"). Release with `pagedkv_cuda_backend_destroy`.
///
/// # Safety
/// `out` is null or valid for a write.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_backend_create(
    ordinal: i32,
    out: *mut *mut pagedkv_cuda_backend,
) -> pagedkv_status {
    guard(|| {
        if out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "out is null");
        }
        if ordinal < 0 {
            return fail(PAGEDKV_ERR_INVALID_ARGUMENT, format!("ordinal {ordinal}"));
        }
        let inner = match pagedkv::cuda::device(ordinal as usize) {
            Ok(b) => b,
            Err(e) => return from_error(&e),
        };
        let h = register(pagedkv_cuda_backend { inner });
        // SAFETY: non-null, valid for a write.
        unsafe { out.write(h) };
        PAGEDKV_OK
    })
}

/// Creates a CUDA backend like `pagedkv_cuda_backend_create`, whose every copy and
/// launch goes to `stream` (a `CUstream` / `cudaStream_t` of device `ordinal`'s primary
/// context that the caller owns), or to the context's default stream when `stream` is
/// null.
///
/// # Safety
/// `out` is null or valid for a write; a non-null `stream` is a live stream of that
/// context, kept alive until the backend is destroyed.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_backend_create_on_stream(
    ordinal: i32,
    stream: *mut std::ffi::c_void,
    out: *mut *mut pagedkv_cuda_backend,
) -> pagedkv_status {
    guard(|| {
        if out.is_null() {
            return fail(PAGEDKV_ERR_NULL, "out is null");
        }
        if ordinal < 0 {
            return fail(PAGEDKV_ERR_INVALID_ARGUMENT, format!("ordinal {ordinal}"));
        }
        // SAFETY: the caller's contract on `stream`.
        let inner = match unsafe { pagedkv::cuda::device_on_stream(ordinal as usize, stream) } {
            Ok(b) => b,
            Err(e) => return from_error(&e),
        };
        let h = register(pagedkv_cuda_backend { inner });
        // SAFETY: non-null, valid for a write.
        unsafe { out.write(h) };
        PAGEDKV_OK
    })
}

/// Destroys a CUDA backend (after waiting for its stream).
///
/// # Safety
/// `b` is null or a pointer this library returned (a destroyed one is detected).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_backend_destroy(
    b: *mut pagedkv_cuda_backend,
) -> pagedkv_status {
    guard(|| match destroy(b) {
        Ok(h) => {
            let _ = h.inner.synchronize();
            PAGEDKV_OK
        }
        Err(st) => st,
    })
}

/// Waits for all work the backend queued.
///
/// # Safety
/// `b` is null or a pointer this library returned.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn pagedkv_cuda_synchronize(b: *mut pagedkv_cuda_backend) -> pagedkv_status {
    with_cuda(b, |g| g.synchronize().map_err(|e| from_error(&e)))
}
