//! The first-touch working set of a template's clones, recorded and prefetched.
//!
//! A clone shares all of its template's memory, so the first request it serves
//! pays a page fault for every page it touches first: a fault and a page copy
//! for each page it writes (copy-on-write), and a fault for each page of code
//! or read-only file data it reads (fork copies no page-table entries of file
//! mappings without private pages; the clone maps them again as it goes).
//! Hundreds of faults for a Python server: about 2 ms here. As REAP does for
//! microVM snapshots, nestbox records which pages claimed clones have come to
//! touch (`/proc/PID/pagemap`): the pages of private writable mappings that
//! only the clone maps (bit 56, exclusive), and the present pages of its file
//! mappings. While making the next pooled clones, which wait stopped until
//! claimed, it touches those pages in them ahead of time through
//! `/proc/PID/mem`: a written page gets its own bytes written back (the kernel
//! breaks the sharing, the contents do not change), a read page is read (the
//! kernel maps it). Clones forked on demand are not prefetched.
//!
//! The set is learned from the first [`LEARN_FROM`] clones recorded (when a
//! pool is refilled and when a claimed clone is removed) and then kept, so
//! that it holds what a clone's first requests touch rather than all that
//! long-lived clones come to write.

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use crate::{Result, RuntimeError};

/// Most pages recorded of each kind (32 MiB of 4 KiB pages).
pub const MAX_PAGES: usize = 8192;
/// How many clones the set is learned from.
pub const LEARN_FROM: u32 = 8;

const PAGE: u64 = 4096;
const PRESENT: u64 = 1 << 63;
const EXCLUSIVE: u64 = 1 << 56;

/// Which mappings of a process a kind of page is looked for in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mappings {
    /// Private and writable: where a write makes a private copy of a shared page.
    WritablePrivate,
    /// Backed by a file and not private-writable (code, read-only data): what a
    /// clone maps again by faulting.
    FileReadOnly,
}

/// Address ranges of `maps` text of the kind `which`.
fn ranges(maps: &str, which: Mappings) -> Vec<(u64, u64)> {
    maps.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let range = f.next()?;
            let perms = f.next()?;
            let path = f.nth(3).unwrap_or("");
            let (lo, hi) = range.split_once('-')?;
            let writable_private =
                perms.len() == 4 && perms.starts_with("rw") && perms.ends_with('p');
            let ok = match which {
                Mappings::WritablePrivate => writable_private,
                Mappings::FileReadOnly => {
                    !writable_private && perms.starts_with('r') && path.starts_with('/')
                }
            };
            ok.then(|| {
                Some((
                    u64::from_str_radix(lo, 16).ok()?,
                    u64::from_str_radix(hi, 16).ok()?,
                ))
            })
            .flatten()
        })
        .collect()
}

/// Page addresses in the `which` mappings of `pid` whose pagemap entry
/// satisfies `want`.
fn pages_where(pid: i32, which: Mappings, want: impl Fn(u64) -> bool) -> Result<Vec<u64>> {
    let maps_path = format!("/proc/{pid}/maps");
    let maps = fs::read_to_string(&maps_path).map_err(RuntimeError::io("read", &maps_path))?;
    let map_path = format!("/proc/{pid}/pagemap");
    let mut pagemap = fs::File::open(&map_path).map_err(RuntimeError::io("open", &map_path))?;
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for (lo, hi) in ranges(&maps, which) {
        let pages = ((hi - lo) / PAGE) as usize;
        buf.resize(pages * 8, 0);
        pagemap
            .seek(SeekFrom::Start(lo / PAGE * 8))
            .and_then(|_| pagemap.read_exact(&mut buf))
            .map_err(RuntimeError::io("read", &map_path))?;
        for (i, entry) in buf.chunks_exact(8).enumerate() {
            let e = u64::from_le_bytes(entry.try_into().unwrap_or_default());
            if want(e) {
                out.push(lo + i as u64 * PAGE);
            }
        }
    }
    Ok(out)
}

/// A recorded working set.
#[derive(Debug, Default, PartialEq, Eq)]
struct WorkingSet {
    /// How many clones it was learned from.
    sources: u32,
    /// Pages written (made private) by the clones, sorted.
    written: Vec<u64>,
    /// File pages read (mapped) by the clones, sorted.
    read: Vec<u64>,
}

impl WorkingSet {
    /// Parse the file: `sources N`, then one `w ADDR` or `r ADDR` line a page
    /// (addresses in hex). A missing or unreadable file is an empty set.
    fn load(file: &Path) -> WorkingSet {
        let mut set = WorkingSet::default();
        for line in fs::read_to_string(file).unwrap_or_default().lines() {
            let Some((key, value)) = line.split_once(' ') else {
                continue;
            };
            match key {
                "sources" => set.sources = value.trim().parse().unwrap_or(0),
                "w" | "r" => {
                    if let Ok(addr) = u64::from_str_radix(value.trim(), 16) {
                        if key == "w" {
                            set.written.push(addr)
                        } else {
                            set.read.push(addr)
                        }
                    }
                }
                _ => {}
            }
        }
        set.written.sort_unstable();
        set.read.sort_unstable();
        set
    }

    /// Write it atomically (a temporary file of this process, renamed).
    fn save(&self, file: &Path) -> Result<()> {
        let mut text = format!("sources {}\n", self.sources);
        for p in &self.written {
            text.push_str(&format!("w {p:x}\n"));
        }
        for p in &self.read {
            text.push_str(&format!("r {p:x}\n"));
        }
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        nestbox_sys::replace::replace_file(file, &tmp, text.as_bytes())
            .map_err(|e| RuntimeError::io(e.what, &e.path)(e.source))
    }
}

/// Merge `more` into the sorted `pages`, keeping at most [`MAX_PAGES`].
fn merge(pages: &mut Vec<u64>, more: Vec<u64>) {
    pages.extend(more);
    pages.sort_unstable();
    pages.dedup();
    pages.truncate(MAX_PAGES);
}

/// Add the pages process `pid` (a claimed clone) has touched to the working
/// set in `file`, unless it was learned from [`LEARN_FROM`] clones already.
/// Returns the number of pages in the set.
pub fn record(file: &Path, pid: i32) -> Result<usize> {
    let mut set = WorkingSet::load(file);
    if set.sources < LEARN_FROM {
        let learned = pages_where(pid, Mappings::WritablePrivate, |e| {
            e & PRESENT != 0 && e & EXCLUSIVE != 0
        })
        .and_then(|w| {
            Ok((
                w,
                pages_where(pid, Mappings::FileReadOnly, |e| e & PRESENT != 0)?,
            ))
        });
        let (written, read) = match learned {
            Ok(pages) => pages,
            // The clone ended meanwhile (removed, or its template went): it
            // has nothing left to teach, which is no failure.
            Err(e) if process_ended(&e) => return Ok(set.written.len() + set.read.len()),
            Err(e) => return Err(e),
        };
        merge(&mut set.written, written);
        merge(&mut set.read, read);
        set.sources += 1;
        set.save(file)?;
    }
    Ok(set.written.len() + set.read.len())
}

/// Whether `e` says the process read was gone: its /proc entries vanish
/// (ENOENT) or answer ESRCH once it has exited.
fn process_ended(e: &RuntimeError) -> bool {
    matches!(e, RuntimeError::Io { source, .. }
        if matches!(source.raw_os_error(), Some(libc::ESRCH | libc::ENOENT)))
}

/// Touch, in stopped process `pid`, each recorded page it has not touched yet:
/// a written page it still shares gets its own bytes written back, a read page
/// it does not map is read. The process must not run meanwhile (it is checked
/// to be stopped). Returns the number of pages touched.
pub fn prefetch(file: &Path, pid: i32) -> Result<usize> {
    let set = WorkingSet::load(file);
    if set.written.is_empty() && set.read.is_empty() {
        return Ok(0);
    }
    if !is_stopped(pid) {
        return Err(RuntimeError::Failed(format!(
            "process {pid} is not stopped: its pages are not prefetched"
        )));
    }
    let shared = pages_where(pid, Mappings::WritablePrivate, |e| {
        e & PRESENT != 0 && e & EXCLUSIVE == 0
    })?;
    let unmapped = pages_where(pid, Mappings::FileReadOnly, |e| e & PRESENT == 0)?;
    let mem_path = format!("/proc/{pid}/mem");
    let mut mem = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&mem_path)
        .map_err(RuntimeError::io("open", &mem_path))?;
    let mut page = [0u8; PAGE as usize];
    let mut touched = 0;
    for addr in set.written {
        if shared.binary_search(&addr).is_err() {
            continue;
        }
        let done = mem
            .seek(SeekFrom::Start(addr))
            .and_then(|_| mem.read_exact(&mut page))
            .and_then(|_| mem.seek(SeekFrom::Start(addr)))
            .and_then(|_| mem.write_all(&page));
        touched += usize::from(done.is_ok());
    }
    let mut word = [0u8; 8];
    for addr in set.read {
        // (The kernel maps a faulted page's neighbours too: reading one of
        // those again is a copy of 8 bytes, no fault.)
        if unmapped.binary_search(&addr).is_err() {
            continue;
        }
        let done = mem
            .seek(SeekFrom::Start(addr))
            .and_then(|_| mem.read_exact(&mut word));
        touched += usize::from(done.is_ok());
    }
    Ok(touched)
}

/// Whether `pid` is in the stopped state (`T` in /proc/PID/stat).
pub fn is_stopped(pid: i32) -> bool {
    fs::read_to_string(format!("/proc/{pid}/stat"))
        .ok()
        .and_then(|s| {
            s.rsplit_once(')')
                .map(|(_, r)| r.trim_start().starts_with('T'))
        })
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::*;
    use nix::sys::signal::{kill, Signal};
    use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
    use nix::unistd::{fork, ForkResult, Pid};

    #[test]
    fn recording_a_process_that_ended_learns_nothing_and_is_no_error() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("working-set");
        // A child that has exited and been reaped: its pid names no process.
        let child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id() as i32;
        let status = { child }.wait().unwrap();
        assert!(status.success());
        assert_eq!(record(&file, pid).unwrap(), 0);
        assert!(!file.exists(), "nothing learned, nothing written");
    }

    #[test]
    fn mappings_are_told_apart() {
        let maps = "\
55d0c0a00000-55d0c0b00000 r--p 00000000 08:01 1 /usr/bin/python3
55d0c0b00000-55d0c0c00000 rw-p 00100000 08:01 1 /usr/bin/python3
55d0c0c00000-55d0c0d00000 r-xp 00200000 08:01 1 /usr/bin/python3
7f0000000000-7f0000010000 rw-s 00000000 00:05 9 /dev/shm/x
7f1000000000-7f1000020000 rw-p 00000000 00:00 0
7f2000000000-7f2000001000 ---p 00000000 08:01 2 /usr/lib/libc.so.6
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
7ffd10000000-7ffd10002000 r-xp 00000000 00:00 0 [vdso]
";
        assert_eq!(
            ranges(maps, Mappings::WritablePrivate),
            vec![
                (0x55d0c0b00000, 0x55d0c0c00000),
                (0x7f1000000000, 0x7f1000020000),
                (0x7ffd00000000, 0x7ffd00021000)
            ]
        );
        assert_eq!(
            ranges(maps, Mappings::FileReadOnly),
            vec![
                (0x55d0c0a00000, 0x55d0c0b00000),
                (0x55d0c0c00000, 0x55d0c0d00000),
                (0x7f0000000000, 0x7f0000010000)
            ]
        );
    }

    #[test]
    fn the_set_file_round_trips_and_stops_learning() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("working-set");
        assert_eq!(WorkingSet::load(&file), WorkingSet::default());
        let set = WorkingSet {
            sources: LEARN_FROM,
            written: vec![0x1000, 0x7f0000002000],
            read: vec![0x5000],
        };
        set.save(&file).unwrap();
        assert_eq!(WorkingSet::load(&file), set);
        // Learned from enough clones: recording adds nothing (and would not
        // even look at the process: pid 0 has no /proc entry).
        assert_eq!(record(&file, 0).unwrap(), 3);
        assert_eq!(WorkingSet::load(&file), set);
        let mut pages = vec![3, 1];
        merge(&mut pages, (0..MAX_PAGES as u64 + 10).collect());
        assert_eq!(pages.len(), MAX_PAGES);
        assert_eq!(&pages[..3], &[0, 1, 2]);
    }

    /// A parent with 64 pages of data and a 64-page file mapped read-only
    /// forks two children. The first writes 8 of the data pages and reads 3
    /// pages of the file; recording it finds them. The second, stopped, gets
    /// them prefetched: afterwards it owns the written pages, with the
    /// parent's bytes unchanged, and maps the read ones.
    #[test]
    fn recorded_pages_are_prefetched_with_their_contents() {
        if !nestbox_testkit::require(
            nix::unistd::geteuid().is_root(),
            "recorded_pages_are_prefetched_with_their_contents",
            "reading another process's pagemap flags needs root",
        ) {
            return;
        }
        let data: Vec<u8> = (0..64 * PAGE).map(|i| (i / PAGE) as u8 ^ 0x5a).collect();
        let base = data.as_ptr() as u64;
        let first_page = base.div_ceil(PAGE) * PAGE;
        let touched: Vec<u64> = (0..8).map(|i| first_page + (i * 5 + 1) * PAGE).collect();
        let dir = tempfile::tempdir().unwrap();
        let backing = dir.path().join("mapped");
        fs::write(&backing, vec![7u8; 64 * PAGE as usize]).unwrap();
        let backing = fs::File::open(&backing).unwrap();
        // SAFETY: a new read-only private mapping of a file this test owns;
        // nothing else is mapped at the address the kernel picks.
        let mapped = unsafe {
            nix::sys::mman::mmap(
                None,
                std::num::NonZeroUsize::new(64 * PAGE as usize).unwrap(),
                nix::sys::mman::ProtFlags::PROT_READ,
                nix::sys::mman::MapFlags::MAP_PRIVATE,
                &backing,
                0,
            )
        }
        .unwrap()
        .as_ptr() as u64;
        let read: Vec<u64> = [2, 20, 40].iter().map(|i| mapped + i * PAGE).collect();
        let (r, w) = nix::unistd::pipe().unwrap();
        // SAFETY: the children only write to memory they own, read/write a
        // pipe and sleep; no locks are taken after fork.
        let writer = match unsafe { fork() }.unwrap() {
            ForkResult::Child => {
                for &p in &touched {
                    // SAFETY: p lies inside `data` (pages 1..36 of 64 after the
                    // first page boundary), which this process owns.
                    unsafe {
                        let ptr = p as *mut u8;
                        ptr.write_volatile(ptr.read_volatile());
                    }
                }
                for &p in &read {
                    // SAFETY: p lies inside the 64-page read-only mapping above.
                    unsafe { (p as *const u8).read_volatile() };
                }
                // The parent waits for this byte; if it cannot be written the
                // parent's read fails and the test with it.
                let _ = nix::unistd::write(&w, b"x");
                std::thread::sleep(std::time::Duration::from_secs(30));
                nestbox_sys::process::exit_now(0)
            }
            ForkResult::Parent { child } => child,
        };
        let mut b = [0u8; 1];
        nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&r), &mut b).unwrap();
        let file = dir.path().join("working-set");
        let n = record(&file, writer.as_raw()).unwrap();
        let recorded = WorkingSet::load(&file);
        for p in &touched {
            assert!(
                recorded.written.contains(p),
                "page {p:x} written by the child is recorded"
            );
        }
        for p in &read {
            assert!(
                recorded.read.contains(p),
                "file page {p:x} read by the child is recorded"
            );
        }
        assert_eq!(recorded.sources, 1);
        assert!(n >= touched.len() + read.len());
        kill(writer, Signal::SIGKILL).unwrap();
        waitpid(writer, None).unwrap();

        // SAFETY: as above; this child only stops itself and then exits.
        let stopped = match unsafe { fork() }.unwrap() {
            ForkResult::Child => {
                // Stopping oneself cannot fail; the test checks the stop.
                let _ = kill(Pid::this(), Signal::SIGSTOP);
                nestbox_sys::process::exit_now(0)
            }
            ForkResult::Parent { child } => child,
        };
        loop {
            match waitpid(stopped, Some(WaitPidFlag::WUNTRACED)).unwrap() {
                WaitStatus::Stopped(..) => break,
                _ => continue,
            }
        }
        let owned = |pid: Pid| {
            pages_where(pid.as_raw(), Mappings::WritablePrivate, |e| {
                e & PRESENT != 0 && e & EXCLUSIVE != 0
            })
            .unwrap()
        };
        let mapped_now = |pid: Pid| {
            pages_where(pid.as_raw(), Mappings::FileReadOnly, |e| e & PRESENT != 0).unwrap()
        };
        let owned_before = owned(stopped);
        assert!(touched.iter().all(|p| !owned_before.contains(p)));
        let mapped_before = mapped_now(stopped);
        assert!(read.iter().all(|p| !mapped_before.contains(p)));
        let copied = prefetch(&file, stopped.as_raw()).unwrap();
        assert!(copied >= touched.len() + read.len(), "touched {copied}");
        let owned_after = owned(stopped);
        for p in &touched {
            assert!(owned_after.contains(p), "page {p:x} is the child's own now");
        }
        let mapped_after = mapped_now(stopped);
        for p in &read {
            assert!(mapped_after.contains(p), "file page {p:x} is mapped now");
        }
        let mut mem = fs::File::open(format!("/proc/{}/mem", stopped)).unwrap();
        for p in &touched {
            let mut page = [0u8; PAGE as usize];
            mem.seek(SeekFrom::Start(*p)).unwrap();
            mem.read_exact(&mut page).unwrap();
            let off = (*p - base) as usize;
            assert_eq!(
                &page[..],
                &data[off..off + PAGE as usize],
                "contents unchanged"
            );
        }
        kill(stopped, Signal::SIGKILL).unwrap();
        waitpid(stopped, None).unwrap();
    }
}
