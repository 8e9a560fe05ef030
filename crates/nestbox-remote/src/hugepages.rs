//! Collapsing a template's fully populated anonymous memory into transparent
//! huge pages, so that forking it copies one page-table entry per 2 MiB instead
//! of 512.
//!
//! A clone is forked from its template's process; the fork's cost grows with the
//! page-table entries it copies (a 67 MiB Python server: some 17 000). A 2 MiB
//! range that is mapped by one huge page costs the fork one entry. When a clone
//! later writes into such a range the kernel splits its mapping of the huge page
//! and copies only the 4 KiB page written, so clones keep their small private
//! footprint. Only ranges whose 512 pages are all present, anonymous and mapped
//! by this process alone are collapsed: the collapse then neither adds memory
//! (no empty page is filled) nor breaks sharing with another process. Contents
//! do not change. Used at freeze time (`MADV_COLLAPSE` through
//! `process_madvise`, Linux 6.1 or later; older kernels simply refuse it).

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;

use crate::error::{RemoteError, Result};
use crate::maps::{self, Vma};
use crate::procfs::proc_path;

/// Bytes of a transparent huge page on x86_64.
const HUGE: u64 = 2 << 20;
const PAGE: u64 = 4096;

/// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PRESENT: u64 = 1 << 63;
const FILE_OR_SHARED: u64 = 1 << 61;
const EXCLUSIVE: u64 = 1 << 56;

/// What a collapse did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Collapsed {
    /// 2 MiB ranges now mapped by a huge page.
    pub ranges: usize,
    /// Eligible ranges the kernel did not collapse (no huge page free, ...).
    pub failed: usize,
}

/// Whether a mapping holds private anonymous memory a collapse may touch
/// (`[stack]` is left alone: it grows, and its top is hot).
fn eligible(map: &Vma) -> bool {
    map.prot & (libc::PROT_READ | libc::PROT_WRITE) == libc::PROT_READ | libc::PROT_WRITE
        && !map.shared
        && (map.name.is_empty() || map.name == "[heap]" || map.name.starts_with("[anon:"))
}

/// The 2 MiB-aligned ranges of `pid`'s private anonymous memory whose pages are
/// all present and exclusively its own.
pub fn collapsible_ranges(pid: i32) -> Result<Vec<u64>> {
    let path = proc_path(pid, "pagemap");
    let pagemap = File::open(&path).map_err(|source| RemoteError::Proc {
        path: path.clone(),
        source,
    })?;
    let mut out = Vec::new();
    let mut entries = vec![0u8; (HUGE / PAGE * 8) as usize];
    for map in maps::read_maps(pid)?.iter().filter(|m| eligible(m)) {
        let mut start = map.start.next_multiple_of(HUGE);
        while start + HUGE <= map.end {
            pagemap
                .read_exact_at(&mut entries, start / PAGE * 8)
                .map_err(|source| RemoteError::Proc {
                    path: path.clone(),
                    source,
                })?;
            let all = entries.chunks_exact(8).all(|e| {
                let e = u64::from_ne_bytes(e.try_into().unwrap_or_default());
                e & PRESENT != 0 && e & EXCLUSIVE != 0 && e & FILE_OR_SHARED == 0
            });
            if all {
                out.push(start);
            }
            start += HUGE;
        }
    }
    Ok(out)
}

/// Collapse every range [`collapsible_ranges`] finds in `pid` into a huge page.
/// The process may be stopped or frozen; its memory's contents are unchanged.
///
/// # Errors
/// Reading `/proc/PID` or opening a pidfd failed. A range the kernel declines
/// (no free huge page, a kernel without `MADV_COLLAPSE`) is counted in
/// [`Collapsed::failed`], not an error: the fork works either way.
pub fn collapse_anonymous(pid: i32) -> Result<Collapsed> {
    let ranges = collapsible_ranges(pid)?;
    let mut done = Collapsed::default();
    if ranges.is_empty() {
        return Ok(done);
    }
    let pidfd = nestbox_sys::pidfd::pidfd_open(pid).map_err(|e| RemoteError::Sys {
        op: "pidfd_open",
        pid,
        source: e.into(),
    })?;
    for start in ranges {
        match nestbox_sys::process::process_madvise(
            pidfd.as_fd(),
            start,
            HUGE,
            nestbox_sys::process::MADV_COLLAPSE,
        ) {
            Ok(_) => done.ranges += 1,
            Err(nestbox_sys::Errno::EINVAL) if done.ranges == 0 && done.failed == 0 => {
                // The kernel has no MADV_COLLAPSE: nothing else will work.
                done.failed += 1;
                break;
            }
            Err(_) => done.failed += 1,
        }
    }
    Ok(done)
}
