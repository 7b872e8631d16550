//! [`CudaStepDevice`]: the step path's seam on a real GPU, and CUDA-graph capture of a
//! whole step ([`StepGraph`]).

use cudarc::driver::{CudaEvent, CudaGraph, CudaSlice, DevicePtr, PinnedHostSlice, sys};
use pagedkv_kernels::Kernel;

use super::{CudaDevice, DeviceTensor, cuda};
use crate::emulator::LaunchConfig;
use crate::error::{Error, Result};
use crate::step::{DeviceAddr, Space, StepDevice, TensorView, TensorViewMut};
use crate::tensor::TensorDesc;

/// A [`StepDevice`] on a [`CudaDevice`]'s stream: allocations are stream-ordered
/// device buffers kept for the device's life, uploads go through two pinned staging
/// buffers in turn with asynchronous copies (a step's decode and prefill metadata never
/// wait for each other), launches are the backend's.
///
/// Everything runs on the backend's stream (an engine's own, with
/// [`CudaDevice::with_stream`]), so a step orders with the engine's work.
pub struct CudaStepDevice<'a> {
    gpu: &'a CudaDevice,
    bufs: Vec<CudaSlice<u8>>,
    staging: [Option<PinnedHostSlice<u8>>; 2],
    staging_len: usize,
    /// Recorded after each staging buffer's last upload: it is reused only after it.
    uploaded: [Option<CudaEvent>; 2],
    /// The staging buffer the next upload uses.
    next: usize,
}

impl Drop for CudaStepDevice<'_> {
    fn drop(&mut self) {
        // The last uploads may still read the pinned staging buffers: wait for them
        // before the buffers are freed. (The device buffers are freed in stream order by
        // cudarc, after the launches that use them.)
        for e in self.uploaded.iter_mut().filter_map(Option::take) {
            let _ = e.synchronize();
        }
    }
}

impl std::fmt::Debug for CudaStepDevice<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CudaStepDevice({}, {} buffers, {} staging bytes)",
            self.gpu.device_name(),
            self.bufs.len(),
            self.staging_len
        )
    }
}

/// The memory space of a backend's context.
fn space_of(gpu: &CudaDevice) -> Space {
    Space::Cuda(gpu.stream.context().cu_ctx() as u64)
}

impl<'a> CudaStepDevice<'a> {
    /// A step device on `gpu`'s stream.
    pub fn new(gpu: &'a CudaDevice) -> Self {
        Self {
            gpu,
            bufs: Vec::new(),
            staging: [None, None],
            staging_len: 0,
            uploaded: [None, None],
            next: 0,
        }
    }

    /// Captures the work `f` issues on the stream (launches only: a run of the step
    /// path) into a CUDA graph instead of running it. Replay it with
    /// [`StepGraph::replay`] after each [`plan`](crate::step::StepRunner::plan) that
    /// keeps the same shapes (number of sequences, block-table width, tokens, split,
    /// and cascade: [`Planned::cascade`](crate::step::Planned::cascade) equal, or both
    /// `None`), since the graph holds the launches' parameters (a cascade's grid and
    /// its shared pass's) and the plan updates the metadata buffers they point to in
    /// place.
    pub fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<StepGraph> {
        let s = &self.gpu.stream;
        s.begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(cuda("cuStreamBeginCapture"))?;
        let issued = f();
        let graph = s
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(cuda("cuStreamEndCapture"));
        issued?;
        let graph =
            graph?.ok_or_else(|| Error::InvalidState("the capture recorded no work".into()))?;
        Ok(StepGraph { graph })
    }
}

/// A captured step (see [`CudaStepDevice::capture`]).
pub struct StepGraph {
    graph: CudaGraph,
}

impl std::fmt::Debug for StepGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("StepGraph")
    }
}

impl StepGraph {
    /// Launches the whole captured step on the stream it was captured on.
    pub fn replay(&self) -> Result<()> {
        self.graph.launch().map_err(cuda("cuGraphLaunch"))
    }
}

impl StepDevice for CudaStepDevice<'_> {
    fn space(&self) -> Space {
        space_of(self.gpu)
    }

    fn max_shared_bytes(&self) -> u32 {
        self.gpu.max_dynamic_shared
    }

    fn alloc(&mut self, bytes: usize) -> Result<DeviceAddr> {
        let s = &self.gpu.stream;
        let buf = s
            .alloc_zeros::<u8>(bytes.max(1))
            .map_err(cuda("cuMemAlloc"))?;
        let (addr, _) = buf.device_ptr(s);
        self.bufs.push(buf);
        Ok(DeviceAddr::new(addr))
    }

    fn reserve_upload(&mut self, bytes: usize) -> Result<()> {
        if bytes > self.staging_len {
            for (slot, e) in self.staging.iter_mut().zip(&mut self.uploaded) {
                // A copy may still read the old buffer: wait before it is freed.
                if let Some(e) = e.take() {
                    e.synchronize().map_err(cuda("cuEventSynchronize"))?;
                }
                // SAFETY: the memory is written before any copy reads it (`upload`).
                let p = unsafe { self.gpu.stream.context().alloc_pinned::<u8>(bytes) }
                    .map_err(cuda("cuMemHostAlloc"))?;
                *slot = Some(p);
            }
            self.staging_len = bytes;
        }
        Ok(())
    }

    fn upload(&mut self, dst: DeviceAddr, src: &[u8]) -> Result<()> {
        crate::step::check_reserved(src.len(), self.staging_len)?;
        let i = self.next;
        self.next = 1 - i;
        // This buffer's previous upload read it asynchronously: wait for it (issued two
        // uploads ago, a step ago with one or two uploads a step, so this rarely waits).
        if let Some(e) = self.uploaded[i].take() {
            e.synchronize().map_err(cuda("cuEventSynchronize"))?;
        }
        let staging = self.staging[i]
            .as_mut()
            .ok_or_else(|| Error::InvalidState("no staging buffer reserved".into()))?;
        let base = staging.as_mut_ptr().map_err(cuda("pinned memory"))?;
        // SAFETY: `src.len() <= staging_len` bytes of pinned memory this device owns;
        // no copy reads it (waited above).
        let host = unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), base, src.len());
            std::slice::from_raw_parts(base, src.len())
        };
        // SAFETY: `dst` is an address this device allocated with room for `src` (the
        // runner's contract); the pinned source stays untouched until the event below.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst.get(), host, self.gpu.stream.cu_stream())
        }
        .map_err(cuda("cuMemcpyHtoDAsync"))?;
        self.uploaded[i] = Some(
            self.gpu
                .stream
                .record_event(None)
                .map_err(cuda("cuEventRecord"))?,
        );
        Ok(())
    }

    unsafe fn launch<K: Kernel>(&self, cfg: LaunchConfig, params: K::Params) -> Result<()> {
        // SAFETY: the caller's conditions 1-4 are `CudaDevice::launch`'s.
        unsafe { self.gpu.launch::<K>(cfg, params) }
    }
}

impl DeviceTensor {
    /// A read-only view for the step path (and the per-call methods, which run on it).
    /// With the device's own context (event tracking off) this makes no driver call; on
    /// an engine's context with tracking on, make views outside the layer loop. A view
    /// records no cudarc event for the launches that use it: pagedkv orders all its
    /// work on the device's one stream, and an engine that touches the buffers from
    /// another stream orders that stream after pagedkv's itself (an event recorded on
    /// [`CudaDevice::stream`]).
    pub fn view(&self) -> TensorView<'_> {
        let s = self.buf.stream();
        let (addr, _) = self.buf.device_ptr(s);
        TensorView::borrowed(
            addr,
            TensorDesc::len(self) as u64,
            self.dtype,
            Space::Cuda(s.context().cu_ctx() as u64),
        )
    }

    /// A writable view for the step path (see [`DeviceTensor::view`]).
    pub fn view_mut(&mut self) -> TensorViewMut<'_> {
        let s = self.buf.stream();
        let (addr, _) = self.buf.device_ptr(s);
        TensorViewMut::borrowed(
            addr,
            TensorDesc::len(self) as u64,
            self.dtype,
            Space::Cuda(s.context().cu_ctx() as u64),
        )
    }
}
