//! Status codes and the last-error message: how every call reports its result.
//!
//! Every function of the C ABI returns a [`pagedkv_status`]. `PAGEDKV_OK` is 0, so C
//! code checks a call with `!= PAGEDKV_OK`; every other value names a kind of failure
//! (a null pointer, a bad argument, a full pool, an unknown id, a call at the wrong
//! time, CUDA, a caught panic). A failed call also leaves a message for its thread,
//! which [`pagedkv_last_error_message`] returns:
//!
//! ```c
//! if (pagedkv_scheduler_create(&cfg, &s) != PAGEDKV_OK)
//!     fprintf(stderr, "create: %s\n", pagedkv_last_error_message());
//! ```
//!
//! The message lives in a thread-local `CString`, so threads never see each other's
//! errors, and the pointer stays valid until the next pagedkv call on the same thread.
//! A successful guarded call clears it to `""` (see [`crate::guard`]), so "OK with a
//! message" never happens.
//!
//! Inside the library an entry point that finds a problem returns
//! `fail(PAGEDKV_ERR_..., message)`: it records the message and hands back the status,
//! so a check is one line. An error of the Rust crate (`pagedkv::host::Error`) goes
//! through [`from_error`], which picks the status from the error's kind and keeps its
//! `Display` text as the message.
//!
//! [`pagedkv_version`] lives here too: like the message, it is a string the library
//! owns and the caller only reads.

use std::cell::RefCell;
use std::ffi::{CString, c_char};

use pagedkv::host::Error;

/// Result of every call. `PAGEDKV_OK` is 0.
#[repr(i32)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum pagedkv_status {
    /// Success.
    PAGEDKV_OK = 0,
    /// A required pointer was null.
    PAGEDKV_ERR_NULL = 1,
    /// An argument is out of range or inconsistent.
    PAGEDKV_ERR_INVALID_ARGUMENT = 2,
    /// The block pool is full.
    PAGEDKV_ERR_OUT_OF_BLOCKS = 3,
    /// A request or sequence id names nothing live.
    PAGEDKV_ERR_UNKNOWN_ID = 4,
    /// The call is not allowed now (destroyed handle, re-entrance, call order).
    PAGEDKV_ERR_INVALID_STATE = 5,
    /// A CUDA driver call failed, or no CUDA driver or device.
    PAGEDKV_ERR_CUDA = 6,
    /// A panic inside the library was caught (a bug: please report it).
    PAGEDKV_ERR_PANIC = 7,
}

use pagedkv_status::*;

thread_local! {
    /// This thread's last-error message.
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

/// Records `msg` as this thread's last-error message (a NUL inside becomes a space).
pub(crate) fn set_error(msg: &str) {
    let c = CString::new(msg.replace('\0', " ")).unwrap_or_default();
    let _ = LAST_ERROR.try_with(|e| *e.borrow_mut() = c);
}

/// Records `msg` and returns `status`: the one-line way to refuse a call.
pub(crate) fn fail(status: pagedkv_status, msg: impl AsRef<str>) -> pagedkv_status {
    set_error(msg.as_ref());
    status
}

/// The status for an error of the Rust crate, with its text as the message.
pub(crate) fn from_error(e: &Error) -> pagedkv_status {
    let s = match e {
        Error::InvalidArgument { .. } => PAGEDKV_ERR_INVALID_ARGUMENT,
        Error::OutOfBlocks { .. } => PAGEDKV_ERR_OUT_OF_BLOCKS,
        Error::Unknown { .. } => PAGEDKV_ERR_UNKNOWN_ID,
        Error::InvalidState(_) => PAGEDKV_ERR_INVALID_STATE,
        Error::NoCudaDriver
        | Error::NoCudaDevice(_)
        | Error::UnsupportedDevice(_)
        | Error::Cuda { .. } => PAGEDKV_ERR_CUDA,
        _ => PAGEDKV_ERR_INVALID_STATE,
    };
    fail(s, e.to_string())
}

/// The message of the last failed call on this thread ("" after a success). The
/// pointer stays valid until the next pagedkv call on this thread. Never null.
#[unsafe(no_mangle)]
pub extern "C" fn pagedkv_last_error_message() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// The library's version, `"MAJOR.MINOR.PATCH"`, static. Never null.
#[unsafe(no_mangle)]
pub extern "C" fn pagedkv_version() -> *const c_char {
    concat!(env!("CARGO_PKG_VERSION"), "\0").as_ptr().cast()
}
