//! [`CudaBackend`]: the [`AttentionBackend`] on a GPU: the step path over a
//! [`CudaStepDevice`], the cache in [`DeviceTensor`]s, swap space in pinned host memory.

use super::{CudaDevice, CudaStepDevice, DeviceTensor, HostSwapPool, LayerCache, PagedCache};
use crate::backend::{
    AsView, AttentionBackend, BackendConfig, DecodeArgs, KvAppendArgs, PrefillArgs, StepCore,
    check_pairs,
};
use crate::error::{Error, Result};
use crate::scheduler::Batch;
use crate::step::{Planned, TensorView, TensorViewMut};
use crate::tensor::HostTensor;

impl AsView for DeviceTensor {
    fn view(&self) -> TensorView<'_> {
        DeviceTensor::view(self)
    }
    fn view_mut(&mut self) -> TensorViewMut<'_> {
        DeviceTensor::view_mut(self)
    }
}

/// The CUDA backend behind the engine-facing [`AttentionBackend`] API: everything runs
/// on `gpu`'s stream (an engine's own with [`CudaDevice::with_stream`]); decode
/// launches split for the GPU's SM count unless the config says otherwise.
///
/// A run ([`kv_append`](AttentionBackend::kv_append),
/// [`decode`](AttentionBackend::decode)) only launches, so a step can be captured
/// with [`capture`](Self::capture) and replayed after the next `begin_step`.
pub struct CudaBackend<'g> {
    gpu: &'g CudaDevice,
    core: StepCore<CudaStepDevice<'g>>,
    swap: Option<HostSwapPool>,
}

impl std::fmt::Debug for CudaBackend<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("device", &self.gpu.device_name())
            .field("config", &self.core.config)
            .finish_non_exhaustive()
    }
}

impl<'g> CudaBackend<'g> {
    /// A backend for `config` on `gpu`: allocates the step buffers (metadata, split-K
    /// workspace, ALiBi slopes) once.
    pub fn new(gpu: &'g CudaDevice, config: BackendConfig) -> Result<Self> {
        Ok(Self {
            gpu,
            core: StepCore::new(CudaStepDevice::new(gpu), config, Some(gpu.split_target()))?,
            swap: None,
        })
    }

    /// The GPU.
    pub fn gpu(&self) -> &'g CudaDevice {
        self.gpu
    }

    /// Captures the launches `f` issues (a step's runs) into a CUDA graph (see
    /// [`CudaStepDevice::capture`]).
    pub fn capture(&self, f: impl FnOnce() -> Result<()>) -> Result<super::StepGraph> {
        self.core.runner.device().capture(f)
    }

    fn swap_pool(&mut self) -> Result<&mut HostSwapPool> {
        self.swap
            .as_mut()
            .ok_or_else(|| Error::InvalidState("no swap space: call alloc_cache first".into()))
    }
}

impl AttentionBackend for CudaBackend<'_> {
    type Tensor = DeviceTensor;

    fn name(&self) -> String {
        format!("cuda:{}", self.gpu.device_name())
    }

    fn config(&self) -> &BackendConfig {
        &self.core.config
    }

    fn upload(&mut self, t: &HostTensor) -> Result<DeviceTensor> {
        DeviceTensor::from_host(self.gpu, t)
    }

    fn download(&mut self, t: &DeviceTensor) -> Result<HostTensor> {
        t.to_host(self.gpu)
    }

    fn alloc_cache(&mut self) -> Result<PagedCache> {
        let c = self.core.config;
        let dtype = c.shape.kv_dtype;
        let shape = [crate::ops::checked_pool_elems(&c.layout())? as usize];
        // NaN in chunks of up to 1 MiB: one upload, then device-to-device copies.
        let nan = HostTensor::full(dtype, &[shape[0].min((1 << 20) / dtype.size())], f64::NAN);
        let pool = || -> Result<DeviceTensor> {
            let mut t = DeviceTensor::zeros(self.gpu, dtype, &shape)?;
            t.fill_repeat(self.gpu, nan.buf().as_bytes())?;
            Ok(t)
        };
        let layers = (0..c.num_layers)
            .map(|_| {
                Ok(LayerCache {
                    key: pool()?,
                    value: pool()?,
                    kv_scales: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let bb = usize::try_from(c.block_bytes()?)
            .map_err(|_| Error::invalid("shape", "block too large"))?;
        self.swap = Some(self.gpu.alloc_swap_pool(
            c.num_host_blocks.max(1) as usize,
            2 * c.num_layers,
            bb,
        )?);
        Ok(PagedCache {
            layout: c.layout(),
            layers,
        })
    }

    fn plan(&mut self, batch: &Batch) -> Result<Planned> {
        self.core.plan_batch(batch)
    }

    fn kv_append(&mut self, args: KvAppendArgs<'_, DeviceTensor>) -> Result<()> {
        self.core.kv_append(args)
    }

    fn decode(&mut self, args: DecodeArgs<'_, DeviceTensor>) -> Result<()> {
        self.core.decode(args)
    }

    fn prefill(&mut self, args: PrefillArgs<'_, DeviceTensor>) -> Result<()> {
        self.core.prefill(args)
    }

    fn merge_states(&mut self, io: crate::step::MergeIo<'_>) -> Result<()> {
        self.core.merge_states(io)
    }

    fn copy_blocks(&mut self, cache: &mut PagedCache, pairs: &[(u32, u32)]) -> Result<()> {
        self.core.check_cache(cache)?;
        if pairs.is_empty() {
            return Ok(());
        }
        let bb = self.core.config.block_bytes()?;
        let mut pools: Vec<&mut DeviceTensor> = cache.pools_mut().collect();
        self.gpu.copy_blocks(&mut pools, bb, pairs)
    }

    fn swap_out(&mut self, cache: &PagedCache, pairs: &[(u32, u32)]) -> Result<()> {
        self.core.check_cache(cache)?;
        let c = self.core.config;
        check_pairs("swap_out", pairs, c.shape.num_blocks, c.num_host_blocks)?;
        if pairs.is_empty() {
            return Ok(());
        }
        let bb = c.block_bytes()?;
        let gpu = self.gpu;
        let pools: Vec<&DeviceTensor> = cache.pools().collect();
        gpu.swap_out(&pools, bb, pairs, self.swap_pool()?)
    }

    fn swap_in(&mut self, cache: &mut PagedCache, pairs: &[(u32, u32)]) -> Result<()> {
        self.core.check_cache(cache)?;
        let c = self.core.config;
        check_pairs("swap_in", pairs, c.num_host_blocks, c.shape.num_blocks)?;
        if pairs.is_empty() {
            return Ok(());
        }
        let bb = c.block_bytes()?;
        let gpu = self.gpu;
        let mut pools: Vec<&mut DeviceTensor> = cache.pools_mut().collect();
        gpu.swap_in(&mut pools, bb, pairs, self.swap_pool()?)
    }

    fn synchronize(&mut self) -> Result<()> {
        self.gpu.synchronize()
    }

    fn read_blocks(&mut self, cache: &PagedCache, blocks: &[u32], out: &mut Vec<u8>) -> Result<()> {
        self.core.check_cache(cache)?;
        let c = self.core.config;
        let per_block = crate::backend::check_transfer("read_blocks", blocks, &c, None)?;
        let at = out.len();
        let total = crate::backend::reserve_transfer(out, blocks.len(), per_block)?;
        out.resize(at + total, 0);
        let pools: Vec<&DeviceTensor> = cache.pools().collect();
        let gpu = self.gpu;
        let r = gpu.read_blocks(&pools, c.block_bytes()?, blocks, &mut out[at..]);
        if r.is_err() {
            out.truncate(at);
        }
        r
    }

    fn write_blocks(&mut self, cache: &mut PagedCache, blocks: &[u32], data: &[u8]) -> Result<()> {
        self.core.check_cache(cache)?;
        let c = self.core.config;
        crate::backend::check_transfer("write_blocks", blocks, &c, Some(data.len()))?;
        let mut pools: Vec<&mut DeviceTensor> = cache.pools_mut().collect();
        let gpu = self.gpu;
        gpu.write_blocks(&mut pools, c.block_bytes()?, blocks, data)
    }
}
