//! Resident memory of nestbox's own long-idle processes (a box's monitor and
//! init). Both map the nestbox binary and the C library; while they run, the
//! kernel maps the file pages they touch (and, by fault-around, up to 16 pages
//! around each), which then stay counted in their RSS although they only sit in
//! the shared page cache. Once such a process has nothing to do but wait,
//! [`drop_file_pages`] unmaps those clean file pages from it, so that its RSS
//! shows what it really holds: its own anonymous memory plus the code pages it
//! touches from then on (with their fault-around neighbours).

use std::io::{BufRead, BufReader};

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

/// Unmap this process's clean file pages (see the module documentation). Best
/// effort: a mapping the kernel refuses is left as it is.
pub fn drop_file_pages() {
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
    // SAFETY: malloc_trim only returns free heap memory to the kernel.
    unsafe {
        libc::malloc_trim(0);
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
}
