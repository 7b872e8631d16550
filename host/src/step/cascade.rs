//! Cascade attention on the step path (see [`crate::ops::cascade`]):
//! [`StepRunner::enable_cascade`] allocates its buffers once,
//! [`StepRunner::plan_cascade`] uploads a step's groups, and every layer's
//! [`StepRunner::decode`] then runs the suffix pass, the shared pass and the merge.

use pagedkv_kernels::{GlobalSlice, GlobalSliceMut};

use super::PlannedPrefill;
use super::device::{DeviceAddr, StepDevice};
use super::merge::MergeLaunch;
use super::prefill::PrefillLaunch;
use super::run::{DecodeSource, DecodeTarget};
use super::runner::{MAX_STEP_META_BYTES, StepMeta, StepRunner};
use crate::error::{Error, Result};
use crate::ops::attention::{AttentionOptions, DecodeShape, SplitPlan};
use crate::ops::cascade::{CascadeGroup, validate_groups};
use crate::ops::prefill::PrefillKernel;

/// The buffers of a runner's cascade, allocated by [`StepRunner::enable_cascade`]:
/// its metadata (`[shared tables | qo_indptr | lens | q_rows | q_pos | kv_start |
/// state_rows]`, 16-byte aligned sections) and its workspace (every row's suffix output
/// and each cascaded row's shared output, `f32`-sized, and their log-sum-exp).
#[derive(Clone, Copy, Debug)]
pub(super) struct CascadeBuffers {
    meta: DeviceAddr,
    meta_bytes: u64,
    ws_v: DeviceAddr,
    ws_lse: DeviceAddr,
    /// The [`fingerprint`] of the step `plan` last planned (its metadata validated).
    pub(super) planned: Option<u64>,
}

/// A fingerprint of a step's decode tables and lengths (FNV-1a over their words): what
/// `plan_cascade` checks its `meta` against, so a cascade's groups are those of the
/// step whose tables the suffix pass reads.
pub(super) fn fingerprint(meta: &StepMeta<'_>) -> u64 {
    let mut h = 0xcbf2_9ce4_8422_2325u64;
    let words = std::iter::once(meta.max_blocks_per_seq as i32)
        .chain(meta.context_lens.iter().copied())
        .chain(std::iter::once(-1))
        .chain(meta.block_tables.iter().copied());
    for w in words {
        h = (h ^ w as u32 as u64).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// What [`StepRunner::plan_cascade`] decided for the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlannedCascade {
    /// Groups of rows sharing a prefix.
    pub groups: u32,
    /// Rows in a group (the shared pass's query tokens).
    pub rows: u32,
    /// Tokens the shared passes attend, over every group (each once per KV head and
    /// CTA tile of query rows, instead of once per row).
    pub shared_tokens: u64,
    /// The shared pass's launch (a prefill of one sequence per group).
    pub shared: PlannedPrefill,
    offsets: CascadeOffsets,
}

/// Byte offsets of the cascade's metadata sections.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct CascadeOffsets {
    tables: u64,
    qo_indptr: u64,
    lens: u64,
    q_rows: u64,
    q_pos: u64,
    kv_start: u64,
    state_rows: u64,
}

fn a16(x: u64) -> u64 {
    x.next_multiple_of(16)
}

/// The sections of the cascade metadata for `groups` groups of `width`-block tables,
/// `rows` cascaded rows of `seqs` decode rows; returns the offsets and the total bytes.
fn layout(groups: u64, width: u64, rows: u64, seqs: u64) -> Option<(CascadeOffsets, u64)> {
    let tables = 0;
    let qo_indptr = a16((4 * groups).checked_mul(width)?);
    let lens = qo_indptr + a16(4 * (groups + 1));
    let q_rows = lens + a16(4 * groups);
    let q_pos = q_rows + a16(4 * rows);
    let kv_start = q_pos + a16(4 * rows);
    let state_rows = kv_start + a16(4 * seqs);
    let end = state_rows.checked_add(8 * seqs)?;
    Some((
        CascadeOffsets {
            tables,
            qo_indptr,
            lens,
            q_rows,
            q_pos,
            kv_start,
            state_rows,
        },
        end,
    ))
}

impl<D: StepDevice> StepRunner<D> {
    /// Allocates the cascade's metadata buffer and workspace for the runner's
    /// capacity (the only allocations besides the constructor's and `set_groups`'):
    /// call it once, before the first step and before capturing a graph. Refused for a
    /// runner of several layer groups. Forgets the current plan.
    pub fn enable_cascade(&mut self) -> Result<()> {
        if self.groups > 1 {
            return Err(Error::invalid(
                "cascade",
                "not for a model of several layer groups (their windows release blocks)",
            ));
        }
        self.planned = None;
        self.planned_prefill = None;
        let (seqs, width) = (self.cap.max_seqs as u64, self.cap.max_blocks_per_seq as u64);
        let too_large = || Error::invalid("capacity", "the cascade's buffers are too large");
        let (_, meta_bytes) = layout(seqs, width, seqs, seqs).ok_or_else(too_large)?;
        let row = self.shape.num_q_heads as u64 * self.shape.head_dim as u64;
        let v_bytes = (2 * seqs).checked_mul(4 * row).ok_or_else(too_large)?;
        let lse_bytes = 2 * seqs * 4 * self.shape.num_q_heads as u64;
        if meta_bytes.max(v_bytes) > MAX_STEP_META_BYTES {
            return Err(too_large());
        }
        self.dev.reserve_upload(meta_bytes as usize)?;
        let meta = self.dev.alloc(meta_bytes as usize)?;
        let ws_v = self.dev.alloc(v_bytes as usize)?;
        let ws_lse = self.dev.alloc(lse_bytes as usize)?;
        self.cascade = Some(CascadeBuffers {
            meta,
            meta_bytes,
            ws_v,
            ws_lse,
            planned: None,
        });
        Ok(())
    }

    /// Plans this step's decode as cascade attention over `groups` (see
    /// [`crate::ops::cascade`]; [`find_groups`](crate::ops::cascade::find_groups) finds
    /// them in `meta`'s tables): validates them against `meta` (the step [`plan`] just
    /// planned), uploads their metadata with one copy, and makes every layer's
    /// [`decode`](Self::decode) of this step a cascade. No groups: flat attention.
    /// Refused with a sliding window.
    ///
    /// [`plan`]: Self::plan
    pub fn plan_cascade(
        &mut self,
        meta: &StepMeta<'_>,
        groups: &[CascadeGroup],
    ) -> Result<Option<PlannedCascade>> {
        let planned = self
            .planned
            .as_mut()
            .ok_or_else(|| Error::InvalidState("no step planned: call plan() first".into()))?;
        planned.cascade = None;
        let Some((ds, _)) = planned.decode else {
            return Ok(None);
        };
        if groups.is_empty() {
            return Ok(None);
        }
        let buffers = self.cascade.ok_or_else(|| {
            Error::InvalidState("no cascade buffers: call enable_cascade() first".into())
        })?;
        if meta.window.is_some() || planned.window.is_some() {
            return Err(Error::invalid(
                "cascade",
                "not with a sliding window (its tables hold released blocks)",
            ));
        }
        if self.groups > 1 {
            return Err(Error::invalid(
                "cascade",
                "not for a runner of several layer groups",
            ));
        }
        // The step `plan` validated (its tables' and lengths' fingerprint), and every
        // block id the shared pass reads inside the pool (checked again here: a
        // fingerprint is no proof against a crafted table).
        if meta.context_lens.len() != ds.num_seqs as usize
            || meta.max_blocks_per_seq != ds.max_blocks_per_seq
            || Some(fingerprint(meta)) != buffers.planned
        {
            return Err(Error::invalid("meta", "not the step plan() planned"));
        }
        crate::ops::attention::validate_metadata(&ds, None, meta.block_tables, meta.context_lens)?;
        let bs = self.shape.block_size;
        validate_groups(
            groups,
            meta.block_tables,
            meta.max_blocks_per_seq,
            meta.context_lens,
            bs,
        )?;
        let n = ds.num_seqs as usize;
        let width = groups.iter().map(|g| g.shared_blocks).max().unwrap_or(1);
        let rows: usize = groups.iter().map(|g| g.rows.len()).sum();
        let (off, bytes) = layout(groups.len() as u64, width as u64, rows as u64, n as u64)
            .filter(|&(_, b)| b <= buffers.meta_bytes)
            .ok_or_else(|| Error::invalid("cascade", "more groups than the runner holds"))?;
        // The sections, as i32 words.
        let mut words = vec![0i32; bytes as usize / 4];
        let (w, mw) = (width as usize, meta.max_blocks_per_seq as usize);
        let at = |o: u64| o as usize / 4;
        let mut tok = 0usize;
        let mut shared_tokens = 0u64;
        let mut max_group = 0u32;
        let mut state_rows: Vec<i32> = (0..n).flat_map(|r| [r as i32, -1]).collect();
        words[at(off.qo_indptr)] = 0;
        for (gi, g) in groups.iter().enumerate() {
            let first = g.rows[0] as usize;
            let s = g.shared_blocks as usize;
            words[at(off.tables) + gi * w..at(off.tables) + gi * w + s]
                .copy_from_slice(&meta.block_tables[first * mw..first * mw + s]);
            let shared = g.shared_blocks * bs;
            words[at(off.lens) + gi] = shared as i32;
            shared_tokens += shared as u64;
            max_group = max_group.max(g.rows.len() as u32);
            for &r in &g.rows {
                let r = r as usize;
                words[at(off.q_rows) + tok] = r as i32;
                // The row's own position: past every shared token.
                words[at(off.q_pos) + tok] = meta.context_lens[r] - 1;
                words[at(off.kv_start) + r] = shared as i32;
                state_rows[2 * r + 1] = (n + tok) as i32;
                tok += 1;
            }
            words[at(off.qo_indptr) + gi + 1] = tok as i32;
        }
        words[at(off.state_rows)..at(off.state_rows) + 2 * n].copy_from_slice(&state_rows);
        self.staging.clear();
        self.staging
            .extend(words.iter().flat_map(|x| x.to_le_bytes()));
        self.dev.upload(buffers.meta, &self.staging)?;
        let shape = self.shape.batch(groups.len() as u32, width);
        let shared = PlannedPrefill {
            shape,
            num_tokens: rows as u32,
            max_rows: max_group * shape.group(),
            window: None,
            kernel: PrefillKernel::choose(
                &shape,
                self.shape.dtype,
                self.shape.kv_dtype,
                self.dev.max_shared_bytes(),
            ),
        };
        let c = PlannedCascade {
            groups: groups.len() as u32,
            rows: rows as u32,
            shared_tokens,
            shared,
            offsets: off,
        };
        let planned = self.planned.as_mut().expect("planned above");
        planned.cascade = Some(c);
        Ok(Some(c))
    }

    /// A layer's decode as cascade attention (see [`crate::ops::cascade`]).
    ///
    /// # Safety
    /// As [`launch_decode_with`](Self::launch_decode_with) for `src` and `out`; `c` is
    /// the cascade `plan_cascade` planned for this step.
    pub(super) unsafe fn decode_cascade(
        &self,
        opts: &AttentionOptions,
        (ds, p): (DecodeShape, SplitPlan),
        src: &DecodeSource,
        out: DecodeTarget,
        c: PlannedCascade,
    ) -> Result<()> {
        let b = self
            .cascade
            .ok_or_else(|| Error::InvalidState("cascade planned without its buffers".into()))?;
        let n = ds.num_seqs as u64;
        let heads = ds.num_q_heads as u64;
        let row = ds.row_elems();
        let esize = self.shape.dtype.size() as u64;
        let total = n + c.rows as u64;
        let meta = |o: u64| b.meta.offset(o).get();
        // SAFETY (each slice): the runner's own buffers, sized by `enable_cascade` for
        // `2 * max_seqs` rows of f32 (so of any dtype) and their heads.
        let lse_at = |first: u64, rows: u64| unsafe {
            GlobalSliceMut::from_raw_parts(
                (b.ws_lse.get() + 4 * first * heads) as *mut f32,
                rows * heads,
            )
        };
        // 1. Suffixes: every row from its first unshared token, into the workspace.
        // SAFETY: the caller's for `src`; the workspace as above; `kv_start` the
        // validated starts `plan_cascade` uploaded (each inside its context).
        unsafe {
            self.launch_decode_with(
                opts,
                (ds, p),
                src,
                DecodeTarget {
                    out: (b.ws_v.get(), n * row, row),
                    lse: lse_at(0, n),
                    sinks: GlobalSlice::empty(),
                    kv_start: GlobalSlice::from_raw_parts(
                        meta(c.offsets.kv_start) as *const i32,
                        n,
                    ),
                },
            )?;
        }
        // 2. Shared prefixes: each group's rows as one sequence of query tokens.
        // SAFETY: as above; the shared tables, offsets, lengths, rows and positions
        // `plan_cascade` validated and uploaded.
        unsafe {
            self.launch_prefill_with(&PrefillLaunch {
                planned: c.shared,
                opts,
                q: (src.q.0, src.q.1),
                q_row_stride: src.q.2,
                q_rows: meta(c.offsets.q_rows),
                q_pos: meta(c.offsets.q_pos),
                tree_mask: 0,
                tables: meta(c.offsets.tables),
                qo_indptr: meta(c.offsets.qo_indptr),
                context_lens: meta(c.offsets.lens),
                caches: src.caches,
                scales: src.scales,
                sinks: GlobalSlice::empty(),
                out: b.ws_v.get() + n * row * esize,
                lse: lse_at(n, c.rows as u64),
                // Each row's window from its own position (`q_pos`): the part of the
                // prefix before it gets no weight (its rows' tables hold every block:
                // a step planned with a window has no cascade).
                window: opts.window.unwrap_or(0),
            })?;
        }
        // 3. The merge of each row's parts into `out`, the sinks once.
        // SAFETY: the workspace the two passes wrote; `state_rows` the uploaded parts
        // of every row (its suffix, and its shared output or none); `out` the caller's.
        unsafe {
            self.launch_merge_with(&MergeLaunch {
                num_rows: ds.num_seqs,
                num_states: 2,
                v: (b.ws_v.get(), total * row),
                lse: lse_at(0, total).as_const(),
                state_rows: GlobalSlice::from_raw_parts(
                    meta(c.offsets.state_rows) as *const i32,
                    2 * n,
                ),
                sinks: out.sinks,
                out: out.out,
                lse_out: out.lse,
            })
        }
    }
}
