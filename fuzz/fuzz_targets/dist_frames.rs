//! pagedkv-dist's parsing of bytes from another process: the frame reader (whole
//! frames in memory and streams delivered in arbitrary pieces), the export decoder
//! and the import's checks, on arbitrary bytes. Never a panic; a payload buffer never
//! far ahead of the bytes that arrived (a header's claimed length allocates nothing
//! until its bytes come); an import that fails registers nothing and holds no block.
//!
//! The first byte picks how the rest is used: (0) raw bytes, as frames from a
//! stream; (1) a postcard payload in a well-formed frame (a right CRC-32, so the
//! decoder and the import see it); (2) a valid export (tokens, data and names from
//! the bytes, names from the importer's own chain) whose encoded payload is then
//! edited at positions the bytes choose, re-checksummed, decoded and imported.
#![no_main]

use std::alloc::{GlobalAlloc, Layout, System};
use std::io::Read;
use std::sync::atomic::{AtomicIsize, Ordering::Relaxed};

use libfuzzer_sys::fuzz_target;
use pagedkv::host::DType;
use pagedkv::host::backend::{AttentionBackend, BackendConfig, CpuBackend};
use pagedkv::host::scheduler::{Scheduler, SchedulerConfig};
use pagedkv::host::step::StepShape;
use pagedkv_dist::ShardSpec;
use pagedkv_dist::transfer::{
    BlockExport, ExportedBlock, Instance, LayoutDescriptor, RequestTokens, TransferEndpoint,
    decode_export,
};
use pagedkv_dist::wire::{HEADER_BYTES, MAGIC, Message, WIRE_VERSION, decode, read_message};

/// The system allocator, counting live bytes and their peak (the target runs on one
/// thread).
struct Counting;
static LIVE: AtomicIsize = AtomicIsize::new(0);
static PEAK: AtomicIsize = AtomicIsize::new(0);

fn add(d: isize) {
    let now = LIVE.fetch_add(d, Relaxed) + d;
    PEAK.fetch_max(now, Relaxed);
}

// SAFETY: every call is the system allocator's; the counting touches none of it.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc(l) };
        if !p.is_null() {
            add(l.size() as isize);
        }
        p
    }
    unsafe fn alloc_zeroed(&self, l: Layout) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let p = unsafe { System.alloc_zeroed(l) };
        if !p.is_null() {
            add(l.size() as isize);
        }
        p
    }
    unsafe fn dealloc(&self, p: *mut u8, l: Layout) {
        // SAFETY: the caller's contract, passed on.
        unsafe { System.dealloc(p, l) };
        add(-(l.size() as isize));
    }
    unsafe fn realloc(&self, p: *mut u8, l: Layout, n: usize) -> *mut u8 {
        // SAFETY: the caller's contract, passed on.
        let q = unsafe { System.realloc(p, l, n) };
        if !q.is_null() {
            add(n as isize - l.size() as isize);
        }
        q
    }
}

#[global_allocator]
static ALLOC: Counting = Counting;

/// Runs `f` and checks it never held more than 10 times `input` bytes plus 4 MiB at
/// once, whatever length a header claims: the payload buffer is at most 64 KiB ahead
/// of the bytes that arrived; a decoded message is at most some times its payload (a
/// one-byte varint is a 4-byte u32, a vector may double as it grows); and a vector's
/// claimed length preallocates at most 1 MiB (serde's cautious size hint) for each of
/// the few vectors being decoded at once (an export's blocks, a block's tokens and
/// bytes).
fn bounded<T>(input: usize, f: impl FnOnce() -> T) -> T {
    let base = LIVE.load(Relaxed);
    PEAK.store(base, Relaxed);
    let r = f();
    let held = PEAK.load(Relaxed) - base;
    let bound = 10 * input as isize + (4 << 20);
    assert!(
        held <= bound,
        "{input} bytes of input held {held} bytes at once"
    );
    r
}

/// A stream that delivers `data` in pieces of the sizes `pieces` cycles through.
struct Pieces<'a> {
    data: &'a [u8],
    pieces: &'a [u8],
    i: usize,
}

impl Read for Pieces<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        let size = match self.pieces {
            [] => usize::MAX,
            p => 1 + p[self.i % p.len()] as usize * 37,
        };
        self.i += 1;
        let n = buf.len().min(size).min(self.data.len());
        buf[..n].copy_from_slice(&self.data[..n]);
        self.data = &self.data[n..];
        Ok(n)
    }
}

/// Tokens per block.
const BS: usize = 8;

/// The importer: one layer, one KV head of 32 f32 elements, blocks of [`BS`] tokens.
fn shape() -> StepShape {
    StepShape {
        num_q_heads: 1,
        num_kv_heads: 1,
        head_dim: 32,
        block_size: BS as u32,
        num_blocks: 8,
        dtype: DType::F32,
        kv_dtype: DType::F32,
    }
}

const MODEL: &str = "fuzz";

fn endpoint(be: &CpuBackend) -> TransferEndpoint {
    TransferEndpoint::new(LayoutDescriptor::of(
        be.config(),
        ShardSpec::WHOLE,
        MODEL,
        Vec::new(),
    ))
}

fn instance() -> (Scheduler, CpuBackend) {
    let sched = Scheduler::new(SchedulerConfig {
        num_blocks: 8,
        block_size: BS as u32,
        max_num_seqs: 2,
        max_model_len: 64,
        enable_prefix_caching: true,
        ..SchedulerConfig::default()
    })
    .expect("a valid scheduler");
    let be = CpuBackend::new(BackendConfig::new(shape(), 1, 2, 8)).expect("a valid backend");
    (sched, be)
}

/// Imports `export` for `tokens` into a fresh instance: a failure registers nothing
/// and holds no block.
fn import(export: &BlockExport, tokens: &[u32], salt: Option<u64>) {
    let (mut sched, mut be) = instance();
    let mut cache = be.alloc_cache().expect("a cache");
    let ep = endpoint(&be);
    let free = sched.kv().device().num_free();
    let req = RequestTokens {
        request: export.request,
        tokens,
        salt,
    };
    let at = Instance {
        sched: &mut sched,
        be: &mut be,
        cache: &mut cache,
    };
    match ep.import(at, req, export) {
        Ok(n) => assert!(n <= export.blocks.len()),
        Err(e) => {
            assert!(!e.to_string().is_empty());
            assert_eq!(sched.kv().device().num_free(), free, "{e}: blocks held");
            let names = sched.block_names(tokens, salt);
            let cached = sched.cached_blocks(&names).expect("between steps");
            assert!(cached.is_empty(), "{e}: registered");
        }
    }
}

/// The tokens an export says it holds, in order (what an importer would be asked
/// for when the export is of its request).
fn tokens_of(export: &BlockExport) -> Vec<u32> {
    let mut t: Vec<u32> = Vec::new();
    for b in export.blocks.iter().take(16) {
        t.extend(b.tokens.iter().take(64));
    }
    t
}

fn frame(payload: &[u8]) -> Vec<u8> {
    let mut f = Vec::with_capacity(HEADER_BYTES + payload.len());
    f.extend_from_slice(&MAGIC);
    f.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    f.extend_from_slice(&[0, 0]);
    f.extend_from_slice(&(payload.len() as u32).to_le_bytes());
    f.extend_from_slice(&crc32fast::hash(payload).to_le_bytes());
    f.extend_from_slice(payload);
    f
}

fn on_message(m: Message) {
    if let Message::Export(e) = m {
        let tokens = tokens_of(&e);
        import(&e, &tokens, None);
    }
}

fuzz_target!(|data: &[u8]| {
    let Some((&mode, rest)) = data.split_first() else {
        return;
    };
    // The frame limit the reader is given: 256 MiB, or small ones.
    let limit = match mode >> 4 {
        0 => 256 << 20,
        n => (n as u32) << 12,
    };
    match mode % 3 {
        0 => {
            // A stream of frames in pieces; and the whole of it as one frame.
            let (pieces, bytes) = rest.split_at(rest.len().min(4));
            let mut r = Pieces {
                data: bytes,
                pieces,
                i: 0,
            };
            for _ in 0..8 {
                match bounded(bytes.len(), || read_message(&mut r, limit)) {
                    Ok(m) => on_message(m),
                    Err(_) => break,
                }
            }
            if let Ok(m) = bounded(rest.len(), || decode(rest, limit)) {
                on_message(m);
            }
        }
        1 => {
            let f = frame(rest);
            if let Ok(e) = bounded(f.len(), || decode_export(&f, limit)) {
                let tokens = tokens_of(&e);
                import(&e, &tokens, None);
                import(&e, &tokens, Some(1));
            }
            if let Ok(m) = bounded(f.len(), || decode(&f, limit)) {
                on_message(m);
            }
        }
        _ => {
            // A valid export of up to 3 blocks, then edits of its payload.
            let (head, edits) = rest.split_at(rest.len().min(8));
            let blocks = head.first().map_or(0, |b| (b % 4) as usize);
            let salt = head.get(1).filter(|b| **b & 1 == 1).map(|b| *b as u64);
            let tokens: Vec<u32> = (0..blocks * BS + 2)
                .map(|i| head.get(2 + i % 6).copied().unwrap_or(0) as u32 * 7 + i as u32)
                .collect();
            let (sched, be) = instance();
            let ep = endpoint(&be);
            let per_block = ep.descriptor.block_bytes().expect("a small block");
            let names = sched.block_names(&tokens, salt);
            let export = BlockExport {
                request: 9,
                descriptor: ep.descriptor.clone(),
                blocks: (0..blocks)
                    .map(|i| {
                        let bytes: Vec<u8> = (0..per_block).map(|j| (i * 31 + j) as u8).collect();
                        ExportedBlock {
                            name: names[i].to_bytes(),
                            tokens: tokens[i * BS..(i + 1) * BS].to_vec(),
                            crc32: crc32fast::hash(&bytes),
                            data: bytes,
                        }
                    })
                    .collect(),
            };
            let mut payload = postcard_payload(&Message::Export(Box::new(export.clone())));
            for e in edits.chunks(3) {
                if payload.is_empty() {
                    break;
                }
                let at =
                    (u16::from_le_bytes([e[0], *e.get(1).unwrap_or(&0)]) as usize) % payload.len();
                match e.get(2) {
                    Some(&v) if v & 3 == 0 => {
                        payload.truncate(at);
                    }
                    Some(&v) if v & 3 == 1 => payload.insert(at, v),
                    Some(&v) => payload[at] ^= v,
                    None => {
                        payload.remove(at);
                    }
                };
            }
            let f = frame(&payload);
            match bounded(f.len(), || decode_export(&f, limit)) {
                Ok(e) => import(&e, &tokens, salt),
                // Unedited, it decodes (when it fits the limit).
                Err(err) => assert!(
                    !edits.is_empty() || f.len() - HEADER_BYTES > limit as usize,
                    "a valid export refused: {err}"
                ),
            }
            if edits.is_empty() && f.len() - HEADER_BYTES <= limit as usize {
                // The valid export imports whole.
                let (mut sched, mut be) = instance();
                let mut cache = be.alloc_cache().expect("a cache");
                let req = RequestTokens {
                    request: 9,
                    tokens: &tokens,
                    salt,
                };
                let at = Instance {
                    sched: &mut sched,
                    be: &mut be,
                    cache: &mut cache,
                };
                let n = ep.import(at, req, &export).expect("a valid export imports");
                assert_eq!(n, blocks);
            }
        }
    }
});

/// The payload of `msg`'s frame (its encoded form without the header).
fn postcard_payload(msg: &Message) -> Vec<u8> {
    let f = pagedkv_dist::wire::encode(msg).expect("a small message encodes");
    f[HEADER_BYTES..].to_vec()
}
