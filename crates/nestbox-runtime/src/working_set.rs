//! The first-touch working set of a template's clones, recorded and prefetched.
//!
//! A clone shares all of its template's memory copy-on-write, so the first
//! request it serves pays a page fault and a page copy for every page that
//! request writes (hundreds for a Python server: about 2 ms here). As REAP
//! does for microVM snapshots, nestbox records which pages a claimed clone has
//! come to own (the pages mapped only by it: `/proc/PID/pagemap` bit 56), and,
//! while making the next pooled clones, which wait stopped until claimed, it
//! copies those pages in them ahead of time by writing each page's own bytes
//! back through `/proc/PID/mem`. Contents never change; only when the copy
//! happens does. Clones forked on demand are not prefetched.

use std::fs;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::Path;

use crate::{Result, RuntimeError};

/// Most pages recorded for a template (32 MiB of 4 KiB pages).
pub const MAX_PAGES: usize = 8192;

const PAGE: u64 = 4096;
const PRESENT: u64 = 1 << 63;
const EXCLUSIVE: u64 = 1 << 56;

/// Address ranges of `maps` text that are private and writable: the only
/// mappings where a write makes a private copy of a shared page.
fn writable_private(maps: &str) -> Vec<(u64, u64)> {
    maps.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let range = f.next()?;
            let perms = f.next()?;
            let (lo, hi) = range.split_once('-')?;
            let ok = perms.len() == 4 && perms.starts_with("rw") && perms.ends_with('p');
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

/// Page addresses in the writable private ranges of `pid` whose pagemap entry
/// satisfies `want`.
fn pages_where(pid: i32, want: impl Fn(u64) -> bool) -> Result<Vec<u64>> {
    let maps_path = format!("/proc/{pid}/maps");
    let maps = fs::read_to_string(&maps_path).map_err(RuntimeError::io("read", &maps_path))?;
    let map_path = format!("/proc/{pid}/pagemap");
    let mut pagemap = fs::File::open(&map_path).map_err(RuntimeError::io("open", &map_path))?;
    let mut out = Vec::new();
    let mut buf = Vec::new();
    for (lo, hi) in writable_private(&maps) {
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

fn read_recorded(file: &Path) -> Vec<u64> {
    fs::read_to_string(file)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| u64::from_str_radix(l.trim(), 16).ok())
        .collect()
}

/// Add the pages process `pid` (a claimed clone) maps exclusively to the
/// working set in `file`, keeping at most [`MAX_PAGES`]. Returns the size of
/// the set.
pub fn record(file: &Path, pid: i32) -> Result<usize> {
    let mut pages = read_recorded(file);
    pages.extend(pages_where(pid, |e| {
        e & PRESENT != 0 && e & EXCLUSIVE != 0
    })?);
    pages.sort_unstable();
    pages.dedup();
    pages.truncate(MAX_PAGES);
    let text: String = pages.iter().map(|p| format!("{p:x}\n")).collect();
    let tmp = file.with_extension("tmp");
    fs::write(&tmp, text).map_err(RuntimeError::io("write", &tmp))?;
    fs::rename(&tmp, file).map_err(RuntimeError::io("rename", &tmp))?;
    Ok(pages.len())
}

/// Copy, in stopped process `pid`, each recorded page that it still shares
/// (present, not exclusive), by writing the page's bytes back to it. The
/// process must not run meanwhile (it is checked to be stopped). Returns the
/// number of pages copied.
pub fn prefetch(file: &Path, pid: i32) -> Result<usize> {
    let wanted = read_recorded(file);
    if wanted.is_empty() {
        return Ok(0);
    }
    if !is_stopped(pid) {
        return Err(RuntimeError::Invalid(format!(
            "process {pid} is not stopped: its pages are not prefetched"
        )));
    }
    let shared = pages_where(pid, |e| e & PRESENT != 0 && e & EXCLUSIVE == 0)?;
    let mem_path = format!("/proc/{pid}/mem");
    let mut mem = fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&mem_path)
        .map_err(RuntimeError::io("open", &mem_path))?;
    let mut page = [0u8; PAGE as usize];
    let mut copied = 0;
    for addr in wanted {
        if shared.binary_search(&addr).is_err() {
            continue;
        }
        let done = mem
            .seek(SeekFrom::Start(addr))
            .and_then(|_| mem.read_exact(&mut page))
            .and_then(|_| mem.seek(SeekFrom::Start(addr)))
            .and_then(|_| mem.write_all(&page));
        if done.is_ok() {
            copied += 1;
        }
    }
    Ok(copied)
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
    fn only_private_writable_ranges_count() {
        let maps = "\
55d0c0a00000-55d0c0b00000 r--p 00000000 08:01 1 /usr/bin/python3
55d0c0b00000-55d0c0c00000 rw-p 00100000 08:01 1 /usr/bin/python3
7f0000000000-7f0000010000 rw-s 00000000 00:05 9 /dev/shm/x
7f1000000000-7f1000020000 rw-p 00000000 00:00 0
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0 [stack]
";
        assert_eq!(
            writable_private(maps),
            vec![
                (0x55d0c0b00000, 0x55d0c0c00000),
                (0x7f1000000000, 0x7f1000020000),
                (0x7ffd00000000, 0x7ffd00021000)
            ]
        );
    }

    /// A parent with 64 pages of data forks two children. The first writes 8
    /// of the pages; recording it finds them. The second, stopped, gets them
    /// prefetched: afterwards it owns exactly those pages and sees the
    /// parent's bytes, unchanged.
    #[test]
    fn recorded_pages_are_prefetched_with_their_contents() {
        if !nix::unistd::geteuid().is_root() {
            eprintln!("SKIP: reading another process's pagemap flags needs root");
            return;
        }
        let data: Vec<u8> = (0..64 * PAGE).map(|i| (i / PAGE) as u8 ^ 0x5a).collect();
        let base = data.as_ptr() as u64;
        let first_page = base.div_ceil(PAGE) * PAGE;
        let touched: Vec<u64> = (0..8).map(|i| first_page + (i * 5 + 1) * PAGE).collect();
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
                let _ = nix::unistd::write(&w, b"x");
                std::thread::sleep(std::time::Duration::from_secs(30));
                // SAFETY: _exit ends this forked child without running the
                // test harness's exit handlers.
                unsafe { libc::_exit(0) }
            }
            ForkResult::Parent { child } => child,
        };
        let mut b = [0u8; 1];
        nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(&r), &mut b).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("working-set");
        let n = record(&file, writer.as_raw()).unwrap();
        let recorded = read_recorded(&file);
        for p in &touched {
            assert!(
                recorded.contains(p),
                "page {p:x} written by the child is recorded"
            );
        }
        assert!(n >= touched.len());
        kill(writer, Signal::SIGKILL).unwrap();
        waitpid(writer, None).unwrap();

        // SAFETY: as above; this child only stops itself and then exits.
        let stopped = match unsafe { fork() }.unwrap() {
            ForkResult::Child => {
                let _ = kill(Pid::this(), Signal::SIGSTOP);
                // SAFETY: as above.
                unsafe { libc::_exit(0) }
            }
            ForkResult::Parent { child } => child,
        };
        loop {
            match waitpid(stopped, Some(WaitPidFlag::WUNTRACED)).unwrap() {
                WaitStatus::Stopped(..) => break,
                _ => continue,
            }
        }
        let owned_before =
            pages_where(stopped.as_raw(), |e| e & PRESENT != 0 && e & EXCLUSIVE != 0).unwrap();
        assert!(touched.iter().all(|p| !owned_before.contains(p)));
        let copied = prefetch(&file, stopped.as_raw()).unwrap();
        assert!(copied >= touched.len(), "copied {copied}");
        let owned_after =
            pages_where(stopped.as_raw(), |e| e & PRESENT != 0 && e & EXCLUSIVE != 0).unwrap();
        for p in &touched {
            assert!(owned_after.contains(p), "page {p:x} is the child's own now");
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
