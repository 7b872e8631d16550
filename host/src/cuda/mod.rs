//! The CUDA device ([`CudaDevice`]: loads pagedkv's PTX with cudarc and launches the
//! kernels) and the [`CudaBackend`] on it.
//!
//! By default cudarc is built with dynamic loading, so this module compiles everywhere
//! and finds the driver (`libcuda`) only at run time; the crate's features
//! `cuda-dynamic-linking` and `cuda-fallback-dynamic-loading` pick cudarc's other modes
//! (to build next to candle-core's `cuda` feature, which links), and
//! [`driver_library_present`] works under each. Without a driver or a device,
//! [`CudaDevice::new`] returns [`Error::NoCudaDriver`] or [`Error::NoCudaDevice`];
//! it never panics.
//!
//! ```no_run
//! # fn ptx() -> Vec<pagedkv_host::cuda::PtxSource> { Vec::new() }
//! use pagedkv_host::cuda::{CudaDevice, DeviceTensor};
//! use pagedkv_host::{DType, HostTensor};
//!
//! // `pagedkv::cuda::device(0)` does this with the PTX embedded in the `pagedkv` crate.
//! let gpu = CudaDevice::new(0, &ptx())?;
//! let q = DeviceTensor::from_host(&gpu, &HostTensor::full(DType::F16, &[8, 32, 128], 0.5))?;
//! # Ok::<(), pagedkv_host::Error>(())
//! ```
//!
//! # Layers
//! cudarc's safe driver API is the raw layer. This module adds the one `unsafe` launch
//! (`CudaDevice::launch`, with its numbered safety conditions) and, above it, a safe
//! API whose every entry point runs the same validation as the emulator path
//! (`ops::*::validate`) before it uploads or launches anything.
//!
//! # Buffers
//! A [`DeviceTensor`] is a `CudaSlice<u8>` with a dtype and a shape. Engines that already
//! use cudarc wrap their own allocations with [`DeviceTensor::from_cuda_slice`] (no copy)
//! and can build the backend on their own stream with [`CudaDevice::with_stream`].
//! Small per-step metadata (slot mapping, block tables, context lengths) comes from the
//! scheduler's [`Batch`](crate::scheduler::Batch) on the host: it is validated there and
//! uploaded on the backend's stream.

mod backend;
mod blocks;
mod step;
mod tensor;

use std::collections::HashMap;
use std::sync::Arc;

pub use backend::CudaBackend;
pub use blocks::HostSwapPool;
pub use step::{CudaStepDevice, StepGraph};
pub use tensor::{BorrowedDeviceTensor, DeviceTensor};

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DeviceRepr, DriverError,
    LaunchConfig as CuConfig, PushKernelArg, sys,
};
use cudarc::nvrtc::Ptx;
use pagedkv_kernels::{Kernel, PagedLayout};

use crate::emulator::LaunchConfig;
use crate::error::{Error, Result};
use crate::ops::attention::{DecodeInputs, SplitPlan};
use crate::ops::kv_append::KvAppendInputs;
use crate::tensor::DType;

/// Whether the CUDA driver library is there, so that the first driver call cannot
/// panic (cudarc's dynamic loading panics when it finds no `libcuda`), under each of
/// this crate's linking-mode features:
/// * `cuda-dynamic-loading` (the default): cudarc's own check, which tries the very
///   names cudarc loads;
/// * `cuda-dynamic-linking`: libcuda is linked, so the process could not have started
///   without it;
/// * `cuda-fallback-dynamic-loading`, or no mode of ours (cudarc follows another crate
///   of the build, e.g. candle-core's `cuda` feature, which links): which mode cudarc
///   ended up in is not visible here, so this tries to load the driver's standard names
///   (`libcuda.so`, `libcuda.so.1`, `nvcuda.dll`). Under linking the library is already
///   loaded and the probe succeeds; under loading it finds what cudarc's loader would,
///   bar exotic names.
pub fn driver_library_present() -> bool {
    #[cfg(feature = "cuda-dynamic-loading")]
    {
        // SAFETY: only tries to load the driver library; no CUDA call is made.
        unsafe { sys::is_culib_present() }
    }
    #[cfg(all(
        feature = "cuda-dynamic-linking",
        not(feature = "cuda-dynamic-loading")
    ))]
    {
        true
    }
    #[cfg(not(any(feature = "cuda-dynamic-loading", feature = "cuda-dynamic-linking")))]
    {
        probe_driver_library()
    }
}

/// Tries to load the CUDA driver under its standard names (see
/// [`driver_library_present`]).
#[cfg_attr(
    any(feature = "cuda-dynamic-loading", feature = "cuda-dynamic-linking"),
    allow(dead_code)
)]
fn probe_driver_library() -> bool {
    use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};
    let names = [
        format!("{DLL_PREFIX}cuda{DLL_SUFFIX}"),
        format!("{DLL_PREFIX}cuda{DLL_SUFFIX}.1"),
        format!("{DLL_PREFIX}nvcuda{DLL_SUFFIX}"),
    ];
    names.iter().any(|n| {
        // SAFETY: loading the NVIDIA driver library runs only its own initialisers (what
        // cudarc's loader and `is_culib_present` do too); the handle is closed at once.
        unsafe { libloading::Library::new(n) }.is_ok()
    })
}

/// One PTX module the backend may load: the `pagedkv` crate embeds one per architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PtxSource {
    /// `"sm_80"`, `"sm_90"`, ...
    pub arch: &'static str,
    /// Lowest compute capability that runs it.
    pub compute_capability: (u32, u32),
    /// The PTX text.
    pub ptx: &'static str,
}

/// The entry points of a PTX module: the names of its `.visible .entry` lines (the
/// backend loads every one).
fn entry_points(ptx: &'static str) -> impl Iterator<Item = &'static str> {
    ptx.lines().filter_map(|l| {
        let rest = l.strip_prefix(".visible .entry ")?;
        let end = rest.find('(').unwrap_or(rest.len());
        Some(rest[..end].trim())
    })
}

fn cuda(what: &'static str) -> impl FnOnce(DriverError) -> Error {
    move |e| Error::Cuda {
        what,
        message: format!("{e:?}"),
    }
}

/// A kernel's parameter struct as one by-value launch argument.
#[repr(transparent)]
#[derive(Clone, Copy)]
struct KernelParams<P>(P);

// SAFETY: every kernel parameter struct is `#[repr(C)]` plain data (integers, floats and
// device addresses), which the driver copies byte for byte into the entry point's single
// `.param` of the same size and layout.
unsafe impl<P: Copy> DeviceRepr for KernelParams<P> {}

/// One layer's K and V pools on the GPU.
pub type LayerCache = crate::backend::LayerCache<DeviceTensor>;

/// The paged cache of a model on the GPU: every layer's K and V pools, one layout.
pub type PagedCache = crate::backend::PagedCache<DeviceTensor>;

/// A loaded kernel as the driver sees it (see [`CudaDevice::kernel_info`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelInfo {
    /// Registers per thread.
    pub registers: u32,
    /// Blocks one SM runs at once at the asked block size and shared memory.
    pub blocks_per_sm: u32,
}

/// A CUDA device as pagedkv uses it: a context, a stream, and the loaded kernels (the
/// launcher under [`CudaBackend`] and the per-call methods).
#[derive(Debug)]
pub struct CudaDevice {
    stream: Arc<CudaStream>,
    funcs: HashMap<&'static str, CudaFunction>,
    arch: &'static str,
    sm_count: u32,
    device_name: String,
    /// The most dynamic shared memory a block may have on this device (the opt-in
    /// limit, which every loaded kernel is set to allow).
    max_dynamic_shared: u32,
}

impl CudaDevice {
    /// Device `ordinal`'s primary context and default stream, with the
    /// newest of `modules` the device can run (an error below compute capability 8.0).
    pub fn new(ordinal: usize, modules: &[PtxSource]) -> Result<Self> {
        if !driver_library_present() {
            return Err(Error::NoCudaDriver);
        }
        let n = CudaContext::device_count().map_err(|e| {
            Error::NoCudaDevice(format!("the driver could not count devices ({e:?})"))
        })?;
        if n <= 0 {
            return Err(Error::NoCudaDevice("the driver reports no device".into()));
        }
        if ordinal >= n as usize {
            return Err(Error::NoCudaDevice(format!(
                "device {ordinal} asked for, {n} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda("cuCtxCreate"))?;
        // SAFETY: this backend made the context and does all of its work on the one
        // default stream, in order, so no buffer needs cross-stream event tracking; with
        // it off, taking a buffer's address makes no driver call (a run only launches).
        unsafe { ctx.disable_event_tracking() };
        Self::with_stream(ctx.default_stream(), modules)
    }

    /// A backend on device `ordinal`'s primary context and a raw `CUstream` an engine
    /// owns (from CUDA C++, PyTorch, ...), or its default stream when `stream` is null:
    /// every copy and launch of the backend goes to that stream.
    ///
    /// # Safety
    /// 1. A non-null `stream` is a live stream of device `ordinal`'s primary context.
    /// 2. Its owner keeps it alive as long as the backend (and anything it made) lives.
    pub unsafe fn on_raw_stream(
        ordinal: usize,
        stream: *mut std::ffi::c_void,
        modules: &[PtxSource],
    ) -> Result<Self> {
        let probe = Self::new(ordinal, modules)?;
        if stream.is_null() {
            return Ok(probe);
        }
        let ctx = probe.stream.context().clone();
        // SAFETY: the caller's conditions 1 and 2.
        let s = unsafe { ctx.wrap_borrowed_stream(stream as sys::CUstream) };
        Self::with_stream(s, modules)
    }

    /// A backend on an existing stream (and its context): engines that already use
    /// cudarc share theirs, so pagedkv's launches order with their own work.
    pub fn with_stream(stream: Arc<CudaStream>, modules: &[PtxSource]) -> Result<Self> {
        let ctx = stream.context().clone();
        let device_name = ctx.name().map_err(cuda("cuDeviceGetName"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda("cuDeviceGetAttribute"))?;
        let cc = (major as u32, minor as u32);
        let module = modules
            .iter()
            .filter(|m| m.compute_capability <= cc)
            .max_by_key(|m| m.compute_capability)
            .ok_or_else(|| {
                Error::UnsupportedDevice(format!(
                    "{device_name} has compute capability {major}.{minor}; pagedkv's PTX needs 8.0 or newer"
                ))
            })?;
        let loaded = ctx
            .load_module(Ptx::from_src(module.ptx))
            .map_err(cuda("cuModuleLoadData"))?;
        // A launch with more than 48 KiB of dynamic shared memory (the tensor-core
        // decode and multi-warp prefill kernels: 96 KiB at head_dim 128) fails unless
        // the function opts in.
        let max_dynamic_shared = ctx
            .attribute(
                sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            )
            .map_err(cuda("cuDeviceGetAttribute"))?
            .max(0) as u32;
        let mut funcs = HashMap::new();
        for name in entry_points(module.ptx) {
            let f = loaded
                .load_function(name)
                .map_err(cuda("cuModuleGetFunction"))?;
            // No kernel has static shared memory; subtract it anyway.
            let fixed = f
                .shared_size_bytes()
                .map_err(cuda("cuFuncGetAttribute"))?
                .max(0);
            f.set_attribute(
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                (max_dynamic_shared as i32 - fixed).max(0),
            )
            .map_err(cuda("cuFuncSetAttribute"))?;
            funcs.insert(name, f);
        }
        let sm_count = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda("cuDeviceGetAttribute"))? as u32;
        Ok(Self {
            stream,
            funcs,
            arch: module.arch,
            sm_count,
            device_name,
            max_dynamic_shared,
        })
    }

    /// What the driver says of a loaded kernel: its registers per thread
    /// (`cuFuncGetAttribute`) and how many blocks of `block_threads` threads with
    /// `dynamic_smem` bytes of shared memory one SM runs at once
    /// (`cuOccupancyMaxActiveBlocksPerMultiprocessor`).
    pub fn kernel_info(
        &self,
        name: &str,
        block_threads: u32,
        dynamic_smem: u32,
    ) -> Result<KernelInfo> {
        let f = self
            .funcs
            .get(name)
            .ok_or_else(|| Error::invalid("name", format!("no kernel `{name}` is loaded")))?;
        let registers = f.num_regs().map_err(cuda("cuFuncGetAttribute"))? as u32;
        let blocks_per_sm = f
            .occupancy_max_active_blocks_per_multiprocessor(
                block_threads,
                dynamic_smem as usize,
                None,
            )
            .map_err(cuda("cuOccupancyMaxActiveBlocksPerMultiprocessor"))?;
        Ok(KernelInfo {
            registers,
            blocks_per_sm,
        })
    }

    /// The SM and memory clocks, MHz (`cuDeviceGetAttribute`).
    pub fn clocks_mhz(&self) -> Result<(u32, u32)> {
        let ctx = self.stream.context();
        let a = |at| {
            ctx.attribute(at)
                .map_err(cuda("cuDeviceGetAttribute"))
                .map(|khz| khz as u32 / 1000)
        };
        Ok((
            a(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_CLOCK_RATE)?,
            a(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE)?,
        ))
    }

    /// The device's name.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// The architecture of the loaded PTX.
    pub fn arch(&self) -> &'static str {
        self.arch
    }

    /// Streaming multiprocessors (the split-K planner's input).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// What the split-K planner plans for on this device: its SM count and the
    /// architecture of the PTX loaded (sm_80's bounds for one pagedkv has no table for).
    pub fn split_target(&self) -> crate::ops::attention::SplitTarget {
        use crate::ops::attention::{Arch, SplitTarget};
        SplitTarget {
            sm_count: self.sm_count,
            arch: Arch::from_name(self.arch).unwrap_or(Arch::Sm80),
        }
    }

    /// The stream every launch goes to.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Waits for all work on the stream.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(cuda("cuStreamSynchronize"))
    }

    /// Allocates a paged cache: `num_layers` K and V pools of `layout`, zero-filled.
    pub fn alloc_cache(
        &self,
        layout: PagedLayout,
        dtype: DType,
        num_layers: usize,
    ) -> Result<PagedCache> {
        crate::ops::check_layout(&layout)?;
        let shape = [
            layout.num_blocks as usize,
            layout.num_kv_heads as usize,
            layout.block_size as usize,
            layout.head_dim as usize,
        ];
        let layers = (0..num_layers)
            .map(|_| {
                Ok(LayerCache {
                    key: DeviceTensor::zeros(self, dtype, &shape)?,
                    value: DeviceTensor::zeros(self, dtype, &shape)?,
                    kv_scales: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(PagedCache { layout, layers })
    }

    fn upload<T: DeviceRepr>(&self, what: &'static str, data: &[T]) -> Result<CudaSlice<T>> {
        self.stream.clone_htod(data).map_err(cuda(what))
    }

    /// Launches kernel `K` on the backend's stream.
    ///
    /// # Safety
    /// 1. Every `GlobalSlice` / `GlobalSliceMut` in `params` holds a device address in
    ///    this backend's context, valid for its whole length (for writes when mutable)
    ///    until the launch completes on the stream.
    /// 2. The parameters passed the kernel's host validation (`ops::*::validate`), so
    ///    every index the kernel computes stays inside those lengths.
    /// 3. Until the launch completes, nothing else writes memory the kernel reads or
    ///    touches memory it writes: the buffers are borrowed by the calling method and
    ///    all of pagedkv's work runs on this one stream.
    /// 4. `cfg` is the kernel's own launch configuration (`ops::*::launch_config`),
    ///    which sizes shared memory for the parameters.
    unsafe fn launch<K: Kernel>(&self, cfg: LaunchConfig, params: K::Params) -> Result<()> {
        let f = self
            .funcs
            .get(K::NAME)
            .ok_or_else(|| Error::InvalidState(format!("kernel {} is not loaded", K::NAME)))?;
        if cfg.shared_bytes > self.max_dynamic_shared {
            return Err(Error::UnsupportedDevice(format!(
                "{} needs {} bytes of shared memory per block; {} allows {}",
                K::NAME,
                cfg.shared_bytes,
                self.device_name,
                self.max_dynamic_shared
            )));
        }
        let p = KernelParams(params);
        let mut b = self.stream.launch_builder(f);
        b.arg(&p);
        let c = CuConfig {
            grid_dim: (cfg.grid.x, cfg.grid.y, cfg.grid.z),
            block_dim: (cfg.block.x, cfg.block.y, cfg.block.z),
            shared_mem_bytes: cfg.shared_bytes,
        };
        // SAFETY: conditions 1-4 above are the caller's; `p` lives until the call returns.
        unsafe { b.launch(c) }.map_err(cuda(K::NAME))?;
        Ok(())
    }

    /// Appends tokens' K and V to one layer's cache (see `ops::kv_append`), the slot
    /// mapping from the batch. A per-call convenience, one step of a
    /// [`StepRunner`](crate::step::StepRunner) made for the call (it allocates and
    /// uploads the slot mapping each call); the step path ([`CudaBackend`]) keeps one
    /// runner and uploads once per step.
    pub fn kv_append(&self, io: KvAppendInputs<'_, DeviceTensor>) -> Result<()> {
        crate::step::once::kv_append(CudaStepDevice::new(self), io)
    }

    /// Paged decode attention over one layer's cache (see `ops::attention`). Without
    /// `inputs.plan`, plans split-K from this device's SM count. Returns the plan used.
    ///
    /// A per-call convenience, one step of a [`StepRunner`](crate::step::StepRunner)
    /// made for the call: it allocates the metadata and split-K workspace and uploads
    /// them each call. An engine's layer loop uses the step path ([`CudaBackend`]),
    /// which does that once per step.
    pub fn paged_decode_attention<'o>(
        &self,
        inputs: DecodeInputs<'_, DeviceTensor>,
        out: impl Into<crate::ops::attention::AttentionOut<'o, DeviceTensor>>,
    ) -> Result<SplitPlan> {
        crate::step::once::decode(
            CudaStepDevice::new(self),
            Some(self.split_target()),
            inputs,
            out,
        )
    }

    /// Merges partial attention states (see [`crate::ops::merge`]): a per-call
    /// convenience, one launch of a [`StepRunner`](crate::step::StepRunner) made for
    /// the call (an engine's layer loop uses
    /// [`AttentionBackend::merge_states`](crate::backend::AttentionBackend::merge_states)).
    pub fn merge_states<'o>(
        &self,
        inputs: crate::ops::merge::MergeInputs<'_, DeviceTensor>,
        out: impl Into<crate::ops::attention::AttentionOut<'o, DeviceTensor>>,
    ) -> Result<()> {
        crate::step::once::merge(CudaStepDevice::new(self), inputs, out)
    }

    /// Times `f` on the stream with CUDA events, in milliseconds (for benchmarks).
    pub fn time_ms(&self, f: impl FnOnce() -> Result<()>) -> Result<f32> {
        let ctx = self.stream.context();
        let flags = Some(sys::CUevent_flags::CU_EVENT_DEFAULT);
        let start = ctx.new_event(flags).map_err(cuda("cuEventCreate"))?;
        let end = ctx.new_event(flags).map_err(cuda("cuEventCreate"))?;
        start.record(&self.stream).map_err(cuda("cuEventRecord"))?;
        f()?;
        end.record(&self.stream).map_err(cuda("cuEventRecord"))?;
        start.elapsed_ms(&end).map_err(cuda("cuEventElapsedTime"))
    }

    /// A device-to-device copy of `bytes` bytes (the bandwidth ceiling benchmarks
    /// compare against).
    pub fn copy_d2d(&self, src: &DeviceTensor, dst: &mut DeviceTensor) -> Result<()> {
        if src.num_bytes() != dst.num_bytes() {
            return Err(Error::invalid("dst", "sizes differ"));
        }
        self.stream
            .memcpy_dtod(&src.buf, &mut dst.buf)
            .map_err(cuda("cuMemcpyDtoD"))
    }
}

#[cfg(test)]
mod tests {
    /// The probe of the modes that cannot ask cudarc agrees with the mode in use (no
    /// driver on a CI machine: both false; on a GPU machine: both true).
    #[test]
    fn driver_probe_agrees_with_the_linking_mode() {
        assert_eq!(
            super::driver_library_present(),
            super::probe_driver_library()
        );
    }
}
