//! The driver-facing seam of the step path: [`StepDevice`], the tensor views runs take,
//! and [`Recorder`], a device that only records what it is asked to do.

use std::cell::RefCell;
use std::marker::PhantomData;

use pagedkv_kernels::Kernel;

use crate::emulator::LaunchConfig;
use crate::error::{Error, Result};
use crate::tensor::{DType, HostTensor};

/// Which memory an address belongs to: a view is usable only on a device of the same
/// space (a host address handed to a GPU would fault, or worse).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// Host memory (the emulator's "device").
    Host,
    /// A CUDA context, by an id unique in the process.
    Cuda(u64),
    /// The [`Recorder`]'s fake addresses.
    Recorder,
}

/// The driver calls of the step path. [`StepRunner`](super::StepRunner) calls
/// [`alloc`](StepDevice::alloc) only when it is made, [`upload`](StepDevice::upload)
/// only in [`plan`](super::StepRunner::plan), and nothing but
/// [`launch`](StepDevice::launch) in a run: [`Recorder`] proves it in the tests.
pub trait StepDevice {
    /// The memory this device's addresses live in.
    fn space(&self) -> Space;

    /// Allocates `bytes` zeroed bytes that live as long as the device; returns their
    /// 256-byte aligned address.
    fn alloc(&mut self, bytes: usize) -> Result<u64>;

    /// Copies `src` to `dst` (an address [`alloc`](StepDevice::alloc) returned, with
    /// room for `src`), asynchronously where the device can: the device stages `src`
    /// first, so the caller's slice is free when this returns. Ordered before every
    /// later launch.
    fn upload(&mut self, dst: u64, src: &[u8]) -> Result<()>;

    /// Makes room for uploads of up to `bytes` (pinned staging memory on a GPU), so
    /// [`upload`](StepDevice::upload) never allocates. Called once by the runner.
    fn reserve_upload(&mut self, bytes: usize) -> Result<()> {
        let _ = bytes;
        Ok(())
    }

    /// Launches kernel `K` (ordered after every earlier upload and launch).
    ///
    /// # Safety
    /// 1. Every view in `params` holds an address of this device's [`Space`], valid
    ///    for its whole length (for writes when mutable) until the launch completes.
    /// 2. The parameters passed the kernel's host validation, so every index the kernel
    ///    computes stays inside those lengths.
    /// 3. Until the launch completes, nothing else writes memory the kernel reads or
    ///    touches memory it writes.
    /// 4. `cfg` is the kernel's own launch configuration for these parameters.
    unsafe fn launch<K: Kernel>(&self, cfg: LaunchConfig, params: K::Params) -> Result<()>;
}

/// Where a view's elements are: the part shared by [`TensorView`] and
/// [`TensorViewMut`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawView {
    pub(crate) addr: u64,
    pub(crate) elems: u64,
    pub(crate) dtype: DType,
    pub(crate) space: Space,
    pub(crate) row_stride: Option<u64>,
}

impl RawView {
    fn new(addr: u64, elems: u64, dtype: DType, space: Space) -> Self {
        Self {
            addr,
            elems,
            dtype,
            space,
            row_stride: None,
        }
    }
}

/// A read-only view of a tensor a run reads: an address in some [`Space`], its dtype
/// and element count, and for q-like inputs a row stride. The lifetime ties it to the
/// borrow it was made from.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub(crate) raw: RawView,
    _borrow: PhantomData<&'a ()>,
}

/// A writable view of a tensor a run writes (see [`TensorView`]).
#[derive(Debug)]
pub struct TensorViewMut<'a> {
    pub(crate) raw: RawView,
    _borrow: PhantomData<&'a mut ()>,
}

impl<'a> TensorView<'a> {
    /// A view of `elems` elements at `addr` in `space`, for a backend that knows the
    /// memory is valid for `'a` (the caller holds the borrow).
    pub(crate) fn borrowed(addr: u64, elems: u64, dtype: DType, space: Space) -> Self {
        Self {
            raw: RawView::new(addr, elems, dtype, space),
            _borrow: PhantomData,
        }
    }

    /// A view of a host tensor (for the emulator device).
    pub fn of_host(t: &'a HostTensor) -> Self {
        let addr = t.buf().as_bytes().as_ptr() as u64;
        Self::borrowed(addr, t.len() as u64, t.dtype(), Space::Host)
    }

    /// A view of `elems` elements of `dtype` at `addr` in `space`.
    ///
    /// # Safety
    /// `addr` is valid for reads of `elems` elements in `space` for `'a`, and nothing
    /// writes that memory while a run that reads through the view executes.
    pub unsafe fn from_raw(addr: u64, elems: u64, dtype: DType, space: Space) -> Self {
        Self::borrowed(addr, elems, dtype, space)
    }

    /// The same memory read as rows `stride` elements apart (q inside a fused QKV
    /// projection): row `i` starts at element `i * stride`.
    pub fn with_row_stride(mut self, stride: u64) -> Self {
        self.raw.row_stride = Some(stride);
        self
    }
}

impl<'a> TensorViewMut<'a> {
    /// A writable view for a backend that holds the exclusive borrow for `'a`.
    pub(crate) fn borrowed(addr: u64, elems: u64, dtype: DType, space: Space) -> Self {
        Self {
            raw: RawView::new(addr, elems, dtype, space),
            _borrow: PhantomData,
        }
    }

    /// A view of a host tensor (for the emulator device).
    pub fn of_host(t: &'a mut HostTensor) -> Self {
        let (dtype, elems) = (t.dtype(), t.len() as u64);
        let addr = t.buf_mut().as_bytes_mut().as_mut_ptr() as u64;
        Self::borrowed(addr, elems, dtype, Space::Host)
    }

    /// A writable view of `elems` elements of `dtype` at `addr` in `space`.
    ///
    /// # Safety
    /// `addr` is valid for reads and writes of `elems` elements in `space` for `'a`,
    /// and nothing else uses that memory while a run that writes through it executes.
    pub unsafe fn from_raw(addr: u64, elems: u64, dtype: DType, space: Space) -> Self {
        Self::borrowed(addr, elems, dtype, space)
    }

    /// Rows `stride` elements apart (see [`TensorView::with_row_stride`]).
    pub fn with_row_stride(mut self, stride: u64) -> Self {
        self.raw.row_stride = Some(stride);
        self
    }

    /// The same memory, writable, for as long as this view is borrowed mutably: pass
    /// `cache.reborrow()` to a run and keep `cache` for the next layer.
    pub fn reborrow(&mut self) -> TensorViewMut<'_> {
        TensorViewMut {
            raw: self.raw,
            _borrow: PhantomData,
        }
    }

    /// The same memory, read-only, for as long as this view is borrowed.
    pub fn as_view(&self) -> TensorView<'_> {
        TensorView {
            raw: self.raw,
            _borrow: PhantomData,
        }
    }
}

/// What a [`Recorder`] was asked to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceOp {
    /// An allocation of this many bytes.
    Alloc(usize),
    /// An upload of this many bytes.
    Upload(usize),
    /// A launch of this kernel with this configuration.
    Launch(&'static str, LaunchConfig),
}

/// A [`StepDevice`] that executes nothing and records every call, so a test can
/// assert that a run does nothing but launch. Its addresses are fake (never
/// dereferenced): 256-byte aligned and increasing.
#[derive(Debug, Default)]
pub struct Recorder {
    next: u64,
    ops: RefCell<Vec<DeviceOp>>,
}

impl Recorder {
    /// A recorder with an empty log.
    pub fn new() -> Self {
        Self {
            next: 1 << 20,
            ops: RefCell::new(Vec::new()),
        }
    }

    /// Takes the log recorded so far, leaving it empty.
    pub fn take(&self) -> Vec<DeviceOp> {
        std::mem::take(&mut self.ops.borrow_mut())
    }

    /// A fake view of `elems` elements (for tests of the run path's arguments).
    pub fn view(&mut self, elems: u64, dtype: DType) -> TensorViewMut<'static> {
        let addr = self.next;
        self.next += (elems * dtype.size() as u64).next_multiple_of(256).max(256);
        // SAFETY: the recorder never dereferences an address.
        unsafe { TensorViewMut::from_raw(addr, elems, dtype, Space::Recorder) }
    }
}

impl StepDevice for Recorder {
    fn space(&self) -> Space {
        Space::Recorder
    }
    fn alloc(&mut self, bytes: usize) -> Result<u64> {
        self.ops.borrow_mut().push(DeviceOp::Alloc(bytes));
        let addr = self.next;
        self.next += (bytes as u64).next_multiple_of(256).max(256);
        Ok(addr)
    }
    fn upload(&mut self, dst: u64, src: &[u8]) -> Result<()> {
        if dst == 0 {
            return Err(Error::InvalidState("upload to a null address".into()));
        }
        self.ops.borrow_mut().push(DeviceOp::Upload(src.len()));
        Ok(())
    }
    unsafe fn launch<K: Kernel>(&self, cfg: LaunchConfig, _params: K::Params) -> Result<()> {
        self.ops.borrow_mut().push(DeviceOp::Launch(K::NAME, cfg));
        Ok(())
    }
}
