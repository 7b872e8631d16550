//! Prefill on the step path: [`StepRunner::plan_prefill`] once per step (validate and
//! upload the prefill rows' metadata into a persistent buffer), then
//! [`StepRunner::prefill`] per layer, which only checks views and launches.

use pagedkv_kernels::kernels::prefill::{PagedPrefill, PagedPrefillSimt, PrefillParams};
use pagedkv_kernels::{Bf16, E4m3, E5m2, F16, GlobalSlice, GlobalSliceMut, Kernel};

use super::device::{StepDevice, TensorView, TensorViewMut};
use super::runner::StepRunner;
use crate::emulator::LaunchConfig;
use crate::error::{Error, Result};
use crate::ops::attention::{AttentionOptions, DecodeShape, validate_options};
use crate::ops::prefill::{self, PrefillKernel};
use crate::tensor::DType;

/// One step's prefill metadata: the sequences whose new tokens the prefill kernel
/// computes (named fields: the `&[i32]`s cannot be swapped by position).
#[derive(Clone, Copy, Debug)]
pub struct PrefillMeta<'a> {
    /// `[num_seqs, max_blocks_per_seq]`.
    pub block_tables: &'a [i32],
    /// Row length of `block_tables`.
    pub max_blocks_per_seq: u32,
    /// `[num_seqs + 1]`: sequence `s`'s query rows are `qo_indptr[s]..qo_indptr[s + 1]`.
    pub qo_indptr: &'a [i32],
    /// `[num_seqs]`: tokens in each sequence's cache, its new ones included.
    pub context_lens: &'a [i32],
    /// The sliding window the tables were built for, as
    /// [`StepMeta::window`](super::StepMeta::window): blocks no new token's window
    /// reaches may be released, and the prefill must attend within it.
    pub window: Option<u32>,
    /// `[qo_indptr[num_seqs]]`: each new token's tree mask (verifying a tree of draft
    /// tokens; see [`ops::prefill::tree_mask`](crate::ops::prefill::tree_mask)), or
    /// `None`: causal. Not with a window or ALiBi.
    pub tree_mask: Option<&'a [u64]>,
}

/// The tensors of one layer's prefill.
#[derive(Debug)]
pub struct PrefillIo<'a> {
    /// `[qo_indptr[num_seqs], num_q_heads, head_dim]`, dense.
    pub q: TensorView<'a>,
    /// The layer's key cache (this step's tokens appended).
    pub key_cache: TensorView<'a>,
    /// The layer's value cache.
    pub value_cache: TensorView<'a>,
    /// The layer's fp8 scales, as [`KvAppendIo::kv_scales`](super::KvAppendIo::kv_scales).
    pub kv_scales: Option<TensorView<'a>>,
    /// The layer's attention-sink logits, as [`DecodeIo::sinks`](super::DecodeIo::sinks).
    pub sinks: Option<TensorView<'a>>,
    /// The layer's layer group, as [`DecodeIo::group`](super::DecodeIo::group).
    pub group: usize,
    /// `[qo_indptr[num_seqs], num_q_heads, head_dim]`, dense: written.
    pub out: TensorViewMut<'a>,
    /// `[qo_indptr[num_seqs], num_q_heads]` f32, dense: each output's log-sum-exp, as
    /// [`DecodeIo::lse`](super::DecodeIo::lse); `None` writes none.
    pub lse: Option<TensorViewMut<'a>>,
}

/// Everything one prefill launch reads and writes, as device addresses (0: none) and
/// the slices the runner's checks made: see [`StepRunner::launch_prefill_with`].
pub(super) struct PrefillLaunch<'a> {
    /// The planned shapes and kernel.
    pub(super) planned: PlannedPrefill,
    /// Scale, soft-cap, ALiBi (the window is `window`).
    pub(super) opts: &'a AttentionOptions,
    /// `q`'s address and elements.
    pub(super) q: (u64, u64),
    /// Elements from one q row to the next.
    pub(super) q_row_stride: u64,
    /// `[num_tokens]` i32 q rows (0: token order).
    pub(super) q_rows: u64,
    /// `[num_tokens]` i32 positions (0: after each sequence's cached tokens).
    pub(super) q_pos: u64,
    /// `[num_tokens]` u64 tree masks (0: none).
    pub(super) tree_mask: u64,
    /// `[num_seqs, max_blocks_per_seq]` i32.
    pub(super) tables: u64,
    /// `[num_seqs + 1]` i32.
    pub(super) qo_indptr: u64,
    /// `[num_seqs]` i32.
    pub(super) context_lens: u64,
    /// The K and V caches' addresses and their elements each.
    pub(super) caches: (u64, u64, u64),
    /// An fp8 cache's K and V scales (empty otherwise).
    pub(super) scales: (GlobalSlice<f32>, GlobalSlice<f32>),
    /// Attention-sink logits (empty: none).
    pub(super) sinks: GlobalSlice<f32>,
    /// `out`'s address (`num_tokens` dense rows).
    pub(super) out: u64,
    /// The log-sum-exp output (empty: none).
    pub(super) lse: GlobalSliceMut<f32>,
    /// The sliding window (0: none).
    pub(super) window: u32,
}

/// What [`StepRunner::plan_prefill`] decided.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedPrefill {
    /// The prefill's shapes (`num_seqs` prefilling sequences).
    pub shape: DecodeShape,
    /// Query rows in all (`qo_indptr[num_seqs]`).
    pub num_tokens: u32,
    /// The most query rows of one sequence's KV head (sizes the grid).
    pub max_rows: u32,
    /// The window the metadata was validated for ([`PrefillMeta::window`]).
    pub window: Option<u32>,
    /// The kernel every layer's [`prefill`](StepRunner::prefill) launches this step,
    /// chosen from the shapes, dtypes and the device's shared memory.
    pub kernel: PrefillKernel,
}

/// Byte offsets of a step's prefill metadata sections in the runner's prefill buffer
/// (`[tables of each group | qo_indptr | lens]`, each 16-byte aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct PrefillOffsets {
    /// `[num_seqs, max_blocks_per_seq]` i32 block tables of group 0; group `g`'s
    /// `g * table_stride` bytes on.
    pub(super) tables: u64,
    /// Bytes from one group's tables to the next's.
    pub(super) table_stride: u64,
    /// `[num_seqs + 1]` i32 query offsets.
    pub(super) qo_indptr: u64,
    /// `[num_seqs]` i32 context lengths.
    pub(super) lens: u64,
    /// `[num_tokens]` u64 tree masks, when the step has them.
    pub(super) tree_mask: Option<u64>,
}

/// Bytes of the prefill metadata buffer for `max_seqs` rows of `width` blocks and
/// `max_tokens` new tokens: `[tables | qo_indptr | lens | tree mask]`, 16-byte aligned
/// sections.
pub(super) fn meta_bytes(max_seqs: u64, width: u64, max_tokens: u64) -> Option<u64> {
    let tables = (4 * max_seqs).checked_mul(width)?;
    Some(
        tables.next_multiple_of(16)
            + (4 * (max_seqs + 1)).next_multiple_of(16)
            + (4 * max_seqs).next_multiple_of(16)
            + 8 * max_tokens,
    )
}

impl<D: StepDevice> StepRunner<D> {
    /// Plans this step's prefill: validates `meta` (as `ops::prefill` does: every block
    /// a new token's window reaches must be in the pool) and uploads it with
    /// one asynchronous copy into the runner's prefill buffer. Call it after
    /// [`plan`](Self::plan) (which forgets the previous step's prefill). A runner of
    /// several layer groups plans with [`plan_prefill_groups`](Self::plan_prefill_groups).
    pub fn plan_prefill(&mut self, meta: &PrefillMeta<'_>) -> Result<PlannedPrefill> {
        self.plan_prefill_groups(std::slice::from_ref(meta))
    }

    /// [`plan_prefill`](Self::plan_prefill) for a model of layer groups: `metas[g]` is
    /// group `g`'s (as [`plan_groups`](Self::plan_groups)), every group with the same
    /// rows, query offsets and context lengths, each validated against its own window
    /// and uploaded into its group's buffer.
    pub fn plan_prefill_groups(&mut self, metas: &[PrefillMeta<'_>]) -> Result<PlannedPrefill> {
        self.planned_prefill = None;
        if let Some(step) = self.planned.as_mut() {
            step.prefill = None;
        }
        if metas.len() != self.groups {
            return Err(Error::invalid(
                "metas",
                format!(
                    "{} groups' prefill metadata for a runner of {} layer groups",
                    metas.len(),
                    self.groups
                ),
            ));
        }
        let meta = &metas[0];
        for m in &metas[1..] {
            if m.context_lens != meta.context_lens
                || m.qo_indptr != meta.qo_indptr
                || m.max_blocks_per_seq != meta.max_blocks_per_seq
                || m.tree_mask != meta.tree_mask
            {
                return Err(Error::invalid(
                    "metas",
                    "layer groups of one step differ in rows, query offsets, context lengths or tree masks",
                ));
            }
        }
        let n = meta.context_lens.len();
        let width = meta.max_blocks_per_seq;
        if n == 0 || n > self.cap.max_seqs as usize || width > self.cap.max_blocks_per_seq {
            return Err(Error::invalid(
                "meta",
                format!(
                    "{n} prefilling sequences of {width} blocks (the runner holds 1..={} of {})",
                    self.cap.max_seqs, self.cap.max_blocks_per_seq
                ),
            ));
        }
        let shape = self.shape.batch(n as u32, width);
        if meta.window == Some(0) {
            return Err(Error::invalid("window", "must be at least 1 token"));
        }
        let max_rows = prefill::validate_metadata(
            &shape,
            meta.window,
            meta.block_tables,
            meta.qo_indptr,
            meta.context_lens,
        )?;
        for m in &metas[1..] {
            if m.window == Some(0) {
                return Err(Error::invalid("window", "must be at least 1 token"));
            }
            prefill::validate_metadata(
                &shape,
                m.window,
                m.block_tables,
                m.qo_indptr,
                m.context_lens,
            )?;
        }
        let num_tokens = meta.qo_indptr[n] as u32;
        if num_tokens > self.cap.max_tokens {
            return Err(Error::invalid(
                "qo_indptr",
                format!(
                    "{num_tokens} tokens exceed the runner's capacity of {}",
                    self.cap.max_tokens
                ),
            ));
        }
        if let Some(tm) = meta.tree_mask {
            prefill::check_tree_mask(tm, num_tokens, metas.iter().map(|m| m.window))?;
        }
        // [tables of each group | qo_indptr | lens | tree mask], uploaded in one copy.
        let t_bytes = (4 * meta.block_tables.len()).next_multiple_of(16);
        let i_bytes = (4 * (n + 1)).next_multiple_of(16);
        let g_bytes = metas.len() * t_bytes;
        let m_at = g_bytes + i_bytes + (4 * n).next_multiple_of(16);
        let m_bytes = meta.tree_mask.map_or(0, |m| 8 * m.len());
        self.staging.clear();
        self.staging.resize(m_at + m_bytes, 0);
        for (k, w) in meta.tree_mask.unwrap_or(&[]).iter().enumerate() {
            self.staging[m_at + 8 * k..m_at + 8 * k + 8].copy_from_slice(&w.to_le_bytes());
        }
        let mut put = |at: usize, words: &[i32]| {
            for (k, x) in words.iter().enumerate() {
                self.staging[at + 4 * k..at + 4 * k + 4].copy_from_slice(&x.to_le_bytes());
            }
        };
        put(g_bytes, meta.qo_indptr);
        put(g_bytes + i_bytes, meta.context_lens);
        for (g, m) in metas.iter().enumerate() {
            put(g * t_bytes, m.block_tables);
            self.pwindows[g] = m.window;
        }
        self.dev.upload(self.pmeta, &self.staging)?;
        let planned = PlannedPrefill {
            shape,
            num_tokens,
            max_rows,
            window: meta.window,
            kernel: PrefillKernel::choose(
                &shape,
                self.shape.dtype,
                self.shape.kv_dtype,
                self.dev.max_shared_bytes(),
            ),
        };
        if let Some(step) = self.planned.as_mut() {
            step.prefill = Some(planned);
        }
        self.planned_prefill = Some((
            planned,
            PrefillOffsets {
                tables: 0,
                table_stride: t_bytes as u64,
                qo_indptr: g_bytes as u64,
                lens: (g_bytes + i_bytes) as u64,
                tree_mask: meta.tree_mask.map(|_| m_at as u64),
            },
        ));
        Ok(planned)
    }

    /// Prefill attention for one layer: one launch, with the options `opts` (ALiBi
    /// slopes as uploaded with `set_alibi_slopes`).
    pub fn prefill(&self, opts: &AttentionOptions, io: PrefillIo<'_>) -> Result<()> {
        let (pp, offsets) = self
            .planned_prefill
            .ok_or_else(|| Error::InvalidState("no prefill planned: call plan_prefill()".into()))?;
        validate_options(opts, pp.shape.num_q_heads)?;
        if io.group >= self.groups {
            return Err(Error::invalid(
                "group",
                format!(
                    "{}: the runner plans {} layer groups",
                    io.group, self.groups
                ),
            ));
        }
        super::runner::check_window(self.pwindows[io.group], opts.window)?;
        if offsets.tree_mask.is_some() {
            prefill::check_tree_options(opts)?;
        }
        if opts.alibi_slopes != self.slopes_host {
            return Err(Error::invalid(
                "alibi_slopes",
                "differ from the slopes uploaded with set_alibi_slopes",
            ));
        }
        let (rows, row) = (pp.num_tokens as u64, pp.shape.row_elems());
        self.check_view("q", &io.q.raw, rows, row, false)?;
        self.check_view("out", &io.out.raw, rows, row, false)?;
        let pool = self.check_caches(&io.key_cache.raw, &io.value_cache.raw)?;
        let (k_scales, v_scales) = self.scale_slices(io.kv_scales.as_ref())?;
        let sinks = self.sink_slice(io.sinks.as_ref())?;
        let lse = self.lse_slice(io.lse.as_ref(), rows)?;
        if pp.max_rows == 0 {
            return Ok(());
        }
        let at = |off: u64| self.pmeta.offset(off).get();
        // SAFETY: checked views of this device's space; the metadata `plan_prefill`
        // validated and uploaded into the runner's buffer.
        unsafe {
            self.launch_prefill_with(&PrefillLaunch {
                planned: pp,
                opts,
                q: (io.q.raw.addr, rows * row),
                q_row_stride: row,
                q_rows: 0,
                q_pos: 0,
                tree_mask: offsets.tree_mask.map_or(0, at),
                tables: at(offsets.tables + io.group as u64 * offsets.table_stride),
                qo_indptr: at(offsets.qo_indptr),
                context_lens: at(offsets.lens),
                caches: (io.key_cache.raw.addr, io.value_cache.raw.addr, pool),
                scales: (k_scales, v_scales),
                sinks,
                out: io.out.raw.addr,
                lse,
                window: opts.window.unwrap_or(0),
            })
        }
    }

    /// Builds the parameters of one prefill launch and launches the kernel `l.planned`
    /// chose: the one place prefill's parameters are made (a layer's prefill, a
    /// cascade's shared pass).
    ///
    /// # Safety
    /// Every address in `l` is of this device's space and as long as the planned shape
    /// needs (`q` its rows of `q_row_stride` elements; `q_rows` and `q_pos` 0 or
    /// `num_tokens` i32 each, `tree_mask` 0 or `num_tokens` u64; the tables, offsets and lengths as validated; `out`
    /// `num_tokens` rows), and `l`'s metadata passed the prefill validation.
    pub(super) unsafe fn launch_prefill_with(&self, l: &PrefillLaunch<'_>) -> Result<()> {
        let pp = l.planned;
        let lay = self.shape.layout();
        let (rows, row) = (pp.num_tokens as u64, pp.shape.row_elems());
        let n = pp.shape.num_seqs as u64;
        let cfg = pp
            .kernel
            .launch_config(&pp.shape, self.shape.kv_dtype, pp.max_rows);
        let (key, value, pool) = l.caches;
        let i32s = |addr: u64, len: u64| {
            if addr == 0 {
                GlobalSlice::empty()
            } else {
                // SAFETY: the caller's: `len` i32 at `addr`.
                unsafe { GlobalSlice::from_raw_parts(addr as *const i32, len) }
            }
        };
        // SAFETY: the caller's contract for every address; the slopes buffer the
        // runner owns.
        macro_rules! params {
            ($t:ty, $k:ty) => {
                unsafe {
                    PrefillParams::<$t, $k> {
                        q: GlobalSlice::from_raw_parts(l.q.0 as *const $t, l.q.1),
                        key_cache: GlobalSlice::from_raw_parts(key as *const $k, pool),
                        value_cache: GlobalSlice::from_raw_parts(value as *const $k, pool),
                        k_scales: l.scales.0,
                        v_scales: l.scales.1,
                        block_tables: i32s(l.tables, n * pp.shape.max_blocks_per_seq as u64),
                        qo_indptr: i32s(l.qo_indptr, n + 1),
                        context_lens: i32s(l.context_lens, n),
                        alibi_slopes: if l.opts.alibi_slopes.is_some() {
                            GlobalSlice::from_raw_parts(
                                self.slopes.get() as *const f32,
                                pp.shape.num_q_heads as u64,
                            )
                        } else {
                            GlobalSlice::empty()
                        },
                        sinks: l.sinks,
                        out: GlobalSliceMut::from_raw_parts(l.out as *mut $t, rows * row),
                        lse: l.lse,
                        q_rows: i32s(l.q_rows, rows),
                        q_pos: i32s(l.q_pos, rows),
                        tree_mask: if l.tree_mask == 0 {
                            GlobalSlice::empty()
                        } else {
                            // SAFETY: the caller's: `num_tokens` u64 at `tree_mask`.
                            GlobalSlice::from_raw_parts(l.tree_mask as *const u64, rows)
                        },
                        layout: lay,
                        num_q_heads: pp.shape.num_q_heads,
                        max_blocks_per_seq: pp.shape.max_blocks_per_seq,
                        scale: l.opts.scale,
                        softcap: l.opts.softcap.unwrap_or(0.0),
                        inv_softcap: l.opts.softcap.map_or(0.0, |c| 1.0 / c),
                        window: l.window,
                        q_row_stride: l.q_row_stride,
                    }
                }
            };
        }
        // SAFETY (each launch): (1)-(2) the caller's; (3) `out` and `lse` borrowed
        // mutably by the caller, the caches shared, all on the device's one queue; (4)
        // the kernel's own configuration.
        macro_rules! launch {
            ($kernel:ty, $t:ty, $k:ty) => {{
                let p = params!($t, $k);
                unsafe { self.launch_prefill::<$kernel>(cfg, p) }
            }};
        }
        // The tensor-core kernel of the pair the plan chose.
        macro_rules! mma {
            ($t:ty, $k:ty) => {
                match pp.kernel {
                    PrefillKernel::MultiWarp { head_dim: 64 } => {
                        launch!(PagedPrefill<$t, $k, 64>, $t, $k)
                    }
                    PrefillKernel::MultiWarp { head_dim: 128 } => {
                        launch!(PagedPrefill<$t, $k, 128>, $t, $k)
                    }
                    PrefillKernel::OneWarp if l.tree_mask != 0 => {
                        launch!(PagedPrefill<$t, $k, 0, true>, $t, $k)
                    }
                    PrefillKernel::OneWarp => launch!(PagedPrefill<$t, $k>, $t, $k),
                    other => Err(Error::InvalidState(format!(
                        "a {other:?} prefill planned for 16-bit queries"
                    ))),
                }
            };
        }
        use DType as D;
        match (self.shape.dtype, self.shape.kv_dtype) {
            (D::F16, D::F16) => mma!(F16, F16),
            (D::Bf16, D::Bf16) => mma!(Bf16, Bf16),
            (D::F32, D::F32) => launch!(PagedPrefillSimt<f32>, f32, f32),
            (D::F16, D::E4m3) => mma!(F16, E4m3),
            (D::F16, D::E5m2) => mma!(F16, E5m2),
            (D::Bf16, D::E4m3) => mma!(Bf16, E4m3),
            (D::Bf16, D::E5m2) => mma!(Bf16, E5m2),
            (q, c) => Err(Error::invalid(
                "dtype",
                format!("no prefill kernel for {q} queries over {c} caches"),
            )),
        }
    }

    /// # Safety
    /// As [`StepDevice::launch`].
    unsafe fn launch_prefill<K: Kernel>(&self, cfg: LaunchConfig, p: K::Params) -> Result<()> {
        // SAFETY: the caller's.
        unsafe { self.dev.launch::<K>(cfg, p) }
    }
}
