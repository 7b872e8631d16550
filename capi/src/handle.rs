//! Handles: how a C pointer becomes a safe `&mut` for the length of one call.
//!
//! C holds a library object (a scheduler, a CUDA backend) as an opaque pointer that it
//! received from a `*_create` function and gives back to `*_destroy`. C can get that
//! pointer wrong in every way: null, already destroyed, never created, or passed to two
//! calls at once (two threads, or a callback re-entering the library). This module
//! turns each of those into a status instead of undefined behaviour.
//!
//! Each handle type implements [`Handle`]: a name for the messages and a static
//! [`Registry`], the map from every live handle's address to what it is doing
//! ([`Use`]: idle, busy inside a call, or poisoned by a panic). The life of a handle:
//!
//! 1. **Create**: the `*_create` function builds the Rust value and calls [`register`],
//!    which boxes it, records its address as idle, and returns the pointer for C.
//! 2. **Call**: every entry point that takes the handle runs through [`enter`]. Under
//!    the registry lock, `enter` checks that the address is registered and idle and
//!    marks it busy; only then does it turn the pointer into `&mut H` for the closure.
//!    When the closure returns, a guard marks the handle idle again; when it panics
//!    instead, poisoned, since its state may be half-updated (only destroy is allowed
//!    then). `enter` runs inside [`crate::guard::guard`], so the panic itself becomes
//!    `PAGEDKV_ERR_PANIC`.
//! 3. **Destroy**: the `*_destroy` function calls [`destroy`], which under the same
//!    lock refuses a busy handle, unregisters an idle or poisoned one, and only then
//!    gives the `Box` back to be dropped.
//!
//! Because the "is it live" check, the busy mark and destroy's unregistering all happen
//! under one lock, destroy racing a call is an error for one of the two (whichever takes
//! the lock second), never a use after free. What the registry cannot catch: a new
//! handle the allocator places at a destroyed one's address looks live again, so C must
//! still not use a handle after destroying it.
//!
//! Adding a handle type takes a `static` registry and an `impl Handle` naming it; see
//! `pagedkv_scheduler` in [`crate::scheduler`] and `pagedkv_cuda_backend` in
//! [`crate::cuda`].

use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::Mutex;

use crate::guard::guard;
use crate::pagedkv_status::{self, *};
use crate::status::fail;

/// What a live handle is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Use {
    /// No call runs on it.
    Idle,
    /// A call runs on it: other calls and destroy are refused.
    Busy,
    /// A call on it panicked: its state may be inconsistent, so only destroy is allowed.
    Poisoned,
}

/// The live handles of one type and what each is doing: a pointer is dereferenced only
/// while registered and marked busy by the caller, both under this lock, so a
/// destroyed or foreign handle is refused instead of dereferenced, and destroy (which
/// checks and unregisters under the same lock) never frees a handle a call is using.
pub(crate) struct Registry(Mutex<Option<HashMap<usize, Use>>>);

impl Registry {
    pub(crate) const fn new() -> Self {
        Self(Mutex::new(None))
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, Option<HashMap<usize, Use>>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// An opaque handle type of this library.
pub(crate) trait Handle: Sized {
    /// Its name in error messages.
    const WHAT: &'static str;
    /// Its registry.
    fn registry() -> &'static Registry;
}

/// Moves a new handle to the heap and registers it, idle.
pub(crate) fn register<H: Handle>(h: H) -> *mut H {
    let p = Box::into_raw(Box::new(h));
    H::registry()
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(p as usize, Use::Idle);
    p
}

fn destroyed<H: Handle>() -> pagedkv_status {
    fail(
        PAGEDKV_ERR_INVALID_STATE,
        format!("{} handle was destroyed or never created", H::WHAT),
    )
}

/// Marks a handle idle again when a call on it returns, or poisoned when the call
/// unwinds instead (a panic).
struct Leave<H: Handle> {
    handle: usize,
    returned: bool,
    what: PhantomData<H>,
}

impl<H: Handle> Drop for Leave<H> {
    fn drop(&mut self) {
        let next = if self.returned {
            Use::Idle
        } else {
            Use::Poisoned
        };
        if let Some(u) = H::registry()
            .lock()
            .as_mut()
            .and_then(|m| m.get_mut(&self.handle))
        {
            *u = next;
        }
    }
}

/// Runs `f` on a live, idle handle; refuses null, destroyed, busy and poisoned handles.
pub(crate) fn enter<H: Handle>(
    p: *mut H,
    f: impl FnOnce(&mut H) -> pagedkv_status,
) -> pagedkv_status {
    guard(|| {
        if p.is_null() {
            return fail(PAGEDKV_ERR_NULL, format!("{} is null", H::WHAT));
        }
        {
            // The live check and the busy mark happen under one lock: `destroy` takes
            // the same lock, so it either unregisters first (and this call is refused)
            // or sees the handle busy (and refuses itself).
            let mut reg = H::registry().lock();
            match reg.as_mut().and_then(|m| m.get_mut(&(p as usize))) {
                None => return destroyed::<H>(),
                Some(Use::Busy) => {
                    return fail(
                        PAGEDKV_ERR_INVALID_STATE,
                        format!(
                            "{} is already inside a call (re-entrant or concurrent use)",
                            H::WHAT
                        ),
                    );
                }
                Some(Use::Poisoned) => {
                    return fail(
                        PAGEDKV_ERR_INVALID_STATE,
                        format!(
                            "{} is unusable: an earlier call on it panicked (destroy it)",
                            H::WHAT
                        ),
                    );
                }
                Some(u @ Use::Idle) => *u = Use::Busy,
            }
        }
        let mut leave = Leave::<H> {
            handle: p as usize,
            returned: false,
            what: PhantomData,
        };
        // SAFETY: registered, so created by `register` and not destroyed, and marked
        // busy by this call under the registry lock: `destroy` and every other call
        // refuse it until `leave` marks it idle again, so this is the only reference.
        let r = f(unsafe { &mut *p });
        leave.returned = true;
        r
    })
}

/// Unregisters a live handle that no call is using and gives it back for dropping.
pub(crate) fn destroy<H: Handle>(p: *mut H) -> Result<Box<H>, pagedkv_status> {
    if p.is_null() {
        return Err(fail(PAGEDKV_ERR_NULL, format!("{} is null", H::WHAT)));
    }
    let mut reg = H::registry().lock();
    let Some(map) = reg.as_mut() else {
        return Err(destroyed::<H>());
    };
    match map.get(&(p as usize)) {
        None => Err(destroyed::<H>()),
        Some(Use::Busy) => Err(fail(
            PAGEDKV_ERR_INVALID_STATE,
            format!(
                "{} is inside a call (on another thread, or re-entrant): it was not destroyed",
                H::WHAT
            ),
        )),
        Some(Use::Idle | Use::Poisoned) => {
            map.remove(&(p as usize));
            drop(reg);
            // SAFETY: registered and idle until just now, under the lock: no call uses
            // it and none can start (it is unregistered); this is the only release.
            Ok(unsafe { Box::from_raw(p) })
        }
    }
}
