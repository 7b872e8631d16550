//! [`StepCore`]: what every [`AttentionBackend`](super::AttentionBackend) shares: a
//! [`StepRunner`] over the backend's [`StepDevice`], the batch-to-metadata step, and
//! the per-layer calls on views of the backend's tensors.

use super::{
    BackendConfig, DecodeArgs, KvAppendArgs, LayerCache, PagedCache, PrefillArgs, SplitPolicy,
};
use crate::error::{Error, Result};
use crate::ops::attention::SplitTarget;
use crate::ops::cascade::{CascadePolicy, find_groups, pays};
use crate::scheduler::Batch;
use crate::step::{
    DecodeIo, KvAppendIo, Planned, PrefillIo, PrefillMeta, StepDevice, StepMeta, StepRunner,
    TensorView, TensorViewMut,
};
use crate::tensor::{HostTensor, TensorDesc};

/// A tensor the runs can view: [`HostTensor`]s on the emulator, `DeviceTensor`s on a
/// GPU. Every backend's [`Tensor`](super::AttentionBackend::Tensor) is one, so a layer
/// loop generic over the backend passes `q.view()` and `out.view_mut()`.
pub trait AsView {
    /// A read-only view of the whole tensor, for as long as it is borrowed.
    fn view(&self) -> TensorView<'_>;
    /// A writable view of the whole tensor, for as long as it is borrowed mutably.
    fn view_mut(&mut self) -> TensorViewMut<'_>;
}

impl AsView for HostTensor {
    fn view(&self) -> TensorView<'_> {
        TensorView::of_host(self)
    }
    fn view_mut(&mut self) -> TensorViewMut<'_> {
        TensorViewMut::of_host(self)
    }
}

/// The step runner of a backend, and the buffers that turn a [`Batch`] into the
/// runner's [`StepMeta`] without allocating once they have grown.
#[derive(Debug)]
pub(crate) struct StepCore<D: StepDevice> {
    pub(crate) runner: StepRunner<D>,
    pub(crate) config: BackendConfig,
    /// The decoding rows' block tables (per layer group) and context lengths.
    tables: Vec<Vec<i32>>,
    lens: Vec<i32>,
    /// The prefilling rows' block tables (per layer group), query offsets and context
    /// lengths.
    ptables: Vec<Vec<i32>>,
    pindptr: Vec<i32>,
    plens: Vec<i32>,
}

impl<D: StepDevice> StepCore<D> {
    /// A core on `dev`, whose GPU is `gpu` (`None`: a CPU, which never splits unless
    /// the config asks).
    pub(crate) fn new(dev: D, config: BackendConfig, gpu: Option<SplitTarget>) -> Result<Self> {
        config.check()?;
        let sms = match (config.split, gpu) {
            (SplitPolicy::Never, _) | (SplitPolicy::Auto, None) => None,
            (SplitPolicy::Auto, Some(t)) => Some(t),
            (SplitPolicy::ForSms(n), _) => Some(SplitTarget::conservative(n)),
        };
        let mut runner = StepRunner::with_split(dev, config.shape, config.capacity, sms)?;
        runner.set_groups(config.num_groups)?;
        if config.cascade != CascadePolicy::Off && config.num_groups == 1 {
            runner.enable_cascade()?;
        }
        let cap = &config.capacity;
        let table = || Vec::with_capacity(cap.max_seqs as usize * cap.max_blocks_per_seq as usize);
        Ok(Self {
            runner,
            config,
            tables: (0..config.num_groups).map(|_| table()).collect(),
            lens: Vec::with_capacity(cap.max_seqs as usize),
            ptables: (0..config.num_groups).map(|_| table()).collect(),
            pindptr: Vec::with_capacity(cap.max_seqs as usize + 1),
            plens: Vec::with_capacity(cap.max_seqs as usize),
        })
    }

    /// Plans the step of `batch`: the decoding rows' tables and lengths, every new
    /// token's slot.
    pub(crate) fn plan_batch(&mut self, batch: &Batch) -> Result<Planned> {
        super::check_block_size(batch, &self.config)?;
        let w = batch.max_blocks_per_seq as usize;
        let rows = batch.seqs.len();
        if batch.context_lens.len() != rows || batch.block_tables.len() != rows * w {
            return Err(Error::invalid(
                "batch",
                format!(
                    "{} context lengths and {} table entries for {rows} sequences of {w} blocks",
                    batch.context_lens.len(),
                    batch.block_tables.len()
                ),
            ));
        }
        super::check_rows(batch)?;
        let groups = batch.num_groups();
        if groups != self.config.num_groups {
            return Err(Error::invalid(
                "batch",
                format!(
                    "has {groups} layer groups, the backend was made for {} (BackendConfig::num_groups)",
                    self.config.num_groups
                ),
            ));
        }
        let view = |g: usize| batch.group(g).expect("g < num_groups");
        if (1..groups).any(|g| {
            view(g).block_tables.len() != rows * w
                || view(g).slot_mapping.len() != batch.slot_mapping.len()
        }) {
            return Err(Error::invalid(
                "batch",
                "a layer group's tables or slots do not match the batch's rows and tokens",
            ));
        }
        // The decodes are the leading rows: their tables and lengths in one copy each.
        let nd = super::decode_rows(batch).end;
        for (g, t) in self.tables.iter_mut().enumerate() {
            t.clear();
            t.extend_from_slice(&view(g).block_tables[..nd * w]);
        }
        self.lens.clear();
        self.lens.extend_from_slice(&batch.context_lens[..nd]);
        let width = if self.lens.is_empty() { 0 } else { w as u32 };
        let meta = |g: usize| StepMeta {
            block_tables: &self.tables[g],
            max_blocks_per_seq: width,
            context_lens: &self.lens,
            slot_mapping: view(g).slot_mapping,
            window: view(g).sliding_window,
        };
        // (One group, the common model: no list of metas to allocate.)
        let mut planned = if groups == 1 {
            self.runner.plan(&meta(0))
        } else {
            let metas: Vec<StepMeta<'_>> = (0..groups).map(meta).collect();
            self.runner.plan_groups(&metas)
        }
        .copied()?;
        // Cascade attention over the prefixes the decodes share, where the policy
        // wants it (one layer group, no window: see `ops::cascade`).
        if groups == 1 && !self.lens.is_empty() && view(0).sliding_window.is_none() {
            let sh = &self.config.shape;
            let min = match self.config.cascade {
                CascadePolicy::Off => None,
                CascadePolicy::Always { min_shared_blocks } => Some(min_shared_blocks),
                CascadePolicy::Auto => Some(1),
            };
            if let Some(min) = min {
                let found = find_groups(&self.tables[0], width, &self.lens, sh.block_size, min);
                let dims = (nd as u32, sh.num_q_heads, sh.num_kv_heads, sh.head_dim);
                let take = match self.config.cascade {
                    CascadePolicy::Auto => pays(&found, dims, sh.block_size, sh.kv_dtype),
                    _ => true,
                };
                if take {
                    planned.cascade = self.runner.plan_cascade(&meta(0), &found)?;
                }
            }
        }
        // The prefilling rows: one prefill launch over their new tokens.
        for t in &mut self.ptables {
            t.clear();
        }
        self.plens.clear();
        self.pindptr.clear();
        self.pindptr.push(0);
        for i in super::prefill_rows(batch) {
            let sq = &batch.seqs[i];
            for (g, t) in self.ptables.iter_mut().enumerate() {
                t.extend_from_slice(&view(g).block_tables[i * w..(i + 1) * w]);
            }
            self.plens.push(batch.context_lens[i]);
            let end = self.pindptr[self.pindptr.len() - 1] + sq.num_new_tokens as i32;
            self.pindptr.push(end);
        }
        // A tree mask: the prefill rows' tokens' words (they follow the decodes').
        let tree =
            if batch.tree_mask.is_empty() {
                None
            } else if batch.tree_mask.len() != batch.slot_mapping.len() {
                return Err(Error::invalid(
                    "tree_mask",
                    format!(
                        "{} words for the batch's {} new tokens (one each, or none)",
                        batch.tree_mask.len(),
                        batch.slot_mapping.len()
                    ),
                ));
            } else {
                // The decodes take one token each: the prefill rows' tokens follow.
                Some(batch.tree_mask.get(nd..).ok_or_else(|| {
                    Error::invalid("tree_mask", "shorter than the batch's decodes")
                })?)
            };
        if !self.plens.is_empty() {
            let pmeta = |g: usize| PrefillMeta {
                block_tables: &self.ptables[g],
                max_blocks_per_seq: w as u32,
                qo_indptr: &self.pindptr,
                context_lens: &self.plens,
                window: view(g).sliding_window,
                tree_mask: tree,
            };
            planned.prefill = Some(if groups == 1 {
                self.runner.plan_prefill(&pmeta(0))?
            } else {
                let pmetas: Vec<PrefillMeta<'_>> = (0..groups).map(pmeta).collect();
                self.runner.plan_prefill_groups(&pmetas)?
            });
        }
        Ok(planned)
    }

    pub(crate) fn prefill<T: AsView>(&mut self, args: PrefillArgs<'_, T>) -> Result<()> {
        self.sync_slopes(args.opts)?;
        self.runner.prefill(
            args.opts,
            PrefillIo {
                q: args.q,
                key_cache: args.cache.key.view(),
                value_cache: args.cache.value.view(),
                kv_scales: args.cache.kv_scales.as_ref().map(|s| s.view()),
                sinks: args.sinks,
                group: args.group,
                out: args.out,
                lse: args.lse,
            },
        )
    }

    pub(crate) fn merge_states(&self, io: crate::step::MergeIo<'_>) -> Result<()> {
        self.runner.merge(io)
    }

    /// Uploads `opts`' ALiBi slopes when they differ from the runner's (once, in the
    /// first layer of the first step that uses them).
    fn sync_slopes(&mut self, opts: &crate::ops::attention::AttentionOptions) -> Result<()> {
        if self.runner.alibi_slopes() != opts.alibi_slopes.as_deref() {
            self.runner.set_alibi_slopes(opts.alibi_slopes.as_deref())?;
        }
        Ok(())
    }

    /// `cache` is one `alloc_cache` made for this config: its fields are public, so a
    /// pool may have been replaced by one of another size or dtype.
    pub(crate) fn check_cache<T: TensorDesc>(&self, cache: &PagedCache<T>) -> Result<()> {
        let c = &self.config;
        let elems = crate::ops::checked_pool_elems(&c.layout())?;
        let ok = cache.layout == c.layout()
            && cache.layers.len() == c.num_layers
            && cache
                .pools()
                .all(|t| t.dtype() == c.shape.kv_dtype && t.len() as u64 == elems);
        if !ok {
            return Err(Error::invalid(
                "cache",
                "not a cache of this backend's layout, dtype and layers",
            ));
        }
        Ok(())
    }

    pub(crate) fn kv_append<T: AsView>(&self, args: KvAppendArgs<'_, T>) -> Result<()> {
        let LayerCache {
            key,
            value,
            kv_scales,
        } = args.cache;
        self.runner.kv_append(KvAppendIo {
            key: args.key,
            value: args.value,
            key_cache: key.view_mut(),
            value_cache: value.view_mut(),
            kv_scales: kv_scales.as_ref().map(|s| s.view()),
            group: args.group,
        })
    }

    pub(crate) fn decode<T: AsView>(&mut self, args: DecodeArgs<'_, T>) -> Result<()> {
        self.sync_slopes(args.opts)?;
        self.runner.decode(
            args.opts,
            DecodeIo {
                q: args.q,
                key_cache: args.cache.key.view(),
                value_cache: args.cache.value.view(),
                kv_scales: args.cache.kv_scales.as_ref().map(|s| s.view()),
                sinks: args.sinks,
                group: args.group,
                out: args.out,
                lse: args.lse,
            },
        )?;
        Ok(())
    }
}
