//! Phase marks of the engine's steps, for measurement: the caller may set a
//! hook (nestbox-runtime sets its `phases::mark` when `NESTBOX_PHASES` is
//! set), called with a step's name as the step ends. Unset, a mark is one
//! relaxed load.

use std::sync::atomic::{AtomicPtr, Ordering};

static HOOK: AtomicPtr<()> = AtomicPtr::new(std::ptr::null_mut());

/// Call `hook` with the name of each step of a restore as it ends, from
/// now on (in this process and its forks).
pub fn set_hook(hook: fn(&'static str)) {
    HOOK.store(hook as *mut (), Ordering::Relaxed);
}

/// Step `name` ended.
pub(crate) fn mark(name: &'static str) {
    let hook = HOOK.load(Ordering::Relaxed);
    if hook.is_null() {
        return;
    }
    // SAFETY: the only non-null value ever stored is a `fn(&'static str)`
    // cast to a pointer by `set_hook`; it is cast back to that same type.
    let hook: fn(&'static str) = unsafe { std::mem::transmute::<*mut (), fn(&'static str)>(hook) };
    hook(name);
}
