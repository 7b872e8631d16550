//! Whole-block copies on the GPU: copy-on-write inside the pools ([`CudaDevice::copy_blocks`])
//! and swapping blocks to and from pinned host memory ([`HostSwapPool`]).

use std::cell::RefCell;

use cudarc::driver::{DevicePtr, DevicePtrMut, PinnedHostSlice};

use super::{CudaDevice, DeviceTensor, cuda};
use crate::error::{Error, Result};
use crate::ops::copy_blocks;

/// Host memory for swapped-out blocks: pinned, `[num_host_blocks, num_pools, block_bytes]`.
///
/// Swap copies are asynchronous: each records an event after its copies, and dropping
/// the pool waits for the last one, so pinned memory is never freed under a DMA.
pub struct HostSwapPool {
    buf: PinnedHostSlice<u8>,
    num_pools: usize,
    block_bytes: usize,
    num_blocks: usize,
    /// Recorded after the last swap's copies.
    last_copy: RefCell<Option<cudarc::driver::CudaEvent>>,
}

impl Drop for HostSwapPool {
    fn drop(&mut self) {
        if let Some(e) = self.last_copy.get_mut().take() {
            // An error here means the context is already broken; the memory is freed
            // either way, so there is nothing better to do than wait as well as we can.
            let _ = e.synchronize();
        }
    }
}

impl std::fmt::Debug for HostSwapPool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "HostSwapPool({} blocks x {} pools x {} bytes)",
            self.num_blocks, self.num_pools, self.block_bytes
        )
    }
}

impl CudaDevice {
    /// Copies whole blocks for `(src, dst)` pairs in every pool (copy-on-write). A
    /// pool of another device's context is an error naming it.
    pub fn copy_blocks(
        &self,
        pools: &mut [&mut DeviceTensor],
        block_bytes: u64,
        pairs: &[(u32, u32)],
    ) -> Result<()> {
        let s = &self.stream;
        let ctx = s.context().cu_ctx();
        if let Some(i) = pools
            .iter()
            .position(|p| p.buf.stream().context().cu_ctx() != ctx)
        {
            return Err(Error::invalid(
                "pools",
                format!("pool {i} lives in another CUDA context than this device's"),
            ));
        }
        let mut guards = Vec::with_capacity(pools.len());
        let mut raw = Vec::with_capacity(pools.len());
        for p in pools.iter_mut() {
            let len = p.buf.len() as u64;
            let (ptr, g) = p.buf.device_ptr_mut(s);
            raw.push((ptr, len));
            guards.push(g);
        }
        let mut dev = super::CudaStepDevice::new(self);
        // SAFETY: (1) device buffers of this device's context (checked above; every
        // DeviceTensor is at least 16-byte aligned), borrowed mutably for the call, their guards alive
        // until the launch is issued on the stream every use orders on; (2) distinct
        // `&mut` borrows, so no two overlap and nothing else touches them.
        unsafe { crate::step::once::copy_blocks(&mut dev, &raw, block_bytes, pairs) }
    }

    /// Allocates pinned host memory for `num_host_blocks` swapped blocks of `num_pools`
    /// pools of `block_bytes` each.
    pub fn alloc_swap_pool(
        &self,
        num_host_blocks: usize,
        num_pools: usize,
        block_bytes: usize,
    ) -> Result<HostSwapPool> {
        let n = num_host_blocks
            .checked_mul(num_pools)
            .and_then(|x| x.checked_mul(block_bytes))
            .ok_or_else(|| Error::invalid("num_host_blocks", "size overflows"))?;
        // SAFETY: the memory is only ever read after a copy into it completes.
        let buf = unsafe { self.stream.context().alloc_pinned::<u8>(n) }
            .map_err(cuda("cuMemHostAlloc"))?;
        Ok(HostSwapPool {
            buf,
            num_pools,
            block_bytes,
            num_blocks: num_host_blocks,
            last_copy: RefCell::new(None),
        })
    }

    /// Records an event after the swap copies just issued on the stream, for the host
    /// pool's `Drop` to wait on.
    fn record_swap(&self, host: &HostSwapPool) -> Result<()> {
        let e = self
            .stream
            .record_event(None)
            .map_err(cuda("cuEventRecord"))?;
        *host.last_copy.borrow_mut() = Some(e);
        Ok(())
    }

    fn check_swap(
        pools: &[&DeviceTensor],
        block_bytes: u64,
        host: &HostSwapPool,
        pairs: &[(u32, u32)],
        dev_first: bool,
    ) -> Result<u64> {
        let lens: Vec<u64> = pools.iter().map(|p| p.num_bytes() as u64).collect();
        let num_blocks = copy_blocks::pool_blocks(&lens, block_bytes)?;
        if pools.len() != host.num_pools || block_bytes as usize != host.block_bytes {
            return Err(Error::invalid(
                "host",
                format!(
                    "{host:?} does not match {} pools of {block_bytes} bytes",
                    pools.len()
                ),
            ));
        }
        let mut seen = std::collections::HashSet::new();
        for (i, &(a, b)) in pairs.iter().enumerate() {
            let (dev, hst) = if dev_first { (a, b) } else { (b, a) };
            if dev as u64 >= num_blocks || hst as usize >= host.num_blocks {
                return Err(Error::invalid(
                    "pairs",
                    format!("pair {i}: device block {dev} or host block {hst} out of range"),
                ));
            }
            if !seen.insert(b) {
                return Err(Error::invalid(
                    "pairs",
                    format!("pair {i}: destination {b} is written twice"),
                ));
            }
        }
        Ok(num_blocks)
    }

    /// Copies `blocks` of every pool to `out` (block after block, each block's bytes of
    /// every pool in order), on the stream, and waits for the copies. The caller checks
    /// the ids and that `out` holds `blocks.len() * pools.len() * block_bytes` bytes.
    pub fn read_blocks(
        &self,
        pools: &[&DeviceTensor],
        block_bytes: u64,
        blocks: &[u32],
        out: &mut [u8],
    ) -> Result<()> {
        let bb = block_bytes as usize;
        assert_eq!(
            out.len(),
            blocks.len() * pools.len() * bb,
            "checked by the caller"
        );
        for (pi, pool) in pools.iter().enumerate() {
            let (src, _g) = pool.buf.device_ptr(&self.stream);
            for (i, &b) in blocks.iter().enumerate() {
                let dst = &mut out[(i * pools.len() + pi) * bb..][..bb];
                // SAFETY: the source range is inside the pool (ids checked by the
                // caller); `dst` stays borrowed until the stream is synchronised below.
                let r = unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        dst,
                        src + b as u64 * block_bytes,
                        self.stream.cu_stream(),
                    )
                };
                if let Err(e) = r {
                    // (Copies issued so far still write `out`: wait for them.)
                    let _ = self.synchronize();
                    return Err(cuda("cuMemcpyDtoHAsync")(e));
                }
            }
        }
        self.synchronize()
    }

    /// Copies `data` (laid out as [`read_blocks`](Self::read_blocks) writes it) into
    /// `blocks` of every pool, on the stream, and waits for the copies. The caller
    /// checks the ids and the length.
    pub fn write_blocks(
        &self,
        pools: &mut [&mut DeviceTensor],
        block_bytes: u64,
        blocks: &[u32],
        data: &[u8],
    ) -> Result<()> {
        let bb = block_bytes as usize;
        let n = pools.len();
        assert_eq!(data.len(), blocks.len() * n * bb, "checked by the caller");
        for (pi, pool) in pools.iter_mut().enumerate() {
            let (dst, _g) = pool.buf.device_ptr_mut(&self.stream);
            for (i, &b) in blocks.iter().enumerate() {
                let src = &data[(i * n + pi) * bb..][..bb];
                // SAFETY: the destination range is inside the pool (ids checked by the
                // caller), borrowed mutably; `src` stays borrowed until the stream is
                // synchronised below.
                let r = unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        dst + b as u64 * block_bytes,
                        src,
                        self.stream.cu_stream(),
                    )
                };
                if let Err(e) = r {
                    // (Copies issued so far still read `data`: wait for them.)
                    let _ = self.synchronize();
                    return Err(cuda("cuMemcpyHtoDAsync")(e));
                }
            }
        }
        self.synchronize()
    }

    /// Copies device blocks to host blocks (`(device, host)` pairs from the scheduler's
    /// `swap_out`), asynchronously on the stream.
    pub fn swap_out(
        &self,
        pools: &[&DeviceTensor],
        block_bytes: u64,
        pairs: &[(u32, u32)],
        host: &mut HostSwapPool,
    ) -> Result<()> {
        Self::check_swap(pools, block_bytes, host, pairs, true)?;
        let bb = block_bytes as usize;
        let base = host.buf.as_mut_ptr().map_err(cuda("pinned memory"))?;
        for (pi, pool) in pools.iter().enumerate() {
            let (src, _g) = pool.buf.device_ptr(&self.stream);
            for &(d, h) in pairs {
                let off = (h as usize * host.num_pools + pi) * bb;
                // SAFETY: `off + bb` is inside the pinned buffer (checked ranges), which
                // `host` keeps alive and borrowed mutably for the call.
                let dst = unsafe { std::slice::from_raw_parts_mut(base.add(off), bb) };
                // SAFETY: the source range is inside the pool (checked); the copy is
                // ordered on the stream after every earlier write to the pool.
                unsafe {
                    cudarc::driver::result::memcpy_dtoh_async(
                        dst,
                        src + d as u64 * block_bytes,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(cuda("cuMemcpyDtoHAsync"))?;
            }
        }
        self.record_swap(host)
    }

    /// Copies host blocks back to device blocks (`(host, device)` pairs from the
    /// scheduler's `swap_in`), asynchronously on the stream.
    pub fn swap_in(
        &self,
        pools: &mut [&mut DeviceTensor],
        block_bytes: u64,
        pairs: &[(u32, u32)],
        host: &HostSwapPool,
    ) -> Result<()> {
        {
            let view: Vec<&DeviceTensor> = pools.iter().map(|p| &**p).collect();
            Self::check_swap(&view, block_bytes, host, pairs, false)?;
        }
        let bb = block_bytes as usize;
        let base = host.buf.as_ptr().map_err(cuda("pinned memory"))?;
        for (pi, pool) in pools.iter_mut().enumerate() {
            let (dst, _g) = pool.buf.device_ptr_mut(&self.stream);
            for &(h, d) in pairs {
                let off = (h as usize * host.num_pools + pi) * bb;
                // SAFETY: `off + bb` is inside the pinned buffer (checked ranges).
                let src = unsafe { std::slice::from_raw_parts(base.add(off), bb) };
                // SAFETY: the destination range is inside the pool (checked), which is
                // borrowed mutably for the call.
                unsafe {
                    cudarc::driver::result::memcpy_htod_async(
                        dst + d as u64 * block_bytes,
                        src,
                        self.stream.cu_stream(),
                    )
                }
                .map_err(cuda("cuMemcpyHtoDAsync"))?;
            }
        }
        self.record_swap(host)
    }
}
