//! The runs of [`StepRunner`]: per-layer `kv_append` and `decode`, which check the
//! layer's views on the host and then only launch.

use pagedkv_kernels::kernels::attention::fixed_head_dim;
use pagedkv_kernels::kernels::{
    DecodeParams, DecodeReduce, KvAppend, KvAppendParams, PagedDecode, ReduceParams,
};
use pagedkv_kernels::{GlobalSlice, GlobalSliceMut, Kernel};

use super::device::{RawView, StepDevice};
use super::runner::{DecodeIo, KvAppendIo, Planned, StepRunner};
use crate::emulator::LaunchConfig;
use crate::error::{Error, Result};
use crate::ops::attention::{
    self, AttentionOptions, DecodeShape, SplitPlan, decode_launch_config, reduce_launch_config,
};
use crate::ops::scales::with_kv;
use crate::ops::{checked_pool_elems, kv_append};
use crate::step::{TensorView, TensorViewMut};
use crate::tensor::DType;

impl<D: StepDevice> StepRunner<D> {
    fn current(&self) -> Result<&Planned> {
        self.planned
            .as_ref()
            .ok_or_else(|| Error::InvalidState("no step planned: call plan() first".into()))
    }

    /// [`check_view_as`](Self::check_view_as) the runner's query dtype.
    pub(super) fn check_view(
        &self,
        arg: &'static str,
        v: &RawView,
        rows: u64,
        row: u64,
        strided: bool,
    ) -> Result<u64> {
        self.check_view_as(arg, v, self.shape.dtype, rows, row, strided)
    }

    /// Checks a layer's K and V cache views (the runner's cache dtype, one pool each).
    pub(super) fn check_caches(&self, key: &RawView, value: &RawView) -> Result<u64> {
        let pool = checked_pool_elems(&self.shape.layout())?;
        let kv = self.shape.kv_dtype;
        self.check_view_as("key_cache", key, kv, 1, pool, false)?;
        self.check_view_as("value_cache", value, kv, 1, pool, false)?;
        Ok(pool)
    }

    /// Checks a layer's fp8 scales view (`[2, num_kv_heads]` f32, there exactly when
    /// the cache is fp8); returns the K and V scale slices (empty for an unscaled
    /// cache).
    pub(super) fn scale_slices(
        &self,
        scales: Option<&TensorView<'_>>,
    ) -> Result<(GlobalSlice<f32>, GlobalSlice<f32>)> {
        let h = self.shape.num_kv_heads as u64;
        match (self.shape.kv_dtype.is_fp8(), scales) {
            (false, None) => Ok((GlobalSlice::empty(), GlobalSlice::empty())),
            (false, Some(_)) => Err(Error::invalid(
                "kv_scales",
                format!(
                    "given for {} caches: only fp8 caches are scaled",
                    self.shape.kv_dtype
                ),
            )),
            (true, None) => Err(Error::invalid(
                "kv_scales",
                format!(
                    "missing: {} caches need each layer's K and V scales",
                    self.shape.kv_dtype
                ),
            )),
            (true, Some(v)) => {
                self.check_view_as("kv_scales", &v.raw, DType::F32, 1, 2 * h, false)?;
                // SAFETY: a checked view of this device's space of `2 * h` f32: K's `h`
                // scales, then V's.
                Ok(unsafe {
                    (
                        GlobalSlice::from_raw_parts(v.raw.addr as *const f32, h),
                        GlobalSlice::from_raw_parts((v.raw.addr + 4 * h) as *const f32, h),
                    )
                })
            }
        }
    }

    /// Checks a layer's attention-sink view (`[num_q_heads]` f32, dense); returns its
    /// slice (empty for `None`: no sinks).
    pub(super) fn sink_slice(&self, sinks: Option<&TensorView<'_>>) -> Result<GlobalSlice<f32>> {
        let Some(v) = sinks else {
            return Ok(GlobalSlice::empty());
        };
        let h = self.shape.num_q_heads as u64;
        self.check_view_as("sinks", &v.raw, DType::F32, 1, h, false)?;
        // SAFETY: a checked view of this device's space of `h` f32.
        Ok(unsafe { GlobalSlice::from_raw_parts(v.raw.addr as *const f32, h) })
    }

    /// Checks a layer's log-sum-exp output view (`[rows, num_q_heads]` f32, dense);
    /// returns its slice (empty for `None`: none written).
    pub(super) fn lse_slice(
        &self,
        lse: Option<&TensorViewMut<'_>>,
        rows: u64,
    ) -> Result<GlobalSliceMut<f32>> {
        let Some(v) = lse else {
            return Ok(GlobalSliceMut::empty());
        };
        let h = self.shape.num_q_heads as u64;
        // One dense row: the kernels store it a value at a time (no 16-byte rows).
        self.check_view_as("lse", &v.raw, DType::F32, 1, rows * h, false)?;
        // SAFETY: a checked view of this device's space of `rows * h` f32, borrowed
        // mutably by the caller for the launch.
        Ok(unsafe { GlobalSliceMut::from_raw_parts(v.raw.addr as *mut f32, rows * h) })
    }

    /// Checks a view: its memory space, dtype, 16-byte alignment, and element count
    /// (`rows` rows of `row` elements, `stride` apart, for row-strided views; exactly
    /// `elems` for dense ones). Returns the row stride (dense: `row`).
    pub(super) fn check_view_as(
        &self,
        arg: &'static str,
        v: &RawView,
        want: DType,
        rows: u64,
        row: u64,
        strided: bool,
    ) -> Result<u64> {
        let &RawView {
            addr,
            elems,
            dtype,
            space,
            row_stride: stride,
        } = v;
        if space != self.dev.space() {
            return Err(Error::invalid(
                arg,
                format!(
                    "memory of {space:?}, but the runner's device is {:?}",
                    self.dev.space()
                ),
            ));
        }
        if dtype != want {
            return Err(Error::invalid(
                arg,
                format!("dtype {dtype}, expected {want}"),
            ));
        }
        if addr == 0 || !addr.is_multiple_of(16) {
            return Err(Error::invalid(
                arg,
                format!(
                    "address {addr:#x} is not 16-byte aligned (the kernels read 16-byte vectors)"
                ),
            ));
        }
        let size = dtype.size() as u64;
        let stride = match stride {
            Some(s) if !strided => {
                return Err(Error::invalid(
                    arg,
                    format!("row stride {s}: this input is dense only"),
                ));
            }
            Some(s) => s,
            None => row,
        };
        // Each row after the first starts `stride` elements on: the kernels read rows
        // in 16-byte vectors, so a stride must keep them 16-byte aligned (a dense view
        // of one row, e.g. one layer's fp8 scales of 1 or 3 KV heads, has no stride to
        // speak of).
        let Some(stride_bytes) = stride.checked_mul(size) else {
            return Err(Error::invalid(
                arg,
                format!(
                    "row stride {stride}: {stride} elements of {size} bytes overflow 64 bits (no memory holds such rows)"
                ),
            ));
        };
        if stride < row
            || ((rows > 1 || v.row_stride.is_some()) && !stride_bytes.is_multiple_of(16))
        {
            return Err(Error::invalid(
                arg,
                format!("row stride {stride} must be >= {row} elements and a multiple of 16 bytes"),
            ));
        }
        // Checked: a stride near u64::MAX once wrapped `(rows - 1) * stride + row`
        // around to a small count that passed.
        let need = match rows {
            0 => Some(0),
            _ => (rows - 1)
                .checked_mul(stride)
                .and_then(|n| n.checked_add(row)),
        }
        .ok_or_else(|| {
            Error::invalid(
                arg,
                format!("{rows} rows of {row} elements, stride {stride}: the span overflows"),
            )
        })?;
        let ok = if strided && stride != row {
            elems >= need
        } else {
            elems == need
        };
        if !ok {
            return Err(Error::invalid(
                arg,
                format!(
                    "{elems} elements, expected {need} ({rows} rows of {row}, stride {stride})"
                ),
            ));
        }
        Ok(stride)
    }

    /// Appends this step's new tokens' K and V to one layer's cache: one launch.
    pub fn kv_append(&self, io: KvAppendIo<'_>) -> Result<()> {
        let planned = self.current()?;
        self.group_window(io.group)?;
        let n = planned.num_tokens as u64;
        let l = self.shape.layout();
        let row = l.num_kv_heads as u64 * l.head_dim as u64;
        self.check_view("key", &io.key.raw, n, row, false)?;
        self.check_view("value", &io.value.raw, n, row, false)?;
        let pool = self.check_caches(&io.key_cache.raw, &io.value_cache.raw)?;
        let (k_scales, v_scales) = self.scale_slices(io.kv_scales.as_ref())?;
        if n == 0 {
            return Ok(());
        }
        let slots = self.meta.offset(planned.offsets.slots_of(io.group)).get();
        let cfg = kv_append::launch_config(n as usize);
        with_kv!(self.shape.dtype, self.shape.kv_dtype, T, K => {
            // SAFETY: every address was checked to be of this device's space, aligned
            // and as long as its length here; the slot mapping lives in the runner's
            // metadata buffer, uploaded by `plan` (ordered before this launch).
            let params = unsafe {
                KvAppendParams::<T, K> {
                    key: GlobalSlice::from_raw_parts(io.key.raw.addr as *const T, n * row),
                    value: GlobalSlice::from_raw_parts(io.value.raw.addr as *const T, n * row),
                    slot_mapping: GlobalSlice::from_raw_parts(slots as *const i64, n),
                    key_cache: GlobalSliceMut::from_raw_parts(io.key_cache.raw.addr as *mut K, pool),
                    value_cache: GlobalSliceMut::from_raw_parts(io.value_cache.raw.addr as *mut K, pool),
                    k_scales,
                    v_scales,
                    layout: l,
                }
            };
            // SAFETY: (1) above; (2) `plan` validated the slots against this layout and
            // the views' lengths were checked; (3) the caches are borrowed mutably and
            // the inputs shared for the call, all work on the device's one queue;
            // (4) kv_append's own configuration.
            unsafe { self.dev.launch::<KvAppend<T, K>>(cfg, params)? };
        });
        Ok(())
    }

    /// Decode attention for one layer: one launch (two with split-K), with the options
    /// `opts` (`opts.alibi_slopes` must equal what [`set_alibi_slopes`](Self::set_alibi_slopes)
    /// uploaded). With a cascade planned ([`plan_cascade`](Self::plan_cascade)) the
    /// suffixes, the shared prefixes and their merge: three launches (four with
    /// split-K). Returns the split plan used.
    pub fn decode(&self, opts: &AttentionOptions, io: DecodeIo<'_>) -> Result<Option<SplitPlan>> {
        let planned = self.current()?;
        let Some((ds, p)) = planned.decode else {
            return Ok(None);
        };
        attention::validate_options(opts, ds.num_q_heads)?;
        super::runner::check_window(self.group_window(io.group)?, opts.window)?;
        if opts.alibi_slopes != self.slopes_host {
            return Err(Error::invalid(
                "alibi_slopes",
                "differ from the slopes uploaded with set_alibi_slopes",
            ));
        }
        let row = ds.row_elems();
        let rows = ds.num_seqs as u64;
        let q_stride = self.check_view("q", &io.q.raw, rows, row, true)?;
        let out_stride = self.check_view("out", &io.out.raw, rows, row, true)?;
        let pool = self.check_caches(&io.key_cache.raw, &io.value_cache.raw)?;
        let scales = self.scale_slices(io.kv_scales.as_ref())?;
        let sinks = self.sink_slice(io.sinks.as_ref())?;
        let lse = self.lse_slice(io.lse.as_ref(), rows)?;
        let src = DecodeSource {
            q: (io.q.raw.addr, io.q.raw.elems, q_stride),
            caches: (io.key_cache.raw.addr, io.value_cache.raw.addr, pool),
            scales,
            tables: self.meta.offset(planned.offsets.tables_of(io.group)).get(),
            lens: self.meta.offset(planned.offsets.lens).get(),
        };
        let out = DecodeTarget {
            out: (io.out.raw.addr, io.out.raw.elems, out_stride),
            lse,
            sinks,
            kv_start: GlobalSlice::empty(),
        };
        match planned.cascade {
            // SAFETY: the views checked above; the metadata `plan` validated.
            None => unsafe { self.launch_decode_with(opts, (ds, p), &src, out)? },
            // (A cascade runner has one layer group: `set_groups` refuses more.)
            Some(_) if io.group != 0 => {
                return Err(Error::invalid(
                    "group",
                    "a cascade serves layer group 0 only",
                ));
            }
            // SAFETY: as above; the cascade's metadata `plan_cascade` validated.
            Some(c) => unsafe { self.decode_cascade(opts, (ds, p), &src, out, c)? },
        }
        Ok(Some(p))
    }

    /// Builds the decode's parameters and launches it (and, with split-K, the reduce),
    /// writing `out`: the one place decode's parameters are made (a layer's decode, a
    /// cascade's suffix pass).
    ///
    /// # Safety
    /// Every address in `src` and `out` is of this device's space and as long as the
    /// planned shape `ds` needs (`q` and `out` rows at their strides, the tables and
    /// lengths as `plan` validated, `kv_start` 0 or `num_seqs` starts inside each
    /// context).
    pub(super) unsafe fn launch_decode_with(
        &self,
        opts: &AttentionOptions,
        (ds, p): (DecodeShape, SplitPlan),
        src: &DecodeSource,
        out: DecodeTarget,
    ) -> Result<()> {
        let l = self.shape.layout();
        let rows = ds.num_seqs as u64;
        let (dtype, kv_dtype) = (self.shape.dtype, self.shape.kv_dtype);
        let (key, value, pool) = src.caches;
        let (out_addr, out_elems, out_stride) = out.out;
        with_kv!(dtype, kv_dtype, T, K => {
            // SAFETY: the caller's for every address; the workspace and slopes buffers
            // the runner owns, sized for every plan within its capacity.
            let params = unsafe {
                DecodeParams::<T, K> {
                    q: GlobalSlice::from_raw_parts(src.q.0 as *const T, src.q.1),
                    key_cache: GlobalSlice::from_raw_parts(key as *const K, pool),
                    value_cache: GlobalSlice::from_raw_parts(value as *const K, pool),
                    k_scales: src.scales.0,
                    v_scales: src.scales.1,
                    block_tables: GlobalSlice::from_raw_parts(src.tables as *const i32, rows * ds.max_blocks_per_seq as u64),
                    context_lens: GlobalSlice::from_raw_parts(src.lens as *const i32, rows),
                    kv_start: out.kv_start,
                    alibi_slopes: if opts.alibi_slopes.is_some() {
                        GlobalSlice::from_raw_parts(self.slopes.get() as *const f32, ds.num_q_heads as u64)
                    } else {
                        GlobalSlice::empty()
                    },
                    // Read by the decode kernel without split, by the reduce with it.
                    sinks: out.sinks,
                    out: if p.is_split() {
                        GlobalSliceMut::empty()
                    } else {
                        GlobalSliceMut::from_raw_parts(out_addr as *mut T, out_elems)
                    },
                    // Likewise the log-sum-exp.
                    lse: if p.is_split() { GlobalSliceMut::empty() } else { out.lse },
                    part_out: GlobalSliceMut::from_raw_parts(self.part_out.0.get() as *mut f32, self.part_out.1),
                    part_ml: GlobalSliceMut::from_raw_parts(self.part_ml.0.get() as *mut f32, self.part_ml.1),
                    layout: l,
                    num_q_heads: ds.num_q_heads,
                    max_blocks_per_seq: ds.max_blocks_per_seq,
                    heads_per_block: p.heads_per_block,
                    partition_tokens: p.partition_tokens,
                    num_partitions: p.num_partitions,
                    scale: opts.scale,
                    softcap: opts.softcap.unwrap_or(0.0),
                    inv_softcap: opts.softcap.map_or(0.0, |c| 1.0 / c),
                    window: opts.window.unwrap_or(0),
                    _pad: 0,
                    q_row_stride: src.q.2,
                    out_row_stride: out_stride,
                }
            };
            let cfg = decode_launch_config(&ds, kv_dtype, &p);
            if p.is_split() {
                // SAFETY: (1)-(2) the caller's and `plan`'s validation; (3) `out`
                // borrowed mutably, the workspace used by one launch at a time on the
                // device's one queue; (4) the decode kernel's own configuration.
                unsafe { launch_decode::<T, K, _>(&self.dev, cfg, params)? };
                // SAFETY: as above; the reduce reads the partials the decode wrote.
                let rp = unsafe {
                    ReduceParams::<T> {
                        part_out: params.part_out.as_const(),
                        part_ml: params.part_ml.as_const(),
                        sinks: out.sinks,
                        out: GlobalSliceMut::from_raw_parts(out_addr as *mut T, out_elems),
                        lse: out.lse,
                        num_q_heads: ds.num_q_heads,
                        head_dim: ds.head_dim,
                        num_partitions: p.num_partitions,
                        _pad: 0,
                        out_row_stride: out_stride,
                    }
                };
                // SAFETY: as above.
                unsafe { self.dev.launch::<DecodeReduce<T>>(reduce_launch_config(&ds, dtype), rp)? };
            } else {
                // SAFETY: as for the split launch.
                unsafe { launch_decode::<T, K, _>(&self.dev, cfg, params)? };
            }
        });
        Ok(())
    }
}

/// What a decode launch reads: q (address, elements, row stride), the caches (K, V,
/// elements each), an fp8 cache's scales, the tables' and lengths' addresses.
pub(super) struct DecodeSource {
    pub(super) q: (u64, u64, u64),
    pub(super) caches: (u64, u64, u64),
    pub(super) scales: (GlobalSlice<f32>, GlobalSlice<f32>),
    pub(super) tables: u64,
    pub(super) lens: u64,
}

/// Where a decode launch writes, and what only its epilogue reads: out (address,
/// elements, row stride), the log-sum-exp, the sinks, each row's first token.
#[derive(Clone, Copy)]
pub(super) struct DecodeTarget {
    pub(super) out: (u64, u64, u64),
    pub(super) lse: GlobalSliceMut<f32>,
    pub(super) sinks: GlobalSlice<f32>,
    pub(super) kv_start: GlobalSlice<i32>,
}

/// Launches the decode kernel for `params.layout`: the compile-time-geometry kernel
/// [`fixed_head_dim`] names (head_dim 64, 128 or 256 at block size 16), else the
/// runtime-geometry one. The one dispatch table of the decode kernels.
///
/// # Safety
/// [`StepDevice::launch`]'s, for `params` and `cfg`.
unsafe fn launch_decode<T, K, D: StepDevice>(
    dev: &D,
    cfg: LaunchConfig,
    params: DecodeParams<T, K>,
) -> Result<()>
where
    PagedDecode<T, K, 0>: Kernel<Params = DecodeParams<T, K>>,
    PagedDecode<T, K, 64>: Kernel<Params = DecodeParams<T, K>>,
    PagedDecode<T, K, 128>: Kernel<Params = DecodeParams<T, K>>,
    PagedDecode<T, K, 256>: Kernel<Params = DecodeParams<T, K>>,
{
    // SAFETY: the caller's.
    unsafe {
        match fixed_head_dim(&params.layout) {
            64 => dev.launch::<PagedDecode<T, K, 64>>(cfg, params),
            128 => dev.launch::<PagedDecode<T, K, 128>>(cfg, params),
            256 => dev.launch::<PagedDecode<T, K, 256>>(cfg, params),
            _ => dev.launch::<PagedDecode<T, K, 0>>(cfg, params),
        }
    }
}
