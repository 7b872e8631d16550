//! [`AlignedBuf`]: a host byte buffer aligned to 16 bytes.
//!
//! The kernels move 16-byte vectors, which must be 16-byte aligned; a `Vec<u8>` is not.
//! The emulator's "device memory" is therefore an `AlignedBuf`, with typed views
//! through [`bytemuck`].

use bytemuck::{Pod, Zeroable};

#[repr(C, align(16))]
#[derive(Clone, Copy, Pod, Zeroable)]
struct Chunk([u8; 16]);

/// A zero-initialised byte buffer whose start is 16-byte aligned.
#[derive(Clone)]
pub struct AlignedBuf {
    chunks: Vec<Chunk>,
    len: usize,
}

impl std::fmt::Debug for AlignedBuf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBuf({} bytes)", self.len)
    }
}

impl AlignedBuf {
    /// `len` zero bytes.
    ///
    /// # Panics
    /// If the allocation fails (as `vec!` does); [`try_zeroed`](Self::try_zeroed)
    /// returns `None` instead.
    pub fn zeroed(len: usize) -> Self {
        Self::try_zeroed(len).unwrap_or_else(|| panic!("allocation of {len} bytes failed"))
    }

    /// `len` zero bytes, or `None` when the allocation fails (for sizes that come from
    /// a caller).
    pub fn try_zeroed(len: usize) -> Option<Self> {
        let n = len.div_ceil(16);
        let mut chunks = Vec::new();
        chunks.try_reserve_exact(n).ok()?;
        chunks.resize(n, Chunk([0; 16]));
        Some(Self { chunks, len })
    }

    /// A buffer holding a copy of `data`.
    pub fn from_slice<T: Pod>(data: &[T]) -> Self {
        let bytes: &[u8] = bytemuck::cast_slice(data);
        let mut b = Self::zeroed(bytes.len());
        b.as_bytes_mut().copy_from_slice(bytes);
        b
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer holds no byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.chunks)[..self.len]
    }

    /// The bytes, writable.
    pub fn as_bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.chunks)[..self.len]
    }

    /// The buffer as a slice of `T` (its length must be a multiple of `size_of::<T>()`;
    /// panics otherwise, a programming error).
    pub fn as_slice<T: Pod>(&self) -> &[T] {
        bytemuck::cast_slice(self.as_bytes())
    }

    /// The buffer as a mutable slice of `T` (see [`AlignedBuf::as_slice`]).
    pub fn as_mut_slice<T: Pod>(&mut self) -> &mut [T] {
        bytemuck::cast_slice_mut(self.as_bytes_mut())
    }
}
