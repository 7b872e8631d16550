//! # One engine-facing API for every backend: [`AttentionBackend`]
//!
//! An engine's layer loop is the same whether the kernels run on a GPU or in the CPU
//! emulator: allocate the paged cache once, then every step
//!
//! 1. hand the scheduler's [`Batch`] to [`begin_step`](AttentionBackend::begin_step):
//!    the backend runs the batch's swaps and copy-on-write copies on the cache, checks
//!    the batch's metadata once (block ids inside the pool, lengths, slots), plans the
//!    decode launch and uploads the metadata;
//! 2. per layer, [`kv_append`](AttentionBackend::kv_append) the new tokens' K and V
//!    into the layer's cache and run [`decode`](AttentionBackend::decode) attention
//!    for the decoding sequences: launches only, nothing allocated or uploaded.
//!
//! Two backends implement it: [`CpuBackend`] (the real kernel bodies in the SIMT
//! emulator, on [`HostTensor`]s) and [`crate::cuda::CudaBackend`] (a GPU, on
//! [`DeviceTensor`](crate::cuda::DeviceTensor)s). Both are the step path of
//! [`crate::step`] over a different [`StepDevice`](crate::step::StepDevice), so what
//! the emulator proves is the code a GPU runs. A test body written once over
//! `B: AttentionBackend` runs on both (see `tests/serving/backend.rs`).
//!
//! ## Which rows decode
//! A batch mixes prefills and decodes. `kv_append` writes every new token of the batch
//! (`batch.slot_mapping`, sequence by sequence). `decode` computes one query per
//! *decoding* sequence: its `q` and `out` hold one row for each of the batch's first
//! [`num_decodes`](Batch::num_decodes) rows, in batch order ([`decode_rows`] lists
//! them). [`prefill`](AttentionBackend::prefill) computes the new tokens of every other
//! row ([`prefill_rows`]): prefills, prefill chunks and speculative decoding's verify
//! rows (a decode with draft tokens, `is_prefill` false), each token attending causally
//! to its sequence's cache (or through [`Batch::tree_mask`]) with the prefill kernels.
//!
//! ## Options
//! [`AttentionOptions`] are defined once for every backend (scale, sliding window,
//! soft-cap then ALiBi: see [`crate::ops::attention`]); a layer's attention sinks are
//! its own tensor ([`DecodeArgs::sinks`]).
//!
//! ## Models of several layer groups
//! A model that mixes sliding-window and full-attention layers (Gemma 2/3, gpt-oss)
//! is cut into [`LayerGroups`](crate::block::LayerGroups); the scheduler's
//! `kv_groups` are their specs, and [`BackendConfig::for_groups`] makes the backend:
//! a cache of `layers_per_group` K/V tensors that every group shares (block ids are
//! per group), and each batch's block tables and slot mapping per group
//! ([`Batch::group`]) planned once per step. Layer `l`'s calls pass
//! `cache.layers[groups.tensor_of(l)]` and `group: groups.group_of(l)`, and attend
//! with at most their group's window. The layers sharing a tensor share its fp8
//! scales.
//!
//! ```
//! use pagedkv_host::backend::{AsView, AttentionBackend, BackendConfig, CpuBackend, DecodeArgs,
//!                             KvAppendArgs};
//! use pagedkv_host::ops::attention::AttentionOptions;
//! use pagedkv_host::scheduler::{Request, Scheduler, SchedulerConfig};
//! use pagedkv_host::step::StepShape;
//! use pagedkv_host::{DType, HostTensor};
//!
//! let shape = StepShape { num_q_heads: 4, num_kv_heads: 2, head_dim: 64, block_size: 16,
//!                         num_blocks: 32, dtype: DType::F32, kv_dtype: DType::F32 };
//! let mut be = CpuBackend::new(BackendConfig::new(shape, 1, 4, 8))?;
//! let mut cache = be.alloc_cache()?;
//! let mut sched = Scheduler::new(SchedulerConfig { num_blocks: 32, block_size: 16,
//!     max_model_len: 128, ..SchedulerConfig::default() })?;
//! sched.add_request(Request::new(7, vec![1, 2, 3], 4))?;
//! let opts = AttentionOptions::new(64);
//! let mut decoded = 0;
//! while !sched.is_idle() {
//!     let batch = sched.step()?.clone();
//!     be.begin_step(&batch, &mut cache)?;
//!     let n = batch.slot_mapping.len();
//!     let k = be.upload(&HostTensor::full(DType::F32, &[n, 2, 64], 0.5))?;
//!     let v = be.upload(&HostTensor::full(DType::F32, &[n, 2, 64], 2.0))?;
//!     be.kv_append(KvAppendArgs { key: k.view(), value: v.view(), cache: &mut cache.layers[0],
//!                                 group: 0 })?;
//!     let rows = pagedkv_host::backend::decode_rows(&batch).count();
//!     if rows > 0 {
//!         let q = be.upload(&HostTensor::full(DType::F32, &[rows, 4, 64], 1.0))?;
//!         let mut out = be.upload(&HostTensor::full(DType::F32, &[rows, 4, 64], f64::NAN))?;
//!         be.decode(DecodeArgs { opts: &opts, q: q.view(), cache: &cache.layers[0],
//!                                sinks: None, group: 0, out: out.view_mut(), lse: None })?;
//!         // Every cached V is 2.0, so attention returns 2.0 whatever the scores.
//!         assert!(be.download(&out)?.to_f64().iter().all(|&x| (x - 2.0).abs() < 1e-6));
//!         decoded += rows;
//!     }
//!     let sampled: Vec<_> = batch.seqs.iter().map(|s| (s.seq, 9)).collect();
//!     sched.on_step_done(&sampled)?;
//! }
//! assert_eq!(decoded, 3); // 4 tokens: the first from the prefill, 3 decode steps
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```

mod cpu;
mod step_core;

pub use cpu::CpuBackend;

pub use step_core::AsView;
pub(crate) use step_core::StepCore;

use pagedkv_kernels::PagedLayout;

use crate::block::MAX_POOL_BLOCKS;
use crate::error::{Error, Result};
use crate::ops::attention::AttentionOptions;
use crate::ops::cascade::CascadePolicy;
use crate::ops::scales::{KvScales, check_cache_types};
use crate::scheduler::Batch;
use crate::step::{MergeIo, Planned, StepCapacity, StepShape, TensorView, TensorViewMut};
use crate::tensor::{DType, HostTensor, TensorDesc};

/// How a backend cuts a decode launch into split-K partitions.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum SplitPolicy {
    /// What suits the backend: a GPU plans for its SM count, the CPU never splits.
    #[default]
    Auto,
    /// Never split (one partition per sequence).
    Never,
    /// Plan as if for a GPU of this many SMs with sm_80's residency bounds
    /// ([`SplitTarget::conservative`](crate::ops::attention::SplitTarget::conservative)),
    /// on any backend: tests of split-K.
    ForSms(u32),
}

/// What a backend is made for: the model's attention shape, its layers, the most a
/// step may hold, and the host blocks for swapped-out sequences.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendConfig {
    /// Heads, head size, block size, pool size and dtype of every layer.
    pub shape: StepShape,
    /// Layers of the cache [`AttentionBackend::alloc_cache`] makes: the model's
    /// layers, or with layer groups the K/V tensors they share
    /// ([`LayerGroups::layers_per_group`](crate::block::LayerGroups::layers_per_group)).
    pub num_layers: usize,
    /// Layer groups of the model (1 for a model of one group): every batch carries
    /// this many ([`Batch::num_groups`]), and each layer's call names its group.
    pub num_groups: usize,
    /// The most one step holds (the step buffers are allocated for it once).
    pub capacity: StepCapacity,
    /// Host blocks for swapped-out sequences (the scheduler's `num_host_blocks`), at
    /// most [`MAX_POOL_BLOCKS`].
    pub num_host_blocks: u32,
    /// How decode launches split.
    pub split: SplitPolicy,
    /// Whether decode runs as cascade attention over the prefixes its rows share
    /// (see [`crate::ops::cascade`]; by default where its cost model says it pays).
    /// Models of several layer groups and sliding windows always attend flat.
    pub cascade: CascadePolicy,
}

impl BackendConfig {
    /// A config for `num_layers` layers of `shape`, steps of up to `max_seqs`
    /// sequences of up to `max_blocks_per_seq` blocks each, no swap space, the
    /// backend's own split policy. Room for `max_seqs * max_blocks_per_seq *
    /// block_size` new tokens per step (every sequence prefilling at once) and 64
    /// split-K partitions.
    pub fn new(
        shape: StepShape,
        num_layers: usize,
        max_seqs: u32,
        max_blocks_per_seq: u32,
    ) -> Self {
        let tokens = (max_seqs as u64)
            .saturating_mul(max_blocks_per_seq as u64)
            .saturating_mul(shape.block_size as u64)
            .min(u32::MAX as u64) as u32;
        Self {
            shape,
            num_layers,
            capacity: StepCapacity {
                max_seqs,
                max_blocks_per_seq,
                max_tokens: tokens,
                max_partitions: 64,
            },
            num_host_blocks: 0,
            split: SplitPolicy::Auto,
            num_groups: 1,
            cascade: CascadePolicy::Auto,
        }
    }

    /// [`new`](Self::new) for a model of layer groups: a cache of
    /// `groups.layers_per_group()` K/V tensors, shared by the groups (see
    /// [`crate::block::spec`]), and `groups.specs().len()` groups per batch.
    pub fn for_groups(
        shape: StepShape,
        groups: &crate::block::LayerGroups,
        max_seqs: u32,
        max_blocks_per_seq: u32,
    ) -> Self {
        Self {
            num_groups: groups.specs().len(),
            ..Self::new(
                shape,
                groups.layers_per_group(),
                max_seqs,
                max_blocks_per_seq,
            )
        }
    }

    /// The cache layout of one layer.
    pub fn layout(&self) -> PagedLayout {
        self.shape.layout()
    }

    /// Bytes of one block in one pool (`num_kv_heads * block_size * head_dim` elements).
    pub fn block_bytes(&self) -> Result<u64> {
        let l = self.layout();
        l.block_stride()
            .checked_mul(self.shape.kv_dtype.size() as u64)
            .ok_or_else(|| Error::invalid("shape", "block size in bytes overflows"))
    }

    pub(crate) fn check(&self) -> Result<()> {
        crate::ops::check_layout(&self.layout())?;
        if self.num_layers == 0 || self.num_layers > 1024 {
            return Err(Error::invalid(
                "num_layers",
                format!("{} (must be 1..=1024)", self.num_layers),
            ));
        }
        if self.num_groups == 0 || self.num_groups > crate::block::MAX_KV_GROUPS {
            return Err(Error::invalid(
                "num_groups",
                format!(
                    "{} (must be 1..={})",
                    self.num_groups,
                    crate::block::MAX_KV_GROUPS
                ),
            ));
        }
        // The pools a backend allocates, at most what a scheduler's may hold.
        for (arg, n) in [
            ("num_blocks", self.shape.num_blocks),
            ("num_host_blocks", self.num_host_blocks),
        ] {
            if n > MAX_POOL_BLOCKS {
                return Err(Error::invalid(
                    arg,
                    format!(
                        "{n} blocks: more than a pool may have ({MAX_POOL_BLOCKS}, MAX_POOL_BLOCKS)"
                    ),
                ));
            }
        }
        match self.cascade {
            CascadePolicy::Always {
                min_shared_blocks: 0,
            } => Err(Error::invalid(
                "cascade",
                "min_shared_blocks must be at least 1",
            )),
            CascadePolicy::Always { .. } if self.num_groups > 1 => Err(Error::invalid(
                "cascade",
                "not for a model of several layer groups (their windows release blocks)",
            )),
            _ => Ok(()),
        }
    }
}

/// One layer's K and V pools, each `[num_blocks, num_kv_heads, block_size, head_dim]`.
///
/// The fp8 scales are private: only [`AttentionBackend::set_kv_scales`], which
/// validates them, sets them (scales placed directly once reached `kv_append`
/// unchecked: NaN, 0, negative or infinite).
///
/// ```compile_fail
/// fn clear(l: &mut pagedkv_host::backend::LayerCache<pagedkv_host::HostTensor>) {
///     l.kv_scales = None; // private
/// }
/// ```
#[derive(Debug)]
pub struct LayerCache<T> {
    /// The key pool.
    pub key: T,
    /// The value pool.
    pub value: T,
    /// `[2, num_kv_heads]` f32, an fp8 cache's K then V scales (see
    /// [`crate::ops::scales::KvScales`]): `None` until
    /// [`AttentionBackend::set_kv_scales`] sets them, and always for other caches.
    pub(crate) kv_scales: Option<T>,
}

impl<T> LayerCache<T> {
    /// The layer's fp8 scales (`[2, num_kv_heads]` f32, K's then V's), as
    /// [`AttentionBackend::set_kv_scales`] set them; `None` before, and for other
    /// caches.
    pub fn kv_scales(&self) -> Option<&T> {
        self.kv_scales.as_ref()
    }
}

/// The paged cache of a model: every layer's K and V pools, one layout and dtype.
#[derive(Debug)]
pub struct PagedCache<T> {
    /// The layout shared by every pool.
    pub layout: PagedLayout,
    /// One entry per layer.
    pub layers: Vec<LayerCache<T>>,
}

impl<T> PagedCache<T> {
    /// Blocks of `layout` (its `num_blocks` ignored) that fit in `budget_bytes` for
    /// `num_layers` layers of K and V in `dtype`.
    pub fn blocks_for_budget(
        layout: &PagedLayout,
        dtype: DType,
        num_layers: usize,
        budget_bytes: u64,
    ) -> u32 {
        let per_block = layout
            .block_stride()
            .saturating_mul(dtype.size() as u64 * 2)
            .saturating_mul(num_layers as u64);
        (budget_bytes / per_block.max(1)).min(u32::MAX as u64) as u32
    }

    /// Every pool, K then V of each layer (the order swaps and copies walk).
    pub fn pools(&self) -> impl Iterator<Item = &T> {
        self.layers.iter().flat_map(|l| [&l.key, &l.value])
    }

    /// Every pool, mutably.
    pub fn pools_mut(&mut self) -> impl Iterator<Item = &mut T> {
        self.layers
            .iter_mut()
            .flat_map(|l| [&mut l.key, &mut l.value])
    }
}

/// The inputs of [`AttentionBackend::kv_append`]: this step's new tokens' K and V,
/// and the layer's cache they go into (at the slots of the step's batch). K and V are
/// views ([`AsView::view`] of the backend's tensors, or of an engine's own buffers:
/// `TensorView::from_slice`, `TensorView::of_cuda_slice`), so they reach the cache
/// with no copy; views of another memory space than the backend's are refused.
#[derive(Debug)]
pub struct KvAppendArgs<'a, T> {
    /// `[num_new_tokens, num_kv_heads, head_dim]`, in `batch.slot_mapping` order.
    pub key: TensorView<'a>,
    /// `[num_new_tokens, num_kv_heads, head_dim]`.
    pub value: TensorView<'a>,
    /// The layer's cache: `cache.layers[l]` for layer `l` of a model of one group,
    /// `cache.layers[groups.tensor_of(l)]` with layer groups
    /// ([`LayerGroups`](crate::block::LayerGroups)).
    pub cache: &'a mut LayerCache<T>,
    /// The layer's group (`groups.group_of(l)`; 0 for a model of one group): the
    /// batch's slot mapping of that group ([`Batch::group`]) places the tokens.
    pub group: usize,
}

/// The inputs of [`AttentionBackend::decode`] for one layer (q and out as views, see
/// [`KvAppendArgs`]; q and out may be row-strided: [`TensorView::with_row_stride`]).
#[derive(Debug)]
pub struct DecodeArgs<'a, T> {
    /// Scale, window, soft-cap, ALiBi (the same every layer, usually; a layer's
    /// attention sinks are its own tensor, `sinks`).
    pub opts: &'a AttentionOptions,
    /// `[num_decode_rows, num_q_heads, head_dim]`: one query per decoding sequence, in
    /// [`decode_rows`] order.
    pub q: TensorView<'a>,
    /// The layer's cache.
    pub cache: &'a LayerCache<T>,
    /// `[num_q_heads]` f32 on the backend's device: the layer's attention-sink logits
    /// (gpt-oss), or `None` (see [`DecodeIo::sinks`](crate::step::DecodeIo::sinks)).
    pub sinks: Option<TensorView<'a>>,
    /// The layer's group, as [`KvAppendArgs::group`]: attention goes through that
    /// group's block tables, within its window (`opts.window` at most the group's).
    pub group: usize,
    /// `[num_decode_rows, num_q_heads, head_dim]`: written.
    pub out: TensorViewMut<'a>,
    /// `[num_decode_rows, num_q_heads]` f32 on the backend's device: each output's
    /// log-sum-exp, base 2 (see [`DecodeIo::lse`](crate::step::DecodeIo::lse)), or
    /// `None` for none.
    pub lse: Option<TensorViewMut<'a>>,
}

/// The inputs of [`AttentionBackend::prefill`] for one layer (q and out as views, see
/// [`KvAppendArgs`]; dense).
#[derive(Debug)]
pub struct PrefillArgs<'a, T> {
    /// Scale, window, soft-cap, ALiBi (as for decode).
    pub opts: &'a AttentionOptions,
    /// `[num_prefill_tokens, num_q_heads, head_dim]`: the new tokens of the prefilling
    /// rows ([`prefill_rows`]), row after row, each row's tokens in order.
    pub q: TensorView<'a>,
    /// The layer's cache (this step's tokens appended first).
    pub cache: &'a LayerCache<T>,
    /// The layer's attention-sink logits, as [`DecodeArgs::sinks`].
    pub sinks: Option<TensorView<'a>>,
    /// The layer's group, as [`DecodeArgs::group`].
    pub group: usize,
    /// `[num_prefill_tokens, num_q_heads, head_dim]`: written.
    pub out: TensorViewMut<'a>,
    /// `[num_prefill_tokens, num_q_heads]` f32: each output's log-sum-exp, as
    /// [`DecodeArgs::lse`].
    pub lse: Option<TensorViewMut<'a>>,
}

/// The rows of `batch` that run through the prefill kernels (a prompt, a chunk of one,
/// or a verify row of draft tokens), in batch order: the rows after the decodes, `num_decodes..seqs.len()` (a backend's `plan` refuses a
/// batch where that does not hold). Their new tokens are the rows of
/// [`PrefillArgs::q`] and [`PrefillArgs::out`].
pub fn prefill_rows(batch: &Batch) -> std::ops::Range<usize> {
    decode_rows(batch).end..batch.seqs.len()
}

/// The rows of `batch` that decode (one query token each): the first
/// [`num_decodes`](Batch::num_decodes), as the scheduler lists them. They are the rows
/// of [`DecodeArgs::q`] and [`DecodeArgs::out`].
pub fn decode_rows(batch: &Batch) -> std::ops::Range<usize> {
    0..(batch.num_decodes as usize).min(batch.seqs.len())
}

/// `batch` was scheduled for blocks of the backend's size: its slots and tables name
/// token positions only in a pool of that block size (a scheduler of block 16 over a
/// cache of block 32 would write and attend other positions).
pub(crate) fn check_block_size(batch: &Batch, config: &BackendConfig) -> Result<()> {
    let bs = config.shape.block_size;
    if batch.block_size != bs {
        return Err(Error::invalid(
            "batch",
            format!(
                "scheduled for blocks of {} tokens, the backend's cache has blocks of {bs} \
                 (SchedulerConfig::block_size and StepShape::block_size must be equal)",
                batch.block_size
            ),
        ));
    }
    Ok(())
}

/// `batch` lists its decodes first and only there, as [`decode_rows`] and
/// [`prefill_rows`] read it (`Batch`'s fields are public: a batch an engine built or
/// edited may not).
pub(crate) fn check_rows(batch: &Batch) -> Result<()> {
    let nd = batch.num_decodes as usize;
    // (The rows after them are prefills and verify rows: a decode with draft tokens,
    // `is_prefill` false, through the prefill path.)
    let ok = nd <= batch.seqs.len()
        && batch.seqs[..nd]
            .iter()
            .all(|s| !s.is_prefill && s.num_new_tokens == 1 && s.num_draft_tokens == 0);
    if !ok {
        return Err(Error::invalid(
            "batch",
            format!(
                "num_decodes {nd} of {} rows: the decodes must be exactly the first num_decodes rows",
                batch.seqs.len()
            ),
        ));
    }
    Ok(())
}

/// A KV-cache and attention backend: the one API an engine's layer loop is written
/// against (see the [module docs](self)).
///
/// Per step: [`begin_step`](Self::begin_step) once, then per layer
/// [`kv_append`](Self::kv_append) and [`decode`](Self::decode). Tensors are the
/// backend's own ([`Self::Tensor`]); [`upload`](Self::upload) and
/// [`download`](Self::download) move them to and from the host.
pub trait AttentionBackend {
    /// The backend's tensor type (viewed for the runs: [`AsView`]).
    type Tensor: TensorDesc + AsView;

    /// A short name for reports (`"cpu-emulator"`, `"cuda:NVIDIA H200"`).
    fn name(&self) -> String;

    /// What the backend was made for.
    fn config(&self) -> &BackendConfig;

    /// A new tensor holding `t`'s elements.
    fn upload(&mut self, t: &crate::HostTensor) -> Result<Self::Tensor>;

    /// `t`'s elements on the host (waits for the work that writes it).
    fn download(&mut self, t: &Self::Tensor) -> Result<crate::HostTensor>;

    /// Allocates the paged cache, `config().num_layers` layers, every slot NaN (a
    /// kernel that read a slot nothing wrote would poison its output), and the swap
    /// space the config asks for.
    fn alloc_cache(&mut self) -> Result<PagedCache<Self::Tensor>>;

    /// Starts a step: runs `batch.swap_out`, then `batch.swap_in`, then
    /// `batch.copies` on `cache`, then [`plan`](Self::plan)s the step. Returns the plan.
    /// A batch scheduled for another block size than the backend's
    /// ([`Batch::block_size`]) is refused before any block moves.
    fn begin_step(
        &mut self,
        batch: &Batch,
        cache: &mut PagedCache<Self::Tensor>,
    ) -> Result<Planned> {
        check_block_size(batch, self.config())?;
        self.swap_out(cache, &batch.swap_out)?;
        self.swap_in(cache, &batch.swap_in)?;
        self.copy_blocks(cache, &batch.copies)?;
        self.plan(batch)
    }

    /// Checks the batch's metadata once (block ids inside the pool, lengths, slots
    /// inside the pool and distinct), plans the decode launch of its decoding rows and
    /// the prefill launch of its prefilling rows ([`Planned::prefill`]: the kernel and
    /// query tile it chose) and uploads the metadata ([`begin_step`](Self::begin_step)
    /// without the block moves).
    fn plan(&mut self, batch: &Batch) -> Result<Planned>;

    /// Sets layer `layer`'s fp8 scales (one K and one V scale per KV head, see
    /// [`KvScales`]): an fp8 cache is written as `encode(x / scale)` and read as
    /// `decode(b) * scale`. Every layer of an fp8 cache needs its scales before its
    /// first `kv_append`; other caches refuse them. Uploads `2 * num_kv_heads` floats
    /// (once per layer, not per step).
    fn set_kv_scales(
        &mut self,
        cache: &mut PagedCache<Self::Tensor>,
        layer: usize,
        scales: &KvScales,
    ) -> Result<()> {
        let s = self.config().shape;
        check_cache_types(s.dtype, s.kv_dtype, Some(scales), s.num_kv_heads)?;
        let n = cache.layers.len();
        let Some(l) = cache.layers.get_mut(layer) else {
            return Err(Error::invalid("layer", format!("{layer} of {n} layers")));
        };
        let both: Vec<f64> = scales
            .k
            .iter()
            .chain(&scales.v)
            .map(|&x| x as f64)
            .collect();
        let host = HostTensor::from_f64(DType::F32, &[2, s.num_kv_heads as usize], &both)?;
        l.kv_scales = Some(self.upload(&host)?);
        Ok(())
    }

    /// Writes this step's new tokens' K and V into one layer's cache: launches only.
    fn kv_append(&mut self, args: KvAppendArgs<'_, Self::Tensor>) -> Result<()>;

    /// Decode attention of the step's decoding sequences over one layer's cache:
    /// launches only (the ALiBi slopes are uploaded the first time they change).
    fn decode(&mut self, args: DecodeArgs<'_, Self::Tensor>) -> Result<()>;

    /// Prefill attention of the step's prefilling rows over one layer's cache: each
    /// new token attends causally to its sequence's cache up to itself (launches only).
    fn prefill(&mut self, args: PrefillArgs<'_, Self::Tensor>) -> Result<()>;

    /// Merges partial attention states of the config's query heads into one (see
    /// [`crate::ops::merge`]): partial outputs of the same queries over disjoint keys,
    /// with the log-sum-exp [`DecodeArgs::lse`] or [`PrefillArgs::lse`] wrote (one
    /// launch; needs no plan).
    fn merge_states(&mut self, io: MergeIo<'_>) -> Result<()>;

    /// Copies blocks `src -> dst` in every pool of `cache` (copy-on-write).
    fn copy_blocks(
        &mut self,
        cache: &mut PagedCache<Self::Tensor>,
        pairs: &[(u32, u32)],
    ) -> Result<()>;

    /// Copies `(device block, host block)` pairs of every pool to the swap space.
    fn swap_out(&mut self, cache: &PagedCache<Self::Tensor>, pairs: &[(u32, u32)]) -> Result<()>;

    /// Copies `(host block, device block)` pairs of every pool back from the swap space.
    fn swap_in(&mut self, cache: &mut PagedCache<Self::Tensor>, pairs: &[(u32, u32)])
    -> Result<()>;

    /// Waits for every launch and copy issued so far.
    fn synchronize(&mut self) -> Result<()>;

    /// Appends the bytes of `blocks` to `out`, block after block, each block's bytes
    /// of every pool in [`PagedCache::pools`] order (K then V of each layer): what a
    /// KV transfer exports ([`block_transfer_bytes`] a block). Waits for the work
    /// that writes the cache first, and for the copy. An id outside the pool is an
    /// error, nothing appended.
    fn read_blocks(
        &mut self,
        cache: &PagedCache<Self::Tensor>,
        blocks: &[u32],
        out: &mut Vec<u8>,
    ) -> Result<()>;

    /// Writes `data`, laid out as [`read_blocks`](Self::read_blocks) lays it out,
    /// into `blocks` of every pool (a KV transfer's import), and waits for the copy.
    /// An id outside the pool or a length other than `blocks.len()` blocks is an
    /// error, nothing written.
    fn write_blocks(
        &mut self,
        cache: &mut PagedCache<Self::Tensor>,
        blocks: &[u32],
        data: &[u8],
    ) -> Result<()>;
}

/// Bytes of one block of every pool of `config`'s cache: K and V of each layer (what
/// [`AttentionBackend::read_blocks`] writes per block).
pub fn block_transfer_bytes(config: &BackendConfig) -> Result<usize> {
    let bb = usize::try_from(config.block_bytes()?)
        .map_err(|_| Error::invalid("shape", "block size in bytes overflows"))?;
    bb.checked_mul(2 * config.num_layers)
        .ok_or_else(|| Error::invalid("num_layers", "block size in bytes overflows"))
}

/// Checks a block transfer of `config`'s cache: every id inside the pool, and (for a
/// write) `len` bytes for `blocks.len()` blocks. Returns the bytes of one block
/// ([`block_transfer_bytes`]).
pub(crate) fn check_transfer(
    what: &'static str,
    blocks: &[u32],
    config: &BackendConfig,
    len: Option<usize>,
) -> Result<usize> {
    let per_block = block_transfer_bytes(config)?;
    let num_blocks = config.shape.num_blocks;
    if let Some(&b) = blocks.iter().find(|&&b| b >= num_blocks) {
        return Err(Error::invalid(
            "blocks",
            format!("{what}: block {b} is outside the pool of {num_blocks}"),
        ));
    }
    if let Some(len) = len {
        let want = blocks.len().checked_mul(per_block);
        if want != Some(len) {
            return Err(Error::invalid(
                "data",
                format!(
                    "{what}: {len} bytes for {} blocks of {per_block}",
                    blocks.len()
                ),
            ));
        }
    }
    Ok(per_block)
}

/// Reserves room in `out` for `n` blocks of `per_block` bytes (fallibly: the count
/// comes from the caller); returns the bytes.
pub(crate) fn reserve_transfer(out: &mut Vec<u8>, n: usize, per_block: usize) -> Result<usize> {
    let total = n
        .checked_mul(per_block)
        .ok_or_else(|| Error::invalid("blocks", "too many bytes"))?;
    out.try_reserve(total)
        .map_err(|_| Error::invalid("blocks", format!("cannot allocate {total} bytes")))?;
    Ok(total)
}

/// Checks `(a, b)` block pairs against pools of `a_blocks` and `b_blocks` blocks.
pub(crate) fn check_pairs(
    what: &'static str,
    pairs: &[(u32, u32)],
    a_blocks: u32,
    b_blocks: u32,
) -> Result<()> {
    for &(a, b) in pairs {
        if a >= a_blocks || b >= b_blocks {
            return Err(Error::invalid(
                what,
                format!("pair ({a}, {b}) is outside {a_blocks} x {b_blocks} blocks"),
            ));
        }
    }
    Ok(())
}
