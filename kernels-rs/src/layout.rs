//! [`PagedLayout`]: every piece of page-table address arithmetic, in one place.
//!
//! Per layer, the K and the V cache are each
//! `[num_blocks, num_kv_heads, block_size, head_dim]` (HND): one (block, head) is
//! `block_size * head_dim` contiguous elements, so a thread block serving one KV head
//! streams whole contiguous chunks with 16-byte loads.
//!
//! A *slot* is `physical_block * block_size + offset_in_block`; token `t` of a sequence
//! lives in logical block `t / block_size` of its block table, at offset
//! `t % block_size`. Block ids are widened to 64 bits before they are multiplied by a
//! stride, so pools above 2^31 elements address correctly.

/// Shape of one layer's paged K (or V) cache, and the offsets into it.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PagedLayout {
    /// Blocks in the pool.
    pub num_blocks: u32,
    /// KV heads per layer.
    pub num_kv_heads: u32,
    /// Tokens per block.
    pub block_size: u32,
    /// Elements per head vector.
    pub head_dim: u32,
}

impl PagedLayout {
    /// Elements per token and head (`head_dim`).
    #[inline(always)]
    pub const fn token_stride(&self) -> u64 {
        self.head_dim as u64
    }

    /// Elements per (block, head): `block_size * head_dim`.
    #[inline(always)]
    pub const fn head_stride(&self) -> u64 {
        self.block_size as u64 * self.head_dim as u64
    }

    /// Elements per block: `num_kv_heads * block_size * head_dim`.
    #[inline(always)]
    pub const fn block_stride(&self) -> u64 {
        self.num_kv_heads as u64 * self.head_stride()
    }

    /// Elements in the whole pool. Unchecked (the kernels take a layout the host
    /// validated): it wraps around for a layout of 2^64 elements or more, so a host
    /// sizing anything from a caller's layout uses
    /// `pagedkv_host::ops::checked_pool_elems` instead.
    #[inline(always)]
    pub const fn pool_elems(&self) -> u64 {
        self.num_blocks as u64 * self.block_stride()
    }

    /// Token slots in the whole pool.
    #[inline(always)]
    pub const fn num_slots(&self) -> u64 {
        self.num_blocks as u64 * self.block_size as u64
    }

    /// Element offset of `(block_id, head, offset_in_block, 0)`.
    #[inline(always)]
    pub const fn offset(&self, block_id: u32, head: u32, offset_in_block: u32) -> u64 {
        block_id as u64 * self.block_stride()
            + head as u64 * self.head_stride()
            + offset_in_block as u64 * self.token_stride()
    }

    /// Element offset of `(slot, head, 0)`, for a non-negative slot.
    #[inline(always)]
    pub const fn slot_offset(&self, slot: u64, head: u32) -> u64 {
        let bs = self.block_size as u64;
        self.offset((slot / bs) as u32, head, (slot % bs) as u32)
    }

    /// Logical block and offset within it of token position `pos`.
    #[inline(always)]
    pub const fn logical(&self, pos: u32) -> (u32, u32) {
        (pos / self.block_size, pos % self.block_size)
    }
}
