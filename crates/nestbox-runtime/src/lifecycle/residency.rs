//! Resident memory of nestbox's own long-idle processes (a box's monitor and
//! init). Both map the nestbox binary and the C library; while they run, the
//! kernel maps the file pages they touch (and, by fault-around, up to 16 pages
//! around each), which then stay counted in their RSS although they only sit in
//! the shared page cache. Once such a process has nothing to do but wait,
//! [`drop_idle_memory`] unmaps those clean file pages from it, so that its RSS
//! shows what it really holds: its own anonymous memory plus the code pages it
//! touches from then on (with their fault-around neighbours).
//!
//! Its own anonymous memory is then made smaller too: the allocator gives back
//! the free parts of its heap (`malloc_trim`), and every resident page of its
//! heap and other private anonymous mappings that holds only zeros is dropped
//! (`MADV_DONTNEED`: the next read of such a page reads zeros again, from the
//! kernel's zero page, and the next write gets a fresh page). A monitor's
//! heap holds many such pages (buffers allocated zeroed and never filled,
//! memory cleared before reuse): about 36 of its 63 resident heap pages, and 22
//! of its box init's 47, measured on an idle clone's monitor and init. Each
//! box pays for these two processes, so this is memory every idle box gives
//! back.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;

/// How long (ms) a monitor or init waits with nothing to do before it drops its
/// file pages: boxes that end sooner never pay for it.
pub const IDLE_MS_BEFORE_DROP: u16 = 1000;

/// A file-backed mapping of this process that holds no private (copied-on-write)
/// pages, so dropping its resident pages loses nothing: they are re-read from
/// the page cache on the next access.
#[derive(Debug, PartialEq, Eq)]
struct CleanFileMapping {
    start: usize,
    end: usize,
}

/// Parse `/proc/self/smaps` text into the mappings that are safe to drop: backed
/// by a file (the path starts with `/`), private and not writable (so no page
/// can be written, hence copied, between this reading and the drop), and with
/// no anonymous pages (a relocated read-only segment has them: it was written
/// before it was made read-only).
fn clean_file_mappings(smaps: impl BufRead) -> Vec<CleanFileMapping> {
    let mut found = Vec::new();
    let mut current: Option<(CleanFileMapping, bool)> = None;
    let finish = |c: Option<(CleanFileMapping, bool)>, found: &mut Vec<CleanFileMapping>| {
        if let Some((m, true)) = c {
            found.push(m);
        }
    };
    for line in smaps.lines().map_while(|l| l.ok()) {
        let mut fields = line.split_whitespace();
        let Some(first) = fields.next() else { continue };
        if let Some((start, end)) = first.split_once('-') {
            // A mapping header: "start-end perms offset dev inode [path]".
            if let (Ok(start), Ok(end)) = (
                usize::from_str_radix(start, 16),
                usize::from_str_radix(end, 16),
            ) {
                finish(current.take(), &mut found);
                let perms = fields.next().unwrap_or("");
                let path = fields.nth(3).unwrap_or("");
                let candidate = path.starts_with('/')
                    && perms.len() == 4
                    && perms.as_bytes()[1] == b'-'
                    && perms.ends_with('p');
                current = Some((CleanFileMapping { start, end }, candidate));
                continue;
            }
        }
        if first == "Anonymous:" {
            if let Some((_, candidate)) = current.as_mut() {
                if fields.next().is_some_and(|kb| kb != "0") {
                    *candidate = false;
                }
            }
        }
    }
    finish(current.take(), &mut found);
    found
}

/// Private anonymous writable mappings of `/proc/self/maps` text whose
/// zero-filled pages may be dropped: the heap and unnamed anonymous memory,
/// never the stack (the dropping code itself writes below the stack pointer)
/// nor anything named (`[vdso]`, `[vvar]`, files).
fn zero_candidates(maps: &str) -> Vec<(usize, usize)> {
    maps.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (lo, hi) = f.next()?.split_once('-')?;
            let perms = f.next()?;
            let ino = f.nth(2)?;
            let name = f.next().unwrap_or("");
            let anonymous = ino == "0" && (name.is_empty() || name == "[heap]");
            (anonymous && perms.starts_with("rw") && perms.ends_with('p')).then_some((
                usize::from_str_radix(lo, 16).ok()?,
                usize::from_str_radix(hi, 16).ok()?,
            ))
        })
        .collect()
}

/// Whether this process has exactly one thread (`Threads:` of its status).
pub(crate) fn single_threaded() -> bool {
    std::fs::read_to_string("/proc/self/status").is_ok_and(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("Threads:"))
            .is_some_and(|n| n.trim() == "1")
    })
}

/// Drop every resident page of this process's heap and private anonymous
/// memory that holds only zeros (see the module documentation); returns how
/// many. Nothing is done unless the process has one thread: the check of a
/// page and its drop must have no writer between them, and this thread writes
/// only its stack (excluded) and locals while it runs. The caller's process
/// must not write memory from signal handlers (monitor and init read signals
/// through a signalfd).
fn drop_zero_pages() -> usize {
    const PAGE: usize = 4096;
    if !single_threaded() {
        return 0;
    }
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return 0;
    };
    // Never this thread's own stack (`[stack]` is not a candidate, but a
    // thread's stack made by mmap is unnamed): the check below writes there.
    let here = 0u8;
    let sp = std::ptr::addr_of!(here) as usize;
    let ranges: Vec<(usize, usize)> = zero_candidates(&maps)
        .into_iter()
        .filter(|(lo, hi)| !(*lo..*hi).contains(&sp))
        .collect();
    drop(maps);
    let (Ok(mem), Ok(pagemap)) = (
        std::fs::File::open("/proc/self/mem"),
        std::fs::File::open("/proc/self/pagemap"),
    ) else {
        return 0;
    };
    let mut page = [0u8; PAGE];
    let mut entries = [0u8; 8 * 64];
    let mut dropped = 0;
    for (start, end) in ranges {
        let mut addr = start;
        while addr < end {
            let n = ((end - addr) / PAGE).min(64);
            let want = &mut entries[..8 * n];
            if pagemap
                .read_exact_at(want, (addr / PAGE * 8) as u64)
                .is_err()
            {
                break;
            }
            for i in 0..n {
                let at = addr + i * PAGE;
                let entry = u64::from_ne_bytes(want[8 * i..8 * i + 8].try_into().unwrap_or([0; 8]));
                if entry >> 63 == 0 || mem.read_exact_at(&mut page, at as u64).is_err() {
                    continue;
                }
                if page.iter().all(|&b| b == 0) {
                    // SAFETY: `at` is a page of one of this process's own
                    // private anonymous mappings (not the stack) that holds
                    // only zeros, read just now with no other thread to write
                    // it since (single-threaded, signals read by fd). After
                    // MADV_DONTNEED it reads as zeros again, so every value in
                    // it, live or free, is unchanged.
                    if unsafe { libc::madvise(at as *mut libc::c_void, PAGE, libc::MADV_DONTNEED) }
                        == 0
                    {
                        dropped += 1;
                    }
                }
            }
            addr += n * PAGE;
        }
    }
    dropped
}

/// Give back what an idle monitor or init does not need (see the module
/// documentation): its clean file pages, the free parts of its heap, and its
/// zero-filled anonymous pages. Best effort: what the kernel refuses is left as
/// it is.
pub fn drop_idle_memory() {
    // SAFETY: malloc_trim only returns free heap memory to the kernel.
    unsafe {
        libc::malloc_trim(0);
    }
    let zero = drop_zero_pages();
    // After the steps above, whose code is mapped again by running it.
    drop_file_pages();
    // Last: the steps above reach deeper into the stack than what follows,
    // and a dropped stack page touched again is a new private page.
    let stack = drop_dead_stack();
    tracing::debug!(zero, stack, "dropped zero-filled and dead stack pages");
}

/// How far below the current stack pointer the stack is left alone: far more
/// than the frames of the calls between here and the `madvise` below.
const STACK_MARGIN: usize = 16 * 1024;

/// Drop the pages of this thread's stack (the mapping that holds its stack
/// pointer: `[stack]` for the main thread, which the monitor and init run on)
/// that lie more than [`STACK_MARGIN`] below the stack pointer: what deep calls
/// made during the start left there is dead (the ABI keeps nothing below the
/// stack pointer but a 128-byte red zone), and a later deeper call finds fresh
/// zero pages. Returns how many pages were resident there.
fn drop_dead_stack() -> usize {
    const PAGE: usize = 4096;
    let here = 0u8;
    let sp = std::ptr::addr_of!(here) as usize;
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return 0;
    };
    let Some((lo, hi)) = mapping_holding(&maps, sp) else {
        return 0;
    };
    if !(lo..hi).contains(&sp) || sp - lo <= STACK_MARGIN {
        return 0;
    }
    let end = (sp - STACK_MARGIN) & !(PAGE - 1);
    let resident = resident_pages(lo, end);
    // SAFETY: [lo, end) is part of the mapping holding this thread's stack
    // pointer, i.e. its own stack (stacks grow down from their top), and lies
    // entirely below the stack pointer minus a margin larger than any frame
    // pushed until this call returns, so it holds no live data; after
    // MADV_DONTNEED it reads as zeros and is faulted in again on use.
    if unsafe { libc::madvise(lo as *mut libc::c_void, end - lo, libc::MADV_DONTNEED) } != 0 {
        return 0;
    }
    resident
}

/// The range of the mapping of `/proc/self/maps` text that holds `addr`.
fn mapping_holding(maps: &str, addr: usize) -> Option<(usize, usize)> {
    maps.lines()
        .filter_map(|l| {
            let (lo, hi) = l.split_whitespace().next()?.split_once('-')?;
            Some((
                usize::from_str_radix(lo, 16).ok()?,
                usize::from_str_radix(hi, 16).ok()?,
            ))
        })
        .find(|(lo, hi)| (*lo..*hi).contains(&addr))
}

/// How many pages of [lo, hi) of this process are resident (`/proc/self/pagemap`).
fn resident_pages(lo: usize, hi: usize) -> usize {
    const PAGE: usize = 4096;
    let Ok(pagemap) = std::fs::File::open("/proc/self/pagemap") else {
        return 0;
    };
    (lo / PAGE..hi / PAGE)
        .filter(|p| {
            let mut e = [0u8; 8];
            pagemap.read_exact_at(&mut e, (*p * 8) as u64).is_ok()
                && u64::from_ne_bytes(e) >> 63 == 1
        })
        .count()
}

/// Unmap this process's clean file pages (see the module documentation). Best
/// effort: a mapping the kernel refuses is left as it is.
fn drop_file_pages() {
    let Ok(file) = std::fs::File::open("/proc/self/smaps") else {
        return;
    };
    for m in clean_file_mappings(BufReader::new(file)) {
        let addr = m.start as *mut libc::c_void;
        let len = m.end - m.start;
        // SAFETY: the range is exactly one of this process's own file-backed,
        // private, read-only mappings with no anonymous pages (read from smaps
        // just now; being read-only, nothing can have written it since).
        // MADV_DONTNEED on such a mapping only unmaps clean pages
        // that are read back from the file on the next access, so no data is
        // lost and every pointer into it stays valid.
        unsafe {
            libc::madvise(addr, len, libc::MADV_DONTNEED);
        }
    }
}

/// Keep every thread of this process on the C library's main heap. A
/// detached monitor lives as long as its box and runs short-lived threads
/// (network setup joins the box's network namespace on one): each would get
/// an allocator arena of its own, whose touched pages (about 100 KiB here)
/// stay with the monitor for good.
pub fn one_malloc_arena() {
    // SAFETY: mallopt only changes a tuning parameter of the allocator; it is
    // called before this process starts any thread.
    unsafe {
        libc::mallopt(libc::M_ARENA_MAX, 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SMAPS: &str = "\
55d0c0a00000-55d0c0b00000 r--p 00000000 08:01 1234 /usr/bin/nestbox
Size:               1024 kB
Rss:                 512 kB
Anonymous:             0 kB
55d0c0b00000-55d0c0c00000 r-xp 00100000 08:01 1234 /usr/bin/nestbox
Anonymous:             0 kB
55d0c0c00000-55d0c0c10000 r--p 00200000 08:01 1234 /usr/bin/nestbox
Anonymous:            64 kB
55d0c0c10000-55d0c0c20000 rw-p 00210000 08:01 1234 /usr/bin/nestbox
Anonymous:             4 kB
55d0c1000000-55d0c1100000 rw-p 00000000 00:00 0 [heap]
Anonymous:            12 kB
7f0000000000-7f0000001000 rw-s 00000000 00:05 99 /dev/shm/x
Anonymous:             0 kB
7ffd00000000-7ffd00002000 r-xp 00000000 00:00 0 [vdso]
Anonymous:             0 kB
7f1000000000-7f1000010000 r-xp 00000000 08:01 77 /usr/lib/libc.so.6
Anonymous:             0 kB
";

    #[test]
    fn only_private_file_mappings_without_anonymous_pages_are_dropped() {
        let got = clean_file_mappings(SMAPS.as_bytes());
        assert_eq!(
            got,
            vec![
                CleanFileMapping {
                    start: 0x55d0c0a00000,
                    end: 0x55d0c0b00000
                },
                CleanFileMapping {
                    start: 0x55d0c0b00000,
                    end: 0x55d0c0c00000
                },
                CleanFileMapping {
                    start: 0x7f1000000000,
                    end: 0x7f1000010000
                },
            ]
        );
    }

    #[test]
    fn dropping_keeps_code_and_data_working() {
        let data: Vec<u8> = (0..=255).collect();
        drop_file_pages();
        // Code, relocated read-only data and the heap all still work.
        assert_eq!(data.iter().map(|&b| b as u32).sum::<u32>(), 32640);
        assert_eq!(format!("{:?}", Some(1)), "Some(1)");
    }

    #[test]
    fn zero_candidates_are_the_heap_and_unnamed_private_writable_memory() {
        let maps = "\
55d0c0a00000-55d0c0b00000 r--p 00000000 08:01 1234 /usr/bin/nestbox
55d0c0c10000-55d0c0c20000 rw-p 00210000 08:01 1234 /usr/bin/nestbox
55d0c0c20000-55d0c0c30000 rw-p 00000000 00:00 0 
55d0c1000000-55d0c1100000 rw-p 00000000 00:00 0                          [heap]
7f0000000000-7f0000001000 rw-s 00000000 00:01 0 /SYSV00000000 (deleted)
7f0000002000-7f0000003000 rw-s 00000000 00:01 5 /dev/zero (deleted)
7f0000004000-7f0000005000 ---p 00000000 00:00 0 
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
7ffd00030000-7ffd00032000 r--p 00000000 00:00 0                          [vvar]
";
        assert_eq!(
            zero_candidates(maps),
            vec![
                (0x55d0c0c20000, 0x55d0c0c30000),
                (0x55d0c1000000, 0x55d0c1100000)
            ]
        );
    }

    /// In a child (one thread: the forked test thread): after a deep call,
    /// the stack far below the caller is given back, and the caller's frames
    /// still work.
    #[test]
    fn dead_stack_is_dropped() {
        #[inline(never)]
        fn deep(n: usize) -> u64 {
            let mut a = [0u8; 4096];
            a[n % 4096] = n as u8;
            std::hint::black_box(&mut a);
            if n == 0 {
                1
            } else {
                deep(n - 1) + u64::from(std::hint::black_box(a)[n % 4096])
            }
        }
        in_child(|| {
            let live = [7u8; 512];
            let sum = deep(100);
            let sp = std::ptr::addr_of!(live) as usize;
            let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
            let lo = mapping_holding(&maps, sp).unwrap().0;
            let below = resident_pages(lo, sp - STACK_MARGIN);
            let dropped = drop_dead_stack();
            let after = resident_pages(lo, (sp - STACK_MARGIN - 4096) & !4095);
            below >= 20
                && dropped >= 20
                && after == 0
                && std::hint::black_box(live).iter().all(|&b| b == 7)
                && deep(100) == sum
        });
    }

    /// In a child (the test harness has threads; the drop needs one): zeroed
    /// heap memory is given back and still reads as zeros, and memory with
    /// data keeps it.
    #[test]
    fn zero_pages_are_dropped_and_data_is_kept() {
        in_child(|| {
            let zeros = vec![0u8; 64 * 4096];
            let mut data = vec![0u8; 16 * 4096];
            for (i, b) in data.iter_mut().enumerate() {
                *b = (i % 251) as u8 | 1;
            }
            // The whole pages inside `v`.
            let resident = |v: &[u8]| -> usize {
                let first = (v.as_ptr() as usize).next_multiple_of(4096);
                resident_pages(first, (v.as_ptr() as usize + v.len()) & !4095)
            };
            // Touch the zeroed pages (calloc may have left them untouched).
            for p in (0..zeros.len()).step_by(4096) {
                // SAFETY: p is inside `zeros`; writing the zero it holds.
                unsafe { std::ptr::write_volatile(zeros.as_ptr().add(p).cast_mut(), 0) };
            }
            let before = resident(&zeros);
            let dropped = drop_zero_pages();
            let after = resident(&zeros);
            before >= 60
                && after == 0
                && dropped >= 60
                && zeros.iter().all(|&b| b == 0)
                && data
                    .iter()
                    .enumerate()
                    .all(|(i, &b)| b == (i % 251) as u8 | 1)
                && resident(&data) >= 14
        });
    }

    /// Run `check` in a forked child (one thread, as the monitor and init
    /// are) and assert that it returned true.
    fn in_child(check: impl FnOnce() -> bool) {
        // SAFETY: the child runs `check` (allocations, reads and the
        // functions under test) and leaves with _exit; the parent waits.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0, "fork");
        if pid == 0 {
            nestbox_sys::process::exit_now(if check() { 0 } else { 1 });
        }
        let mut status = 0;
        // SAFETY: waitpid on our own child with a valid status pointer.
        assert_eq!(unsafe { libc::waitpid(pid, &mut status, 0) }, pid);
        assert!(
            libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0,
            "status {status:#x}"
        );
    }
}
