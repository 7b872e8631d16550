//! [`EmuDevice`]: the step path on the CPU, kernels in the SIMT emulator; [`HostMemory`],
//! the device memory of every host-memory device.

use pagedkv_kernels::Kernel;

use super::device::{DeviceAddr, Space, StepDevice};
use crate::buffer::AlignedBuf;
use crate::emulator::{Emulator, LaunchConfig};
use crate::error::{Error, Result};

/// Device memory that is host memory: 256-byte aligned allocations kept for the
/// owner's lifetime, and uploads checked against them and against the staging room
/// reserved, as a GPU's. What every host-memory [`StepDevice`] (the emulator's, the PTX
/// interpreter's) allocates and uploads with.
#[derive(Debug, Default)]
pub struct HostMemory {
    /// Every allocation (addresses stay valid: an `AlignedBuf`'s storage does not move
    /// when the list grows).
    bufs: Vec<AlignedBuf>,
    /// The staging room reserved ([`StepDevice::reserve_upload`]), enforced as a GPU's.
    reserved: usize,
}

impl HostMemory {
    /// No allocations yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// [`StepDevice::alloc`]: `bytes` zeroed bytes at a 256-byte aligned address,
    /// fallibly.
    pub fn alloc(&mut self, bytes: usize) -> Result<DeviceAddr> {
        let mut b = bytes
            .checked_add(256)
            .and_then(AlignedBuf::try_zeroed)
            .ok_or_else(|| {
                Error::invalid("capacity", format!("{bytes} bytes could not be allocated"))
            })?;
        let base = b.as_bytes_mut().as_mut_ptr() as u64;
        self.bufs.push(b);
        Ok(DeviceAddr::new(base.next_multiple_of(256)))
    }

    /// [`StepDevice::reserve_upload`].
    pub fn reserve_upload(&mut self, bytes: usize) -> Result<()> {
        self.reserved = self.reserved.max(bytes);
        Ok(())
    }

    /// [`StepDevice::upload`]: `src` into one of these allocations, within the
    /// reserved staging room.
    pub fn upload(&mut self, dst: DeviceAddr, src: &[u8]) -> Result<()> {
        super::device::check_reserved(src.len(), self.reserved)?;
        let dst = dst.get();
        let inside = self.bufs.iter().any(|b| {
            let base = b.as_bytes().as_ptr() as u64;
            dst >= base
                && dst
                    .checked_add(src.len() as u64)
                    .is_some_and(|end| end <= base + b.len() as u64)
        });
        if !inside {
            return Err(Error::InvalidState(format!(
                "upload of {} bytes to {dst:#x}: not inside an allocation of this device",
                src.len()
            )));
        }
        // SAFETY: `dst..dst + len` lies inside one of these live buffers (checked above,
        // without overflow), which `src` (a caller's borrow) cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }
}

/// A [`StepDevice`] whose memory is host memory and whose launches run the real kernel
/// bodies in the [`Emulator`]: the same runner code as on a GPU, proven on the CPU.
#[derive(Debug)]
pub struct EmuDevice {
    emu: Emulator,
    mem: HostMemory,
}

impl EmuDevice {
    /// A device that launches through `emu`.
    pub fn new(emu: Emulator) -> Self {
        Self {
            emu,
            mem: HostMemory::new(),
        }
    }

    /// The emulator it launches through.
    pub fn emulator(&self) -> &Emulator {
        &self.emu
    }
}

impl StepDevice for EmuDevice {
    fn space(&self) -> Space {
        Space::Host
    }

    fn alloc(&mut self, bytes: usize) -> Result<DeviceAddr> {
        self.mem.alloc(bytes)
    }

    fn reserve_upload(&mut self, bytes: usize) -> Result<()> {
        self.mem.reserve_upload(bytes)
    }

    fn upload(&mut self, dst: DeviceAddr, src: &[u8]) -> Result<()> {
        self.mem.upload(dst, src)
    }

    unsafe fn launch<K: Kernel>(&self, cfg: LaunchConfig, params: K::Params) -> Result<()> {
        // SAFETY: the caller's conditions 1-3 are the emulator's (host addresses valid
        // for the launch, no other user, one writer per element).
        unsafe { self.emu.launch::<K>(cfg, params) }?;
        Ok(())
    }
}
