//! KV specs and layer groups: models whose layers keep different parts of the context
//! (Gemma 2 and 3, gpt-oss: sliding-window layers between full-attention ones) share
//! one block pool.
//!
//! A layer's [`KvSpec`] says which tokens it keeps: all of them, or the last `w`. Layers
//! of one spec are cut into *layer groups* of equal size ([`LayerGroups`], as vLLM's
//! hybrid KV-cache manager does): the scheduler keeps one block table per group and
//! sequence, and a block id names the same token slots in every layer *of its group*.
//! A window group's table releases what falls out of its window, so a 32k-token
//! request holds the whole context in the full groups and about `window / block_size
//! + 1` blocks in each window group.
//!
//! # Memory layout
//! Every group has the same number of layers, `layers_per_group` (the last group of a
//! spec may have fewer, its missing layers unused). The cache is `layers_per_group`
//! K/V tensors of `num_blocks` blocks each, and the `i`-th layer of every group uses
//! tensor `i` ([`LayerGroups::tensor_of`]): a block id belongs to one group, which
//! uses it in every tensor. So the pool's blocks are what every group draws from,
//! one block id standing for `layers_per_group` layers' pages, and the memory is
//! `num_blocks × layers_per_group` pages, not `num_blocks × num_layers`.
//!
//! ```
//! use pagedkv_host::block::{KvSpec, LayerGroups};
//!
//! // Gemma 3 (1B): 26 layers, every sixth global, the rest with a 512-token window.
//! let layers: Vec<KvSpec> = (0..26)
//!     .map(|l| if l % 6 == 5 { KvSpec::Full } else { KvSpec::SlidingWindow(512) })
//!     .collect();
//! let g = LayerGroups::new(&layers)?;
//! assert_eq!(g.layers_per_group(), 4); // the 4 full layers set the group size
//! assert_eq!(g.specs().len(), 7); // 6 window groups (22 layers) and 1 full group
//! assert_eq!(g.specs()[0], KvSpec::SlidingWindow(512)); // in order of first appearance
//! assert_eq!((g.group_of(5), g.tensor_of(5)), (6, 0)); // the first full layer
//! # Ok::<(), pagedkv_host::Error>(())
//! ```

use crate::error::{Error, Result};

/// The most layer groups one pool serves.
pub const MAX_KV_GROUPS: usize = 64;

/// Which of a sequence's tokens a layer keeps in its cache.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum KvSpec {
    /// Every token (full attention).
    Full,
    /// The last `w` tokens (sliding-window attention of `w` tokens, the query's own
    /// included); blocks wholly before the window are released.
    SlidingWindow(u32),
}

impl KvSpec {
    /// The window, for a sliding-window spec.
    pub fn window(self) -> Option<u32> {
        match self {
            KvSpec::Full => None,
            KvSpec::SlidingWindow(w) => Some(w),
        }
    }

    /// The spec of a window (`None`: full attention).
    pub fn from_window(window: Option<u32>) -> Self {
        window.map_or(KvSpec::Full, KvSpec::SlidingWindow)
    }

    /// Checks the spec (a window of at least one token).
    pub(crate) fn check(self, arg: &'static str) -> Result<()> {
        if self == KvSpec::SlidingWindow(0) {
            return Err(Error::invalid(
                arg,
                "a sliding window must be at least 1 token",
            ));
        }
        Ok(())
    }
}

/// A model's layers cut into groups of one spec and equal size (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LayerGroups {
    specs: Vec<KvSpec>,
    /// Per layer, its group and its index in the group (its tensor).
    layers: Vec<(u32, u32)>,
    layers_per_group: u32,
}

impl LayerGroups {
    /// The groups of a model whose layer `l` has spec `layers[l]`: the layers of each
    /// spec (specs in order of first appearance), in layer order, cut into groups of
    /// `layers_per_group`, the fewest layers any spec has. Errors: no layers, a window
    /// of 0 tokens, more than [`MAX_KV_GROUPS`] groups.
    pub fn new(layers: &[KvSpec]) -> Result<Self> {
        if layers.is_empty() {
            return Err(Error::invalid("layers", "a model has at least one layer"));
        }
        let mut kinds: Vec<(KvSpec, Vec<u32>)> = Vec::new();
        for (l, &s) in layers.iter().enumerate() {
            s.check("layers")?;
            match kinds.iter_mut().find(|(k, _)| *k == s) {
                Some((_, v)) => v.push(l as u32),
                None => kinds.push((s, vec![l as u32])),
            }
        }
        let size = kinds.iter().map(|(_, v)| v.len()).min().unwrap_or(1);
        let groups: usize = kinds.iter().map(|(_, v)| v.len().div_ceil(size)).sum();
        if groups > MAX_KV_GROUPS {
            return Err(Error::invalid(
                "layers",
                format!("{groups} layer groups (at most {MAX_KV_GROUPS})"),
            ));
        }
        let mut specs = Vec::with_capacity(groups);
        let mut map = vec![(0, 0); layers.len()];
        for (spec, ls) in kinds {
            for chunk in ls.chunks(size) {
                for (i, &l) in chunk.iter().enumerate() {
                    map[l as usize] = (specs.len() as u32, i as u32);
                }
                specs.push(spec);
            }
        }
        Ok(Self {
            specs,
            layers: map,
            layers_per_group: size as u32,
        })
    }

    /// One group of `num_layers` layers of one spec.
    pub fn uniform(spec: KvSpec, num_layers: usize) -> Result<Self> {
        Self::new(&vec![spec; num_layers])
    }

    /// The spec of each group (the scheduler's
    /// [`kv_groups`](crate::scheduler::SchedulerConfig::kv_groups)).
    pub fn specs(&self) -> &[KvSpec] {
        &self.specs
    }

    /// Layers of the model.
    pub fn num_layers(&self) -> usize {
        self.layers.len()
    }

    /// Layers per group: the K/V tensors a cache holds (see the module docs).
    pub fn layers_per_group(&self) -> usize {
        self.layers_per_group as usize
    }

    /// The group of layer `layer` (< `num_layers`).
    pub fn group_of(&self, layer: usize) -> usize {
        self.layers[layer].0 as usize
    }

    /// The K/V tensor layer `layer` reads and writes: its index in its group.
    pub fn tensor_of(&self, layer: usize) -> usize {
        self.layers[layer].1 as usize
    }
}
