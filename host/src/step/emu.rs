//! [`EmuDevice`]: the step path on the CPU, kernels in the SIMT emulator.

use pagedkv_kernels::Kernel;

use super::device::{DeviceAddr, Space, StepDevice};
use crate::buffer::AlignedBuf;
use crate::emulator::{Emulator, LaunchConfig};
use crate::error::{Error, Result};

/// A [`StepDevice`] whose memory is host memory and whose launches run the real kernel
/// bodies in the [`Emulator`]: the same runner code as on a GPU, proven on the CPU.
#[derive(Debug)]
pub struct EmuDevice {
    emu: Emulator,
    /// Every allocation, kept until the device is dropped (addresses stay valid: an
    /// `AlignedBuf`'s storage does not move when the list grows).
    bufs: Vec<AlignedBuf>,
    /// The staging room reserved ([`StepDevice::reserve_upload`]), enforced as a GPU's.
    reserved: usize,
}

impl EmuDevice {
    /// A device that launches through `emu`.
    pub fn new(emu: Emulator) -> Self {
        Self {
            emu,
            bufs: Vec::new(),
            reserved: 0,
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
        // 256-byte alignment, as a GPU allocation: over-allocate and round up. Fallible,
        // as a GPU's allocation is.
        let mut b = bytes
            .checked_add(256)
            .and_then(AlignedBuf::try_zeroed)
            .ok_or_else(|| {
                Error::invalid("capacity", format!("{bytes} bytes could not be allocated"))
            })?;
        let base = b.as_bytes_mut().as_mut_ptr() as u64;
        let addr = base.next_multiple_of(256);
        self.bufs.push(b);
        Ok(DeviceAddr::new(addr))
    }

    fn reserve_upload(&mut self, bytes: usize) -> Result<()> {
        self.reserved = self.reserved.max(bytes);
        Ok(())
    }

    fn upload(&mut self, dst: DeviceAddr, src: &[u8]) -> Result<()> {
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
        // SAFETY: `dst..dst + len` lies inside one of this device's live buffers
        // (checked above), which `src` (a caller's borrow) cannot overlap.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), dst as *mut u8, src.len()) };
        Ok(())
    }

    unsafe fn launch<K: Kernel>(&self, cfg: LaunchConfig, params: K::Params) -> Result<()> {
        // SAFETY: the caller's conditions 1-3 are the emulator's (host addresses valid
        // for the launch, no other user, one writer per element).
        unsafe { self.emu.launch::<K>(cfg, params) }?;
        Ok(())
    }
}
