//! The driver-facing seam of the step path: [`StepDevice`], the tensor views runs take,
//! and [`Recorder`], a device that only records what it is asked to do.

use std::cell::RefCell;
use std::marker::PhantomData;

use pagedkv_kernels::Kernel;

use crate::emulator::LaunchConfig;
use crate::error::{Error, Result};
use crate::tensor::{DType, HostTensor};

/// Which memory an address belongs to: a view is usable only on a device of the same
/// space (a host address handed to a GPU would fault, or worse).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Space {
    /// Host memory (the emulator's "device").
    Host,
    /// A CUDA context, by an id unique in the process.
    Cuda(u64),
    /// The [`Recorder`]'s fake addresses.
    Recorder,
}

/// An address in a [`StepDevice`]'s memory, as [`StepDevice::alloc`] returns it (not a
/// bare `u64`, so it cannot be mistaken for a size or an offset). Only a launch
/// dereferences one, under that launch's safety conditions.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DeviceAddr(u64);

impl DeviceAddr {
    /// The address `addr` of a device's memory (a device implementation makes these).
    pub const fn new(addr: u64) -> Self {
        Self(addr)
    }

    /// The address as a number.
    pub const fn get(self) -> u64 {
        self.0
    }

    /// The address `bytes` further on (wrapping: an address is never dereferenced
    /// here, and a run checks every length it launches with).
    pub const fn offset(self, bytes: u64) -> Self {
        Self(self.0.wrapping_add(bytes))
    }
}

/// The driver calls of the step path. [`StepRunner`](super::StepRunner) calls
/// [`alloc`](StepDevice::alloc) only when it is made, [`upload`](StepDevice::upload)
/// only when it plans (`plan`, `plan_prefill`) or sets ALiBi slopes, and nothing but
/// [`launch`](StepDevice::launch) in a run: [`Recorder`] proves it in the tests. (The
/// one-shot per-call functions also allocate and upload an fp8 cache's scales into
/// the runner's device they make.)
pub trait StepDevice {
    /// The memory this device's addresses live in.
    fn space(&self) -> Space;

    /// Allocates `bytes` zeroed bytes that live as long as the device; returns their
    /// 256-byte aligned address.
    fn alloc(&mut self, bytes: usize) -> Result<DeviceAddr>;

    /// Copies `src` to `dst` (an address [`alloc`](StepDevice::alloc) returned, with
    /// room for `src`), asynchronously where the device can: the device stages `src`
    /// first, so the caller's slice is free when this returns. Ordered before every
    /// later launch.
    fn upload(&mut self, dst: DeviceAddr, src: &[u8]) -> Result<()>;

    /// Makes room for uploads of up to `bytes` (pinned staging memory on a GPU), so
    /// [`upload`](StepDevice::upload) never allocates: an upload of more bytes than
    /// the largest reservation so far is an error on every device (the emulator's and
    /// the [`Recorder`] too, so a CPU test catches what would fail on a GPU). The
    /// runner calls it when it is made; whoever uploads more reserves first.
    fn reserve_upload(&mut self, bytes: usize) -> Result<()>;

    /// The most dynamic shared memory one block may have on this device, bytes (a
    /// GPU's opt-in limit; unlimited on the CPU devices). The step path picks a kernel
    /// that fits where it has a choice (prefill's multi-warp kernel or its one-warp
    /// one).
    fn max_shared_bytes(&self) -> u32 {
        u32::MAX
    }

    /// Launches kernel `K` (ordered after every earlier upload and launch).
    ///
    /// # Safety
    /// 1. Every view in `params` holds an address of this device's [`Space`], valid
    ///    for its whole length (for writes when mutable) until the launch completes.
    /// 2. The parameters passed the kernel's host validation, so every index the kernel
    ///    computes stays inside those lengths.
    /// 3. Until the launch completes, nothing else writes memory the kernel reads or
    ///    touches memory it writes.
    /// 4. `cfg` is the kernel's own launch configuration for these parameters.
    unsafe fn launch<K: Kernel>(&self, cfg: LaunchConfig, params: K::Params) -> Result<()>;
}

/// Where a view's elements are: the part shared by [`TensorView`] and
/// [`TensorViewMut`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct RawView {
    pub(crate) addr: u64,
    pub(crate) elems: u64,
    pub(crate) dtype: DType,
    pub(crate) space: Space,
    pub(crate) row_stride: Option<u64>,
}

impl RawView {
    fn new(addr: u64, elems: u64, dtype: DType, space: Space) -> Self {
        Self {
            addr,
            elems,
            dtype,
            space,
            row_stride: None,
        }
    }
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for f32 {}
    impl Sealed for pagedkv_kernels::F16 {}
    impl Sealed for pagedkv_kernels::Bf16 {}
}

/// An element type whose host slices can be viewed directly
/// ([`TensorView::from_slice`]): `f32` and the kernels' [`F16`](pagedkv_kernels::F16)
/// and [`Bf16`](pagedkv_kernels::Bf16) bit patterns. (Slices of another crate's half
/// types go through [`TensorView::from_host_bytes`].)
pub trait HostElement: sealed::Sealed + Copy {
    /// The element's dtype.
    const DTYPE: DType;
}

impl HostElement for f32 {
    const DTYPE: DType = DType::F32;
}
impl HostElement for pagedkv_kernels::F16 {
    const DTYPE: DType = DType::F16;
}
impl HostElement for pagedkv_kernels::Bf16 {
    const DTYPE: DType = DType::Bf16;
}

/// The element count of `bytes` bytes of `dtype`, or an error naming `arg`.
fn host_elems(arg: &'static str, bytes: usize, dtype: DType) -> Result<u64> {
    if !bytes.is_multiple_of(dtype.size()) {
        return Err(Error::invalid(
            arg,
            format!("{bytes} bytes is not a whole number of {dtype} elements"),
        ));
    }
    Ok((bytes / dtype.size()) as u64)
}

/// A read-only view of a tensor a run reads: an address in some [`Space`], its dtype
/// and element count, and for q-like inputs a row stride. The lifetime ties it to the
/// borrow it was made from.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    pub(crate) raw: RawView,
    _borrow: PhantomData<&'a ()>,
}

/// A writable view of a tensor a run writes (see [`TensorView`]).
#[derive(Debug)]
pub struct TensorViewMut<'a> {
    pub(crate) raw: RawView,
    _borrow: PhantomData<&'a mut ()>,
}

impl<'a> TensorView<'a> {
    /// A view of `elems` elements at `addr` in `space`, for a backend that knows the
    /// memory is valid for `'a` (the caller holds the borrow).
    pub(crate) fn borrowed(addr: u64, elems: u64, dtype: DType, space: Space) -> Self {
        Self {
            raw: RawView::new(addr, elems, dtype, space),
            _borrow: PhantomData,
        }
    }

    /// A view of a host tensor (for the emulator device).
    pub fn of_host(t: &'a HostTensor) -> Self {
        let addr = t.buf().as_bytes().as_ptr() as u64;
        Self::borrowed(addr, t.len() as u64, t.dtype(), Space::Host)
    }

    /// A view of an engine's own host memory, with no copy: e.g. a candle CPU tensor's
    /// storage from its layout's start offset. Usable on host devices (the emulator);
    /// a GPU runner refuses it (its [`Space`] is [`Space::Host`]). The runs check its
    /// length and its 16-byte alignment.
    pub fn from_slice<E: HostElement>(s: &'a [E]) -> Self {
        Self::borrowed(s.as_ptr() as u64, s.len() as u64, E::DTYPE, Space::Host)
    }

    /// A view of host bytes holding elements of `dtype` (a slice of another crate's
    /// `f16`, cast to bytes), with no copy; an error when the length is not a whole
    /// number of elements.
    pub fn from_host_bytes(bytes: &'a [u8], dtype: DType) -> Result<Self> {
        let elems = host_elems("bytes", bytes.len(), dtype)?;
        Ok(Self::borrowed(
            bytes.as_ptr() as u64,
            elems,
            dtype,
            Space::Host,
        ))
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.raw.dtype
    }

    /// The number of elements the view covers.
    pub fn elems(&self) -> u64 {
        self.raw.elems
    }

    /// The memory it is in.
    pub fn space(&self) -> Space {
        self.raw.space
    }

    /// A view of `elems` elements of `dtype` at `addr` in `space`.
    ///
    /// # Safety
    /// `addr` is valid for reads of `elems` elements in `space` for `'a`, and nothing
    /// writes that memory while a run that reads through the view executes.
    pub unsafe fn from_raw(addr: u64, elems: u64, dtype: DType, space: Space) -> Self {
        Self::borrowed(addr, elems, dtype, space)
    }

    /// The same memory read as rows `stride` elements apart (q inside a fused QKV
    /// projection): row `i` starts at element `i * stride`.
    pub fn with_row_stride(mut self, stride: u64) -> Self {
        self.raw.row_stride = Some(stride);
        self
    }
}

impl<'a> TensorViewMut<'a> {
    /// A writable view for a backend that holds the exclusive borrow for `'a`.
    pub(crate) fn borrowed(addr: u64, elems: u64, dtype: DType, space: Space) -> Self {
        Self {
            raw: RawView::new(addr, elems, dtype, space),
            _borrow: PhantomData,
        }
    }

    /// A view of a host tensor (for the emulator device).
    pub fn of_host(t: &'a mut HostTensor) -> Self {
        let (dtype, elems) = (t.dtype(), t.len() as u64);
        let addr = t.buf_mut().as_bytes_mut().as_mut_ptr() as u64;
        Self::borrowed(addr, elems, dtype, Space::Host)
    }

    /// A writable view of an engine's own host memory, with no copy (see
    /// [`TensorView::from_slice`]): a run writes its results straight into it.
    pub fn from_slice_mut<E: HostElement>(s: &'a mut [E]) -> Self {
        Self::borrowed(s.as_mut_ptr() as u64, s.len() as u64, E::DTYPE, Space::Host)
    }

    /// A writable view of host bytes holding elements of `dtype` (see
    /// [`TensorView::from_host_bytes`]).
    pub fn from_host_bytes_mut(bytes: &'a mut [u8], dtype: DType) -> Result<Self> {
        let elems = host_elems("bytes", bytes.len(), dtype)?;
        Ok(Self::borrowed(
            bytes.as_mut_ptr() as u64,
            elems,
            dtype,
            Space::Host,
        ))
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.raw.dtype
    }

    /// The number of elements the view covers.
    pub fn elems(&self) -> u64 {
        self.raw.elems
    }

    /// The memory it is in.
    pub fn space(&self) -> Space {
        self.raw.space
    }

    /// A writable view of `elems` elements of `dtype` at `addr` in `space`.
    ///
    /// # Safety
    /// `addr` is valid for reads and writes of `elems` elements in `space` for `'a`,
    /// and nothing else uses that memory while a run that writes through it executes.
    pub unsafe fn from_raw(addr: u64, elems: u64, dtype: DType, space: Space) -> Self {
        Self::borrowed(addr, elems, dtype, space)
    }

    /// Rows `stride` elements apart (see [`TensorView::with_row_stride`]).
    pub fn with_row_stride(mut self, stride: u64) -> Self {
        self.raw.row_stride = Some(stride);
        self
    }

    /// The same memory, writable, for as long as this view is borrowed mutably: pass
    /// `cache.reborrow()` to a run and keep `cache` for the next layer.
    pub fn reborrow(&mut self) -> TensorViewMut<'_> {
        TensorViewMut {
            raw: self.raw,
            _borrow: PhantomData,
        }
    }

    /// The same memory, read-only, for as long as this view is borrowed.
    pub fn as_view(&self) -> TensorView<'_> {
        TensorView {
            raw: self.raw,
            _borrow: PhantomData,
        }
    }
}

/// The check every device makes of an upload of `bytes` against its `reserved`
/// staging room ([`StepDevice::reserve_upload`]).
pub(crate) fn check_reserved(bytes: usize, reserved: usize) -> Result<()> {
    if bytes > reserved {
        return Err(Error::InvalidState(format!(
            "upload of {bytes} bytes, {reserved} reserved"
        )));
    }
    Ok(())
}

/// What a [`Recorder`] was asked to do.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DeviceOp {
    /// An allocation of this many bytes.
    Alloc(usize),
    /// An upload of this many bytes.
    Upload(usize),
    /// A launch of this kernel with this configuration.
    Launch(&'static str, LaunchConfig),
}

/// A [`StepDevice`] that executes nothing and records every call, so a test can
/// assert that a run does nothing but launch. Its addresses are fake (never
/// dereferenced): 256-byte aligned and increasing.
#[derive(Debug, Default)]
pub struct Recorder {
    next: u64,
    ops: RefCell<Vec<DeviceOp>>,
    reserved: usize,
}

impl Recorder {
    /// A recorder with an empty log.
    pub fn new() -> Self {
        Self {
            next: 1 << 20,
            ops: RefCell::new(Vec::new()),
            reserved: 0,
        }
    }

    /// Takes the log recorded so far, leaving it empty.
    pub fn take(&self) -> Vec<DeviceOp> {
        std::mem::take(&mut self.ops.borrow_mut())
    }

    /// A fake view of `elems` elements (for tests of the run path's arguments).
    pub fn view(&mut self, elems: u64, dtype: DType) -> TensorViewMut<'static> {
        let addr = self.next;
        self.next += (elems * dtype.size() as u64).next_multiple_of(256).max(256);
        // SAFETY: the recorder never dereferences an address.
        unsafe { TensorViewMut::from_raw(addr, elems, dtype, Space::Recorder) }
    }
}

impl StepDevice for Recorder {
    fn space(&self) -> Space {
        Space::Recorder
    }
    fn alloc(&mut self, bytes: usize) -> Result<DeviceAddr> {
        self.ops.borrow_mut().push(DeviceOp::Alloc(bytes));
        let addr = self.next;
        self.next += (bytes as u64).next_multiple_of(256).max(256);
        Ok(DeviceAddr(addr))
    }
    fn upload(&mut self, dst: DeviceAddr, src: &[u8]) -> Result<()> {
        if dst.0 == 0 {
            return Err(Error::InvalidState("upload to a null address".into()));
        }
        check_reserved(src.len(), self.reserved)?;
        self.ops.borrow_mut().push(DeviceOp::Upload(src.len()));
        Ok(())
    }
    fn reserve_upload(&mut self, bytes: usize) -> Result<()> {
        self.reserved = self.reserved.max(bytes);
        Ok(())
    }
    unsafe fn launch<K: Kernel>(&self, cfg: LaunchConfig, _params: K::Params) -> Result<()> {
        self.ops.borrow_mut().push(DeviceOp::Launch(K::NAME, cfg));
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::emulator::Emulator;
    use crate::ops::attention::AttentionOptions;
    use crate::step::{
        DecodeIo, EmuDevice, KvAppendIo, StepCapacity, StepMeta, StepRunner, StepShape,
    };

    const SHAPE: StepShape = StepShape {
        num_q_heads: 4,
        num_kv_heads: 2,
        head_dim: 64,
        block_size: 16,
        num_blocks: 4,
        dtype: DType::F32,
        kv_dtype: DType::F32,
    };
    const POOL: usize = 4 * 2 * 16 * 64;

    fn runner<D: StepDevice>(dev: D) -> StepRunner<D> {
        let cap = StepCapacity {
            max_seqs: 2,
            max_blocks_per_seq: 2,
            max_tokens: 8,
            max_partitions: 4,
        };
        let mut r = StepRunner::with_split(dev, SHAPE, cap, None).unwrap();
        // One sequence of 3 tokens in block 2.
        r.plan(&StepMeta {
            block_tables: &[2],
            max_blocks_per_seq: 1,
            context_lens: &[3],
            slot_mapping: &[32, 33, 34],
            window: None,
        })
        .unwrap();
        r
    }

    /// Aligned f32 storage seen as a slice, as an engine's own buffer would be.
    fn values(n: usize, f: impl Fn(usize) -> f64) -> HostTensor {
        let v: Vec<f64> = (0..n).map(f).collect();
        HostTensor::from_f64(DType::F32, &[n], &v).unwrap()
    }

    fn f32s(t: &HostTensor) -> &[f32] {
        bytemuck::cast_slice(t.buf().as_bytes())
    }

    /// Views of plain slices run the same kernels as views of host tensors: the
    /// outputs are bit for bit the same.
    #[test]
    fn slice_views_match_host_tensor_views() {
        let k = values(3 * 128, |i| ((i * 7) % 13) as f64 / 13.0 - 0.5);
        let v = values(3 * 128, |i| ((i * 5) % 11) as f64 / 11.0);
        let q = values(256, |i| ((i * 3) % 17) as f64 / 17.0 - 0.3);
        let opts = AttentionOptions::new(64);
        let mut outs = Vec::new();
        for by_slice in [false, true] {
            let r = runner(EmuDevice::new(Emulator::new()));
            let mut kc = HostTensor::full(DType::F32, &[POOL], f64::NAN);
            let mut vc = HostTensor::full(DType::F32, &[POOL], f64::NAN);
            let mut out = HostTensor::full(DType::F32, &[256], f64::NAN);
            let mut kcv = TensorViewMut::of_host(&mut kc);
            let mut vcv = TensorViewMut::of_host(&mut vc);
            let (key, value, qv) = if by_slice {
                (
                    TensorView::from_slice(f32s(&k)),
                    TensorView::from_host_bytes(v.buf().as_bytes(), DType::F32).unwrap(),
                    TensorView::from_slice(f32s(&q)),
                )
            } else {
                (
                    TensorView::of_host(&k),
                    TensorView::of_host(&v),
                    TensorView::of_host(&q),
                )
            };
            r.kv_append(KvAppendIo {
                key,
                value,
                key_cache: kcv.reborrow(),
                value_cache: vcv.reborrow(),
                kv_scales: None,
                group: 0,
            })
            .unwrap();
            let out_view = if by_slice {
                let bytes = out.buf_mut().as_bytes_mut();
                TensorViewMut::from_slice_mut(bytemuck::cast_slice_mut::<u8, f32>(bytes))
            } else {
                TensorViewMut::of_host(&mut out)
            };
            r.decode(
                &opts,
                DecodeIo {
                    lse: None,
                    q: qv,
                    key_cache: kcv.as_view(),
                    value_cache: vcv.as_view(),
                    sinks: None,
                    out: out_view,
                    kv_scales: None,
                    group: 0,
                },
            )
            .unwrap();
            let bits: Vec<u64> = out.to_f64().iter().map(|x| x.to_bits()).collect();
            assert!(out.to_f64().iter().all(|x| x.is_finite()));
            outs.push(bits);
        }
        assert_eq!(outs[0], outs[1]);
    }

    /// A slice that does not start on 16 bytes, a byte count that is not whole
    /// elements, and a host slice handed to a device of another memory space are
    /// errors, never a launch.
    #[test]
    fn slice_views_are_checked() {
        let k = values(3 * 128 + 1, |_| 0.5);
        let mut kc = HostTensor::full(DType::F32, &[POOL], 0.0);
        let mut vc = HostTensor::full(DType::F32, &[POOL], 0.0);
        let r = runner(EmuDevice::new(Emulator::new()));
        let mut kcv = TensorViewMut::of_host(&mut kc);
        let mut vcv = TensorViewMut::of_host(&mut vc);
        let off = &f32s(&k)[1..];
        let e = r
            .kv_append(KvAppendIo {
                key: TensorView::from_slice(off),
                value: TensorView::from_slice(off),
                key_cache: kcv.reborrow(),
                value_cache: vcv.reborrow(),
                kv_scales: None,
                group: 0,
            })
            .unwrap_err();
        assert!(e.to_string().contains("16-byte aligned"), "{e}");

        assert!(TensorView::from_host_bytes(&[0u8; 6], DType::F32).is_err());
        assert_eq!(
            TensorView::from_host_bytes(&[0u8; 6], DType::F16)
                .unwrap()
                .elems(),
            3
        );

        let mut rec = Recorder::new();
        let (kr, vr) = (
            rec.view(POOL as u64, DType::F32),
            rec.view(POOL as u64, DType::F32),
        );
        let r = runner(rec);
        let whole = &f32s(&k)[..3 * 128];
        let e = r
            .kv_append(KvAppendIo {
                key: TensorView::from_slice(whole),
                value: TensorView::from_slice(whole),
                key_cache: kr,
                value_cache: vr,
                kv_scales: None,
                group: 0,
            })
            .unwrap_err();
        assert!(e.to_string().contains("memory of Host"), "{e}");
        assert!(
            r.device()
                .take()
                .iter()
                .all(|op| !matches!(op, DeviceOp::Launch(..)))
        );
    }
}
