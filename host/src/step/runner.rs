//! [`StepRunner`]: plan once per step, run per layer with nothing but launches.

use pagedkv_kernels::PagedLayout;

use super::device::{DeviceAddr, StepDevice, TensorView, TensorViewMut};
use crate::error::{Error, Result};
use crate::ops::attention::{self, DecodeShape, SplitPlan, SplitTarget};
use crate::ops::scales::check_cache_pair;
use crate::ops::{MAX_GRID_YZ, check_layout, kv_append};
use crate::tensor::DType;

/// The attention shape of a model's layers: the same for every layer a runner serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct StepShape {
    /// Query heads (a multiple of `num_kv_heads`).
    pub num_q_heads: u32,
    /// KV heads.
    pub num_kv_heads: u32,
    /// Elements per head vector.
    pub head_dim: u32,
    /// Tokens per cache block.
    pub block_size: u32,
    /// Blocks in each layer's K (and V) pool.
    pub num_blocks: u32,
    /// Element type of q, out, and the new tokens' k and v.
    pub dtype: DType,
    /// Element type of the caches: `dtype`, or fp8 ([`DType::E4m3`], [`DType::E5m2`])
    /// under f16 / bf16 queries, each layer's cache then with its per-KV-head scales
    /// ([`KvAppendIo::kv_scales`]).
    pub kv_dtype: DType,
}

impl StepShape {
    /// One layer's cache layout.
    pub fn layout(&self) -> PagedLayout {
        self.batch(0, 0).layout()
    }

    /// The shape of a launch over `num_seqs` sequences of block-table rows
    /// `max_blocks_per_seq` long, with this geometry (the one place a
    /// [`DecodeShape`] is made from a step shape).
    pub fn batch(&self, num_seqs: u32, max_blocks_per_seq: u32) -> DecodeShape {
        DecodeShape {
            num_seqs,
            num_q_heads: self.num_q_heads,
            num_kv_heads: self.num_kv_heads,
            head_dim: self.head_dim,
            block_size: self.block_size,
            num_blocks: self.num_blocks,
            max_blocks_per_seq,
        }
    }
}

/// The most bytes of step metadata (block tables, lengths, slots) a [`StepRunner`]
/// allocates for its [`StepCapacity`] (1 GiB: 65535 rows of 4096 blocks): a capacity
/// that needs more is refused at creation.
pub const MAX_STEP_META_BYTES: u64 = 1 << 30;

/// The most a step may hold: the runner allocates its device buffers for these once,
/// so [`StepRunner::plan`] never allocates and a captured graph's addresses stay valid.
/// Its metadata must fit [`MAX_STEP_META_BYTES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StepCapacity {
    /// Decoding sequences per step.
    pub max_seqs: u32,
    /// Block-table row length.
    pub max_blocks_per_seq: u32,
    /// New tokens per step (`slot_mapping` entries).
    pub max_tokens: u32,
    /// Split-K partitions per sequence (the planner makes partitions longer to stay
    /// within it).
    pub max_partitions: u32,
}

/// One step's metadata, as the scheduler's `Batch` has it (named fields: two `&[i32]`
/// cannot be swapped by accident).
#[derive(Clone, Copy, Debug)]
pub struct StepMeta<'a> {
    /// `[num_seqs, max_blocks_per_seq]`: physical block of each logical block; every
    /// entry below `ceil(context_len / block_size)` is a block of the pool.
    pub block_tables: &'a [i32],
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: u32,
    /// `[num_seqs]`: tokens in each decoding sequence's cache, the new one included.
    pub context_lens: &'a [i32],
    /// `[num_tokens]`: slot of each new token (negative: skip).
    pub slot_mapping: &'a [i64],
    /// The sliding window the tables were built for (the scheduler's
    /// `Batch::sliding_window`): with one, a sequence's blocks wholly before its last
    /// `window` tokens may be released (any id), and the step's decode must attend
    /// with a window of at most this many tokens. `None`: every block up to each
    /// context is in the pool, any window may be used.
    pub window: Option<u32>,
}

/// The tensors of one layer's `kv_append`.
#[derive(Debug)]
pub struct KvAppendIo<'a> {
    /// `[num_tokens, num_kv_heads, head_dim]`, dense.
    pub key: TensorView<'a>,
    /// `[num_tokens, num_kv_heads, head_dim]`, dense.
    pub value: TensorView<'a>,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: the layer's key cache.
    pub key_cache: TensorViewMut<'a>,
    /// `[num_blocks, num_kv_heads, block_size, head_dim]`: the layer's value cache.
    pub value_cache: TensorViewMut<'a>,
    /// `[2, num_kv_heads]` f32: the layer's K scales, then its V scales, for an fp8
    /// cache (required then, refused otherwise). Values must be finite and positive
    /// (checked where they are set, e.g. `AttentionBackend::set_kv_scales`).
    pub kv_scales: Option<TensorView<'a>>,
    /// The layer's layer group, whose slot mapping the tokens are written through (0
    /// for a model of one group; see [`StepRunner::plan_groups`]).
    pub group: usize,
}

/// The tensors of one layer's decode attention.
#[derive(Debug)]
pub struct DecodeIo<'a> {
    /// `[num_seqs, row_stride]`: each row starts with `num_q_heads * head_dim` q values
    /// (row stride: the view's, else dense).
    pub q: TensorView<'a>,
    /// The layer's key cache.
    pub key_cache: TensorView<'a>,
    /// The layer's value cache.
    pub value_cache: TensorView<'a>,
    /// The layer's fp8 scales, as [`KvAppendIo::kv_scales`].
    pub kv_scales: Option<TensorView<'a>>,
    /// `[num_q_heads]` f32: the layer's attention-sink logits (gpt-oss), one per query
    /// head, each joining its head's softmax denominator once; `None` for none. (A
    /// tensor, not an [`AttentionOptions`](crate::ops::attention::AttentionOptions)
    /// field: sinks are learned weights, different in every layer, and live on the
    /// device beside them.)
    pub sinks: Option<TensorView<'a>>,
    /// The layer's layer group, whose block tables and window it attends through (0
    /// for a model of one group).
    pub group: usize,
    /// `[num_seqs, row_stride]`: the output rows (row stride as for `q`).
    pub out: TensorViewMut<'a>,
    /// `[num_seqs, num_q_heads]` f32, dense: where to write each output's log-sum-exp
    /// (base 2: `log2(Σ exp(x))` over the scores `x` it attended, the sink included;
    /// see [`SoftmaxState::lse`](pagedkv_kernels::SoftmaxState::lse)), for a later
    /// merge with other parts of the same attention
    /// ([`StepRunner::merge`]); `None` writes none.
    pub lse: Option<TensorViewMut<'a>>,
}

/// What [`StepRunner::plan`] decided for the current step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Planned {
    /// The decode launch's shapes (`None` when the step decodes no sequence).
    pub decode: Option<(DecodeShape, SplitPlan)>,
    /// New tokens `kv_append` writes.
    pub num_tokens: u32,
    /// The window the metadata was validated for ([`StepMeta::window`]; layer group
    /// 0's, with several).
    pub window: Option<u32>,
    /// The step's prefill launch, once [`plan_prefill`](StepRunner::plan_prefill)
    /// planned one (`None` when the step prefills no sequence).
    pub prefill: Option<super::PlannedPrefill>,
    /// The step's cascade, once [`plan_cascade`](StepRunner::plan_cascade) planned one:
    /// every layer's [`decode`](StepRunner::decode) then runs as cascade attention.
    pub cascade: Option<super::PlannedCascade>,
    /// Where the step's metadata sections start in the metadata buffer.
    pub(super) offsets: MetaOffsets,
}

/// Byte offsets of a step's metadata sections in the runner's metadata buffer
/// (`[tables of each group | lens | slots of each group]`, each 16-byte aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct MetaOffsets {
    /// `[num_seqs, max_blocks_per_seq]` i32 block tables of group 0; group `g`'s
    /// `g * table_stride` bytes on.
    pub(super) tables: u64,
    /// `[num_seqs]` i32 context lengths (every group's).
    pub(super) lens: u64,
    /// `[num_tokens]` i64 slot mapping of group 0; group `g`'s `g * slot_stride` on.
    pub(super) slots: u64,
    /// Bytes from one group's tables to the next's.
    pub(super) table_stride: u64,
    /// Bytes from one group's slots to the next's.
    pub(super) slot_stride: u64,
}

impl MetaOffsets {
    /// Group `g`'s tables.
    pub(super) fn tables_of(&self, g: usize) -> u64 {
        self.tables + g as u64 * self.table_stride
    }

    /// Group `g`'s slots.
    pub(super) fn slots_of(&self, g: usize) -> u64 {
        self.slots + g as u64 * self.slot_stride
    }
}

/// Plans a step once on the host and runs every layer's kernels with nothing but
/// launches (see the module docs of [`super`]).
pub struct StepRunner<D: StepDevice> {
    pub(super) dev: D,
    pub(super) shape: StepShape,
    pub(super) cap: StepCapacity,
    /// SMs the split planner plans for; `None`: never split.
    pub(super) split: Option<SplitTarget>,
    /// `[tables of each group | lens | slots of each group]`, 16-byte aligned
    /// sections, room for `groups` groups (`meta_bytes` a group).
    pub(super) meta: DeviceAddr,
    pub(super) meta_bytes: usize,
    /// Layer groups the buffers hold (`set_groups`).
    pub(super) groups: usize,
    /// The window each group's metadata was validated for (`plan_groups`).
    pub(super) windows: Vec<Option<u32>>,
    /// Split-K partials: `[rows, head_dim]` and `[rows, 2]` f32.
    pub(super) part_out: (DeviceAddr, u64),
    pub(super) part_ml: (DeviceAddr, u64),
    /// `[num_q_heads]` f32 ALiBi slopes on the device, and the host copy they came from.
    pub(super) slopes: DeviceAddr,
    pub(super) slopes_host: Option<Vec<f32>>,
    pub(super) staging: Vec<u8>,
    pub(super) planned: Option<Planned>,
    /// `[tables of each group | qo_indptr | lens]` of the step's prefill, 16-byte
    /// aligned sections, room for `groups` groups (`pmeta_bytes` a group).
    pub(super) pmeta: DeviceAddr,
    pub(super) pmeta_bytes: usize,
    /// The window each group's prefill metadata was validated for.
    pub(super) pwindows: Vec<Option<u32>>,
    /// What `plan_prefill` decided, and its sections' byte offsets in `pmeta`.
    pub(super) planned_prefill: Option<(super::PlannedPrefill, super::prefill::PrefillOffsets)>,
    /// The cascade's metadata buffer and workspace, once `enable_cascade` made them.
    pub(super) cascade: Option<super::cascade::CascadeBuffers>,
}

impl<D: StepDevice> std::fmt::Debug for StepRunner<D> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StepRunner")
            .field("shape", &self.shape)
            .field("capacity", &self.cap)
            .field("planned", &self.planned)
            .finish_non_exhaustive()
    }
}

fn align16(x: u64) -> u64 {
    x.next_multiple_of(16)
}

fn too_large(what: &'static str) -> Error {
    Error::invalid(what, "sizes overflow")
}

impl<D: StepDevice> StepRunner<D> {
    /// A runner for `shape` on `dev` (whose GPU is `target`, the split planner's input:
    /// a [`SplitTarget`], or a bare SM count for sm_80's conservative bounds), with device
    /// buffers allocated for `cap`: metadata, split-K workspace and ALiBi slopes. The
    /// only allocations the runner ever makes.
    pub fn new(
        dev: D,
        shape: StepShape,
        cap: StepCapacity,
        target: impl Into<SplitTarget>,
    ) -> Result<Self> {
        Self::with_split(dev, shape, cap, Some(target.into()))
    }

    /// [`new`](Self::new), planning split-K for `target`, or never splitting when it is
    /// `None` (the CPU: split-K exists to fill a GPU's SMs).
    pub fn with_split(
        dev: D,
        shape: StepShape,
        cap: StepCapacity,
        target: Option<SplitTarget>,
    ) -> Result<Self> {
        Self::with_workspace(dev, shape, cap, target, 0)
    }

    /// [`with_split`](Self::with_split), with a split-K workspace of at least
    /// `min_rows` (sequence, head, partition) rows: room for a plan the caller forces
    /// ([`plan_split`](Self::plan_split)) beyond what the planner makes for `cap`.
    pub(crate) fn with_workspace(
        mut dev: D,
        shape: StepShape,
        cap: StepCapacity,
        split: Option<SplitTarget>,
        min_rows: u64,
    ) -> Result<Self> {
        check_layout(&shape.layout())?;
        check_cache_pair(shape.dtype, shape.kv_dtype)?;
        attention::check_heads(shape.num_q_heads, shape.num_kv_heads)?;
        for (what, v, max) in [
            ("max_seqs", cap.max_seqs, MAX_GRID_YZ),
            ("max_partitions", cap.max_partitions, MAX_GRID_YZ),
            (
                "max_blocks_per_seq",
                cap.max_blocks_per_seq,
                i32::MAX as u32,
            ),
            ("max_tokens", cap.max_tokens, i32::MAX as u32),
        ] {
            if v == 0 || v > max {
                return Err(Error::invalid(what, format!("{v} (must be 1..={max})")));
            }
        }
        let tables = 4 * cap.max_seqs as u64 * cap.max_blocks_per_seq as u64;
        let meta_bytes =
            align16(tables) + align16(4 * cap.max_seqs as u64) + 8 * cap.max_tokens as u64;
        // A budget on what the capacity makes the runner allocate at once (a valid
        // capacity of 65535 rows of 2^31 blocks asked for 512 TiB, and the emulator's
        // host allocation of it was an abort, or the OOM killer).
        let pmeta = super::prefill::meta_bytes(
            cap.max_seqs as u64,
            cap.max_blocks_per_seq as u64,
            cap.max_tokens as u64,
        )
        .unwrap_or(u64::MAX);
        if meta_bytes.max(pmeta) > MAX_STEP_META_BYTES {
            return Err(Error::invalid(
                "capacity",
                format!(
                    "{} rows of {} blocks and {} tokens need {} bytes of step metadata, more than a runner allocates ({MAX_STEP_META_BYTES}, MAX_STEP_META_BYTES)",
                    cap.max_seqs,
                    cap.max_blocks_per_seq,
                    cap.max_tokens,
                    meta_bytes.max(pmeta)
                ),
            ));
        }
        let meta_bytes = usize::try_from(meta_bytes).map_err(|_| too_large("capacity"))?;
        // Partials for the most (sequence, head, partition) rows the planner makes for
        // a batch within `cap` at the longest context (far below max_seqs *
        // num_q_heads * max_partitions: it splits small batches, and large ones at most
        // MAX_BALANCING_PARTITIONS ways). A plan for a shorter context that would need
        // more is cut to what the workspace holds when the step is planned.
        let mut rows = min_rows;
        let decode_shape = |n| shape.batch(n, cap.max_blocks_per_seq);
        let longest = cap.max_blocks_per_seq.saturating_mul(shape.block_size);
        for (n, target) in (1..=cap.max_seqs).filter_map(|n| Some((n, split?))) {
            let p = clamp_partitions(
                attention::plan(&decode_shape(n), shape.kv_dtype, longest, target),
                longest,
                cap.max_partitions,
            );
            if p.is_split() {
                rows = rows.max(n as u64 * shape.num_q_heads as u64 * p.num_partitions as u64);
            }
        }
        let out_bytes = rows
            .checked_mul(shape.head_dim as u64 * 4)
            .filter(|&b| b <= MAX_STEP_META_BYTES)
            .and_then(|b| usize::try_from(b).ok())
            .ok_or_else(|| {
                Error::invalid(
                    "max_partitions",
                    format!(
                        "{rows} split-K partial rows of head_dim {} exceed the {MAX_STEP_META_BYTES} bytes a runner allocates",
                        shape.head_dim
                    ),
                )
            })?;
        dev.reserve_upload(
            meta_bytes.max(4 * shape.num_q_heads as usize).max(
                super::prefill::meta_bytes(
                    cap.max_seqs as u64,
                    cap.max_blocks_per_seq as u64,
                    cap.max_tokens as u64,
                )
                .unwrap_or(u64::MAX)
                .min(usize::MAX as u64) as usize,
            ),
        )?;
        let meta = dev.alloc(meta_bytes)?;
        let pmeta_bytes = super::prefill::meta_bytes(
            cap.max_seqs as u64,
            cap.max_blocks_per_seq as u64,
            cap.max_tokens as u64,
        )
        .and_then(|b| usize::try_from(b).ok())
        .ok_or_else(|| too_large("capacity"))?;
        let pmeta = dev.alloc(pmeta_bytes)?;
        let part_out = (dev.alloc(out_bytes.max(16))?, rows * shape.head_dim as u64);
        let part_ml = (dev.alloc((rows as usize * 8).max(16))?, rows * 2);
        let slopes = dev.alloc(4 * shape.num_q_heads as usize)?;
        Ok(Self {
            dev,
            shape,
            cap,
            split,
            meta,
            meta_bytes,
            groups: 1,
            windows: vec![None],
            part_out,
            part_ml,
            slopes,
            slopes_host: None,
            staging: Vec::with_capacity(meta_bytes),
            planned: None,
            pmeta,
            pmeta_bytes,
            pwindows: vec![None],
            planned_prefill: None,
            cascade: None,
        })
    }

    /// Layer groups the runner plans for ([`plan_groups`](Self::plan_groups)): 1
    /// unless [`set_groups`](Self::set_groups) said more.
    pub fn num_groups(&self) -> usize {
        self.groups
    }

    /// Plans for `n` layer groups (1 to [`MAX_KV_GROUPS`]) from now on. With more than
    /// one, allocates metadata buffers with room for every group's tables and slots
    /// (a step still uploads its metadata in one copy): call it once, before the first
    /// step and before capturing a graph (the only allocations besides the
    /// constructor's; the buffers of an earlier call stay allocated with the device).
    /// Forgets the current plan.
    ///
    /// [`MAX_KV_GROUPS`]: crate::block::MAX_KV_GROUPS
    pub fn set_groups(&mut self, n: usize) -> Result<()> {
        if n == 0 || n > crate::block::MAX_KV_GROUPS {
            return Err(Error::invalid(
                "groups",
                format!("{n} (1 to {})", crate::block::MAX_KV_GROUPS),
            ));
        }
        self.planned = None;
        self.planned_prefill = None;
        if n > 1 && self.cascade.is_some() {
            return Err(Error::invalid(
                "groups",
                "cascade attention is enabled: a runner of layer groups attends flat",
            ));
        }
        if n > self.groups {
            let (m, p) = (
                self.meta_bytes.checked_mul(n),
                self.pmeta_bytes.checked_mul(n),
            );
            let (Some(m), Some(p)) = (m, p) else {
                return Err(too_large("groups"));
            };
            self.dev.reserve_upload(m.max(p))?;
            self.meta = self.dev.alloc(m)?;
            self.pmeta = self.dev.alloc(p)?;
        }
        self.groups = n;
        self.windows.resize(n, None);
        self.pwindows.resize(n, None);
        Ok(())
    }

    /// The planned window of group `g` of a layer's call (an error for a group the
    /// runner does not plan).
    pub(super) fn group_window(&self, g: usize) -> Result<Option<u32>> {
        if g >= self.groups {
            return Err(Error::invalid(
                "group",
                format!("{g}: the runner plans {} layer groups", self.groups),
            ));
        }
        Ok(self.windows[g])
    }

    /// The device.
    pub fn device(&self) -> &D {
        &self.dev
    }

    /// The device, mutably (for its own allocations, outside a step).
    pub fn device_mut(&mut self) -> &mut D {
        &mut self.dev
    }

    /// What the last [`plan`](StepRunner::plan) decided.
    pub fn planned(&self) -> Option<&Planned> {
        self.planned.as_ref()
    }

    /// The ALiBi slopes [`set_alibi_slopes`](Self::set_alibi_slopes) uploaded.
    pub fn alibi_slopes(&self) -> Option<&[f32]> {
        self.slopes_host.as_deref()
    }

    /// Uploads ALiBi slopes (one per query head) for the decode runs that ask for ALiBi,
    /// or clears them. Not a run: call it once, outside the layer loop.
    pub fn set_alibi_slopes(&mut self, slopes: Option<&[f32]>) -> Result<()> {
        if let Some(s) = slopes {
            attention::check_per_head("alibi_slopes", s, self.shape.num_q_heads)?;
            let bytes: Vec<u8> = s.iter().flat_map(|x| x.to_le_bytes()).collect();
            self.dev.upload(self.slopes, &bytes)?;
        }
        self.slopes_host = slopes.map(<[f32]>::to_vec);
        Ok(())
    }

    /// Plans the step: validates `meta` once (block ids inside the pool, lengths, slots
    /// inside the pool and distinct), decides the split, and uploads the metadata with
    /// one asynchronous copy into the runner's persistent buffer. No allocation. A
    /// runner of several layer groups plans with [`plan_groups`](Self::plan_groups).
    pub fn plan(&mut self, meta: &StepMeta<'_>) -> Result<&Planned> {
        self.plan_groups(std::slice::from_ref(meta))
    }

    /// [`plan`](Self::plan) for a model of layer groups: `metas[g]` is group `g`'s
    /// block tables, slot mapping and window (the scheduler's
    /// [`Batch::group`](crate::scheduler::Batch::group)), one per group the runner
    /// plans for, every group with the same rows, context lengths and token count.
    /// Each is validated against its own window and uploaded into its group's buffer;
    /// the split plan is the same for every group (made from the context lengths).
    pub fn plan_groups(&mut self, metas: &[StepMeta<'_>]) -> Result<&Planned> {
        self.plan_split_groups(metas, None)
    }

    /// [`plan_split`](Self::plan_split) of one group.
    pub(crate) fn plan_split(
        &mut self,
        meta: &StepMeta<'_>,
        split: Option<SplitPlan>,
    ) -> Result<&Planned> {
        self.plan_split_groups(std::slice::from_ref(meta), split)
    }

    /// [`plan_groups`](Self::plan_groups), launching the decode with `split` instead
    /// of the planner's choice when it is given (validated against the step; the
    /// workspace must hold it: [`with_workspace`](Self::with_workspace)).
    pub(crate) fn plan_split_groups(
        &mut self,
        metas: &[StepMeta<'_>],
        split: Option<SplitPlan>,
    ) -> Result<&Planned> {
        self.planned = None;
        self.planned_prefill = None;
        if metas.len() != self.groups {
            return Err(Error::invalid(
                "metas",
                format!(
                    "{} groups' metadata for a runner of {} layer groups",
                    metas.len(),
                    self.groups
                ),
            ));
        }
        let meta = &metas[0];
        for m in &metas[1..] {
            if m.context_lens != meta.context_lens
                || m.max_blocks_per_seq != meta.max_blocks_per_seq
                || m.block_tables.len() != meta.block_tables.len()
                || m.slot_mapping.len() != meta.slot_mapping.len()
            {
                return Err(Error::invalid(
                    "metas",
                    "layer groups of one step differ in rows, context lengths or tokens",
                ));
            }
        }
        let n = meta.context_lens.len();
        let width = meta.max_blocks_per_seq;
        let tokens = meta.slot_mapping.len();
        if n > self.cap.max_seqs as usize || width > self.cap.max_blocks_per_seq {
            return Err(Error::invalid(
                "meta",
                format!(
                    "{n} sequences of {width} blocks exceed the runner's capacity ({} of {})",
                    self.cap.max_seqs, self.cap.max_blocks_per_seq
                ),
            ));
        }
        if tokens > self.cap.max_tokens as usize {
            return Err(Error::invalid(
                "slot_mapping",
                format!(
                    "{tokens} tokens exceed the runner's capacity of {}",
                    self.cap.max_tokens
                ),
            ));
        }
        let layout = self.shape.layout();
        for m in metas {
            kv_append::validate_slots(&layout, m.slot_mapping)?;
        }
        let decode = if n == 0 {
            if !meta.block_tables.is_empty() {
                return Err(Error::invalid("block_tables", "rows for no sequence"));
            }
            None
        } else {
            let ds = self.shape.batch(n as u32, width);
            if width == 0 {
                return Err(Error::invalid("max_blocks_per_seq", "must be at least 1"));
            }
            if meta.window == Some(0) {
                return Err(Error::invalid("window", "must be at least 1 token"));
            }
            let max_len = attention::validate_metadata(
                &ds,
                meta.window,
                meta.block_tables,
                meta.context_lens,
            )?;
            // The planner's choice, within the capacity and the workspace's rows.
            let fits = self.part_out.1
                / (self.shape.head_dim as u64 * n.max(1) as u64 * self.shape.num_q_heads as u64);
            let p = split.unwrap_or_else(|| {
                clamp_partitions(
                    match self.split {
                        Some(t) => attention::plan(&ds, self.shape.kv_dtype, max_len, t),
                        None => attention::plan_unsplit(&ds, self.shape.kv_dtype, max_len),
                    },
                    max_len,
                    (fits.min(self.cap.max_partitions as u64) as u32).max(1),
                )
            });
            attention::validate_plan(&ds, self.shape.kv_dtype, &p, max_len)?;
            // The other groups' tables, each against its own window.
            for m in &metas[1..] {
                if m.window == Some(0) {
                    return Err(Error::invalid("window", "must be at least 1 token"));
                }
                attention::validate_metadata(&ds, m.window, m.block_tables, m.context_lens)?;
            }
            Some((ds, p))
        };
        // Pack [tables of each group | lens | slots of each group] and upload it in
        // one copy.
        let groups = metas.len() as u64;
        let table_stride = align16(4 * meta.block_tables.len() as u64);
        let slot_stride = align16(8 * tokens as u64);
        let offsets = MetaOffsets {
            tables: 0,
            lens: groups * table_stride,
            slots: groups * table_stride + align16(4 * n as u64),
            table_stride,
            slot_stride,
        };
        let used = (offsets.slots + groups * slot_stride) as usize;
        debug_assert!(used <= self.meta_bytes * self.groups);
        self.staging.clear();
        self.staging.resize(used, 0);
        let mut put = |at: u64, bytes: &mut dyn Iterator<Item = u8>| {
            for (d, b) in self.staging[at as usize..].iter_mut().zip(bytes) {
                *d = b;
            }
        };
        put(
            offsets.lens,
            &mut meta.context_lens.iter().flat_map(|x| x.to_le_bytes()),
        );
        for (g, m) in metas.iter().enumerate() {
            put(
                offsets.tables_of(g),
                &mut m.block_tables.iter().flat_map(|x| x.to_le_bytes()),
            );
            put(
                offsets.slots_of(g),
                &mut m.slot_mapping.iter().flat_map(|x| x.to_le_bytes()),
            );
            self.windows[g] = m.window;
        }
        if used > 0 {
            self.dev.upload(self.meta, &self.staging)?;
        }
        if let Some((_, p)) = &decode {
            let rows = n as u64 * self.shape.num_q_heads as u64 * p.num_partitions as u64;
            if p.is_split() && rows * self.shape.head_dim as u64 > self.part_out.1 {
                return Err(Error::InvalidState(format!(
                    "split-K plan needs {rows} partial rows, the workspace holds {}",
                    self.part_out.1 / self.shape.head_dim as u64
                )));
            }
        }
        // (With cascade buffers: what `plan_cascade` checks its metadata against.)
        if let Some(c) = self.cascade.as_mut() {
            c.planned = Some(super::cascade::fingerprint(meta));
        }
        Ok(self.planned.insert(Planned {
            decode,
            num_tokens: tokens as u32,
            window: meta.window,
            prefill: None,
            cascade: None,
            offsets,
        }))
    }
}

/// Attention over tables validated for `planned` (a sliding window's, or `None`) reads
/// only what that window kept: `asked` must be a window of at most `planned` (none, or
/// a wider one, would read released blocks: garbage, NaN in a fresh cache).
pub(super) fn check_window(planned: Option<u32>, asked: Option<u32>) -> Result<()> {
    match planned {
        Some(w) if asked.is_none_or(|x| x > w) => Err(Error::invalid(
            "window",
            format!(
                "{asked:?}, but the step was planned with a sliding window of {w} tokens (its blocks before the window may be released): attend with a window of at most {w}"
            ),
        )),
        _ => Ok(()),
    }
}

/// `p` with at most `max` partitions (longer ones), covering `max_len` tokens.
fn clamp_partitions(mut p: SplitPlan, max_len: u32, max: u32) -> SplitPlan {
    if p.num_partitions > max {
        let tile = pagedkv_kernels::kernels::attention::TILE_TOKENS;
        p.partition_tokens = max_len.div_ceil(max).next_multiple_of(tile);
        p.num_partitions = max_len.div_ceil(p.partition_tokens);
    }
    p
}
