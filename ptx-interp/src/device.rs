//! [`PtxDevice`]: the step path's device interface over the interpreter.

use std::sync::{Arc, Mutex};

use pagedkv_host::emulator::LaunchConfig;
use pagedkv_host::step::{DeviceAddr, HostMemory, Space, StepDevice};
use pagedkv_host::{Error as HostError, Result as HostResult};
use pagedkv_kernels::Kernel;

use crate::{LaunchStats, MathMode, Module};

/// A `StepDevice` whose launches run the committed PTX in the interpreter, over host
/// memory (as the emulator's device: host tensors are its tensors, `Space::Host`).
///
/// Every launch's [`LaunchStats`] is kept, in order, in its [`LaunchLog`].
#[derive(Debug)]
pub struct PtxDevice {
    module: Arc<Module>,
    math: MathMode,
    mem: HostMemory,
    log: LaunchLog,
}

/// One launch a [`PtxDevice`] ran.
#[derive(Clone, Debug)]
pub struct LaunchRecord {
    /// The entry point.
    pub kernel: &'static str,
    /// Its grid, block and shared size.
    pub cfg: LaunchConfig,
    /// What it did.
    pub stats: LaunchStats,
}

/// The launches of a [`PtxDevice`], readable after the device moved into a runner.
#[derive(Clone, Debug, Default)]
pub struct LaunchLog(Arc<Mutex<Vec<LaunchRecord>>>);

impl LaunchLog {
    /// Every launch since the last call, in order.
    pub fn take(&self) -> Vec<LaunchRecord> {
        std::mem::take(&mut self.0.lock().unwrap_or_else(|e| e.into_inner()))
    }
}

impl PtxDevice {
    /// A device launching the entry points of `module` with `math`.
    pub fn new(module: Arc<Module>, math: MathMode) -> Self {
        Self {
            module,
            math,
            mem: HostMemory::new(),
            log: LaunchLog::default(),
        }
    }

    /// The module it launches from.
    pub fn module(&self) -> &Arc<Module> {
        &self.module
    }

    /// A handle on its launches' records.
    pub fn log(&self) -> LaunchLog {
        self.log.clone()
    }
}

impl StepDevice for PtxDevice {
    fn space(&self) -> Space {
        Space::Host
    }

    fn alloc(&mut self, bytes: usize) -> HostResult<DeviceAddr> {
        self.mem.alloc(bytes)
    }

    fn upload(&mut self, dst: DeviceAddr, src: &[u8]) -> HostResult<()> {
        self.mem.upload(dst, src)
    }

    fn reserve_upload(&mut self, bytes: usize) -> HostResult<()> {
        self.mem.reserve_upload(bytes)
    }

    unsafe fn launch<K: Kernel>(&self, cfg: LaunchConfig, params: K::Params) -> HostResult<()> {
        // SAFETY: the trait's conditions (every view the params hold valid for the
        // launch, no other user) are `Module::launch`'s 1 and 3; for condition 2, the
        // only params with a table of views (copy_blocks) are built by
        // `step::once::copy_blocks` from pools its caller vouched for (its safety 1-2).
        let stats = unsafe { self.module.launch::<K>(cfg, &params, self.math) }
            .map_err(|e| HostError::InvalidState(format!("PTX interpreter: {e}")))?;
        self.log
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(LaunchRecord {
                kernel: K::NAME,
                cfg,
                stats,
            });
        Ok(())
    }
}
