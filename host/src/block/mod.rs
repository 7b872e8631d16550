//! Block management: the pool of KV-cache blocks and the per-sequence block tables.
//!
//! * [`pool`]: [`BlockPool`], `num_blocks` fixed-size blocks with reference counts, an
//!   LRU free queue and the prefix-cache map.
//! * [`table`]: [`BlockTable`] (one sequence's logical → physical map) and
//!   [`KvCacheManager`], which allocates, shares (fork, prefix hits), copies on write,
//!   slides windows and swaps through the pool.
//! * [`spec`]: [`KvSpec`] (full attention or a sliding window) and [`LayerGroups`], a
//!   hybrid model's layers cut into groups that share the pool.
//!
//! A block id names `block_size` token slots in every layer *of its layer group*'s K
//! and V pool (every layer, for a model of one group): the kernels' `slot = block_id *
//! block_size + offset_in_block`. Each group has its own block table per sequence
//! (see [`spec`]).
//!
//! Misuse is an error, never a panic or a corrupted count: the pool checks every block
//! id and reference it is given, and a [`BlockTable`] is an owning handle (not `Clone`,
//! bound to the [`KvCacheManager`] that filled it; see [`table`]).

pub mod pool;
pub mod spec;
pub mod table;

pub use pool::{BlockHash, BlockId, BlockPool, MAX_POOL_BLOCKS, NULL_BLOCK, PAD_SLOT, hash_block};
pub use spec::{KvSpec, LayerGroups, MAX_KV_GROUPS};
pub use table::{BlockTable, KvCacheManager, Location, PrefixHits};
