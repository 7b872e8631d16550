//! [`CpuBackend`]: the [`AttentionBackend`] whose kernels run in the SIMT emulator on
//! host tensors: the real kernel bodies, with no GPU.

use super::{
    AppendArgs, AttentionBackend, BackendConfig, DecodeArgs, PagedCache, PrefillArgs, StepCore,
    check_pairs,
};
use crate::buffer::AlignedBuf;
use crate::emulator::Emulator;
use crate::error::{Error, Result};
use crate::ops::copy_blocks::copy_blocks_emulated;
use crate::scheduler::Batch;
use crate::step::{EmuDevice, Planned};
use crate::tensor::HostTensor;

/// The CPU backend: the step path over an [`EmuDevice`], the cache in [`HostTensor`]s,
/// swap space in host memory. Never splits decode launches unless its config asks
/// ([`SplitPolicy::ForSms`](super::SplitPolicy::ForSms)).
#[derive(Debug)]
pub struct CpuBackend {
    core: StepCore<EmuDevice>,
    /// `[num_host_blocks, num_pools, block_bytes]`.
    swap: Vec<u8>,
}

impl CpuBackend {
    /// A backend for `config` with a default [`Emulator`].
    pub fn new(config: BackendConfig) -> Result<Self> {
        Self::with_emulator(config, Emulator::new())
    }

    /// A backend for `config` whose kernels run in `emu` (its math mode, workers).
    pub fn with_emulator(config: BackendConfig, emu: Emulator) -> Result<Self> {
        Ok(Self {
            core: StepCore::new(EmuDevice::new(emu), config, None)?,
            swap: Vec::new(),
        })
    }

    fn emulator(&self) -> &Emulator {
        self.core.runner.device().emulator()
    }

    /// Bytes of one host swap block (every pool's block) and of one pool's block.
    fn swap_geometry(&self) -> Result<(usize, usize)> {
        let bb = self.core.config.block_bytes()? as usize;
        let pools = 2 * self.core.config.num_layers;
        Ok((bb * pools, bb))
    }
}

impl AttentionBackend for CpuBackend {
    type Tensor = HostTensor;

    fn name(&self) -> String {
        "cpu-emulator".into()
    }

    fn config(&self) -> &BackendConfig {
        &self.core.config
    }

    fn upload(&mut self, t: &HostTensor) -> Result<HostTensor> {
        Ok(t.clone())
    }

    fn download(&mut self, t: &HostTensor) -> Result<HostTensor> {
        Ok(t.clone())
    }

    fn alloc_cache(&mut self) -> Result<PagedCache<HostTensor>> {
        let c = self.core.config;
        let elems = crate::ops::checked_pool_elems(&c.layout())?;
        let shape = [usize::try_from(elems).map_err(|_| Error::invalid("shape", "too large"))?];
        let layers = (0..c.num_layers)
            .map(|_| {
                Ok(super::LayerCache {
                    key: HostTensor::try_full(c.shape.dtype, &shape, f64::NAN)?,
                    value: HostTensor::try_full(c.shape.dtype, &shape, f64::NAN)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (per_block, _) = self.swap_geometry()?;
        let bytes = per_block
            .checked_mul(c.num_host_blocks as usize)
            .ok_or_else(|| Error::invalid("num_host_blocks", "swap space overflows"))?;
        self.swap = vec![0u8; bytes];
        Ok(PagedCache {
            layout: c.layout(),
            layers,
        })
    }

    fn plan(&mut self, batch: &Batch) -> Result<Planned> {
        self.core.plan_batch(batch)
    }

    fn kv_append(&mut self, args: AppendArgs<'_, HostTensor>) -> Result<()> {
        self.core.kv_append(args)
    }

    fn decode(&mut self, args: DecodeArgs<'_, HostTensor>) -> Result<()> {
        self.core.decode(args)
    }

    fn prefill(&mut self, args: PrefillArgs<'_, HostTensor>) -> Result<()> {
        self.core.prefill(args)
    }

    fn copy_blocks(
        &mut self,
        cache: &mut PagedCache<HostTensor>,
        pairs: &[(u32, u32)],
    ) -> Result<()> {
        self.core.check_cache(cache)?;
        if pairs.is_empty() {
            return Ok(());
        }
        let bb = self.core.config.block_bytes()?;
        // The kernel takes the pools as one slice: move the buffers out and back.
        let mut pools: Vec<AlignedBuf> = cache
            .pools_mut()
            .map(|t| std::mem::replace(t.buf_mut(), AlignedBuf::zeroed(0)))
            .collect();
        let r = copy_blocks_emulated(self.emulator(), &mut pools, bb, pairs);
        for (t, b) in cache.pools_mut().zip(pools) {
            *t.buf_mut() = b;
        }
        r
    }

    fn swap_out(&mut self, cache: &PagedCache<HostTensor>, pairs: &[(u32, u32)]) -> Result<()> {
        self.core.check_cache(cache)?;
        let c = &self.core.config;
        check_pairs("swap_out", pairs, c.shape.num_blocks, c.num_host_blocks)?;
        let (per_block, bb) = self.swap_geometry()?;
        for (p, pool) in cache.pools().enumerate() {
            let src = pool.buf().as_bytes();
            for &(d, h) in pairs {
                let at = h as usize * per_block + p * bb;
                self.swap[at..at + bb].copy_from_slice(&src[d as usize * bb..][..bb]);
            }
        }
        Ok(())
    }

    fn swap_in(&mut self, cache: &mut PagedCache<HostTensor>, pairs: &[(u32, u32)]) -> Result<()> {
        self.core.check_cache(cache)?;
        let c = &self.core.config;
        check_pairs("swap_in", pairs, c.num_host_blocks, c.shape.num_blocks)?;
        let (per_block, bb) = self.swap_geometry()?;
        for (p, pool) in cache.pools_mut().enumerate() {
            let dst = pool.buf_mut().as_bytes_mut();
            for &(h, d) in pairs {
                let at = h as usize * per_block + p * bb;
                dst[d as usize * bb..][..bb].copy_from_slice(&self.swap[at..at + bb]);
            }
        }
        Ok(())
    }

    fn synchronize(&mut self) -> Result<()> {
        Ok(())
    }
}
