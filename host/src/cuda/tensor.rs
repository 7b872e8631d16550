//! [`DeviceTensor`], a typed device allocation, [`BorrowedDeviceTensor`], a caller's
//! allocation seen as one for the length of a call, and safe views of an engine's own
//! `CudaSlice`s ([`TensorView::of_cuda_slice`]: a candle tensor's storage, no copy).

use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr};

use super::{CudaDevice, cuda};
use crate::error::{Error, Result};
use crate::step::{Space, TensorView, TensorViewMut};
use crate::tensor::{DType, HostTensor, TensorDesc};

/// A tensor in device memory: bytes, an element type and a shape.
#[derive(Debug)]
pub struct DeviceTensor {
    pub(super) buf: CudaSlice<u8>,
    pub(super) dtype: DType,
    pub(super) shape: Vec<usize>,
}

impl TensorDesc for DeviceTensor {
    fn dtype(&self) -> DType {
        self.dtype
    }
    fn len(&self) -> usize {
        self.buf.len() / self.dtype.size()
    }
}

impl DeviceTensor {
    /// A zero-filled tensor.
    pub fn zeros(gpu: &CudaDevice, dtype: DType, shape: &[usize]) -> Result<Self> {
        let n = HostTensor::checked_elems(dtype, shape)?;
        let buf = gpu
            .stream
            .alloc_zeros::<u8>(n * dtype.size())
            .map_err(cuda("cuMemAlloc"))?;
        Ok(Self {
            buf,
            dtype,
            shape: shape.to_vec(),
        })
    }

    /// A copy of a host tensor.
    pub fn from_host(gpu: &CudaDevice, t: &HostTensor) -> Result<Self> {
        let buf = gpu
            .stream
            .clone_htod(t.buf().as_bytes())
            .map_err(cuda("cuMemcpyHtoD"))?;
        Ok(Self {
            buf,
            dtype: t.dtype(),
            shape: t.shape().to_vec(),
        })
    }

    /// Copies the tensor back to the host (waits for the stream).
    pub fn to_host(&self, gpu: &CudaDevice) -> Result<HostTensor> {
        let bytes = gpu
            .stream
            .clone_dtoh(&self.buf)
            .map_err(cuda("cuMemcpyDtoH"))?;
        HostTensor::from_bytes(self.dtype, &self.shape, &bytes)
    }

    /// Overwrites the tensor with a host tensor of the same dtype and length.
    pub fn copy_from_host(&mut self, gpu: &CudaDevice, t: &HostTensor) -> Result<()> {
        if t.dtype() != self.dtype || t.len() != TensorDesc::len(self) {
            return Err(Error::invalid(
                "t",
                format!(
                    "{} x {} into {} x {}",
                    t.len(),
                    t.dtype(),
                    TensorDesc::len(self),
                    self.dtype
                ),
            ));
        }
        gpu.stream
            .memcpy_htod(t.buf().as_bytes(), &mut self.buf)
            .map_err(cuda("cuMemcpyHtoD"))
    }

    /// Fills the tensor with `pattern` repeated (uploaded once, then copied on the
    /// device), e.g. random data for benchmarks without a host copy of the whole tensor.
    pub fn fill_repeat(&mut self, gpu: &CudaDevice, pattern: &[u8]) -> Result<()> {
        if pattern.is_empty() {
            return Err(Error::invalid("pattern", "must not be empty"));
        }
        let src = gpu.upload("upload pattern", pattern)?;
        let total = self.buf.len();
        let mut at = 0;
        while at < total {
            let n = pattern.len().min(total - at);
            let mut dst = self.buf.slice_mut(at..at + n);
            gpu.stream
                .memcpy_dtod(&src.slice(0..n), &mut dst)
                .map_err(cuda("cuMemcpyDtoD"))?;
            at += n;
        }
        Ok(())
    }

    /// Wraps an engine's own allocation, without a copy. Errors when its length is not
    /// the shape's element count times the element size.
    pub fn from_cuda_slice(buf: CudaSlice<u8>, dtype: DType, shape: &[usize]) -> Result<Self> {
        let n = HostTensor::checked_elems(dtype, shape)?;
        if buf.len() != n * dtype.size() {
            return Err(Error::invalid(
                "buf",
                format!("{} bytes for shape {shape:?} of {dtype}", buf.len()),
            ));
        }
        Ok(Self {
            buf,
            dtype,
            shape: shape.to_vec(),
        })
    }

    /// Gives the allocation back.
    pub fn into_cuda_slice(self) -> CudaSlice<u8> {
        self.buf
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Bytes.
    pub fn num_bytes(&self) -> usize {
        self.buf.len()
    }
}

/// A caller's device allocation seen as a [`DeviceTensor`] for the length of a call:
/// dropping it gives the memory back untouched (never frees it).
#[derive(Debug)]
pub struct BorrowedDeviceTensor(Option<DeviceTensor>);

impl BorrowedDeviceTensor {
    /// Wraps `ptr` (`shape` elements of `dtype`) without taking ownership.
    ///
    /// # Safety
    /// 1. `ptr` is a device allocation in `gpu`'s context, valid for reads and writes of
    ///    the shape's bytes for as long as the wrapper lives.
    /// 2. Nothing else uses that memory while a launch that uses the wrapper runs.
    pub unsafe fn new(gpu: &CudaDevice, ptr: u64, dtype: DType, shape: &[usize]) -> Result<Self> {
        if ptr == 0 {
            return Err(Error::invalid("ptr", "device pointer is null"));
        }
        if !ptr.is_multiple_of(16) {
            // The kernels read and write 16-byte vectors: a misaligned address would be a
            // fault that kills the process's CUDA context, not an error.
            return Err(Error::invalid(
                "ptr",
                format!("device pointer {ptr:#x} is not 16-byte aligned"),
            ));
        }
        let bytes = HostTensor::checked_elems(dtype, shape)? * dtype.size();
        // SAFETY: the caller's conditions 1 and 2; `Drop` leaks the slice, so cudarc never
        // frees the caller's memory.
        let buf = unsafe { gpu.stream.upgrade_device_ptr::<u8>(ptr, bytes) };
        Ok(Self(Some(DeviceTensor {
            buf,
            dtype,
            shape: shape.to_vec(),
        })))
    }
}

impl std::ops::Deref for BorrowedDeviceTensor {
    type Target = DeviceTensor;
    fn deref(&self) -> &DeviceTensor {
        self.0.as_ref().expect("present until drop")
    }
}

impl std::ops::DerefMut for BorrowedDeviceTensor {
    fn deref_mut(&mut self) -> &mut DeviceTensor {
        self.0.as_mut().expect("present until drop")
    }
}

impl Drop for BorrowedDeviceTensor {
    fn drop(&mut self) {
        if let Some(t) = self.0.take() {
            let _ = t.buf.leak();
        }
    }
}

/// Checks that a `CudaSlice<E>` holds `offset + len` elements of `dtype` on `gpu`'s
/// stream, and returns the device address of element `offset`.
fn cuda_slice_addr<E: DeviceRepr>(
    gpu: &CudaDevice,
    slice: &CudaSlice<E>,
    offset: usize,
    len: usize,
    dtype: DType,
) -> Result<u64> {
    if size_of::<E>() != dtype.size() {
        return Err(Error::invalid(
            "slice",
            format!(
                "elements of {} bytes seen as {dtype} ({} bytes)",
                size_of::<E>(),
                dtype.size()
            ),
        ));
    }
    if offset.checked_add(len).is_none_or(|end| end > slice.len()) {
        return Err(Error::invalid(
            "slice",
            format!(
                "elements {offset}..{offset}+{len} of a slice of {}",
                slice.len()
            ),
        ));
    }
    // The launches that read or write through the view run on `gpu`'s stream, after
    // the view is made and its guard gone: that orders them after the slice's earlier
    // work and before its later work (a free included) only on the slice's own stream.
    if slice.stream().cu_stream() != gpu.stream.cu_stream() {
        return Err(Error::invalid(
            "slice",
            "the slice lives on another stream than the backend's: build the backend on \
             the engine's stream (CudaDevice::with_stream)",
        ));
    }
    let (base, _guard) = slice.device_ptr(&gpu.stream);
    Ok(base + (offset * size_of::<E>()) as u64)
}

impl<'a> TensorView<'a> {
    /// A view of `len` elements of an engine's `CudaSlice`, from element `offset`, with
    /// no copy: e.g. a candle tensor's `CudaStorage` slice
    /// (`storage.as_cuda_slice::<f32>()`) and its layout's `start_offset()`. The
    /// elements are read as `dtype` (same size as `E`). The slice must be on `gpu`'s
    /// stream (the backend built with [`CudaDevice::with_stream`] on the engine's
    /// stream), so a launch through the view is ordered between the slice's earlier and
    /// later work; the borrow keeps the slice alive and unwritten until the view is
    /// gone. The runs check the length and 16-byte alignment.
    pub fn of_cuda_slice<E: DeviceRepr>(
        gpu: &CudaDevice,
        slice: &'a CudaSlice<E>,
        offset: usize,
        len: usize,
        dtype: DType,
    ) -> Result<Self> {
        let addr = cuda_slice_addr(gpu, slice, offset, len, dtype)?;
        Ok(Self::borrowed(
            addr,
            len as u64,
            dtype,
            Space::Cuda(gpu.stream.context().cu_ctx() as u64),
        ))
    }
}

impl<'a> TensorViewMut<'a> {
    /// A writable view of `len` elements of an engine's `CudaSlice` from element
    /// `offset` (see [`TensorView::of_cuda_slice`]; `as_cuda_slice_mut` on a candle
    /// `CudaStorage`).
    pub fn of_cuda_slice_mut<E: DeviceRepr>(
        gpu: &CudaDevice,
        slice: &'a mut CudaSlice<E>,
        offset: usize,
        len: usize,
        dtype: DType,
    ) -> Result<Self> {
        let addr = cuda_slice_addr(gpu, slice, offset, len, dtype)?;
        Ok(Self::borrowed(
            addr,
            len as u64,
            dtype,
            Space::Cuda(gpu.stream.context().cu_ctx() as u64),
        ))
    }
}
