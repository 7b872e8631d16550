//! The wire against hostile peers: a header claiming 256 MiB allocates only as bytes
//! arrive.

use std::io::{ErrorKind, Read};

use crate::common::alloc;

use pagedkv_dist::wire::{
    DEFAULT_MAX_PAYLOAD, HEADER_BYTES, MAGIC, Message, WIRE_VERSION, WireError, encode,
    read_message,
};

/// A frame header claiming `len` payload bytes.
fn header(len: u32) -> Vec<u8> {
    let mut h = Vec::with_capacity(HEADER_BYTES);
    h.extend_from_slice(&MAGIC);
    h.extend_from_slice(&WIRE_VERSION.to_le_bytes());
    h.extend_from_slice(&[0, 0]);
    h.extend_from_slice(&len.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

/// A peer that sent `bytes`, in reads of at most `chunk`, and then stalls (its reads
/// time out).
struct Stalled {
    bytes: Vec<u8>,
    at: usize,
    chunk: usize,
}

impl Read for Stalled {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        if self.at == self.bytes.len() {
            return Err(ErrorKind::WouldBlock.into());
        }
        let n = buf.len().min(self.chunk).min(self.bytes.len() - self.at);
        buf[..n].copy_from_slice(&self.bytes[self.at..self.at + n]);
        self.at += n;
        Ok(n)
    }
}

/// A header claiming 256 MiB then `sent` bytes of its payload: the reader holds at
/// most about twice what arrived (plus its first 64 KiB), however much the header
/// claims (it allocated the claimed length before the first byte: two stalled peers
/// held 512 MiB).
#[test]
fn a_frame_header_claiming_256_mib_allocates_with_the_bytes_that_arrive() {
    for sent in [0usize, 1000, 300_000, 3 << 20] {
        let mut bytes = header(DEFAULT_MAX_PAYLOAD);
        bytes.resize(HEADER_BYTES + sent, 7);
        let mut peer = Stalled {
            bytes,
            at: 0,
            chunk: 1 << 20,
        };
        let base = alloc::start();
        let e = read_message(&mut peer, DEFAULT_MAX_PAYLOAD).unwrap_err();
        let held = alloc::peak_since(base);
        assert!(
            matches!(&e, WireError::Io(io) if io.kind() == ErrorKind::WouldBlock),
            "{e}"
        );
        let bound = 2 * sent + (128 << 10);
        assert!(
            held <= bound as isize,
            "{sent} bytes of a 256 MiB payload arrived: {held} bytes held, more than {bound}"
        );
    }
    // A frame delivered a byte per read still reads whole.
    let frame = encode(&Message::Reply {
        step: 3,
        rank: 1,
        data: vec![5; 200_000],
    })
    .unwrap();
    let mut peer = Stalled {
        bytes: frame,
        at: 0,
        chunk: 1,
    };
    match read_message(&mut peer, DEFAULT_MAX_PAYLOAD).unwrap() {
        Message::Reply { step: 3, data, .. } => assert_eq!(data, vec![5; 200_000]),
        m => panic!("{m:?}"),
    }
}
