//! [`DType`] and [`HostTensor`]: typed, shaped host buffers for the kernels' host API.
//!
//! A `HostTensor` is an [`AlignedBuf`] with an element type and a shape (row-major).
//! It is the emulator's stand-in for a device tensor, and what the CPU references read.

use pagedkv_kernels::device::fp8::{e4m3_to_f32, e5m2_to_f32, f32_to_e4m3, f32_to_e5m2};
use pagedkv_kernels::device::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};

use crate::buffer::AlignedBuf;
use crate::error::{Error, Result};

/// Element type of the cache, the queries and the outputs.
///
/// `F16`, `Bf16` and `F32` ([`DType::ALL`]) serve everywhere. `E4m3` and `E5m2`
/// ([`DType::FP8`]) are cache types only: a cache of them serves queries of `F16` or
/// `Bf16`, and holds each value divided by its KV head's scale
/// ([`KvScales`](crate::ops::scales::KvScales)).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub enum DType {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
    /// IEEE single precision.
    F32,
    /// OCP fp8 `e4m3` (finite to ±448, no infinity): a cache type only.
    E4m3,
    /// OCP fp8 `e5m2` (finite to ±57344): a cache type only.
    E5m2,
}

impl DType {
    /// Every type queries, outputs and caches may have.
    pub const ALL: [DType; 3] = [DType::F16, DType::Bf16, DType::F32];
    /// The fp8 cache types.
    pub const FP8: [DType; 2] = [DType::E4m3, DType::E5m2];

    /// Bytes per element.
    pub const fn size(self) -> usize {
        match self {
            DType::E4m3 | DType::E5m2 => 1,
            DType::F16 | DType::Bf16 => 2,
            DType::F32 => 4,
        }
    }

    /// Whether this is an fp8 type (a scaled cache type, never a query's).
    pub const fn is_fp8(self) -> bool {
        matches!(self, DType::E4m3 | DType::E5m2)
    }

    /// The largest finite value of the type (what a scale maps a head's largest
    /// magnitude to when calibrating an fp8 cache).
    pub const fn max_finite(self) -> f32 {
        match self {
            DType::F16 => 65504.0,
            DType::Bf16 | DType::F32 => f32::MAX,
            DType::E4m3 => pagedkv_kernels::device::fp8::E4M3_MAX,
            DType::E5m2 => pagedkv_kernels::device::fp8::E5M2_MAX,
        }
    }

    /// Elements per 16-byte vector.
    pub const fn per_v4(self) -> u32 {
        16 / self.size() as u32
    }

    /// The short name (`"f16"`, `"bf16"`, `"f32"`, `"e4m3"`, `"e5m2"`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F16 => "f16",
            DType::Bf16 => "bf16",
            DType::F32 => "f32",
            DType::E4m3 => "e4m3",
            DType::E5m2 => "e5m2",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// What validation needs to know of a tensor, wherever it lives: its element type and
/// element count. Implemented by [`HostTensor`] and by the CUDA backend's device tensors.
pub trait TensorDesc {
    /// The element type.
    fn dtype(&self) -> DType;
    /// Number of elements.
    fn len(&self) -> usize;
    /// Whether it has no element.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl TensorDesc for HostTensor {
    fn dtype(&self) -> DType {
        HostTensor::dtype(self)
    }
    fn len(&self) -> usize {
        HostTensor::len(self)
    }
}

/// A row-major host tensor of one [`DType`].
#[derive(Clone, Debug)]
pub struct HostTensor {
    dtype: DType,
    shape: Vec<usize>,
    buf: AlignedBuf,
}

impl HostTensor {
    /// A tensor of the given shape with every element `value` (rounded to `dtype`).
    ///
    /// # Panics
    /// When the shape's size in bytes overflows `isize` (a shape from user input goes
    /// through [`HostTensor::try_full`] instead).
    pub fn full(dtype: DType, shape: &[usize], value: f64) -> Self {
        match Self::try_full(dtype, shape, value) {
            Ok(t) => t,
            Err(e) => panic!("HostTensor::full: {e}"),
        }
    }

    /// A tensor of the given shape with every element `value`, or an error naming
    /// `shape` when its size in bytes overflows `isize` or cannot be allocated.
    pub fn try_full(dtype: DType, shape: &[usize], value: f64) -> Result<Self> {
        let n = Self::checked_elems(dtype, shape)?;
        let bytes = n * dtype.size();
        let buf = AlignedBuf::try_zeroed(bytes).ok_or_else(|| {
            Error::invalid(
                "shape",
                format!("{shape:?} of {dtype}: {bytes} bytes could not be allocated"),
            )
        })?;
        let mut t = HostTensor {
            dtype,
            shape: shape.to_vec(),
            buf,
        };
        t.fill(value);
        Ok(t)
    }

    /// The element count of `shape`, checked so that its bytes fit an allocation.
    pub fn checked_elems(dtype: DType, shape: &[usize]) -> Result<usize> {
        shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .filter(|n| {
                n.checked_mul(dtype.size())
                    .is_some_and(|b| b <= isize::MAX as usize)
            })
            .ok_or_else(|| {
                Error::invalid(
                    "shape",
                    format!("{shape:?} of {dtype} is too large to allocate"),
                )
            })
    }

    /// A tensor holding `values` rounded to `dtype`; `values.len()` must equal the
    /// shape's element count.
    pub fn from_f64(dtype: DType, shape: &[usize], values: &[f64]) -> Result<Self> {
        let n = Self::checked_elems(dtype, shape)?;
        if values.len() != n {
            return Err(Error::invalid(
                "values",
                format!("{} values for shape {shape:?} ({n} elements)", values.len()),
            ));
        }
        let mut t = HostTensor::try_full(dtype, shape, 0.0)?;
        for (i, v) in values.iter().enumerate() {
            t.set(i, *v);
        }
        Ok(t)
    }

    /// A tensor holding raw element bytes (`bytes.len()` must be the shape's element
    /// count times the element size).
    pub fn from_bytes(dtype: DType, shape: &[usize], bytes: &[u8]) -> Result<Self> {
        let n = Self::checked_elems(dtype, shape)?;
        if bytes.len() != n * dtype.size() {
            return Err(Error::invalid(
                "bytes",
                format!("{} bytes for {n} elements of {dtype}", bytes.len()),
            ));
        }
        let mut t = HostTensor::try_full(dtype, shape, 0.0)?;
        t.buf.as_bytes_mut().copy_from_slice(bytes);
        Ok(t)
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.buf.len() / self.dtype.size()
    }

    /// Whether the tensor has no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw storage.
    pub fn buf(&self) -> &AlignedBuf {
        &self.buf
    }

    /// The raw storage, writable.
    pub fn buf_mut(&mut self) -> &mut AlignedBuf {
        &mut self.buf
    }

    /// Element `i` (flat index), widened to `f64` exactly. For fp8 this is the stored
    /// value itself, before any scale.
    pub fn get(&self, i: usize) -> f64 {
        match self.dtype {
            DType::F16 => f16_to_f32(self.buf.as_slice::<u16>()[i]) as f64,
            DType::Bf16 => bf16_to_f32(self.buf.as_slice::<u16>()[i]) as f64,
            DType::F32 => self.buf.as_slice::<f32>()[i] as f64,
            DType::E4m3 => e4m3_to_f32(self.buf.as_bytes()[i]) as f64,
            DType::E5m2 => e5m2_to_f32(self.buf.as_bytes()[i]) as f64,
        }
    }

    /// Sets element `i` (flat index) to `v` rounded to the tensor's type (through
    /// `f32`; fp8 rounds to nearest even and saturates as `kv_append` does, NaN stays
    /// NaN). No scale is applied: store `x / scale` into an fp8 cache.
    pub fn set(&mut self, i: usize, v: f64) {
        match self.dtype {
            DType::F16 => self.buf.as_mut_slice::<u16>()[i] = f32_to_f16(v as f32),
            DType::Bf16 => self.buf.as_mut_slice::<u16>()[i] = f32_to_bf16(v as f32),
            DType::F32 => self.buf.as_mut_slice::<f32>()[i] = v as f32,
            DType::E4m3 => self.buf.as_bytes_mut()[i] = f32_to_e4m3(v as f32),
            DType::E5m2 => self.buf.as_bytes_mut()[i] = f32_to_e5m2(v as f32),
        }
    }

    /// Sets every element to `v` (NaN poisons the tensor).
    pub fn fill(&mut self, v: f64) {
        for i in 0..self.len() {
            self.set(i, v);
        }
    }

    /// Every element, widened to `f64`.
    pub fn to_f64(&self) -> Vec<f64> {
        (0..self.len()).map(|i| self.get(i)).collect()
    }
}
