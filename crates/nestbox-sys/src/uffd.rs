//! Dirty-page tracking of another process's memory: a userfaultfd in
//! asynchronous write-protect mode (`UFFD_FEATURE_WP_ASYNC`, Linux 6.7) and
//! the `PAGEMAP_SCAN` ioctl of `/proc/PID/pagemap` (Linux 6.7), the kernel's
//! replacement for soft-dirty bits.
//!
//! The userfaultfd must be created by the tracked process itself (its
//! `mm` is the creator's); everything else works from outside on a
//! duplicate of it: `UFFDIO_API`, `UFFDIO_REGISTER` and
//! `UFFDIO_WRITEPROTECT` act on the file's `mm`, not the caller's, and
//! `PAGEMAP_SCAN` on the `mm` the pagemap file was opened on. In the
//! asynchronous mode a write to a protected page is never reported as an
//! event nor blocks: the kernel lifts the protection and the page shows as
//! written in the next scan, which can protect it again in the same step.
//!
//! The structures are the kernel's (`linux/userfaultfd.h`, `linux/fs.h`);
//! Debian 12's headers and the libc crate predate them, so they are here.
//! All calls are safe: they take descriptors and plain values, and the
//! buffers the kernel writes are ours.

use std::os::fd::{AsRawFd, BorrowedFd};

use nix::errno::Errno;

use crate::Result;

/// `UFFD_API`.
const UFFD_API: u64 = 0xaa;
/// `UFFD_FEATURE_WP_UNPOPULATED`: protecting a range marks its unpopulated
/// pages too (a first write there shows as written).
const UFFD_FEATURE_WP_UNPOPULATED: u64 = 1 << 13;
/// `UFFD_FEATURE_WP_ASYNC`.
const UFFD_FEATURE_WP_ASYNC: u64 = 1 << 15;
/// `UFFDIO_REGISTER_MODE_WP`.
const UFFDIO_REGISTER_MODE_WP: u64 = 1 << 1;
/// `UFFDIO_WRITEPROTECT_MODE_WP`.
const UFFDIO_WRITEPROTECT_MODE_WP: u64 = 1 << 0;
/// `UFFD_USER_MODE_ONLY`: a userfaultfd any process may create (it is not
/// told of faults in kernel mode; the asynchronous mode has no events).
pub const UFFD_USER_MODE_ONLY: u64 = 1;

/// `PM_SCAN_WP_MATCHING`: write-protect the pages the scan reports.
pub const PM_SCAN_WP_MATCHING: u64 = 1 << 0;
/// `PAGE_IS_WPALLOWED`: the page is in a range registered for
/// asynchronous write-protection.
pub const PAGE_IS_WPALLOWED: u64 = 1 << 0;
/// `PAGE_IS_WRITTEN`: written since it was last protected (or never
/// protected).
pub const PAGE_IS_WRITTEN: u64 = 1 << 1;

#[repr(C)]
struct UffdioApi {
    api: u64,
    features: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioRange {
    start: u64,
    len: u64,
}

#[repr(C)]
struct UffdioRegister {
    range: UffdioRange,
    mode: u64,
    ioctls: u64,
}

#[repr(C)]
struct UffdioWriteprotect {
    range: UffdioRange,
    mode: u64,
}

/// `struct pm_scan_arg`.
#[repr(C)]
#[derive(Default)]
struct PmScanArg {
    size: u64,
    flags: u64,
    start: u64,
    end: u64,
    walk_end: u64,
    vec: u64,
    vec_len: u64,
    max_pages: u64,
    category_inverted: u64,
    category_mask: u64,
    category_anyof_mask: u64,
    return_mask: u64,
}

/// One run of pages of equal categories, as `PAGEMAP_SCAN` reports it
/// (`struct page_region`).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PageRegion {
    /// First byte.
    pub start: u64,
    /// One past the last byte.
    pub end: u64,
    /// `PAGE_IS_*` bits of the pages (of those asked for).
    pub categories: u64,
}

const fn iowr(ty: u8, nr: u8, size: usize) -> libc::c_ulong {
    ((3u64 << 30) | ((size as u64) << 16) | ((ty as u64) << 8) | nr as u64) as libc::c_ulong
}

const UFFDIO_API: libc::c_ulong = iowr(0xaa, 0x3f, std::mem::size_of::<UffdioApi>());
const UFFDIO_REGISTER: libc::c_ulong = iowr(0xaa, 0x00, std::mem::size_of::<UffdioRegister>());
const UFFDIO_WRITEPROTECT: libc::c_ulong =
    iowr(0xaa, 0x06, std::mem::size_of::<UffdioWriteprotect>());
const PAGEMAP_SCAN: libc::c_ulong = iowr(b'f', 16, std::mem::size_of::<PmScanArg>());

fn ioctl<T>(fd: BorrowedFd<'_>, request: libc::c_ulong, arg: &mut T) -> Result<libc::c_long> {
    // SAFETY: `arg` is a live, exclusively borrowed structure of the size the
    // request encodes (every request here is built from its structure's size).
    let rc = unsafe { libc::ioctl(fd.as_raw_fd(), request, arg as *mut T) };
    Errno::result(rc).map(libc::c_long::from)
}

/// Enable asynchronous write-protect tracking on a fresh userfaultfd
/// (`UFFDIO_API` with `UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED`).
/// `EINVAL` when the kernel lacks them.
pub fn enable_wp_async(uffd: BorrowedFd<'_>) -> Result<()> {
    let mut api = UffdioApi {
        api: UFFD_API,
        features: UFFD_FEATURE_WP_ASYNC | UFFD_FEATURE_WP_UNPOPULATED,
        ioctls: 0,
    };
    ioctl(uffd, UFFDIO_API, &mut api).map(drop)
}

/// Register `[start, start + len)` of the userfaultfd's address space for
/// write-protection (`UFFDIO_REGISTER` in `UFFDIO_REGISTER_MODE_WP`); the
/// range must be whole mappings that allow it.
pub fn register_wp(uffd: BorrowedFd<'_>, start: u64, len: u64) -> Result<()> {
    let mut reg = UffdioRegister {
        range: UffdioRange { start, len },
        mode: UFFDIO_REGISTER_MODE_WP,
        ioctls: 0,
    };
    ioctl(uffd, UFFDIO_REGISTER, &mut reg).map(drop)
}

/// Write-protect `[start, start + len)` of a registered range
/// (`UFFDIO_WRITEPROTECT`).
pub fn write_protect(uffd: BorrowedFd<'_>, start: u64, len: u64) -> Result<()> {
    let mut wp = UffdioWriteprotect {
        range: UffdioRange { start, len },
        mode: UFFDIO_WRITEPROTECT_MODE_WP,
    };
    ioctl(uffd, UFFDIO_WRITEPROTECT, &mut wp).map(drop)
}

/// `PAGEMAP_SCAN` of `[start, end)` on a pagemap file: the runs of pages
/// having every category of `require`, reported with the categories of
/// `report`, into `out` (cleared first). With `flags`
/// [`PM_SCAN_WP_MATCHING`] the reported pages are write-protected again.
/// Returns the address the walk stopped at: `end` unless `out` filled up
/// (call again from there).
pub fn pagemap_scan(
    pagemap: BorrowedFd<'_>,
    start: u64,
    end: u64,
    flags: u64,
    require: u64,
    report: u64,
    out: &mut Vec<PageRegion>,
) -> Result<u64> {
    out.clear();
    let cap = out.capacity().max(64);
    out.resize(cap, PageRegion::default());
    let mut arg = PmScanArg {
        size: std::mem::size_of::<PmScanArg>() as u64,
        flags,
        start,
        end,
        vec: out.as_mut_ptr() as u64,
        vec_len: cap as u64,
        category_mask: require,
        return_mask: report,
        ..PmScanArg::default()
    };
    let n = ioctl(pagemap, PAGEMAP_SCAN, &mut arg);
    let n = match n {
        Ok(n) => n as usize,
        Err(e) => {
            out.clear();
            return Err(e);
        }
    };
    out.truncate(n.min(cap));
    Ok(arg.walk_end)
}
