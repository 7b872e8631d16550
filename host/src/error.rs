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
