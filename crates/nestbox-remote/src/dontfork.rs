//! Mappings a fork does not copy: `madvise(MADV_DONTFORK)` regions (`dc` in the
//! `VmFlags` of `/proc/PID/smaps`). V8 marks its whole heap so (Node.js), and a
//! clone made by fork would miss them. When a plain fork of G1 comes out smaller
//! than the template, the remote fork reads them, clears the mark in the
//! template's memory (through C1, which shares it) just around a second fork of
//! G1, puts it back at once, and marks the same regions in the clone.

use crate::error::{RemoteError, Result};
use crate::procfs::{proc_path, read_to_string};
use crate::tracee::Tracee;

/// The mappings of a process marked `MADV_DONTFORK`.
#[derive(Debug, Clone, Default)]
pub(crate) struct DontFork {
    /// `[start, end)` ranges (adjacent ones merged), without device and
    /// raw-PFN mappings, which the kernel marks itself and a fork never copies.
    pub ranges: Vec<(u64, u64)>,
    /// Whether no device mapping (`VM_IO`, where `MADV_DOFORK` fails) lies
    /// between the first range's start and the last one's end, so that one
    /// `madvise` over that span unmarks them all.
    pub span_clean: bool,
}

impl DontFork {
    /// Read from `/proc/PID/smaps`.
    pub fn read(pid: i32) -> Result<DontFork> {
        let path = proc_path(pid, "smaps");
        let text = read_to_string(&path)?;
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        let mut io: Vec<u64> = Vec::new();
        let mut current: Option<(u64, u64)> = None;
        let mut seen_flags = false;
        for line in text.lines() {
            if let Some(flags) = line.strip_prefix("VmFlags:") {
                seen_flags = true;
                let flags: Vec<&str> = flags.split_whitespace().collect();
                let special = flags.iter().any(|f| ["io", "pf"].contains(f));
                match current {
                    Some((start, _)) if flags.contains(&"io") => io.push(start),
                    Some((start, end)) if flags.contains(&"dc") && !special => {
                        match ranges.last_mut() {
                            Some(last) if last.1 == start => last.1 = end,
                            _ => ranges.push((start, end)),
                        }
                    }
                    _ => {}
                }
                continue;
            }
            let Some(range) = line.split_whitespace().next() else {
                continue;
            };
            if let Some((start, end)) = range.split_once('-') {
                if let (Ok(start), Ok(end)) =
                    (u64::from_str_radix(start, 16), u64::from_str_radix(end, 16))
                {
                    current = Some((start, end));
                }
            }
        }
        if !seen_flags && !text.is_empty() {
            return Err(RemoteError::Parse {
                path,
                message: "no VmFlags lines".into(),
            });
        }
        let span_clean = match (ranges.first(), ranges.last()) {
            (Some(first), Some(last)) => !io.iter().any(|&s| s >= first.0 && s < last.1),
            _ => true,
        };
        Ok(DontFork { ranges, span_clean })
    }

    /// Unmark the ranges (`MADV_DOFORK`) by calls injected in `tracee`: one
    /// over the whole span when it is clean (the holes in it answer `ENOMEM`
    /// after the advice is applied to every mapping around them).
    pub fn unmark(&self, tracee: &mut Tracee) -> Result<()> {
        let (Some(first), Some(last)) = (self.ranges.first(), self.ranges.last()) else {
            return Ok(());
        };
        if !self.span_clean {
            for &(start, end) in &self.ranges {
                tracee.syscall(
                    "madvise(MADV_DOFORK)",
                    || format!("{start:#x}-{end:#x}"),
                    libc::SYS_madvise,
                    &[start, end - start, libc::MADV_DOFORK as u64],
                )?;
            }
            return Ok(());
        }
        let (start, len) = (first.0, last.1 - first.0);
        let rc =
            tracee.inject_syscall(libc::SYS_madvise, &[start, len, libc::MADV_DOFORK as u64])?;
        if rc < 0 && rc != -i64::from(libc::ENOMEM) {
            return Err(RemoteError::Injected {
                syscall: "madvise(MADV_DOFORK)",
                pid: tracee.pid(),
                context: format!("{start:#x}-{:#x}", last.1),
                source: std::io::Error::from_raw_os_error(-rc as i32),
            });
        }
        Ok(())
    }

    /// Mark the ranges again (`MADV_DONTFORK`), spread over `threads` (all of
    /// one memory), which run their calls at once.
    pub fn mark(&self, threads: &mut [&mut Tracee]) -> Result<()> {
        if threads.is_empty() {
            return Ok(());
        }
        for chunk in self.ranges.chunks(threads.len()) {
            let calls: Vec<_> = chunk
                .iter()
                .map(|&(start, end)| {
                    Some((
                        libc::SYS_madvise,
                        vec![start, end - start, libc::MADV_DONTFORK as u64],
                    ))
                })
                .collect();
            crate::threads::syscall_each_checked(
                &mut threads[..chunk.len()],
                "madvise(MADV_DONTFORK)",
                "re-marking memory a fork does not copy",
                &calls,
            )?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn own_dontfork_mapping_is_found() {
        let len = 3 * 4096;
        // SAFETY: a fresh anonymous mapping, only advised and unmapped here.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        // SAFETY: advising the mapping made above.
        assert_eq!(unsafe { libc::madvise(addr, len, libc::MADV_DONTFORK) }, 0);
        let me = std::process::id() as i32;
        let start = addr as u64;
        let found = DontFork::read(me).expect("smaps").ranges;
        assert!(
            found
                .iter()
                .any(|&(s, e)| s <= start && e >= start + len as u64),
            "{found:x?}"
        );
        // SAFETY: unmapping the mapping made above.
        unsafe { libc::munmap(addr, len) };
    }
}
