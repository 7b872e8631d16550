//! Cascade attention: decode rows whose block tables begin with the same blocks (a
//! shared system prompt, few-shot examples, the parallel samples of one prompt) attend
//! that shared prefix *once for all of them* and their own suffixes each alone, and the
//! two parts are merged by their log-sum-exp ([`crate::ops::merge`]).
//!
//! ## The plan ([`find_groups`])
//! A row can share its *full* blocks before the block of its newest token: `(len - 1)
//! / block_size` of them, so its own suffix always holds at least that token. Rows are
//! bucketed by their first block; a bucket's rows share the longest common prefix of
//! their tables (at most each row's shareable blocks). Where a bucket's rows diverge,
//! splitting it at the first differing block may save more (the parallel samples of a
//! prompt inside a batch sharing only its system prompt): [`find_groups`] takes the
//! split or the whole bucket, whichever reads fewer blocks, recursively. A group
//! needs two rows and at least `min_shared_blocks` shared blocks. One level: a row is
//! in at most one group (FlashInfer's multi-level cascade would nest them).
//!
//! ## The passes (a layer's decode, [`StepRunner::decode`](crate::step::StepRunner::decode))
//! 1. **Suffix**: the decode kernel over every row, each from its first unshared token
//!    (`kv_start`; 0 for a row in no group), into a workspace with its log-sum-exp, no
//!    sink.
//! 2. **Shared**: the prefill kernel (tensor cores for f16 / bf16) with one sequence
//!    per group: its rows' queries (gathered by `q_rows`, each at its own position
//!    `q_pos`, so ALiBi is each row's and the causal mask admits the whole prefix) over
//!    the shared blocks, into the workspace with its log-sum-exp, no sink. A CTA tile of
//!    query rows reads the shared K/V once: `ceil(query rows / rows per tile)` times per
//!    KV head in all, instead of once per row.
//! 3. **Merge**: the two parts of every row (one for a row in no group) into the
//!    output, the sink joining once.
//!
//! GQA, soft-cap, ALiBi and fp8 caches compose (each pass applies them as flat
//! attention does). Sliding windows and layer groups are refused: a window's tables
//! hold released blocks the prefix comparison would have to skip.
//!
//! ## When it pays ([`CascadePolicy::Auto`], [`pays`])
//! A model, not a measurement: cascade saves `(rows - 1) x shared tokens` of K/V reads
//! per group and KV head, and costs two more launches per layer (about
//! [`LAUNCH_COST_BYTES`] of DRAM time each on an H100: a launch in a CUDA graph is
//! about a microsecond, 3.35 TB/s moves ~3.4 MB in it) plus the workspace traffic
//! (each row's suffix output written and read once more, the shared outputs written
//! and read, in `f32` at most: `4 x num_q_heads x head_dim` bytes, 4 times a row).
//! `Auto` runs the cascade when the saving exceeds the cost.

use crate::error::{Error, Result};
use crate::tensor::DType;

/// DRAM bytes one extra launch is worth in [`pays`]'s model (a microsecond at an
/// H100's 3.35 TB/s).
pub const LAUNCH_COST_BYTES: u64 = 3_350_000;

/// Whether a backend runs decode as cascade attention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum CascadePolicy {
    /// Flat attention always.
    Off,
    /// Cascade whenever [`find_groups`] finds a group sharing at least
    /// `min_shared_blocks` blocks.
    Always {
        /// The fewest shared blocks worth a group (at least 1).
        min_shared_blocks: u32,
    },
    /// Cascade when [`pays`] says the groups [`find_groups`] finds (of at least one
    /// shared block) save more K/V traffic than the extra launches and the merge cost:
    /// the default.
    #[default]
    Auto,
}

/// Decode rows that share their first `shared_blocks` blocks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct CascadeGroup {
    /// The rows (indices into the step's decode rows), by context length, shortest
    /// first (the shared pass needs their positions non-decreasing).
    pub rows: Vec<u32>,
    /// Blocks every row's table begins with (each a full block before the row's
    /// newest token).
    pub shared_blocks: u32,
}

/// Blocks row `r` can share: its full blocks before its newest token's.
fn shareable(lens: &[i32], r: usize, block_size: u32) -> u32 {
    (lens[r].max(1) as u32 - 1) / block_size
}

/// The groups of decode rows that share a prefix of at least `min_shared_blocks` full
/// blocks (see the [module docs](self)). `tables` is `[lens.len(), width]`.
pub fn find_groups(
    tables: &[i32],
    width: u32,
    lens: &[i32],
    block_size: u32,
    min_shared_blocks: u32,
) -> Vec<CascadeGroup> {
    if block_size == 0 {
        return Vec::new();
    }
    let w = width as usize;
    let n = lens.len().min(tables.len().checked_div(w).unwrap_or(0));
    // Each row's shareable blocks, once.
    let caps: Vec<u32> = (0..n)
        .map(|r| shareable(lens, r, block_size).min(width))
        .collect();
    let mut rows: Vec<usize> = (0..n)
        .filter(|&r| caps[r] >= min_shared_blocks.max(1))
        .collect();
    let mut out = Vec::new();
    split(
        tables,
        w,
        &mut rows,
        0,
        min_shared_blocks.max(1),
        &caps,
        &mut out,
    );
    for g in &mut out {
        g.rows.sort_by_key(|&r| (lens[r as usize], r));
    }
    out.sort_by_key(|g| g.rows[0]);
    out
}

/// Groups `rows` (which share their first `depth` blocks), appending the cheaper of:
/// one group over all of them at their common prefix, or their split at the first
/// block they differ in (recursively). Returns the blocks the choice saves. Sorts
/// `rows` in place (by their block at each depth: `O(n log n)` a level, no allocation
/// unless a group is found: it runs every step under `CascadePolicy::Auto`).
fn split(
    tables: &[i32],
    w: usize,
    rows: &mut [usize],
    depth: u32,
    min: u32,
    caps: &[u32],
    out: &mut Vec<CascadeGroup>,
) -> u64 {
    if rows.len() < 2 {
        return 0;
    }
    // The common prefix, at most every row's shareable blocks.
    let limit = rows.iter().map(|&r| caps[r]).min().unwrap_or(0);
    let mut lcp = depth;
    while lcp < limit {
        let b = tables[rows[0] * w + lcp as usize];
        if rows.iter().any(|&r| tables[r * w + lcp as usize] != b) {
            break;
        }
        lcp += 1;
    }
    let whole = if lcp >= min {
        (rows.len() as u64 - 1) * lcp as u64
    } else {
        0
    };
    // The split at block `lcp`: the rows with more to share, by their block there
    // (those without first, left out).
    let key = |r: usize| (caps[r] > lcp).then(|| tables[r * w + lcp as usize]);
    rows.sort_unstable_by_key(|&r| key(r));
    let first = rows.partition_point(|&r| key(r).is_none());
    let rest = &mut rows[first..];
    let mut sub = Vec::new();
    let mut saved = 0;
    let mut i = 0;
    // (Never all the rows in one part: `lcp` would have been longer.)
    while i < rest.len() && (first > 0 || key(rest[0]) != key(rest[rest.len() - 1])) {
        let k = key(rest[i]);
        let j = i + rest[i..].partition_point(|&r| key(r) == k);
        saved += split(tables, w, &mut rest[i..j], lcp + 1, min, caps, &mut sub);
        i = j;
    }
    if whole > 0 && whole >= saved {
        out.push(CascadeGroup {
            rows: rows.iter().map(|&r| r as u32).collect(),
            shared_blocks: lcp,
        });
        whole
    } else {
        out.extend(sub);
        saved
    }
}

/// The cost model of [`CascadePolicy::Auto`] (see the [module docs](self)): whether
/// `groups` save more DRAM bytes per layer than the cascade's extra cost, for
/// `num_rows` decode rows of `num_q_heads` heads over `num_kv_heads`, `head_dim`
/// elements of `kv_dtype` in the cache.
pub fn pays(
    groups: &[CascadeGroup],
    (num_rows, num_q_heads, num_kv_heads, head_dim): (u32, u32, u32, u32),
    block_size: u32,
    kv_dtype: DType,
) -> bool {
    let kv_row = 2 * num_kv_heads as u64 * head_dim as u64 * kv_dtype.size() as u64;
    let saved: u64 = groups
        .iter()
        .map(|g| {
            (g.rows.len() as u64).saturating_sub(1)
                * (g.shared_blocks as u64 * block_size as u64)
                * kv_row
        })
        .fold(0u64, u64::saturating_add);
    let row_bytes = 4 * num_q_heads as u64 * head_dim as u64;
    let cost = 2 * LAUNCH_COST_BYTES + 4 * row_bytes * num_rows as u64;
    saved > cost
}

/// Checks `groups` against a step's decode rows: rows in range and in one group at
/// most, at least two a group, each group's rows ordered by context length and every
/// one's table beginning with the same `shared_blocks` blocks, each a full block
/// before its newest token.
pub fn validate_groups(
    groups: &[CascadeGroup],
    tables: &[i32],
    width: u32,
    lens: &[i32],
    block_size: u32,
) -> Result<()> {
    let w = width as usize;
    if block_size == 0 || (tables.len() as u64) < lens.len() as u64 * width as u64 {
        return Err(Error::invalid(
            "cascade",
            format!(
                "{} table entries for {} rows of {width} blocks of {block_size}",
                tables.len(),
                lens.len()
            ),
        ));
    }
    let mut seen = vec![false; lens.len()];
    for (gi, g) in groups.iter().enumerate() {
        let bad = |why: String| Err(Error::invalid("cascade", format!("group {gi}: {why}")));
        if g.rows.len() < 2 {
            return bad(format!("{} rows (at least 2)", g.rows.len()));
        }
        if g.shared_blocks == 0 || g.shared_blocks > width {
            return bad(format!("{} shared blocks (1..={width})", g.shared_blocks));
        }
        let first = g.rows[0] as usize;
        let mut prev = 0;
        for &r in &g.rows {
            let r = r as usize;
            if r >= lens.len() || seen[r] {
                return bad(format!("row {r} is out of range or in two groups"));
            }
            seen[r] = true;
            if lens[r] < prev {
                return bad("rows not ordered by context length".into());
            }
            prev = lens[r];
            if shareable(lens, r, block_size) < g.shared_blocks {
                return bad(format!(
                    "row {r} of {} tokens cannot share {} blocks of {block_size}",
                    lens[r], g.shared_blocks
                ));
            }
            let s = g.shared_blocks as usize;
            if tables[r * w..r * w + s] != tables[first * w..first * w + s] {
                return bad(format!("row {r}'s table does not begin with row {first}'s"));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Rows sharing a system prompt, two of them a longer prefix (parallel samples),
    /// one row alone, one too short to share.
    #[test]
    fn groups_take_the_split_that_reads_less() {
        let w = 6;
        #[rustfmt::skip]
        let tables = [
            1, 2, 3, 9, 10, 11, // row 0: system prompt 1,2 then its own
            1, 2, 4, 5, 6, 12,  // row 1: samples of one prompt 1,2,4,5,6
            1, 2, 4, 5, 6, 13,  // row 2
            7, 8, 0, 0, 0, 0,   // row 3: alone
            1, 0, 0, 0, 0, 0,   // row 4: one block, nothing full before its token
            1, 2, 3, 14, 15, 16, // row 5
        ];
        let lens = [90, 95, 93, 40, 10, 91];
        // Whole bucket: 4 rows x 2 blocks = 6 saved; split: {1,2} share 5 (5 saved) +
        // {0,5} share 3 (3 saved) = 8.
        let g = find_groups(&tables, w, &lens, 16, 1);
        assert_eq!(
            g,
            vec![
                CascadeGroup {
                    rows: vec![0, 5],
                    shared_blocks: 3
                },
                CascadeGroup {
                    rows: vec![2, 1],
                    shared_blocks: 5
                },
            ]
        );
        validate_groups(&g, &tables, w, &lens, 16).unwrap();
        // At least 4 shared blocks: only the samples.
        let g4 = find_groups(&tables, w, &lens, 16, 4);
        assert_eq!(
            g4,
            vec![CascadeGroup {
                rows: vec![2, 1],
                shared_blocks: 5
            }]
        );
        // A row whose newest token starts a block shares every block before it.
        let g = find_groups(&[3, 4, 5, 3, 4, 6], 3, &[33, 33], 16, 1);
        assert_eq!(
            g,
            vec![CascadeGroup {
                rows: vec![0, 1],
                shared_blocks: 2
            }]
        );
        let g = find_groups(&[3, 4, 5, 3, 4, 6], 3, &[32, 33], 16, 1);
        assert_eq!(
            g,
            vec![CascadeGroup {
                rows: vec![0, 1],
                shared_blocks: 1
            }]
        );
    }

    #[test]
    fn validation_names_what_is_wrong() {
        let tables = [1, 2, 3, 1, 2, 4, 1, 5, 6];
        let lens = [40, 40, 40];
        let ok = CascadeGroup {
            rows: vec![0, 1],
            shared_blocks: 2,
        };
        assert!(validate_groups(std::slice::from_ref(&ok), &tables, 3, &lens, 16).is_ok());
        for (g, why) in [
            (
                CascadeGroup {
                    rows: vec![0, 2],
                    shared_blocks: 2,
                },
                "does not begin",
            ),
            (
                CascadeGroup {
                    rows: vec![0, 1],
                    shared_blocks: 3,
                },
                "cannot share",
            ),
            (
                CascadeGroup {
                    rows: vec![0],
                    shared_blocks: 1,
                },
                "at least 2",
            ),
            (
                CascadeGroup {
                    rows: vec![0, 7],
                    shared_blocks: 1,
                },
                "out of range",
            ),
        ] {
            let e = validate_groups(&[g], &tables, 3, &lens, 16)
                .unwrap_err()
                .to_string();
            assert!(e.contains(why), "{e}");
        }
        // Tables shorter than the rows, a block size of 0: errors, not panics.
        let short = validate_groups(std::slice::from_ref(&ok), &tables[..4], 3, &lens, 16);
        assert!(short.unwrap_err().to_string().contains("table entries"));
        assert!(validate_groups(std::slice::from_ref(&ok), &tables, 3, &lens, 0).is_err());
        assert!(find_groups(&tables, 3, &lens, 0, 1).is_empty());
        let twice = [
            ok.clone(),
            CascadeGroup {
                rows: vec![1, 2],
                shared_blocks: 1,
            },
        ];
        assert!(
            validate_groups(&twice, &tables, 3, &lens, 16)
                .unwrap_err()
                .to_string()
                .contains("two groups")
        );
    }

    #[test]
    fn the_cost_model_wants_long_prefixes_shared_by_many() {
        let g = |rows: u32, blocks| {
            vec![CascadeGroup {
                rows: (0..rows).collect(),
                shared_blocks: blocks,
            }]
        };
        let shape = (64, 32, 8, 128);
        // 64 rows over 2048 tokens (128 blocks of 16), f16: 63 x 2048 x 4 KiB saved.
        assert!(pays(&g(64, 128), shape, 16, DType::F16));
        // 2 rows over one block: 4 KiB x 16 saved, far below two launches.
        assert!(!pays(&g(2, 1), shape, 16, DType::F16));
    }
}
