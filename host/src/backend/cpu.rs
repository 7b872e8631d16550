//! [`CpuBackend`]: the [`AttentionBackend`] whose kernels run in the SIMT emulator on
//! host tensors: the real kernel bodies, with no GPU. Over another device whose memory
//! is host memory ([`CpuBackend::with_device`], e.g. the PTX interpreter), the same
//! backend runs the committed PTX instead.

use super::{
    AttentionBackend, BackendConfig, DecodeArgs, KvAppendArgs, PagedCache, PrefillArgs, StepCore,
    check_pairs,
};
use crate::buffer::AlignedBuf;
use crate::emulator::Emulator;
use crate::error::{Error, Result};
use crate::scheduler::Batch;
use crate::step::{EmuDevice, Planned, Space, StepDevice};
use crate::tensor::HostTensor;

/// The CPU backend: the step path over an [`EmuDevice`] (or another host-memory
/// device `D`), the cache in [`HostTensor`]s, swap space in host memory. Never splits
/// decode launches unless its config asks
/// ([`SplitPolicy::ForSms`](super::SplitPolicy::ForSms)).
#[derive(Debug)]
pub struct CpuBackend<D: StepDevice = EmuDevice> {
    core: StepCore<D>,
    /// `[num_host_blocks, num_pools, block_bytes]`.
    swap: Vec<u8>,
    name: String,
}

impl CpuBackend {
    /// A backend for `config` with a default [`Emulator`].
    pub fn new(config: BackendConfig) -> Result<Self> {
        Self::with_emulator(config, Emulator::new())
    }

    /// A backend for `config` whose kernels run in `emu` (its math mode, workers).
    pub fn with_emulator(config: BackendConfig, emu: Emulator) -> Result<Self> {
        let mut be = CpuBackend::with_device(config, EmuDevice::new(emu))?;
        be.name = "cpu-emulator".into();
        Ok(be)
    }
}

impl<D: StepDevice> CpuBackend<D> {
    /// A backend for `config` over `device`, whose memory must be host memory
    /// ([`Space::Host`]: the cache is [`HostTensor`]s). Its name is `cpu (D)`.
    pub fn with_device(config: BackendConfig, device: D) -> Result<Self> {
        if device.space() != Space::Host {
            return Err(Error::invalid(
                "device",
                format!("{:?} memory is not host memory", device.space()),
            ));
        }
        let ty = std::any::type_name::<D>();
        Ok(Self {
            core: StepCore::new(device, config, None)?,
            swap: Vec::new(),
            name: format!("cpu ({})", ty.rsplit("::").next().unwrap_or(ty)),
        })
    }

    /// Bytes of one host swap block (every pool's block) and of one pool's block.
    fn swap_geometry(&self) -> Result<(usize, usize)> {
        let bb = usize::try_from(self.core.config.block_bytes()?)
            .map_err(|_| Error::invalid("shape", "block size in bytes overflows"))?;
        Ok((super::block_transfer_bytes(&self.core.config)?, bb))
    }
}

impl<D: StepDevice> AttentionBackend for CpuBackend<D> {
    type Tensor = HostTensor;

    fn name(&self) -> String {
        self.name.clone()
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
                    key: HostTensor::try_full(c.shape.kv_dtype, &shape, f64::NAN)?,
                    value: HostTensor::try_full(c.shape.kv_dtype, &shape, f64::NAN)?,
                    kv_scales: None,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let (per_block, _) = self.swap_geometry()?;
        let bytes = per_block
            .checked_mul(c.num_host_blocks as usize)
            .ok_or_else(|| Error::invalid("num_host_blocks", "swap space overflows"))?;
        let mut swap = Vec::new();
        swap.try_reserve_exact(bytes).map_err(|_| {
            Error::invalid(
                "num_host_blocks",
                format!(
                    "{} blocks of swap space ({bytes} bytes) could not be allocated",
                    c.num_host_blocks
                ),
            )
        })?;
        swap.resize(bytes, 0);
        self.swap = swap;
        Ok(PagedCache {
            layout: c.layout(),
            layers,
        })
    }

    fn plan(&mut self, batch: &Batch) -> Result<Planned> {
        self.core.plan_batch(batch)
    }

    fn kv_append(&mut self, args: KvAppendArgs<'_, HostTensor>) -> Result<()> {
        self.core.kv_append(args)
    }

    fn decode(&mut self, args: DecodeArgs<'_, HostTensor>) -> Result<()> {
        self.core.decode(args)
    }

    fn prefill(&mut self, args: PrefillArgs<'_, HostTensor>) -> Result<()> {
        self.core.prefill(args)
    }

    fn merge_states(&mut self, io: crate::step::MergeIo<'_>) -> Result<()> {
        self.core.merge_states(io)
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
        let r = crate::step::once::copy_blocks_in_host(
            self.core.runner.device_mut(),
            &mut pools,
            bb,
            pairs,
        );
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

    fn read_blocks(
        &mut self,
        cache: &PagedCache<HostTensor>,
        blocks: &[u32],
        out: &mut Vec<u8>,
    ) -> Result<()> {
        self.core.check_cache(cache)?;
        let (_, bb) = self.swap_geometry()?;
        let per_block = super::check_transfer("read_blocks", blocks, &self.core.config, None)?;
        super::reserve_transfer(out, blocks.len(), per_block)?;
        for &b in blocks {
            for pool in cache.pools() {
                out.extend_from_slice(&pool.buf().as_bytes()[b as usize * bb..][..bb]);
            }
        }
        Ok(())
    }

    fn write_blocks(
        &mut self,
        cache: &mut PagedCache<HostTensor>,
        blocks: &[u32],
        data: &[u8],
    ) -> Result<()> {
        self.core.check_cache(cache)?;
        let (_, bb) = self.swap_geometry()?;
        let per_block =
            super::check_transfer("write_blocks", blocks, &self.core.config, Some(data.len()))?;
        for (&b, src) in blocks.iter().zip(data.chunks_exact(per_block)) {
            for (pool, part) in cache.pools_mut().zip(src.chunks_exact(bb)) {
                pool.buf_mut().as_bytes_mut()[b as usize * bb..][..bb].copy_from_slice(part);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::{AsView, DecodeArgs, KvAppendArgs, decode_rows};
    use crate::ops::attention::AttentionOptions;
    use crate::scheduler::{Request, Scheduler, SchedulerConfig};
    use crate::step::{StepShape, TensorView, TensorViewMut};
    use crate::tensor::DType;

    /// The trait's view entry points (an engine's own buffers, no copy) write the same
    /// cache and decode the same outputs as its tensor entry points.
    #[test]
    fn views_match_tensors_through_the_trait() {
        let shape = StepShape {
            num_q_heads: 4,
            num_kv_heads: 2,
            head_dim: 64,
            block_size: 16,
            num_blocks: 16,
            dtype: DType::F32,
            kv_dtype: DType::F32,
        };
        let opts = AttentionOptions::new(64);
        let mut results = Vec::new();
        for by_view in [false, true] {
            let mut be = CpuBackend::new(BackendConfig::new(shape, 1, 4, 4)).unwrap();
            let mut cache = be.alloc_cache().unwrap();
            let mut sched = Scheduler::new(SchedulerConfig {
                num_blocks: 16,
                block_size: 16,
                max_model_len: 64,
                ..SchedulerConfig::default()
            })
            .unwrap();
            sched
                .add_request(Request::new(1, vec![1, 2, 3], 3))
                .unwrap();
            sched.add_request(Request::new(2, vec![4; 20], 3)).unwrap();
            let mut outs = Vec::new();
            let mut step = 0.0;
            while !sched.is_idle() {
                step += 1.0;
                let batch = sched.step().unwrap().clone();
                be.begin_step(&batch, &mut cache).unwrap();
                let n = batch.slot_mapping.len();
                let rows = decode_rows(&batch).count();
                let vals = |len: usize, f: f64| {
                    let v: Vec<f64> = (0..len).map(|i| ((i % 29) as f64 - 14.0) * f).collect();
                    HostTensor::from_f64(DType::F32, &[len], &v).unwrap()
                };
                let (k, v) = (vals(n * 128, 0.01 * step), vals(n * 128, 0.02));
                let q = vals(rows * 256, 0.03);
                let mut out = HostTensor::full(DType::F32, &[rows * 256], f64::NAN);
                let layer = &mut cache.layers[0];
                if by_view {
                    let f = |t: &HostTensor| -> Vec<f32> {
                        t.to_f64().iter().map(|&x| x as f32).collect()
                    };
                    let (kf, vf) = (f(&k), f(&v));
                    be.kv_append(KvAppendArgs {
                        key: TensorView::from_slice(&kf),
                        value: TensorView::from_slice(&vf),
                        cache: layer,
                        group: 0,
                    })
                    .unwrap();
                    let bytes = out.buf_mut().as_bytes_mut();
                    let qb = q.buf().as_bytes();
                    be.decode(DecodeArgs {
                        lse: None,
                        opts: &opts,
                        q: TensorView::from_host_bytes(qb, DType::F32).unwrap(),
                        cache: &cache.layers[0],
                        sinks: None,
                        out: TensorViewMut::from_host_bytes_mut(bytes, DType::F32).unwrap(),
                        group: 0,
                    })
                    .unwrap();
                } else {
                    be.kv_append(KvAppendArgs {
                        key: k.view(),
                        value: v.view(),
                        cache: layer,
                        group: 0,
                    })
                    .unwrap();
                    be.decode(DecodeArgs {
                        lse: None,
                        opts: &opts,
                        q: q.view(),
                        cache: &cache.layers[0],
                        sinks: None,
                        out: out.view_mut(),
                        group: 0,
                    })
                    .unwrap();
                }
                outs.extend(out.to_f64().iter().map(|x| x.to_bits()));
                let sampled: Vec<_> = batch.seqs.iter().map(|s| (s.seq, 5)).collect();
                sched.on_step_done(&sampled).unwrap();
            }
            assert!(!outs.is_empty());
            results.push(outs);
        }
        assert_eq!(results[0], results[1]);
    }

    /// `decode_rows` and `prefill_rows` read `num_decodes` (the scheduler lists the
    /// decodes first): a batch where that does not hold is refused at plan, not run
    /// with prefill rows read as decodes.
    #[test]
    fn a_batch_whose_decodes_are_not_its_first_rows_is_refused() {
        let shape = StepShape {
            num_q_heads: 2,
            num_kv_heads: 2,
            head_dim: 64,
            block_size: 16,
            num_blocks: 8,
            dtype: DType::F32,
            kv_dtype: DType::F32,
        };
        let mut be = CpuBackend::new(BackendConfig::new(shape, 1, 2, 2)).unwrap();
        let mut cache = be.alloc_cache().unwrap();
        let mut sched = Scheduler::new(SchedulerConfig {
            num_blocks: 8,
            block_size: 16,
            max_model_len: 32,
            ..SchedulerConfig::default()
        })
        .unwrap();
        sched
            .add_request(Request::new(1, vec![1, 2, 3], 3))
            .unwrap();
        let mut batch = sched.step().unwrap().clone();
        assert_eq!((batch.num_decodes, batch.seqs.len()), (0, 1));
        be.begin_step(&batch, &mut cache).unwrap();
        batch.num_decodes = 1; // the prefill row claimed as a decode
        let e = be.plan(&batch).unwrap_err();
        assert!(
            matches!(e, Error::InvalidArgument { arg: "batch", .. }),
            "{e:?}"
        );
    }
}
