//! Which pages of a running process were written, for the pre-copy of a
//! migration: the process's private memory is write-protected through a
//! userfaultfd of its own in asynchronous mode, and each round asks the
//! kernel which pages were written since the last (`PAGEMAP_SCAN`),
//! protecting them again in the same step (nestbox_sys::uffd). The process
//! is never stopped by a write: the kernel lifts the protection itself.
//!
//! The userfaultfd has to be created by the process (a userfaultfd tracks
//! its creator's memory): [`DirtyTracker::start`] stops the process for a
//! moment under ptrace, injects `userfaultfd(2)` (the box's seccomp filter,
//! which refuses it to the box, is suspended for the tracer's call with
//! `PTRACE_O_SUSPEND_SECCOMP`), takes the new descriptor with
//! `pidfd_getfd(2)`, closes it in the process and lets it run. The box
//! never sees the descriptor; it lives as long as the tracker.
//!
//! Only the private writable mappings that exist at the start are tracked.
//! A mapping made, moved or replaced later is not registered, so none of
//! its pages is ever reported unchanged by [`unwritten_ranges`]; nor is
//! shared memory: the last stop reads those whole. A process that execs
//! gets a new address space, which is not registered either.

use std::fs::File;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use nestbox_sys::uffd::{self, PageRegion, PAGE_IS_WPALLOWED, PAGE_IS_WRITTEN};

use crate::error::{RemoteError, Result};
use crate::fdinfo::{pidfd_getfd, pidfd_open};
use crate::maps::{read_maps, Vma, PAGE};
use crate::procfs::proc_path;
use crate::procimage::{read_own_pages, PageData, Select};
use crate::rebuild::is_special;
use crate::tracee::{Tracee, PTRACE_O_SUSPEND_SECCOMP, TRACE_OPTIONS};

/// The top of a user address space on x86_64.
const USER_END: u64 = 0x7fff_ffff_f000;

/// Where [`DirtyTracker::round`] puts pages: (address, contents, or `None`
/// for a page the process no longer has contents of its own at).
pub type RoundSink<'a> = dyn FnMut(u64, Option<&[u8]>) -> std::io::Result<()> + 'a;

/// Dirty-page tracking of one process (see the module documentation).
#[derive(Debug)]
pub struct DirtyTracker {
    pid: i32,
    uffd: OwnedFd,
    pagemap: File,
    /// The ranges registered: the process's private writable mappings at
    /// the start.
    ranges: Vec<(u64, u64)>,
    /// Whether [`DirtyTracker::round`] ran once (the first reads every page).
    started: bool,
}

/// Errors of the kernel's userfaultfd calls, with the process.
fn uffd_err(op: &'static str, pid: i32) -> impl Fn(nix::errno::Errno) -> RemoteError {
    move |e| RemoteError::Sys {
        op,
        pid,
        source: e.into(),
    }
}

impl DirtyTracker {
    /// Start tracking the writes of running process `pid` (host pid): it is
    /// stopped under ptrace for the injected `userfaultfd(2)`, then runs
    /// again; every private writable mapping it has is registered and
    /// write-protected.
    ///
    /// # Errors
    /// A process another tracer holds or that ended, a kernel without
    /// asynchronous write-protection, or a failed injection.
    pub fn start(pid: i32) -> Result<DirtyTracker> {
        let mut tracee = Tracee::seize_and_interrupt(pid)?;
        tracee.wait_stopped(Duration::from_secs(5))?;
        let flags = (libc::O_CLOEXEC | libc::O_NONBLOCK) as u64 | uffd::UFFD_USER_MODE_ONLY;
        let uffd = inject_userfaultfd(&mut tracee, flags, TRACE_OPTIONS);
        let detached = tracee.detach();
        let uffd = uffd?;
        detached?;
        uffd::enable_wp_async(uffd.as_fd()).map_err(uffd_err(
            "UFFDIO_API (asynchronous write-protection, Linux 6.7)",
            pid,
        ))?;
        let mut ranges = Vec::new();
        for v in read_maps(pid)?.iter().filter(|v| trackable(v)) {
            // A mapping the kernel will not protect (a special one) stays
            // untracked: read whole at the last stop.
            if uffd::register_wp(uffd.as_fd(), v.start, v.len()).is_ok() {
                uffd::write_protect(uffd.as_fd(), v.start, v.len())
                    .map_err(uffd_err("UFFDIO_WRITEPROTECT", pid))?;
                ranges.push((v.start, v.end));
            }
        }
        let path = proc_path(pid, "pagemap");
        let pagemap = File::open(&path).map_err(|source| RemoteError::Proc { path, source })?;
        Ok(DirtyTracker {
            pid,
            uffd,
            pagemap,
            ranges,
            started: false,
        })
    }

    /// Host pid of the process.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// One pre-copy round: every page written since the last round (the
    /// first: every page of the tracked mappings), protected again, then
    /// given to `sink`: its contents when the process has its own there,
    /// `None` when it has none any more (unmapped, dropped, zero: forget
    /// what was sent of it). Returns how many pages were written.
    ///
    /// # Errors
    /// A failed scan or read (the process ended, a mapping went while it
    /// was read: the caller must then forget what it has of this process),
    /// or `sink`'s error.
    pub fn round(&mut self, sink: &mut RoundSink<'_>) -> Result<usize> {
        let written: Vec<(u64, u64)> = if self.started {
            let mut out = Vec::new();
            for &(start, end) in &self.ranges {
                scan(
                    &self.pagemap,
                    self.pid,
                    start,
                    end,
                    uffd::PM_SCAN_WP_MATCHING,
                    PAGE_IS_WRITTEN,
                    PAGE_IS_WRITTEN,
                    &mut |r| out.push((r.start, r.end)),
                )?;
            }
            out
        } else {
            self.started = true;
            self.ranges.clone()
        };
        let pages: usize = written.iter().map(|(s, e)| ((e - s) / PAGE) as usize).sum();
        if pages == 0 {
            return Ok(0);
        }
        for &(start, end) in &written {
            let mut at = start;
            while at < end {
                sink(at, None).map_err(|source| RemoteError::Image {
                    what: format!("page {at:#x} of process {}", self.pid),
                    source,
                })?;
                at += PAGE;
            }
        }
        let vmas: Vec<Vma> = read_maps(self.pid)?
            .into_iter()
            .filter(|v| !v.shared && written.iter().any(|&(s, e)| s < v.end && v.start < e))
            .collect();
        let select = |_: &Vma, addr: u64| {
            if in_ranges(&written, addr) {
                Select::Read
            } else {
                Select::Skip
            }
        };
        read_own_pages(self.pid, &vmas, &select, &mut |addr, page| match page {
            PageData::Bytes(b) => sink(addr, Some(b)),
            PageData::Unchanged => Ok(()),
        })?;
        Ok(pages)
    }

    /// The userfaultfd (kept open: closing it ends the tracking).
    pub fn uffd(&self) -> &OwnedFd {
        &self.uffd
    }
}

/// Run `userfaultfd(2)` with `flags` in the stopped tracee (its seccomp
/// filter suspended for the call), take the descriptor with
/// `pidfd_getfd(2)`, close it in the tracee and put its registers and
/// ptrace options (`options_after`) back. Shared by the dirty tracker and
/// lazy restore (lazy.rs).
pub(crate) fn inject_userfaultfd(
    tracee: &mut Tracee,
    flags: u64,
    options_after: libc::c_int,
) -> Result<OwnedFd> {
    let pid = tracee.pid();
    tracee.set_options(options_after | PTRACE_O_SUSPEND_SECCOMP)?;
    tracee.find_syscall_insn()?;
    let fd = tracee.syscall("userfaultfd", String::new, libc::SYS_userfaultfd, &[flags]);
    let taken = fd.and_then(|fd| {
        let pidfd = pidfd_open(pid)?;
        let ours = pidfd_getfd(&pidfd, pid, fd as i32);
        let closed = tracee.syscall("close", || format!("fd {fd}"), libc::SYS_close, &[fd]);
        let ours = ours?;
        closed?;
        Ok(ours)
    });
    let options = tracee.set_options(options_after);
    let regs = tracee.restore_regs();
    let taken = taken?;
    options?;
    regs?;
    Ok(taken)
}

/// Private writable mappings, which a tracker registers.
fn trackable(v: &Vma) -> bool {
    !v.shared && v.prot & libc::PROT_WRITE != 0 && !is_special(v)
}

/// `PAGEMAP_SCAN` of `[start, end)`, every reported run given to `each`.
#[allow(clippy::too_many_arguments)]
fn scan(
    pagemap: &File,
    pid: i32,
    start: u64,
    end: u64,
    flags: u64,
    require: u64,
    report: u64,
    each: &mut dyn FnMut(&PageRegion),
) -> Result<()> {
    let mut out = Vec::with_capacity(512);
    let mut at = start;
    while at < end {
        let next = uffd::pagemap_scan(pagemap.as_fd(), at, end, flags, require, report, &mut out)
            .map_err(uffd_err("PAGEMAP_SCAN", pid))?;
        out.iter().for_each(&mut *each);
        if next <= at {
            break;
        }
        at = next;
    }
    Ok(())
}

/// The runs of pages of stopped process `pid` (host pid) that a
/// [`DirtyTracker`] tracks and that were not written since its last round:
/// their contents are what that round read. Sorted, disjoint. A process
/// whose address space is not the tracked one (it exec'd) has none.
///
/// # Errors
/// A failed open or scan of its pagemap.
pub fn unwritten_ranges(pid: i32) -> Result<Vec<(u64, u64)>> {
    let path = proc_path(pid, "pagemap");
    let pagemap = File::open(&path).map_err(|source| RemoteError::Proc { path, source })?;
    let mut out = Vec::new();
    scan(
        &pagemap,
        pid,
        0,
        USER_END,
        0,
        PAGE_IS_WPALLOWED,
        PAGE_IS_WPALLOWED | PAGE_IS_WRITTEN,
        &mut |r| {
            if r.categories & PAGE_IS_WRITTEN == 0 {
                out.push((r.start, r.end));
            }
        },
    )?;
    Ok(out)
}

/// Whether `addr` is in one of the sorted, disjoint `ranges`.
pub fn in_ranges(ranges: &[(u64, u64)], addr: u64) -> bool {
    let i = ranges.partition_point(|&(_, e)| e <= addr);
    ranges.get(i).is_some_and(|&(s, _)| s <= addr)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_lookup() {
        let r = [(0x1000, 0x3000), (0x5000, 0x6000)];
        assert!(!in_ranges(&r, 0));
        assert!(in_ranges(&r, 0x1000));
        assert!(in_ranges(&r, 0x2fff));
        assert!(!in_ranges(&r, 0x3000));
        assert!(in_ranges(&r, 0x5000));
        assert!(!in_ranges(&r, 0x6000));
    }
}
