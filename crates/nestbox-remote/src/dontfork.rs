//! Mappings a fork does not copy: `madvise(MADV_DONTFORK)` regions (`dc` in the
//! `VmFlags` of `/proc/PID/smaps`). V8 marks its whole heap so (Node.js), and a
//! clone made by fork would miss them. When a plain fork of G1 comes out smaller
//! than the template, the remote fork reads them, clears the mark in the
//! template's memory (through C1, which shares it) just around a second fork of
//! G1, puts it back at once, and marks the same regions in the clone.

use crate::error::{RemoteError, Result};
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
    /// The mappings of `template` that `child`, forked from it a moment ago,
    /// does not have: the ones marked `MADV_DONTFORK` (`/proc/PID/maps` of
    /// both, much cheaper than `smaps`; a fork copies every other mapping as
    /// it is). Device mappings (a path under `/dev/`), which the kernel may
    /// mark itself, are left out.
    pub fn missing_in(template: i32, child: i32) -> Result<DontFork> {
        let have: std::collections::HashSet<(u64, u64)> = crate::maps::read_maps(child)?
            .iter()
            .map(|m| (m.start, m.end))
            .collect();
        let mut ranges: Vec<(u64, u64)> = Vec::new();
        let mut devices = Vec::new();
        for m in crate::maps::read_maps(template)? {
            if have.contains(&(m.start, m.end)) {
                continue;
            }
            if m.name.starts_with("/dev/") {
                devices.push(m.start);
                continue;
            }
            match ranges.last_mut() {
                Some(last) if last.1 == m.start => last.1 = m.end,
                _ => ranges.push((m.start, m.end)),
            }
        }
        let span_clean = match (ranges.first(), ranges.last()) {
            (Some(first), Some(last)) => !devices.iter().any(|&s| s >= first.0 && s < last.1),
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
    fn a_dontfork_mapping_is_what_a_forked_child_lacks() {
        let page = 4096;
        // SAFETY: a fresh anonymous mapping, only advised and unmapped here.
        let addr = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                3 * page,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(addr, libc::MAP_FAILED);
        let start = addr as u64;
        // SAFETY: advising the first and last pages of the mapping made above.
        let advised = unsafe {
            libc::madvise(addr, page, libc::MADV_DONTFORK)
                + libc::madvise(addr.byte_add(2 * page), page, libc::MADV_DONTFORK)
        };
        assert_eq!(advised, 0);
        // SAFETY: the child only waits for its signal (async-signal-safe),
        // whatever the test harness's other threads hold.
        let child = unsafe { libc::fork() };
        if child == 0 {
            loop {
                // SAFETY: pause takes no arguments.
                unsafe { libc::pause() };
            }
        }
        assert!(child > 0);
        let me = std::process::id() as i32;
        let found = DontFork::missing_in(me, child);
        // SAFETY: killing and reaping the child forked above.
        unsafe {
            libc::kill(child, libc::SIGKILL);
            libc::waitpid(child, std::ptr::null_mut(), 0);
            libc::munmap(addr, 3 * page);
        }
        let found = found.expect("maps");
        let page = page as u64;
        assert!(found.ranges.contains(&(start, start + page)), "{found:x?}");
        assert!(
            found.ranges.contains(&(start + 2 * page, start + 3 * page)),
            "{found:x?}"
        );
        assert!(
            !found
                .ranges
                .iter()
                .any(|&(s, e)| s <= start + page && e > start + page),
            "the middle page is copied: {found:x?}"
        );
    }
}
