//! The low-level block API under hostile input (issue #13): ids outside the pool,
//! double frees, references to free blocks, and tables handed to the wrong manager are
//! errors that change nothing; they neither panic nor corrupt the counts. Nothing here
//! relies on `debug_assert` (run with `--release` too).

use std::collections::HashSet;

use pagedkv_host::Error;
use pagedkv_host::block::{BlockPool, BlockTable, KvCacheManager, Location, NULL_BLOCK};

/// Every usable block of `p`, allocated: all distinct, then the pool is empty.
fn drain(p: &mut BlockPool) -> Vec<u32> {
    let mut got = Vec::new();
    while let Ok(b) = p.allocate() {
        got.push(b);
    }
    let set: HashSet<u32> = got.iter().copied().collect();
    assert_eq!(
        set.len(),
        got.len(),
        "a block was handed out twice: {got:?}"
    );
    assert_eq!(got.len() as u32, p.num_usable());
    got
}

fn is_unknown_block(r: Result<impl std::fmt::Debug, Error>, id: u32) {
    match r {
        Err(Error::Unknown {
            what: "block",
            id: got,
        }) => assert_eq!(got, id as u64),
        other => panic!("expected an unknown block {id}, got {other:?}"),
    }
}

#[test]
fn block_ids_outside_the_pool_are_errors() {
    let mut p = BlockPool::new(4, true).unwrap();
    for b in [4, 5, u32::MAX] {
        is_unknown_block(p.ref_cnt(b), b);
        is_unknown_block(p.block_hash(b), b);
        is_unknown_block(p.free(b, 0), b);
        is_unknown_block(p.incref(b), b);
        is_unknown_block(p.touch(b, 0), b);
        is_unknown_block(p.cache(b, name(42)), b);
    }
    assert_eq!(p.num_free(), 3);
    assert_eq!(p.ref_cnt(3).unwrap(), 0);
    drain(&mut p);
}

#[test]
fn a_double_free_is_an_error_and_the_block_is_handed_out_once() {
    let mut p = BlockPool::new(4, true).unwrap();
    let b = p.allocate().unwrap();
    p.free(b, 0).unwrap();
    // Release builds used to wrap the count to u32::MAX and queue the block twice.
    assert!(matches!(p.free(b, 0), Err(Error::InvalidState(_))));
    assert_eq!(p.ref_cnt(b).unwrap(), 0);
    assert_eq!(p.num_free(), 3);
    assert_eq!(p.free_queue().iter().filter(|&&x| x == b).count(), 1);
    drain(&mut p);
    assert!(matches!(p.allocate(), Err(Error::OutOfBlocks { .. })));
}

#[test]
fn a_reference_to_a_free_block_is_an_error() {
    let mut p = BlockPool::new(4, true).unwrap();
    let b = p.allocate().unwrap();
    p.free(b, 0).unwrap();
    // An incref of a free block would make it held and free at once.
    assert!(matches!(p.incref(b), Err(Error::InvalidState(_))));
    assert_eq!(p.ref_cnt(b).unwrap(), 0);
    // Caching a free block would corrupt the cached-free count.
    assert!(matches!(p.cache(b, name(7)), Err(Error::InvalidState(_))));
    assert_eq!(p.block_hash(b).unwrap(), None);
    assert_eq!(p.num_cached_free(), 0);
    drain(&mut p);
}

#[test]
fn the_null_block_is_never_handed_out_nor_cached() {
    let mut p = BlockPool::new(3, true).unwrap();
    // Freeing or sharing the null block is a no-op (tables pad with it).
    p.free(NULL_BLOCK, 0).unwrap();
    p.incref(NULL_BLOCK).unwrap();
    assert!(p.cache(NULL_BLOCK, name(1)).is_err());
    assert!(p.touch(NULL_BLOCK, 0).is_err());
    assert_eq!(p.lookup(name(1)), None);
    assert!(!drain(&mut p).contains(&NULL_BLOCK));
}

#[test]
fn a_fill_larger_than_the_held_fill_is_an_error() {
    let mut p = BlockPool::new(3, true).unwrap();
    let b = p.allocate().unwrap();
    p.add_fill(4);
    assert!(matches!(
        p.free(b, 5),
        Err(Error::InvalidArgument { arg: "fill", .. })
    ));
    assert_eq!(p.ref_cnt(b).unwrap(), 1);
    p.free(b, 4).unwrap();
    assert_eq!(p.held_fill(), 0);
}

/// A manager with a 10-token table (two blocks of 8).
fn manager_with_table() -> (KvCacheManager, BlockTable) {
    let mut kv = KvCacheManager::new(8, 4, 8, true, None).unwrap();
    let mut t = BlockTable::new();
    kv.allocate_prefill(&mut [&mut t], &(0..10).collect::<Vec<_>>(), None)
        .unwrap();
    (kv, t)
}

#[test]
fn slot_of_a_position_without_one_is_an_error() {
    let (kv, t) = manager_with_table();
    assert_eq!(kv.slot(&t, 9).unwrap(), t.blocks()[1] as i64 * 8 + 1);
    // Past the table (the blocks end at position 15): used to index out of bounds.
    for pos in [10, 16, u32::MAX] {
        assert!(matches!(
            kv.slot(&t, pos),
            Err(Error::InvalidArgument { arg: "pos", .. })
        ));
    }
    assert!(kv.slot(&BlockTable::new(), 0).is_err());
}

#[test]
fn a_table_of_another_manager_is_refused() {
    let (mut a, mut t) = manager_with_table();
    // The same shape, so the ids would be in range: only identity tells them apart.
    let (mut b, mut u) = manager_with_table();
    assert_eq!(t.owner(), Some(a.id()));
    assert_ne!(a.id(), b.id());
    let foreign = |r: Result<(), Error>| {
        assert!(
            matches!(r, Err(Error::InvalidArgument { arg: "table", .. })),
            "{r:?}"
        )
    };
    let mut copies = Vec::new();
    foreign(b.free(&mut t));
    foreign(b.slot(&t, 0).map(drop));
    foreign(b.append_slot(&mut t, &mut copies).map(drop));
    foreign(b.fork(&mut t).map(drop));
    foreign(b.commit(&mut t, &(0..10).collect::<Vec<_>>(), None));
    foreign(b.append_cost(&t).map(drop));
    foreign(b.group_append_cost([&t]).map(drop));
    foreign(b.swap_out_cost(&[&mut t]).map(drop));
    foreign(b.swap_out(&mut [&mut t], &mut copies));
    assert!(copies.is_empty());
    // Nothing changed in either manager.
    for (kv, table) in [(&a, &t), (&b, &u)] {
        assert_eq!(kv.device().num_used(), 2);
        for &blk in table.blocks() {
            assert_eq!(kv.device().ref_cnt(blk).unwrap(), 1);
        }
    }
    a.free(&mut t).unwrap();
    b.free(&mut u).unwrap();
    assert_eq!(a.device().num_free(), a.device().num_usable());
    assert_eq!(b.device().num_free(), b.device().num_usable());
}

#[test]
fn a_swapped_table_of_another_manager_is_refused() {
    let (mut a, mut t) = manager_with_table();
    let (mut b, _) = manager_with_table();
    let mut pairs = Vec::new();
    a.swap_out(&mut [&mut t], &mut pairs).unwrap();
    assert_eq!(t.location(), Location::Host);
    assert!(b.swap_in(&mut [&mut t], &mut pairs).is_err());
    assert!(b.swap_in_cost(&[&mut t]).is_err());
    assert!(b.free(&mut t).is_err());
    assert_eq!(b.host().num_free(), b.host().num_blocks());
    a.swap_in(&mut [&mut t], &mut pairs).unwrap();
    a.free(&mut t).unwrap();
    assert_eq!(a.host().num_free(), a.host().num_blocks());
    assert_eq!(a.device().num_free(), a.device().num_usable());
}

#[test]
fn freeing_a_table_twice_frees_its_blocks_once() {
    let (mut kv, mut t) = manager_with_table();
    let mut child = kv.fork(&mut t).unwrap();
    let blocks = t.blocks().to_vec();
    assert_eq!(kv.device().ref_cnt(blocks[0]).unwrap(), 2);
    kv.free(&mut t).unwrap();
    // The table is empty now; a second free drops nothing the fork still holds.
    assert!(t.blocks().is_empty() && t.owner().is_none());
    kv.free(&mut t).unwrap();
    assert_eq!(kv.device().ref_cnt(blocks[0]).unwrap(), 1);
    assert_eq!(kv.device().num_used(), 2);
    kv.free(&mut child).unwrap();
    assert_eq!(kv.device().num_free(), kv.device().num_usable());
}

/// `BlockTable` must not be `Clone`: a clone would free the same references twice.
/// (`<T as NotClone<_>>::check` is ambiguous, and fails to compile, when `T: Clone`.)
#[test]
fn block_tables_and_managers_are_not_clone() {
    trait NotClone<A> {
        fn check() {}
    }
    impl<T: ?Sized> NotClone<()> for T {}
    struct IsClone;
    impl<T: Clone> NotClone<IsClone> for T {}
    <BlockTable as NotClone<_>>::check();
    <KvCacheManager as NotClone<_>>::check();
}

/// A reserved table keeps its entries in place while it grows to its reservation (a
/// scheduler's tables do not move until a sequence outgrows the room it got at
/// admission), and so does its fork; the slots are those of a table without the
/// reservation.
#[test]
fn a_reserved_table_never_moves_while_it_grows_to_its_reservation() {
    let bs = 16;
    let mut m = KvCacheManager::new(64, 0, bs, true, None).unwrap();
    let mut plain = KvCacheManager::new(64, 0, bs, true, None).unwrap();
    let (mut t, mut u) = (BlockTable::new(), BlockTable::new());
    t.reserve(24);
    let prompt: Vec<u32> = (0..40).collect();
    m.allocate_prefill(&mut [&mut t], &prompt, None).unwrap();
    plain
        .allocate_prefill(&mut [&mut u], &prompt, None)
        .unwrap();
    let (blocks, hashes) = (t.blocks().as_ptr(), t.hashes().as_ptr());
    let mut copies = Vec::new();
    let mut tokens = prompt.clone();
    while t.num_tokens() < 20 * bs {
        let a = m.append_slot(&mut t, &mut copies).unwrap();
        let b = plain.append_slot(&mut u, &mut copies).unwrap();
        assert_eq!(a, b, "the reservation changed a slot");
        tokens.push(t.num_tokens());
        m.commit(&mut t, &tokens, None).unwrap();
        assert_eq!(
            t.blocks().as_ptr(),
            blocks,
            "moved at {} tokens",
            t.num_tokens()
        );
        assert_eq!(
            t.hashes().as_ptr(),
            hashes,
            "moved at {} tokens",
            t.num_tokens()
        );
    }
    assert_eq!((t.blocks().len(), t.hashes().len()), (20, 20));
    let mut f = m.fork(&mut t).unwrap();
    let at = f.blocks().as_ptr();
    assert_ne!(at, blocks, "a fork has its own entries");
    while f.num_tokens() < 24 * bs {
        m.append_slot(&mut f, &mut copies).unwrap();
        assert_eq!(
            f.blocks().as_ptr(),
            at,
            "the fork moved at {} tokens",
            f.num_tokens()
        );
    }
    for x in [&mut t, &mut f] {
        m.free(x).unwrap();
    }
    plain.free(&mut u).unwrap();
    assert_eq!(m.device().num_free(), m.device().num_usable());
}

/// A distinct block name for `i`.
fn name(i: u32) -> pagedkv_host::block::BlockHash {
    pagedkv_host::block::hash_block(None, &[i], None)
}
