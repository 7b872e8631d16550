//! The panic guard: no panic crosses the C boundary, and none prints.
//!
//! Unwinding out of an `extern "C"` function aborts the process, and a panic message
//! on the host program's stderr is noise it never asked for. So every entry point runs
//! its body inside [`guard`]:
//!
//! ```text
//! pub unsafe extern "C" fn pagedkv_something(out: *mut u32) -> pagedkv_status {
//!     guard(|| {
//!         if out.is_null() {
//!             return fail(PAGEDKV_ERR_NULL, "out is null");
//!         }
//!         // ... the work, which returns a status ...
//!         PAGEDKV_OK
//!     })
//! }
//! ```
//!
//! `guard` does three things around the closure:
//!
//! 1. It catches a panic (`catch_unwind`) and turns it into `PAGEDKV_ERR_PANIC`, with
//!    `"internal panic: <message> at <file>:<line>"` as the last-error message.
//! 2. It keeps that panic quiet. The first call installs, once per process, a panic
//!    hook ([`install_quiet_panic_hook`]) that checks a thread-local counter of guarded
//!    calls (`IN_CALL`, raised by [`InCall`] for the duration of the call): inside one,
//!    the hook only records the message and its location for `guard`; outside, it hands
//!    the panic to the hook that was there before (the host's own, or Rust's default),
//!    so panics elsewhere in a Rust host still print as they always did.
//! 3. On success it clears the thread's last-error message, so after `PAGEDKV_OK` the
//!    message is `""`.
//!
//! Calls on a handle go through [`crate::handle::enter`], which runs inside `guard` and
//! additionally marks the handle poisoned when the call panicked.

use std::any::Any;
use std::cell::Cell;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::Once;

use crate::pagedkv_status::{self, *};
use crate::status::{fail, set_error};

thread_local! {
    /// How many guarded C ABI calls this thread is inside (the quiet panic hook's test).
    static IN_CALL: Cell<u32> = const { Cell::new(0) };
    /// The message of a panic inside a guarded call, recorded by the hook.
    static PANIC_MESSAGE: Cell<Option<String>> = const { Cell::new(None) };
}

static QUIET_HOOK: Once = Once::new();

/// The text of a panic payload (`panic!` with a literal or with a format).
fn payload_text(p: &(dyn Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// Installs, once per process, a panic hook that keeps panics inside guarded calls
/// quiet: it records the message (with its location) for [`guard`] instead of printing
/// to the host program's stderr. Any other panic goes to the hook that was installed
/// before (the host's own, or the default one).
fn install_quiet_panic_hook() {
    // `take_hook`/`set_hook` panic on a panicking thread (a call from a destructor
    // during unwinding in a Rust host): leave the hook alone there.
    if std::thread::panicking() {
        return;
    }
    QUIET_HOOK.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            let inside = IN_CALL.try_with(|c| c.get() > 0).unwrap_or(false);
            if !inside {
                return previous(info);
            }
            let at = info
                .location()
                .map(|l| format!(" at {}:{}", l.file(), l.line()))
                .unwrap_or_default();
            let msg = format!("{}{at}", payload_text(info.payload()));
            let _ = PANIC_MESSAGE.try_with(|m| m.set(Some(msg)));
        }));
    });
}

/// Marks this thread as inside a guarded call while it lives.
struct InCall;

impl InCall {
    fn enter() -> Self {
        let _ = IN_CALL.try_with(|c| c.set(c.get() + 1));
        InCall
    }
}

impl Drop for InCall {
    fn drop(&mut self) {
        let _ = IN_CALL.try_with(|c| c.set(c.get().saturating_sub(1)));
    }
}

/// Runs `f`, turning a panic into `PAGEDKV_ERR_PANIC` with its message (nothing is
/// printed: see [`install_quiet_panic_hook`]).
pub(crate) fn guard(f: impl FnOnce() -> pagedkv_status) -> pagedkv_status {
    install_quiet_panic_hook();
    let _inside = InCall::enter();
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(s) => {
            if s == PAGEDKV_OK {
                set_error("");
            }
            s
        }
        Err(p) => {
            let msg = PANIC_MESSAGE
                .try_with(|m| m.take())
                .ok()
                .flatten()
                .unwrap_or_else(|| payload_text(&*p));
            // A payload whose destructor panics must not unwind out of here either.
            let _ = catch_unwind(AssertUnwindSafe(move || drop(p)));
            let _ = PANIC_MESSAGE.try_with(|m| m.take());
            fail(PAGEDKV_ERR_PANIC, format!("internal panic: {msg}"))
        }
    }
}
