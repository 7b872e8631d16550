//! Fuzzes the C ABI's argument checking: each input decodes into a sequence of C ABI
//! calls on real handles (schedulers created, used, destroyed, used after destroy) with
//! arbitrary counts, nulls, shapes, layout fields, dtypes, block ids and request ids.
//! Every call must return a status, never `PAGEDKV_ERR_PANIC`, with a message exactly
//! when it failed; AddressSanitizer (on by default with cargo fuzz) catches any read or
//! write outside a buffer.
//!
//! The buffers passed are real and as long as the API contract says ("valid for n
//! reads") wherever the library cannot know the length. Counts the library must check
//! against its own state are fuzzed freely, with buffers only as long as what the
//! library may read once its check passed: `on_step_done`'s `n` against the last step
//! (the buffer holds `min(n, scheduled)` entries), the reference kernels' `*_len`
//! against the shape.
#![no_main]

use std::ffi::CStr;
use std::ptr::{null, null_mut};

use libfuzzer_sys::arbitrary::{Result, Unstructured};
use libfuzzer_sys::fuzz_target;
use pagedkv_c::pagedkv_status::*;
use pagedkv_c::*;

/// Most elements of one buffer the target allocates for a kernel argument.
const MAX_ELEMS: u64 = 1 << 16;
/// Most elements of the attention's block tables and queries (its cost grows with both).
const MAX_TABLE: u64 = 256;
const MAX_Q: u64 = 4096;
/// Most calls per input.
const MAX_CALLS: usize = 48;

type Sched = *mut pagedkv_scheduler;

#[derive(Default)]
struct State {
    /// Live schedulers and, for each, the sequences its last step scheduled that wait
    /// for their tokens (what `on_step_done`'s `n` is checked against).
    live: Vec<(Sched, Vec<u64>)>,
    /// Destroyed handles: passed again, never dereferenced here.
    dead: Vec<Sched>,
    /// Request and sequence ids seen, to aim at real ones.
    ids: Vec<u64>,
    seqs: Vec<u64>,
}

fn message() -> String {
    let p = pagedkv_last_error_message();
    assert!(!p.is_null(), "pagedkv_last_error_message() is null");
    // SAFETY: never null, NUL-terminated, valid until the next call on this thread.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Every call: a status, never a panic, with a message exactly when it failed.
fn check(st: pagedkv_status, what: &str) -> pagedkv_status {
    let m = message();
    assert_ne!(st, PAGEDKV_ERR_PANIC, "{what}: {m}");
    if st == PAGEDKV_OK {
        assert!(m.is_empty(), "{what}: OK but message `{m}`");
    } else {
        assert!(!m.is_empty(), "{what}: status {st:?} without a message");
    }
    st
}

/// A value from `interesting` or an arbitrary one.
fn pick_u32(u: &mut Unstructured, interesting: &[u32]) -> Result<u32> {
    if u.ratio(1, 4)? {
        u.arbitrary()
    } else {
        Ok(*u.choose(interesting)?)
    }
}

fn pick_u64(u: &mut Unstructured, small: u64) -> Result<u64> {
    Ok(match u.int_in_range(0..=5)? {
        0 => u.arbitrary()?,
        1 => u64::MAX,
        2 => 1 << 32,
        _ => u.int_in_range(0..=small)?,
    })
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

fn create(st: &mut State, u: &mut Unstructured) -> Result<()> {
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
    c.block_size = pick_u32(u, &[8, 16, 32, 0, 12, 64])?;
    c.num_host_blocks = u.int_in_range(0..=512)?;
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
    // SAFETY: each pointer null or valid.
    if check(unsafe { pagedkv_scheduler_create(cp, op) }, "create") == PAGEDKV_OK {
        assert!(!s.is_null());
        // A new handle may reuse a destroyed one's address: it is live again.
        st.dead.retain(|d| *d != s);
        st.live.push((s, Vec::new()));
    }
    Ok(())
}

fn destroy(st: &mut State, u: &mut Unstructured) -> Result<()> {
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

fn add_request(st: &mut State, u: &mut Unstructured) -> Result<()> {
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
    if u.ratio(1, 16)? {
        // A null prompt with any length: refused before it is read.
        r.prompt = null();
        r.prompt_len = u.arbitrary()?;
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

fn step(st: &mut State, u: &mut Unstructured) -> Result<()> {
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

fn step_done(st: &mut State, u: &mut Unstructured) -> Result<()> {
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
    // SAFETY: `sampled` is null or valid for every entry the library may read.
    let r = check(
        unsafe { pagedkv_on_step_done(s, sampled, n, fin) },
        "on_step_done",
    );
    if r == PAGEDKV_OK {
        assert_eq!(n as usize, st.awaiting(s), "on_step_done accepted n={n}");
        st.set_awaiting(s, Vec::new());
    }
    Ok(())
}

fn queries(st: &mut State, u: &mut Unstructured) -> Result<()> {
    let s = st.handle(u)?;
    match u.int_in_range(0..=3)? {
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

const LAYOUT_U32: &[u32] = &[
    0,
    1,
    2,
    3,
    8,
    16,
    32,
    64,
    128,
    256,
    1 << 20,
    1 << 31,
    u32::MAX,
];

/// An element count for a buffer the library checks against a shape: the one the
/// shape implies when it is small enough, else a small arbitrary one (the buffer is
/// really that long).
fn length(u: &mut Unstructured, implied: Option<u64>, max: u64) -> Result<u64> {
    match implied {
        Some(n) if n <= max && u.ratio(7, 8)? => Ok(n),
        _ => u.int_in_range(0..=max.min(64)),
    }
}

fn product(f: &[u32]) -> Option<u64> {
    f.iter().try_fold(1u64, |a, &x| a.checked_mul(x as u64))
}

/// A buffer pointer: usually the buffer, sometimes null.
fn ptr<T>(u: &mut Unstructured, v: &mut [T]) -> Result<*mut T> {
    Ok(if u.ratio(1, 24)? {
        null_mut()
    } else {
        v.as_mut_ptr()
    })
}

fn floats(u: &mut Unstructured, n: u64) -> Result<Vec<f32>> {
    let seed: u8 = u.arbitrary()?;
    Ok((0..n)
        .map(|i| ((i as u32 ^ seed as u32) % 13) as f32 - 6.0)
        .collect())
}

fn reference_kv_append(u: &mut Unstructured) -> Result<()> {
    let nb = pick_u32(u, LAYOUT_U32)?;
    let nh = pick_u32(u, LAYOUT_U32)?;
    let bs = pick_u32(u, &[8, 16, 32, 0, 12])?;
    let hd = pick_u32(u, &[64, 80, 96, 112, 128, 256, 0, 1, 63])?;
    let row = nh as u64 * hd as u64;
    // key/value hold num_tokens rows: the library cannot know their length, so the
    // count must really fit (or be 0).
    let max_tokens = if row == 0 {
        8
    } else {
        (MAX_ELEMS / row).min(8)
    };
    let num_tokens = u.int_in_range(0..=max_tokens)?;
    let kn = num_tokens * row;
    let mut k = floats(u, kn)?;
    let mut v = floats(u, kn)?;
    let slots_implied = product(&[nb, bs]).unwrap_or(u64::MAX);
    let mut slots: Vec<i64> = (0..num_tokens)
        .map(|_| {
            Ok(match u.int_in_range(0..=5)? {
                0 => u.arbitrary()?,
                1 => -1,
                _ => u.int_in_range(0..=slots_implied.min(1 << 20) as i64)?,
            })
        })
        .collect::<Result<_>>()?;
    let cache_len = length(u, product(&[nb, nh, bs, hd]), MAX_ELEMS)?;
    let mut kc = vec![0f32; cache_len as usize];
    let mut vc = vec![0f32; cache_len as usize];
    let (kp, vp, sp) = (ptr(u, &mut k)?, ptr(u, &mut v)?, ptr(u, &mut slots)?);
    let (kcp, vcp) = (ptr(u, &mut kc)?, ptr(u, &mut vc)?);
    // SAFETY: each pointer null or valid for its length.
    check(
        unsafe {
            pagedkv_reference_kv_append(nb, nh, bs, hd, kp, vp, num_tokens, sp, kcp, vcp, cache_len)
        },
        "reference_kv_append",
    );
    Ok(())
}

fn reference_attention(u: &mut Unstructured) -> Result<()> {
    let sh = pagedkv_decode_shape {
        num_seqs: pick_u32(u, &[0, 1, 2, 3, 4, 1 << 16, u32::MAX])?,
        num_q_heads: pick_u32(u, &[0, 1, 2, 4, 8, 3, 1 << 20])?,
        num_kv_heads: pick_u32(u, &[0, 1, 2, 4, 1 << 20, u32::MAX])?,
        head_dim: pick_u32(u, &[64, 80, 96, 112, 128, 256, 0, 65])?,
        block_size: pick_u32(u, &[8, 16, 32, 0, 12])?,
        num_blocks: pick_u32(u, &[0, 1, 2, 4, 8, 1 << 31, u32::MAX])?,
        max_blocks_per_seq: pick_u32(u, &[0, 1, 2, 4, 8, u32::MAX])?,
        reserved: u.arbitrary()?,
    };
    let qn = product(&[sh.num_seqs, sh.num_q_heads, sh.head_dim]);
    let q_len = length(u, qn, MAX_Q)?;
    let out_len = length(u, qn, MAX_Q)?;
    let cache_len = length(
        u,
        product(&[sh.num_blocks, sh.num_kv_heads, sh.block_size, sh.head_dim]),
        MAX_ELEMS,
    )?;
    let bt_len = length(u, product(&[sh.num_seqs, sh.max_blocks_per_seq]), MAX_TABLE)?;
    let cl_len = length(u, Some(sh.num_seqs as u64), MAX_TABLE)?;
    let mut q = floats(u, q_len)?;
    let mut kc = floats(u, cache_len)?;
    let mut vc = floats(u, cache_len)?;
    let mut out = vec![0f32; out_len as usize];
    let ctx_max = (sh.max_blocks_per_seq as i64).saturating_mul(sh.block_size as i64);
    let mut bt: Vec<i32> = (0..bt_len)
        .map(|_| {
            Ok(match u.int_in_range(0..=5)? {
                0 => u.arbitrary()?,
                1 => -1,
                _ => u.int_in_range(0..=sh.num_blocks.min(64) as i32)?,
            })
        })
        .collect::<Result<_>>()?;
    let mut cl: Vec<i32> = (0..cl_len)
        .map(|_| {
            Ok(match u.int_in_range(0..=4)? {
                0 => u.arbitrary()?,
                1 => 0,
                _ => u.int_in_range(1..=ctx_max.clamp(1, i32::MAX as i64) as i32)?,
            })
        })
        .collect::<Result<_>>()?;
    let scale = match u.int_in_range(0..=5)? {
        0 => u.arbitrary()?,
        1 => 0.0,
        2 => f32::NAN,
        _ => 0.125,
    };
    let (qp, kp, vp) = (ptr(u, &mut q)?, ptr(u, &mut kc)?, ptr(u, &mut vc)?);
    let (bp, cp, op) = (ptr(u, &mut bt)?, ptr(u, &mut cl)?, ptr(u, &mut out)?);
    let shp: *const pagedkv_decode_shape = if u.ratio(1, 24)? { null() } else { &sh };
    // SAFETY: each pointer null or valid for its length.
    check(
        unsafe {
            pagedkv_reference_decode_attention(
                shp, scale, qp, q_len, kp, vp, cache_len, bp, bt_len, cp, cl_len, op, out_len,
            )
        },
        "reference_decode_attention",
    );
    Ok(())
}

/// The CUDA entry points: backend creation (a CUDA error without a driver), and calls
/// on a null backend. Never arbitrary device pointers on a real backend: those are the
/// caller's contract, not something the library can check.
fn cuda(u: &mut Unstructured) -> Result<()> {
    match u.int_in_range(0..=3)? {
        0 => {
            let mut b = null_mut();
            let ordinal: i32 = if u.ratio(1, 2)? { 0 } else { u.arbitrary()? };
            let op = if u.ratio(1, 8)? {
                null_mut()
            } else {
                &mut b as *mut *mut pagedkv_cuda_backend
            };
            // SAFETY: out null or valid for a write.
            if check(
                unsafe { pagedkv_cuda_backend_create(ordinal, op) },
                "cuda_backend_create",
            ) == PAGEDKV_OK
            {
                // SAFETY: just created; destroyed once.
                let r = unsafe { pagedkv_cuda_backend_destroy(b) };
                assert_eq!(check(r, "cuda_backend_destroy"), PAGEDKV_OK);
            }
        }
        1 => {
            let slots = [0i64; 4];
            // SAFETY: a null backend is refused first.
            let r = unsafe {
                pagedkv_cuda_kv_append(
                    null_mut(),
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    4,
                    slots.as_ptr(),
                    u.arbitrary()?,
                    u.arbitrary()?,
                )
            };
            assert_eq!(check(r, "cuda_kv_append"), PAGEDKV_ERR_NULL);
        }
        2 => {
            let sh = pagedkv_decode_shape {
                num_seqs: 1,
                num_q_heads: 1,
                num_kv_heads: 1,
                head_dim: 64,
                block_size: 16,
                num_blocks: 1,
                max_blocks_per_seq: 1,
                reserved: 0,
            };
            let (bt, cl) = ([0i32], [1i32]);
            // SAFETY: a null backend is refused first.
            let r = unsafe {
                pagedkv_cuda_decode_attention(
                    null_mut(),
                    &sh,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    u.arbitrary()?,
                    bt.as_ptr(),
                    1,
                    cl.as_ptr(),
                    1,
                    u.arbitrary()?,
                )
            };
            assert_eq!(check(r, "cuda_decode_attention"), PAGEDKV_ERR_NULL);
        }
        _ => {
            // SAFETY: a null backend is refused.
            let r = unsafe { pagedkv_cuda_synchronize(null_mut()) };
            assert_eq!(check(r, "cuda_synchronize"), PAGEDKV_ERR_NULL);
            let r = unsafe { pagedkv_cuda_backend_destroy(null_mut()) };
            assert_eq!(check(r, "cuda_backend_destroy"), PAGEDKV_ERR_NULL);
        }
    }
    Ok(())
}

fn run(st: &mut State, u: &mut Unstructured) -> Result<()> {
    for _ in 0..MAX_CALLS {
        if u.is_empty() {
            break;
        }
        match u.int_in_range(0..=15)? {
            0 | 1 => create(st, u)?,
            2 => destroy(st, u)?,
            3..=5 => add_request(st, u)?,
            6 | 7 => step(st, u)?,
            8 | 9 => step_done(st, u)?,
            10 | 11 => queries(st, u)?,
            12 => reference_kv_append(u)?,
            13 => reference_attention(u)?,
            14 => cuda(u)?,
            _ => {
                // SAFETY: static, NUL-terminated.
                let v = unsafe { CStr::from_ptr(pagedkv_version()) };
                assert!(!v.to_bytes().is_empty());
                // SAFETY: a null out is refused.
                let r = unsafe { pagedkv_scheduler_config_default(null_mut()) };
                assert_eq!(check(r, "config_default"), PAGEDKV_ERR_NULL);
            }
        }
    }
    Ok(())
}

/// A scheduler with a small valid configuration, so that most inputs reach the
/// scheduler's own checks.
fn create_small(st: &mut State) {
    let mut c = std::mem::MaybeUninit::<pagedkv_scheduler_config>::uninit();
    let mut s: Sched = null_mut();
    // SAFETY: valid out-pointers; the config is filled before it is read.
    unsafe {
        assert_eq!(pagedkv_scheduler_config_default(c.as_mut_ptr()), PAGEDKV_OK);
        let mut c = c.assume_init();
        c.num_blocks = 64;
        c.max_model_len = 512;
        c.num_host_blocks = 16;
        c.enable_prefix_caching = 1;
        assert_eq!(pagedkv_scheduler_create(&c, &mut s), PAGEDKV_OK);
    }
    st.live.push((s, Vec::new()));
}

fuzz_target!(|data: &[u8]| {
    let mut st = State::default();
    create_small(&mut st);
    let mut u = Unstructured::new(data);
    let _ = run(&mut st, &mut u);
    // Nothing runs on another thread: every live handle is idle and destroys once.
    for (s, _) in st.live.drain(..) {
        // SAFETY: live, destroyed once.
        let r = unsafe { pagedkv_scheduler_destroy(s) };
        assert_eq!(check(r, "final destroy"), PAGEDKV_OK);
    }
});
