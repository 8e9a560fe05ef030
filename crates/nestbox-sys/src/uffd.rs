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
//!
//! The missing-page mode (lazy restore, `nestbox-remote`'s lazy.rs) uses
//! [`enable_missing`], [`register_missing`], [`copy`], [`zeropage`] and
//! [`read_msgs`]: a fault on a registered page that has none blocks the
//! faulting thread until a page is put there from outside.

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

/// `UFFD_FEATURE_EVENT_FORK`: a fork of the process is reported with a new
/// userfaultfd for the child's memory.
pub const UFFD_FEATURE_EVENT_FORK: u64 = 1 << 1;
/// `UFFD_FEATURE_EVENT_REMAP`: an `mremap` of registered memory is reported.
pub const UFFD_FEATURE_EVENT_REMAP: u64 = 1 << 2;
/// `UFFD_FEATURE_EVENT_REMOVE`: `madvise(MADV_DONTNEED/REMOVE)` is reported.
pub const UFFD_FEATURE_EVENT_REMOVE: u64 = 1 << 3;
/// `UFFD_FEATURE_EVENT_UNMAP`: an `munmap` of registered memory is reported.
pub const UFFD_FEATURE_EVENT_UNMAP: u64 = 1 << 6;
/// `UFFDIO_REGISTER_MODE_MISSING`.
const UFFDIO_REGISTER_MODE_MISSING: u64 = 1 << 0;

/// `UFFD_EVENT_PAGEFAULT`.
pub const UFFD_EVENT_PAGEFAULT: u8 = 0x12;
/// `UFFD_EVENT_FORK`.
pub const UFFD_EVENT_FORK: u8 = 0x13;
/// `UFFD_EVENT_REMAP`.
pub const UFFD_EVENT_REMAP: u8 = 0x14;
/// `UFFD_EVENT_REMOVE`.
pub const UFFD_EVENT_REMOVE: u8 = 0x15;
/// `UFFD_EVENT_UNMAP`.
pub const UFFD_EVENT_UNMAP: u8 = 0x16;
/// Size of a `struct uffd_msg`.
pub const UFFD_MSG_SIZE: usize = 32;

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

#[repr(C)]
struct UffdioCopy {
    dst: u64,
    src: u64,
    len: u64,
    mode: u64,
    copy: i64,
}

#[repr(C)]
struct UffdioZeropage {
    range: UffdioRange,
    mode: u64,
    zeropage: i64,
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
const UFFDIO_COPY: libc::c_ulong = iowr(0xaa, 0x03, std::mem::size_of::<UffdioCopy>());
const UFFDIO_ZEROPAGE: libc::c_ulong = iowr(0xaa, 0x04, std::mem::size_of::<UffdioZeropage>());
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

/// Enable missing-page handling on a fresh userfaultfd (`UFFDIO_API`)
/// with the event `features` asked (`UFFD_FEATURE_EVENT_*`). `EINVAL`
/// when the kernel lacks one; `EPERM` for `UFFD_FEATURE_EVENT_FORK`
/// without `CAP_SYS_PTRACE`.
pub fn enable_missing(uffd: BorrowedFd<'_>, features: u64) -> Result<()> {
    let mut api = UffdioApi {
        api: UFFD_API,
        features,
        ioctls: 0,
    };
    ioctl(uffd, UFFDIO_API, &mut api).map(drop)
}

/// Register `[start, start + len)` of the userfaultfd's address space in
/// missing-page mode (`UFFDIO_REGISTER_MODE_MISSING`): anonymous private
/// mappings only.
pub fn register_missing(uffd: BorrowedFd<'_>, start: u64, len: u64) -> Result<()> {
    let mut reg = UffdioRegister {
        range: UffdioRange { start, len },
        mode: UFFDIO_REGISTER_MODE_MISSING,
        ioctls: 0,
    };
    ioctl(uffd, UFFDIO_REGISTER, &mut reg).map(drop)
}

/// What a [`copy`] or [`zeropage`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Filled {
    /// This many bytes from the start were filled (all, or up to a page
    /// that could not be: call again from there).
    Bytes(u64),
    /// Nothing was filled: the error (`EEXIST`: the first page has one
    /// already; `EAGAIN`: the address space is changing, read the pending
    /// events first; `ESRCH`: the address space is gone; `ENOENT`: no
    /// registered mapping there).
    Failed(Errno),
}

/// Put `src` (whole pages) at `dst` of the userfaultfd's address space
/// (`UFFDIO_COPY`), waking the threads that wait for those pages.
pub fn copy(uffd: BorrowedFd<'_>, dst: u64, src: &[u8]) -> Filled {
    let mut arg = UffdioCopy {
        dst,
        src: src.as_ptr() as u64,
        len: src.len() as u64,
        mode: 0,
        copy: 0,
    };
    filled(ioctl(uffd, UFFDIO_COPY, &mut arg), arg.copy)
}

/// Map zero pages at `[start, start + len)` (`UFFDIO_ZEROPAGE`), waking
/// the threads that wait for them.
pub fn zeropage(uffd: BorrowedFd<'_>, start: u64, len: u64) -> Filled {
    let mut arg = UffdioZeropage {
        range: UffdioRange { start, len },
        mode: 0,
        zeropage: 0,
    };
    filled(ioctl(uffd, UFFDIO_ZEROPAGE, &mut arg), arg.zeropage)
}

/// The outcome of a fill ioctl from its return and the count it wrote
/// (bytes done, or a negative errno).
fn filled(rc: Result<libc::c_long>, count: i64) -> Filled {
    match rc {
        Ok(_) => Filled::Bytes(count.max(0) as u64),
        Err(_) if count > 0 => Filled::Bytes(count as u64),
        Err(_) if count < 0 => Filled::Failed(Errno::from_raw((-count) as i32)),
        Err(e) => Filled::Failed(e),
    }
}

/// One message of a userfaultfd (`struct uffd_msg`), decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UffdMsg {
    /// A thread waits for the page at this address.
    PageFault {
        /// The faulting address (not aligned).
        address: u64,
    },
    /// The process forked: the child's memory has this new userfaultfd
    /// (now an fd of the reader).
    Fork {
        /// The new descriptor.
        ufd: i32,
    },
    /// `[from, from + len)` moved to `to`.
    Remap {
        /// Old start.
        from: u64,
        /// New start.
        to: u64,
        /// Length.
        len: u64,
    },
    /// `[start, end)` was dropped (`MADV_DONTNEED`, `MADV_REMOVE`): it reads
    /// as zeros now.
    Remove {
        /// First byte.
        start: u64,
        /// One past the last.
        end: u64,
    },
    /// `[start, end)` was unmapped.
    Unmap {
        /// First byte.
        start: u64,
        /// One past the last.
        end: u64,
    },
    /// An event this code does not know.
    Other(u8),
}

impl UffdMsg {
    /// Decode one 32-byte `struct uffd_msg`.
    pub fn parse(raw: &[u8; UFFD_MSG_SIZE]) -> UffdMsg {
        let word = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&raw[at..at + 8]);
            u64::from_ne_bytes(b)
        };
        match raw[0] {
            UFFD_EVENT_PAGEFAULT => UffdMsg::PageFault { address: word(16) },
            UFFD_EVENT_FORK => UffdMsg::Fork {
                ufd: word(8) as u32 as i32,
            },
            UFFD_EVENT_REMAP => UffdMsg::Remap {
                from: word(8),
                to: word(16),
                len: word(24),
            },
            UFFD_EVENT_REMOVE => UffdMsg::Remove {
                start: word(8),
                end: word(16),
            },
            UFFD_EVENT_UNMAP => UffdMsg::Unmap {
                start: word(8),
                end: word(16),
            },
            other => UffdMsg::Other(other),
        }
    }
}

/// Read the pending messages of a non-blocking userfaultfd into `out`
/// (appended); `Ok(0)` when there are none. A fork message installs the
/// child's userfaultfd as an fd of the caller.
pub fn read_msgs(uffd: BorrowedFd<'_>, out: &mut Vec<UffdMsg>) -> Result<usize> {
    let mut buf = [0u8; UFFD_MSG_SIZE * 64];
    // SAFETY: `buf` is ours and writable for its whole length.
    let n = unsafe { libc::read(uffd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len()) };
    match Errno::result(n) {
        Ok(n) => {
            let n = n as usize / UFFD_MSG_SIZE;
            for raw in buf.chunks_exact(UFFD_MSG_SIZE).take(n) {
                let mut m = [0u8; UFFD_MSG_SIZE];
                m.copy_from_slice(raw);
                out.push(UffdMsg::parse(&m));
            }
            Ok(n)
        }
        Err(Errno::EAGAIN) => Ok(0),
        Err(e) => Err(e),
    }
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

#[cfg(test)]
mod tests {
    use super::*;

    fn msg(event: u8, words: [u64; 3]) -> [u8; UFFD_MSG_SIZE] {
        let mut m = [0u8; UFFD_MSG_SIZE];
        m[0] = event;
        for (i, w) in words.iter().enumerate() {
            m[8 + 8 * i..16 + 8 * i].copy_from_slice(&w.to_ne_bytes());
        }
        m
    }

    #[test]
    fn messages_decode() {
        assert_eq!(
            UffdMsg::parse(&msg(UFFD_EVENT_PAGEFAULT, [0, 0x7f00_1234, 9])),
            UffdMsg::PageFault {
                address: 0x7f00_1234
            }
        );
        assert_eq!(
            UffdMsg::parse(&msg(UFFD_EVENT_FORK, [7, 0, 0])),
            UffdMsg::Fork { ufd: 7 }
        );
        assert_eq!(
            UffdMsg::parse(&msg(UFFD_EVENT_REMAP, [0x1000, 0x9000, 0x2000])),
            UffdMsg::Remap {
                from: 0x1000,
                to: 0x9000,
                len: 0x2000
            }
        );
        assert_eq!(
            UffdMsg::parse(&msg(UFFD_EVENT_REMOVE, [0x1000, 0x3000, 0])),
            UffdMsg::Remove {
                start: 0x1000,
                end: 0x3000
            }
        );
        assert_eq!(
            UffdMsg::parse(&msg(UFFD_EVENT_UNMAP, [0x1000, 0x3000, 0])),
            UffdMsg::Unmap {
                start: 0x1000,
                end: 0x3000
            }
        );
        assert_eq!(UffdMsg::parse(&msg(0x42, [0; 3])), UffdMsg::Other(0x42));
    }

    #[test]
    fn fill_outcomes() {
        assert_eq!(filled(Ok(0), 8192), Filled::Bytes(8192));
        assert_eq!(filled(Err(Errno::EAGAIN), 4096), Filled::Bytes(4096));
        assert_eq!(
            filled(Err(Errno::EAGAIN), -(libc::EEXIST as i64)),
            Filled::Failed(Errno::EEXIST)
        );
        assert_eq!(filled(Err(Errno::ESRCH), 0), Filled::Failed(Errno::ESRCH));
    }
}
