//! The error type of pagedkv's host API.
//!
//! Every public function that takes shapes, ids or buffers validates them and returns
//! one of these before it launches anything; nothing panics on bad input.

use crate::emulator::EmuError;

/// What went wrong, with the argument it was about.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Error {
    /// An argument is out of its documented range or inconsistent with another.
    #[error("invalid argument `{arg}`: {reason}")]
    InvalidArgument {
        /// The argument's name.
        arg: &'static str,
        /// What is wrong with it.
        reason: String,
    },
    /// The block pool (or the host swap pool) has too few free blocks.
    #[error("out of KV-cache blocks: {needed} needed, {free} free")]
    OutOfBlocks {
        /// Blocks the operation needed.
        needed: u32,
        /// Blocks that were free.
        free: u32,
    },
    /// An id that names nothing the scheduler knows (or no longer knows).
    #[error("unknown {what} {id}")]
    Unknown {
        /// What kind of id (`"request"`, `"sequence"`).
        what: &'static str,
        /// The id.
        id: u64,
    },
    /// An operation that the object's current state does not allow.
    #[error("{0}")]
    InvalidState(String),
    /// The CUDA driver library could not be found or loaded.
    #[error(
        "no CUDA driver found (libcuda could not be loaded): the CUDA backend needs an NVIDIA driver"
    )]
    NoCudaDriver,
    /// The driver is there but reports no device (or not the one asked for).
    #[error("no CUDA device: {0}")]
    NoCudaDevice(String),
    /// The device is older than every embedded PTX architecture.
    #[error("unsupported CUDA device: {0}")]
    UnsupportedDevice(String),
    /// A CUDA driver call failed.
    #[error("CUDA error in {what}: {message}")]
    Cuda {
        /// The operation.
        what: &'static str,
        /// The driver's message.
        message: String,
    },
    /// An emulated launch failed (a kernel bug or misuse; see [`EmuError`]).
    #[error("emulated launch failed: {0}")]
    Emulator(#[from] EmuError),
}

impl Error {
    /// An [`Error::InvalidArgument`].
    pub fn invalid(arg: &'static str, reason: impl Into<String>) -> Self {
        Error::InvalidArgument {
            arg,
            reason: reason.into(),
        }
    }
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
