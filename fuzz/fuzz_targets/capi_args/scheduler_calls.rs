//! The scheduler's calls, on real handles: create (with arbitrary settings), destroy,
//! add_request, step (reading every array the batch claims, in full, so that ASan
//! checks the claimed lengths), on_step_done and on_step_done_accepted (with the right
//! list, or one reordered, shortened, padded or replaced, and arbitrary counts),
//! set_lookahead and the queries. [`State`]
//! tracks which handles are live or destroyed and what each step scheduled, so that
//! the target knows what every call must answer.

use std::ptr::{null, null_mut};

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use pagedkv_c::pagedkv_status::*;
use pagedkv_c::*;

use crate::generate::{pick_u32, pick_u64};
use crate::{check, message};

pub(crate) type Sched = *mut pagedkv_scheduler;

#[derive(Default)]
pub(crate) struct State {
    /// Live schedulers and, for each, the sequences its last step scheduled that wait
    /// for their tokens (what `on_step_done`'s `n` is checked against).
    pub(crate) live: Vec<(Sched, Vec<u64>)>,
    /// Destroyed handles: passed again, never dereferenced here.
    dead: Vec<Sched>,
    /// Request and sequence ids seen, to aim at real ones.
    ids: Vec<u64>,
    seqs: Vec<u64>,
}

impl State {
    /// A scheduler argument: null, a destroyed one, or a live one.
    fn handle(&self, u: &mut Unstructured) -> Result<Sched> {
        Ok(match u.int_in_range(0..=9)? {
            0 => null_mut(),
            1 if !self.dead.is_empty() => *u.choose(&self.dead)?,
            _ if !self.live.is_empty() => u.choose(&self.live)?.0,
            _ => null_mut(),
        })
    }

    fn awaiting(&self, s: Sched) -> usize {
        self.live
            .iter()
            .find(|(h, _)| *h == s)
            .map_or(0, |(_, w)| w.len())
    }

    fn set_awaiting(&mut self, s: Sched, seqs: Vec<u64>) {
        if let Some((_, w)) = self.live.iter_mut().find(|(h, _)| *h == s) {
            *w = seqs;
        }
    }

    fn id(&self, u: &mut Unstructured, known: &[u64]) -> Result<u64> {
        if !known.is_empty() && u.ratio(3, 4)? {
            Ok(*u.choose(known)?)
        } else {
            u.arbitrary()
        }
    }
}

pub(crate) fn create(st: &mut State, u: &mut Unstructured) -> Result<()> {
    let mut c = std::mem::MaybeUninit::<pagedkv_scheduler_config>::uninit();
    // SAFETY: valid for a write.
    check(
        unsafe { pagedkv_scheduler_config_default(c.as_mut_ptr()) },
        "config_default",
    );
    // SAFETY: filled by the successful call above.
    let mut c = unsafe { c.assume_init() };
    // Sizes bounded: the scheduler allocates in proportion to num_blocks and pads
    // block-table rows to max_model_len (see the report on issue #13).
    c.num_blocks = u.int_in_range(0..=2048)?;
    if u.ratio(1, 32)? {
        // Pools beyond the cap (2^24 blocks), near the type's limits: refused by name,
        // never an allocation that aborts.
        c.num_blocks = u.int_in_range((1 << 24) + 1..=u32::MAX)?;
    }
    c.block_size = pick_u32(u, &[8, 16, 32, 0, 12, 64])?;
    c.num_host_blocks = u.int_in_range(0..=512)?;
    if u.ratio(1, 32)? {
        c.num_host_blocks = u.int_in_range((1 << 24) + 1..=u32::MAX)?;
    }
    c.max_model_len = u.int_in_range(0..=4096)?;
    c.max_num_seqs = pick_u64(u, 64)?;
    c.max_tokens_per_step = pick_u64(u, 8192)?;
    c.watermark = if u.ratio(1, 4)? {
        u.arbitrary()?
    } else {
        *u.choose(&[0.0, 0.01, 0.5, 0.99, 1.0, -0.1, f64::NAN, f64::INFINITY])?
    };
    c.preempt_by_swap = u.arbitrary::<u8>()? as u32 % 3;
    c.priority_policy = u.arbitrary::<u8>()? as u32 % 3;
    c.enable_prefix_caching = u.arbitrary::<u8>()? as u32 % 3;
    c.sliding_window = pick_u32(u, &[0, 1, 16, 100, 4096])?;
    let mut s: Sched = null_mut();
    let (cp, op): (*const pagedkv_scheduler_config, *mut Sched) = match u.int_in_range(0..=15)? {
        0 => (null(), &mut s),
        1 => (&c, null_mut()),
        _ => (&c, &mut s),
    };
    // A scheduler of layer groups in a quarter of the cases: up to 3 windows (0: full)
    // in a buffer as long as the count, or a count past the buffer's (refused first:
    // 0 or past 64 groups), or no buffer.
    let groups = u.ratio(1, 4)?;
    let windows: Vec<u32> = (0..u.int_in_range(0..=3usize)?)
        .map(|_| pick_u32(u, &[0, 1, 16, 100]))
        .collect::<Result<_>>()?;
    let (wp, wn) = match u.int_in_range(0..=7)? {
        0 => (null(), windows.len() as u64),
        1 => (windows.as_ptr(), *u.choose(&[0u64, 65, u64::MAX])?),
        _ => (windows.as_ptr(), windows.len() as u64),
    };
    let status = if groups {
        // SAFETY: each pointer null or valid; `wp` valid for `wn` reads unless `wn` is
        // one the library refuses before reading.
        check(
            unsafe { pagedkv_scheduler_create_groups(cp, wp, wn, op) },
            "create_groups",
        )
    } else {
        // SAFETY: each pointer null or valid.
        check(unsafe { pagedkv_scheduler_create(cp, op) }, "create")
    };
    if status == PAGEDKV_OK {
        assert!(!s.is_null());
        // A new handle may reuse a destroyed one's address: it is live again.
        st.dead.retain(|d| *d != s);
        st.live.push((s, Vec::new()));
    }
    Ok(())
}

pub(crate) fn destroy(st: &mut State, u: &mut Unstructured) -> Result<()> {
    let s = st.handle(u)?;
    // SAFETY: null, live, or destroyed (detected).
    let r = check(unsafe { pagedkv_scheduler_destroy(s) }, "destroy");
    let was_live = st.live.iter().any(|(h, _)| *h == s);
    // Nothing runs on another thread: a live handle is idle, so destroy succeeds.
    assert_eq!(
        r == PAGEDKV_OK,
        was_live,
        "destroy {s:?}: {r:?} {}",
        message()
    );
    if was_live {
        st.live.retain(|(h, _)| *h != s);
        st.dead.push(s);
    }
    Ok(())
}

pub(crate) fn add_request(st: &mut State, u: &mut Unstructured) -> Result<()> {
    let s = st.handle(u)?;
    let len = u.int_in_range(0..=300)?;
    let prompt: Vec<u32> = (0..len)
        .map(|_| u.arbitrary::<u32>().map(|t| t % 64))
        .collect::<Result<_>>()?;
    let id = st.id(u, &st.ids.clone())?;
    let mut r = pagedkv_request {
        id,
        prompt: prompt.as_ptr(),
        prompt_len: len,
        max_tokens: pick_u32(u, &[0, 1, 2, 5, 100, 5000])?,
        stop_token: match u.int_in_range(0..=4)? {
            0 => u.arbitrary()?,
            1 => -1,
            _ => u.int_in_range(-2..=70)?,
        },
        priority: u.arbitrary()?,
        has_cache_salt: u.arbitrary::<u8>()? as u32 % 3,
        cache_salt: u.int_in_range(0..=3)?,
    };
    // A buffer of the longest prompt any scheduler here accepts (`create` makes
    // max_model_len at most 4096): prompt_len is checked against max_model_len before
    // the prompt is read, so a prompt_len beyond it, near the type's limits, reads
    // nothing (AddressSanitizer would report a read past the buffer; a 4-token buffer
    // with prompt_len 2^20 once read 4 MiB past it).
    let longest: Vec<u32> = vec![7; 4096];
    if u.ratio(1, 16)? {
        // A null prompt with any length: refused before it is read.
        r.prompt = null();
        r.prompt_len = u.arbitrary()?;
    } else if u.ratio(1, 8)? {
        r.prompt = longest.as_ptr();
        r.prompt_len = match u.int_in_range(0..=4)? {
            0 => u.arbitrary()?,
            1 => u64::MAX - u.int_in_range(0..=8u64)?,
            2 => 1u64 << u.int_in_range(12..=63u32)?,
            3 => 4096 - u.int_in_range(0..=8u64)?,
            _ => 4096 + u.int_in_range(0..=8u64)?,
        }
        .min(if u.ratio(1, 2)? { u64::MAX } else { 4096 });
    }
    let mut seq = 0u64;
    let (rp, op): (*const pagedkv_request, *mut u64) = match u.int_in_range(0..=15)? {
        0 => (null(), &mut seq),
        1 => (&r, null_mut()),
        _ => (&r, &mut seq),
    };
    // SAFETY: the request's prompt is valid for prompt_len reads (or null).
    if check(unsafe { pagedkv_add_request(s, rp, op) }, "add_request") == PAGEDKV_OK {
        st.ids.push(id);
        st.seqs.push(seq);
    }
    Ok(())
}

pub(crate) fn step(st: &mut State, u: &mut Unstructured) -> Result<()> {
    let s = st.handle(u)?;
    let mut b = std::mem::MaybeUninit::<pagedkv_batch>::uninit();
    let out = if u.ratio(1, 16)? {
        null_mut()
    } else {
        b.as_mut_ptr()
    };
    // SAFETY: out null or valid for a write.
    if check(unsafe { pagedkv_step(s, out) }, "step") != PAGEDKV_OK {
        return Ok(());
    }
    // SAFETY: written by the successful call.
    let b = unsafe { b.assume_init() };
    // Read every array the batch claims, in full: ASan checks the claimed lengths.
    // SAFETY: the library's documented lengths; valid until the next step/destroy.
    let read = |p: *const u8, n: u64, size: usize| {
        if n > 0 {
            assert!(!p.is_null());
            // SAFETY: the batch's documented pointer and length.
            let bytes = unsafe { std::slice::from_raw_parts(p, n as usize * size) };
            std::hint::black_box(bytes.iter().fold(0u8, |a, &x| a ^ x));
        }
    };
    let n = b.num_seqs;
    read(b.seqs.cast(), n, size_of::<pagedkv_scheduled_seq>());
    read(b.block_tables.cast(), n * b.max_blocks_per_seq as u64, 4);
    read(b.context_lens.cast(), n, 4);
    read(b.slot_mapping.cast(), b.num_slots, 8);
    read(b.copies.cast(), b.num_copies * 2, 4);
    read(b.swap_out.cast(), b.num_swap_out * 2, 4);
    read(b.swap_in.cast(), b.num_swap_in * 2, 4);
    let seqs: Vec<u64> = if n == 0 {
        Vec::new()
    } else {
        // SAFETY: as above.
        unsafe { std::slice::from_raw_parts(b.seqs, n as usize) }
            .iter()
            .map(|q| q.seq)
            .collect()
    };
    st.seqs.extend(&seqs);
    st.set_awaiting(s, seqs);
    Ok(())
}

pub(crate) fn step_done(st: &mut State, u: &mut Unstructured) -> Result<()> {
    let s = st.handle(u)?;
    let scheduled: Vec<u64> = st
        .live
        .iter()
        .find(|(h, _)| *h == s)
        .map(|(_, w)| w.clone())
        .unwrap_or_default();
    // Usually the scheduled sequences, sometimes reordered, dropped, duplicated or
    // replaced.
    let mut list = scheduled.clone();
    if u.ratio(1, 3)? && !list.is_empty() {
        match u.int_in_range(0..=3)? {
            0 => {
                let i = u.choose_index(list.len())?;
                list.remove(i);
            }
            1 => list.push(*u.choose(&scheduled)?),
            2 => {
                let i = u.choose_index(list.len())?;
                list[i] = st.id(u, &st.seqs.clone())?;
            }
            _ => list.reverse(),
        }
    }
    let n: u64 = match u.int_in_range(0..=5)? {
        0 => u.arbitrary()?,
        1 => list.len() as u64 + 1,
        2 => u64::MAX,
        _ => list.len() as u64,
    };
    // The library may read at most what its last step scheduled, and only when n
    // matches it: the buffer holds min(n, scheduled) entries, at least the list.
    let need = (n.min(st.awaiting(s) as u64) as usize).max(list.len());
    let mut buf: Vec<pagedkv_sampled> = list
        .iter()
        .map(|&seq| {
            Ok(pagedkv_sampled {
                seq,
                token: u.arbitrary::<u32>()? % 80,
                reserved: 0,
            })
        })
        .collect::<Result<_>>()?;
    buf.resize(
        need,
        pagedkv_sampled {
            seq: 0,
            token: 0,
            reserved: 0,
        },
    );
    let sampled = if u.ratio(1, 16)? {
        null()
    } else {
        buf.as_ptr()
    };
    let mut finished = 0u64;
    let fin = if u.ratio(1, 4)? {
        null_mut()
    } else {
        &mut finished as *mut u64
    };
    let r = if u.ratio(1, 3)? {
        // The speculative form: per row a count of arbitrary size into one token
        // array holding exactly the counts' sum (read only when `num_tokens` is it).
        let mut rows: Vec<pagedkv_accepted> = Vec::with_capacity(buf.len());
        for x in &buf {
            rows.push(pagedkv_accepted {
                seq: x.seq,
                num_tokens: match u.int_in_range(0..=7)? {
                    0 => u.arbitrary()?,
                    k => k - 1,
                },
                reserved: 0,
            });
        }
        let sum = rows.iter().map(|r| r.num_tokens as u64).sum::<u64>();
        let tokens: Vec<u32> = (0..sum.min(1 << 16)).map(|i| (i % 80) as u32).collect();
        let num_tokens = if sum == tokens.len() as u64 && !u.ratio(1, 8)? {
            sum
        } else {
            // Not the sum (or too big to hold): refused before `tokens` is read.
            sum.wrapping_add(1 + u.int_in_range(0..=3)?)
        };
        let rp = if u.ratio(1, 16)? { null() } else { rows.as_ptr() };
        let tp = if u.ratio(1, 16)? { null() } else { tokens.as_ptr() };
        // SAFETY: `rows` null or valid for every entry the library may read;
        // `tokens` null or holding `sum` entries, read only when `num_tokens` is it.
        check(
            unsafe { pagedkv_on_step_done_accepted(s, rp, n, tp, num_tokens, fin) },
            "on_step_done_accepted",
        )
    } else {
        // SAFETY: `sampled` is null or valid for every entry the library may read.
        check(
            unsafe { pagedkv_on_step_done(s, sampled, n, fin) },
            "on_step_done",
        )
    };
    if r == PAGEDKV_OK {
        assert_eq!(n as usize, st.awaiting(s), "on_step_done accepted n={n}");
        st.set_awaiting(s, Vec::new());
    }
    Ok(())
}

pub(crate) fn queries(st: &mut State, u: &mut Unstructured) -> Result<()> {
    let s = st.handle(u)?;
    if u.ratio(1, 6)? {
        // A lookahead for a known or arbitrary sequence, in or out of range.
        let seq = st.id(u, &st.seqs.clone())?;
        let k = match u.int_in_range(0..=3)? {
            0 => u.arbitrary()?,
            k => k * 3,
        };
        // SAFETY: plain values.
        check(unsafe { pagedkv_set_lookahead(s, seq, k) }, "set_lookahead");
        return Ok(());
    }
    match u.int_in_range(0..=4)? {
        4 => {
            // Any group of the last step's batch, null `out` sometimes.
            let g = pick_u32(u, &[0, 1, 2, 3, 64, u32::MAX])?;
            let mut t = std::mem::MaybeUninit::<pagedkv_group_tables>::uninit();
            let p = if u.ratio(1, 8)? {
                null_mut()
            } else {
                t.as_mut_ptr()
            };
            // SAFETY: handle null, live or destroyed; `p` null or valid for a write.
            check(unsafe { pagedkv_batch_group(s, g, p) }, "batch_group");
        }
        0 => {
            let mut idle = 7u32;
            let p = if u.ratio(1, 8)? {
                null_mut()
            } else {
                &mut idle as *mut u32
            };
            // SAFETY: null or valid for a write.
            if check(unsafe { pagedkv_is_idle(s, p) }, "is_idle") == PAGEDKV_OK {
                assert!(idle <= 1);
            }
        }
        1 => {
            let mut m = pagedkv_metrics::default();
            let p = if u.ratio(1, 8)? {
                null_mut()
            } else {
                &mut m as *mut pagedkv_metrics
            };
            // SAFETY: null or valid for a write.
            check(unsafe { pagedkv_get_metrics(s, p) }, "get_metrics");
        }
        2 => {
            let id = st.id(u, &st.ids.clone())?;
            // SAFETY: handle null, live or destroyed.
            check(unsafe { pagedkv_abort(s, id) }, "abort");
            // SAFETY: as above.
            check(
                unsafe { pagedkv_reset_prefix_cache(s) },
                "reset_prefix_cache",
            );
        }
        _ => {
            let seq = st.id(u, &st.seqs.clone())?;
            let cap_buf = u.int_in_range(0..=600usize)?;
            let mut buf = vec![0u32; cap_buf];
            let mut len = 0u64;
            let (out, cap) = match u.int_in_range(0..=7)? {
                // A null `out` with any capacity: refused unless the capacity is 0.
                0 => (null_mut(), pick_u64(u, 4)?),
                _ => (buf.as_mut_ptr(), u.int_in_range(0..=cap_buf as u64)?),
            };
            let lp = if u.ratio(1, 16)? {
                null_mut()
            } else {
                &mut len as *mut u64
            };
            // SAFETY: `out` is null or valid for `cap` writes.
            check(
                unsafe { pagedkv_seq_tokens(s, seq, out, cap, lp) },
                "seq_tokens",
            );
        }
    }
    Ok(())
}
