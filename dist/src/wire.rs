//! The wire format between a leader and its worker ranks: versioned, checksummed
//! frames of [`Message`]s.
//!
//! A frame is a 16-byte header then the payload:
//!
//! | bytes | field |
//! | --- | --- |
//! | 0..4 | magic `PKVD` |
//! | 4..6 | [`WIRE_VERSION`], little-endian |
//! | 6..8 | reserved, 0 |
//! | 8..12 | payload length, little-endian (at most the reader's limit) |
//! | 12..16 | CRC-32 (IEEE) of the payload, little-endian |
//!
//! The payload is one [`Message`] in [postcard](https://docs.rs/postcard) (serde's
//! compact varint format). A reader checks the magic, then the version (a frame of
//! another version is refused, never guessed at), the length against its limit,
//! reads the payload into a buffer that grows as its bytes arrive (fallibly: a header
//! alone allocates nothing near the length it claims), checks the checksum, and
//! decodes: each failure is its own [`WireError`]. How long a frame may take is the
//! caller's: [`crate::link`] gives each frame and each call one deadline. A [`Message::Step`] also names the full shape and the shard
//! size it was planned for, which the worker compares with its own
//! ([`crate::link::Worker`]).

use std::io::{Read, Write};

use serde::{Deserialize, Serialize};

use pagedkv_host::scheduler::Batch;
use pagedkv_host::step::StepShape;

use crate::ShardSpec;

/// The frame version this build writes and accepts. Bump it whenever [`Message`] or
/// anything it holds ([`Batch`] among them) changes its serialized form. Version 2:
/// the batch carries its block size ([`Batch::block_size`]).
pub const WIRE_VERSION: u16 = 2;

/// The magic bytes that begin every frame.
pub const MAGIC: [u8; 4] = *b"PKVD";

/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 16;

/// The default limit on a frame's payload a reader accepts: 256 MiB.
pub const DEFAULT_MAX_PAYLOAD: u32 = 256 << 20;

/// What a frame carries.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub enum Message {
    /// Leader to worker, first: what the group serves. The worker checks it against
    /// its own configuration and answers [`Message::Ready`] or [`Message::Refused`].
    Hello(Hello),
    /// Worker to leader: the hello matched; this rank is ready.
    Ready {
        /// The worker's rank.
        rank: u32,
    },
    /// Worker to leader: the worker refused the last message, and why.
    Refused {
        /// The worker's rank.
        rank: u32,
        /// What did not match, in words.
        reason: String,
    },
    /// Leader to workers: one step.
    Step(Box<StepMessage>),
    /// Worker to leader: what the engine's step returned on this rank (opaque bytes,
    /// e.g. its attention outputs; the checksum covers them).
    Reply {
        /// The step answered.
        step: u64,
        /// The worker's rank.
        rank: u32,
        /// The engine's bytes.
        data: Vec<u8>,
    },
    /// Leader to workers: no more steps.
    Stop,
    /// Prefill instance to decode instance: a request's exported KV blocks
    /// ([`crate::transfer`]).
    Export(Box<crate::transfer::BlockExport>),
    /// Sender to receiver over NIXL's side channel: a frame of `len` bytes waits in
    /// the sender's registered memory at `addr`; `agent_md` is the sender's NIXL agent
    /// metadata (what the receiver loads to read it).
    NixlOffer {
        /// The offer's number (the sender's count of offers), echoed by the ack.
        seq: u64,
        /// The sender agent's metadata.
        agent_md: Vec<u8>,
        /// Address of the frame in the sender's memory.
        addr: u64,
        /// Its length.
        len: u64,
    },
    /// Receiver to sender: offer `seq` was read (the sender may release it).
    NixlDone {
        /// The offer's number.
        seq: u64,
    },
}

/// What a tensor-parallel group serves: sent once by the leader.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Hello {
    /// The model's attention shape, unsharded.
    pub shape: StepShape,
    /// Layers of the model.
    pub num_layers: u32,
    /// The rank this connection serves and the group's size.
    pub shard: ShardSpec,
    /// The engine's model fingerprint (a name and revision, a hash of the weights'
    /// config: whatever the engine uses to tell models apart); compared byte for byte.
    pub model: String,
    /// The engine's own bytes for the ranks, not compared (the NCCL group's unique id,
    /// say: `nccl::NcclGroup::unique_id` with the `nccl` feature).
    pub engine: Vec<u8>,
}

/// One step for every rank: the scheduler's batch and the step's input tokens.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StepMessage {
    /// The step's number (0, 1, 2, ... from the leader's first).
    pub step: u64,
    /// The unsharded shape the step was planned for (checked by the worker).
    pub shape: StepShape,
    /// The group's size the step was planned for (checked by the worker).
    pub shard_size: u32,
    /// The scheduler's batch, unchanged: every rank plans the same step.
    pub batch: Batch,
    /// `[total new tokens]`: the token id of each of the step's new tokens, in
    /// `batch.slot_mapping` order (what a rank embeds to compute its K, V and Q).
    pub input_tokens: Vec<u32>,
}

/// Why a frame was not read.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// The stream failed, or ended inside a frame.
    #[error("I/O: {0}")]
    Io(#[from] std::io::Error),
    /// The stream ended between frames (the peer closed it).
    #[error("the peer closed the connection")]
    Closed,
    /// The frame does not begin with [`MAGIC`]: not a pagedkv-dist peer, or a stream
    /// out of step.
    #[error("bad magic {0:02x?}: not a pagedkv-dist frame")]
    BadMagic([u8; 4]),
    /// The frame is of another wire version.
    #[error(
        "wire version {got}, this build speaks {want}: leader and workers must run the same pagedkv-dist"
    )]
    Version {
        /// The frame's version.
        got: u16,
        /// [`WIRE_VERSION`].
        want: u16,
    },
    /// The payload is longer than the reader accepts.
    #[error("a payload of {len} bytes is more than the limit of {limit}")]
    TooLong {
        /// The header's length.
        len: u32,
        /// The reader's limit.
        limit: u32,
    },
    /// The payload's CRC-32 is not the header's: corrupted in transit.
    #[error("checksum mismatch: header {want:08x}, payload {got:08x}")]
    Checksum {
        /// The header's CRC-32.
        want: u32,
        /// The payload's.
        got: u32,
    },
    /// The payload's memory could not be allocated.
    #[error("cannot allocate {0} bytes for a payload")]
    Alloc(u32),
    /// The payload is not a [`Message`] of this version.
    #[error("malformed payload: {0}")]
    Decode(String),
    /// The message could not be encoded (a payload over 4 GiB, say).
    #[error("cannot encode: {0}")]
    Encode(String),
}

/// `msg` as one frame.
pub fn encode(msg: &Message) -> Result<Vec<u8>, WireError> {
    let payload = postcard::to_stdvec(msg).map_err(|e| WireError::Encode(e.to_string()))?;
    let len = u32::try_from(payload.len())
        .map_err(|_| WireError::Encode(format!("{} bytes do not fit a frame", payload.len())))?;
    let mut out = Vec::with_capacity(HEADER_BYTES + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    out.extend_from_slice(&[0, 0]);
    out.extend_from_slice(&len.to_le_bytes());
    out.extend_from_slice(&crc32fast::hash(&payload).to_le_bytes());
    out.extend_from_slice(&payload);
    Ok(out)
}

/// Writes `msg` as one frame and flushes.
pub fn write_message(w: &mut impl Write, msg: &Message) -> Result<(), WireError> {
    w.write_all(&encode(msg)?)?;
    w.flush()?;
    Ok(())
}

/// Reads one frame of at most `max_payload` payload bytes and decodes its message
/// (checks in the order of the module docs). [`WireError::Closed`] when the stream
/// ends before the frame's first byte.
pub fn read_message(r: &mut impl Read, max_payload: u32) -> Result<Message, WireError> {
    let mut header = [0u8; HEADER_BYTES];
    let mut got = 0;
    while got < HEADER_BYTES {
        match r.read(&mut header[got..]) {
            Ok(0) if got == 0 => return Err(WireError::Closed),
            Ok(0) => {
                return Err(WireError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the stream ended {got} bytes into a frame header"),
                )));
            }
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    let word = |i: usize| u32::from_le_bytes(header[i..i + 4].try_into().expect("4 bytes"));
    let magic: [u8; 4] = header[..4].try_into().expect("4 bytes");
    if magic != MAGIC {
        return Err(WireError::BadMagic(magic));
    }
    let version = u16::from_le_bytes([header[4], header[5]]);
    if version != WIRE_VERSION {
        return Err(WireError::Version {
            got: version,
            want: WIRE_VERSION,
        });
    }
    let (len, crc) = (word(8), word(12));
    if len > max_payload {
        return Err(WireError::TooLong {
            len,
            limit: max_payload,
        });
    }
    let payload = read_payload(r, len)?;
    let actual = crc32fast::hash(&payload);
    if actual != crc {
        return Err(WireError::Checksum {
            want: crc,
            got: actual,
        });
    }
    postcard::from_bytes(&payload).map_err(|e| WireError::Decode(e.to_string()))
}

/// The first bytes a payload's buffer holds; it then doubles as bytes arrive.
const FIRST_CHUNK: usize = 64 << 10;

/// A payload of `len` bytes from `r`, in a buffer that grows with the bytes that
/// arrive (at most [`FIRST_CHUNK`] ahead of them, or as many as arrived): a header
/// claiming 256 MiB followed by nothing costs 64 KiB, not 256 MiB. Each growth is
/// fallible ([`WireError::Alloc`]).
fn read_payload(r: &mut impl Read, len: u32) -> Result<Vec<u8>, WireError> {
    let total = len as usize;
    let mut buf = Vec::new();
    let mut filled = 0;
    while filled < total {
        if filled == buf.len() {
            let grow = (total - filled).min(filled.max(FIRST_CHUNK));
            buf.try_reserve_exact(grow)
                .map_err(|_| WireError::Alloc(len))?;
            buf.resize(filled + grow, 0);
        }
        match r.read(&mut buf[filled..]) {
            Ok(0) => {
                return Err(WireError::Io(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("the stream ended {filled} bytes into a payload of {total}"),
                )));
            }
            Ok(n) => filled += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(buf)
}

/// [`read_message`] of a frame held in memory (the whole of `bytes`).
pub fn decode(bytes: &[u8], max_payload: u32) -> Result<Message, WireError> {
    let mut r = bytes;
    let m = read_message(&mut r, max_payload)?;
    if !r.is_empty() {
        return Err(WireError::Decode(format!(
            "{} bytes after the frame",
            r.len()
        )));
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The encoded bytes of a fixed hello and step: a change of [`Message`]'s or
    /// [`Batch`]'s serialized form (a field added, removed or reordered, a type
    /// changed) changes them, and must come with a new [`WIRE_VERSION`] (then update
    /// the bytes here). Postcard does not describe its own format: without this, two
    /// fields of one type swapped would decode silently wrong.
    #[test]
    fn the_encoded_form_is_pinned_to_the_wire_version() {
        use pagedkv_host::DType;
        use pagedkv_host::scheduler::ScheduledSeq;
        let shape = StepShape {
            num_q_heads: 8,
            num_kv_heads: 4,
            head_dim: 64,
            block_size: 16,
            num_blocks: 22,
            dtype: DType::F32,
            kv_dtype: DType::Bf16,
        };
        let mut batch = Batch::default();
        batch.seqs.push(ScheduledSeq {
            seq: 3,
            request: 3,
            is_prefill: true,
            start_pos: 0,
            num_new_tokens: 2,
            context_len: 2,
            token_offset: 0,
            num_cached_tokens: 0,
            samples: true,
            num_draft_tokens: 0,
        });
        batch.block_tables = vec![5, 0];
        batch.max_blocks_per_seq = 2;
        batch.block_size = 16;
        batch.context_lens = vec![2];
        batch.slot_mapping = vec![80, 81];
        batch.qo_indptr = vec![0, 2];
        let step = Message::Step(Box::new(StepMessage {
            step: 1,
            shape,
            shard_size: 2,
            batch,
            input_tokens: vec![7, 300],
        }));
        let hello = Message::Hello(Hello {
            shape,
            num_layers: 2,
            shard: ShardSpec { rank: 1, size: 2 },
            model: "m".into(),
            engine: vec![9],
        });
        let hex = |m: &Message| -> String {
            encode(m).unwrap()[HEADER_BYTES..]
                .iter()
                .map(|b| format!("{b:02x}"))
                .collect()
        };
        assert_eq!(WIRE_VERSION, 2, "a new version: update the bytes below");
        assert_eq!(hex(&hello), "0008044010160201020102016d0109");
        assert_eq!(
            hex(&step),
            "03010804401016020102010303010002020000010000020a00021000010402a001a201000200040000000000000207ac02"
        );
    }

    fn stop() -> Vec<u8> {
        encode(&Message::Stop).unwrap()
    }

    #[test]
    fn a_frame_round_trips_and_each_defect_is_its_own_error() {
        let reply = Message::Reply {
            step: 7,
            rank: 1,
            data: vec![1, 2, 3, 250],
        };
        let f = encode(&reply).unwrap();
        match decode(&f, DEFAULT_MAX_PAYLOAD).unwrap() {
            Message::Reply { step, rank, data } => {
                assert_eq!((step, rank, data), (7, 1, vec![1, 2, 3, 250]));
            }
            m => panic!("{m:?}"),
        }
        // Every single flipped payload bit is caught by the checksum.
        for i in HEADER_BYTES..f.len() {
            for bit in 0..8 {
                let mut g = f.clone();
                g[i] ^= 1 << bit;
                assert!(
                    matches!(decode(&g, 1 << 20), Err(WireError::Checksum { .. })),
                    "byte {i} bit {bit}"
                );
            }
        }
        let mut g = stop();
        g[0] = b'X';
        assert!(matches!(decode(&g, 64), Err(WireError::BadMagic(_))));
        let mut g = stop();
        g[4] = 9;
        let e = decode(&g, 64).unwrap_err();
        assert!(
            matches!(
                e,
                WireError::Version {
                    got: 9,
                    want: WIRE_VERSION
                }
            ),
            "{e}"
        );
        assert!(e.to_string().contains("same pagedkv-dist"), "{e}");
        assert!(matches!(
            decode(&f, 2),
            Err(WireError::TooLong { len: _, limit: 2 })
        ));
        // A header claiming 4 GiB is refused before anything is allocated.
        let mut g = stop();
        g[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(
            decode(&g, DEFAULT_MAX_PAYLOAD),
            Err(WireError::TooLong { .. })
        ));
        assert!(matches!(decode(&[], 64), Err(WireError::Closed)));
        assert!(matches!(decode(&f[..10], 64), Err(WireError::Io(_))));
        assert!(matches!(
            decode(&f[..f.len() - 1], 64),
            Err(WireError::Io(_))
        ));
        // A well-formed frame whose payload is not a message.
        let junk = [0xffu8; 3];
        let mut g = Vec::new();
        g.extend_from_slice(&MAGIC);
        g.extend_from_slice(&WIRE_VERSION.to_le_bytes());
        g.extend_from_slice(&[0, 0]);
        g.extend_from_slice(&3u32.to_le_bytes());
        g.extend_from_slice(&crc32fast::hash(&junk).to_le_bytes());
        g.extend_from_slice(&junk);
        assert!(matches!(decode(&g, 64), Err(WireError::Decode(_))));
    }
}
