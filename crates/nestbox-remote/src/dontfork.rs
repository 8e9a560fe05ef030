//! Mappings a fork does not copy: `madvise(MADV_DONTFORK)` regions (`dc` in the
//! `VmFlags` of `/proc/PID/smaps`). V8 marks its whole heap so (Node.js), and a
//! clone made by fork would miss them. The remote fork clears the mark in the
//! template's memory (through C1, which shares it) just around the fork of G1,
//! puts it back at once, and marks the same regions in the clone.

use crate::error::{RemoteError, Result};
use crate::procfs::{proc_path, read_to_string};
use crate::tracee::Tracee;

/// The `[start, end)` ranges of `pid`'s mappings marked `MADV_DONTFORK`
/// (adjacent ones merged), leaving out device and raw-PFN mappings, which the
/// kernel marks itself and a fork never copies.
pub(crate) fn ranges(pid: i32) -> Result<Vec<(u64, u64)>> {
    let path = proc_path(pid, "smaps");
    let text = read_to_string(&path)?;
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut current: Option<(u64, u64)> = None;
    for line in text.lines() {
        if let Some(flags) = line.strip_prefix("VmFlags:") {
            let flags: Vec<&str> = flags.split_whitespace().collect();
            let marked = flags.contains(&"dc") && !flags.iter().any(|f| ["io", "pf"].contains(f));
            if let (true, Some((start, end))) = (marked, current) {
                match out.last_mut() {
                    Some(last) if last.1 == start => last.1 = end,
                    _ => out.push((start, end)),
                }
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
    if out.is_empty() && !text.contains("VmFlags:") {
        return Err(RemoteError::Parse {
            path,
            message: "no VmFlags lines".into(),
        });
    }
    Ok(out)
}

/// `madvise(range, advice)` for each range, injected in `tracee`.
pub(crate) fn advise(tracee: &mut Tracee, ranges: &[(u64, u64)], advice: i32) -> Result<()> {
    let name = if advice == libc::MADV_DOFORK {
        "madvise(MADV_DOFORK)"
    } else {
        "madvise(MADV_DONTFORK)"
    };
    for &(start, end) in ranges {
        tracee.syscall(
            name,
            || format!("{start:#x}-{end:#x}"),
            libc::SYS_madvise,
            &[start, end - start, advice as u64],
        )?;
    }
    Ok(())
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
        let found = ranges(me).expect("smaps");
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
