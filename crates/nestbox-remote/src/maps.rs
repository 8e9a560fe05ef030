//! A process's address space as the kernel describes it: `/proc/PID/maps` and
//! `/proc/PID/smaps` lines (range, protection, sharing, file offset, the object's
//! device and inode, its name, and from smaps the `VmFlags` and page counts), and
//! `/proc/PID/pagemap` entries (present, swapped, page frame number).

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::error::{RemoteError, Result};
use crate::procfs::{proc_path, read_to_string};

/// The page size (x86_64).
pub const PAGE: u64 = 4096;

/// One mapping (VMA) of a process.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Vma {
    /// First address.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// `PROT_READ | PROT_WRITE | PROT_EXEC` as the mapping has them now.
    pub prot: i32,
    /// `MAP_SHARED` (the `s` of the permissions).
    pub shared: bool,
    /// Offset in the mapped object, in bytes.
    pub offset: u64,
    /// Device of the mapped object (`makedev(major, minor)`), 0 for anonymous memory.
    pub dev: u64,
    /// Inode of the mapped object, 0 for anonymous memory.
    pub ino: u64,
    /// The name column: a path (with " (deleted)"), `[heap]`, `[stack]`, `[vdso]`, ...
    pub name: String,
    /// Two-letter `VmFlags` of smaps (`sh`, `mw`, `wr`, `dd`, ...); empty from maps.
    pub flags: Vec<[u8; 2]>,
    /// smaps `Rss`, in kB (0 from maps).
    pub rss_kb: u64,
    /// smaps `Private_Dirty`, in kB (0 from maps).
    pub private_dirty_kb: u64,
    /// smaps `Swap`, in kB (0 from maps).
    pub swap_kb: u64,
}

impl Vma {
    /// Length in bytes.
    pub fn len(&self) -> u64 {
        self.end - self.start
    }

    /// Whether the mapping is empty (never, for a kernel VMA).
    pub fn is_empty(&self) -> bool {
        self.end == self.start
    }

    /// Whether smaps listed the two-letter flag `flag` (e.g. `"mw"`).
    pub fn has_flag(&self, flag: &str) -> bool {
        self.flags.iter().any(|f| f.as_slice() == flag.as_bytes())
    }

    /// The object was unlinked (or is a memfd, shared anonymous memory or SysV shm).
    pub fn deleted(&self) -> bool {
        self.name.ends_with(" (deleted)")
    }

    /// The name without the " (deleted)" suffix.
    pub fn path(&self) -> &str {
        self.name.strip_suffix(" (deleted)").unwrap_or(&self.name)
    }

    /// Whether a file (any object with an inode) backs the mapping. Anonymous
    /// memory has device 0 and inode 0; the inode alone does not tell: a System
    /// V segment shows its id as its inode, and the first segment of an IPC
    /// namespace (every box has a fresh one) has id 0.
    pub fn is_file(&self) -> bool {
        self.ino != 0 || self.dev != 0
    }

    /// `maps` range text, as `/proc/PID/map_files` names the mapping.
    pub fn range_name(&self) -> String {
        format!("{:x}-{:x}", self.start, self.end)
    }

    /// The object's identity: (device, inode).
    pub fn object(&self) -> (u64, u64) {
        (self.dev, self.ino)
    }
}

/// Split off `n` whitespace-separated fields; the rest (left-trimmed) is the name.
fn fields(line: &str, n: usize) -> Option<(Vec<&str>, &str)> {
    let mut out = Vec::with_capacity(n);
    let mut rest = line;
    for _ in 0..n {
        rest = rest.trim_start();
        let end = rest.find(char::is_whitespace).unwrap_or(rest.len());
        if end == 0 {
            return None;
        }
        out.push(&rest[..end]);
        rest = &rest[end..];
    }
    Some((out, rest.trim_start()))
}

/// Parse one header line of maps/smaps.
fn parse_header(line: &str) -> Option<Vma> {
    let (f, name) = fields(line, 5)?;
    let (start, end) = f[0].split_once('-')?;
    let start = u64::from_str_radix(start, 16).ok()?;
    let end = u64::from_str_radix(end, 16).ok()?;
    let perms = f[1].as_bytes();
    if perms.len() != 4 {
        return None;
    }
    let mut prot = 0;
    if perms[0] == b'r' {
        prot |= libc::PROT_READ;
    }
    if perms[1] == b'w' {
        prot |= libc::PROT_WRITE;
    }
    if perms[2] == b'x' {
        prot |= libc::PROT_EXEC;
    }
    let offset = u64::from_str_radix(f[2], 16).ok()?;
    let (major, minor) = f[3].split_once(':')?;
    let dev = libc::makedev(
        u32::from_str_radix(major, 16).ok()?,
        u32::from_str_radix(minor, 16).ok()?,
    );
    let ino = f[4].parse().ok()?;
    Some(Vma {
        start,
        end,
        prot,
        shared: perms[3] == b's',
        offset,
        dev,
        ino,
        name: name.to_string(),
        flags: Vec::new(),
        rss_kb: 0,
        private_dirty_kb: 0,
        swap_kb: 0,
    })
}

fn parse(path: std::path::PathBuf, text: &str) -> Result<Vec<Vma>> {
    let bad = |line: &str| RemoteError::Parse {
        path: path.clone(),
        message: format!("bad line {line:?}"),
    };
    let mut out: Vec<Vma> = Vec::new();
    for line in text.lines() {
        let first = line.split_whitespace().next().unwrap_or("");
        if let Some(key) = first.strip_suffix(':') {
            let vma = out.last_mut().ok_or_else(|| bad(line))?;
            let value = line[first.len()..].trim();
            let kb = || value.split_whitespace().next().and_then(|v| v.parse().ok());
            match key {
                "VmFlags" => {
                    vma.flags = value
                        .split_whitespace()
                        .filter_map(|f| f.as_bytes().try_into().ok())
                        .collect()
                }
                "Rss" => vma.rss_kb = kb().unwrap_or(0),
                "Private_Dirty" => vma.private_dirty_kb = kb().unwrap_or(0),
                "Swap" => vma.swap_kb = kb().unwrap_or(0),
                _ => {}
            }
        } else if !line.trim().is_empty() {
            out.push(parse_header(line).ok_or_else(|| bad(line))?);
        }
    }
    Ok(out)
}

fn read(pid: i32, file: &str) -> Result<Vec<Vma>> {
    let path = proc_path(pid, file);
    let text = match std::fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(RemoteError::NoSuchProcess { pid })
        }
        Err(_) => read_to_string(&path)?,
    };
    parse(path, &text)
}

/// `/proc/PID/maps` (no flags or page counts; cheap).
pub fn read_maps(pid: i32) -> Result<Vec<Vma>> {
    read(pid, "maps")
}

/// Whether `/proc/PID/maps` has any shared (`s`) mapping: a quick scan of the
/// permission column, without parsing (the common case of a fork has none).
pub fn has_shared_mapping(pid: i32) -> Result<bool> {
    let path = proc_path(pid, "maps");
    let text = std::fs::read(&path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => RemoteError::NoSuchProcess { pid },
        _ => RemoteError::Proc { path, source },
    })?;
    Ok(text.split(|b| *b == b'\n').any(|line| {
        line.iter()
            .position(|b| *b == b' ')
            .and_then(|i| line.get(i + 4))
            == Some(&b's')
    }))
}

/// `/proc/PID/smaps` (with `VmFlags` and page counts; walks the page tables).
pub fn read_smaps(pid: i32) -> Result<Vec<Vma>> {
    read(pid, "smaps")
}

/// One `/proc/PID/pagemap` entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PageEntry(pub u64);

impl PageEntry {
    /// The page is in memory.
    pub fn present(self) -> bool {
        self.0 & (1 << 63) != 0
    }

    /// The page is swapped out.
    pub fn swapped(self) -> bool {
        self.0 & (1 << 62) != 0
    }

    /// The page is mapped exclusively (not shared with another process).
    pub fn exclusive(self) -> bool {
        self.0 & (1 << 56) != 0
    }

    /// Page frame number (only shown to CAP_SYS_ADMIN; 0 otherwise) of a present page.
    pub fn pfn(self) -> u64 {
        self.0 & ((1 << 55) - 1)
    }

    /// The swap entry (type and offset bits) of a swapped page.
    pub fn swap_entry(self) -> u64 {
        self.0 & ((1 << 55) - 1)
    }
}

/// A process's `/proc/PID/pagemap`, open for reading.
#[derive(Debug)]
pub struct Pagemap {
    pid: i32,
    file: File,
}

impl Pagemap {
    /// Open `/proc/PID/pagemap`.
    pub fn open(pid: i32) -> Result<Pagemap> {
        let path = proc_path(pid, "pagemap");
        let file = File::open(&path).map_err(|source| RemoteError::Proc { path, source })?;
        Ok(Pagemap { pid, file })
    }

    /// The entries of the pages of `[start, end)`.
    pub fn range(&self, start: u64, end: u64) -> Result<Vec<PageEntry>> {
        let pages = ((end - start) / PAGE) as usize;
        let mut buf = vec![0u8; pages * 8];
        let mut done = 0;
        while done < buf.len() {
            let n = self
                .file
                .read_at(&mut buf[done..], (start / PAGE) * 8 + done as u64)
                .map_err(|source| RemoteError::Proc {
                    path: proc_path(self.pid, "pagemap"),
                    source,
                })?;
            if n == 0 {
                break;
            }
            done += n;
        }
        Ok(buf
            .chunks_exact(8)
            .map(|c| PageEntry(u64::from_ne_bytes(c.try_into().unwrap_or([0; 8]))))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_smaps_with_names_that_have_spaces() {
        let text = "\
7f0000000000-7f0000010000 rw-s 00002000 00:01 1234                       /dev/zero (deleted)
Size:                 64 kB
Rss:                  8 kB
Private_Dirty:        4 kB
Swap:                 0 kB
VmFlags: rd wr sh mr mw me ms sd
7ffd00000000-7ffd00021000 rw-p 00000000 00:00 0                          [stack]
VmFlags: rd wr mr mw me gd ac
7f1000000000-7f1000001000 r--s 00000000 fd:01 99 /memfd:my name (deleted)
";
        let v = parse("smaps".into(), text).expect("parse");
        assert_eq!(v.len(), 3);
        assert_eq!(v[0].name, "/dev/zero (deleted)");
        assert!(v[0].shared && v[0].deleted() && v[0].has_flag("mw") && v[0].has_flag("sh"));
        assert_eq!(v[0].prot, libc::PROT_READ | libc::PROT_WRITE);
        assert_eq!(
            (v[0].offset, v[0].ino, v[0].rss_kb, v[0].private_dirty_kb),
            (0x2000, 1234, 8, 4)
        );
        assert_eq!(v[0].dev, libc::makedev(0, 1));
        assert_eq!(v[1].name, "[stack]");
        assert!(!v[1].shared && !v[1].is_file());
        assert_eq!(v[2].path(), "/memfd:my name");
        assert_eq!(v[2].dev, libc::makedev(0xfd, 1));
        assert_eq!(v[2].prot, libc::PROT_READ);
    }

    #[test]
    fn a_system_v_segment_with_id_0_is_a_file() {
        let text = "\
7f4545de0000-7f4545de1000 rw-s 00000000 00:01 0                          /SYSV00000000 (deleted)
7f4545de1000-7f4545de2000 rw-p 00000000 00:00 0 
";
        let v = parse("maps".into(), text).expect("parse");
        assert_eq!(v.len(), 2);
        assert_eq!((v[0].dev, v[0].ino), (libc::makedev(0, 1), 0));
        assert!(v[0].is_file() && v[0].shared);
        assert!(!v[1].is_file());
    }

    #[test]
    fn finds_a_shared_mapping() {
        let pid = std::process::id() as i32;
        let before = has_shared_mapping(pid).expect("maps");
        // SAFETY: a new shared anonymous page of our own, unmapped below.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                4096,
                libc::PROT_READ,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        assert!(has_shared_mapping(pid).expect("maps"));
        // SAFETY: the page mapped above.
        unsafe { libc::munmap(p, 4096) };
        // Other tests' threads may map shared memory meanwhile: only the
        // positive case is certain.
        let _ = before;
    }

    #[test]
    fn reads_own_maps_and_pagemap() {
        let maps = read_maps(std::process::id() as i32).expect("maps");
        assert!(maps.iter().any(|m| m.name == "[stack]"));
        let stack = maps.iter().find(|m| m.name == "[stack]").expect("stack");
        let pm = Pagemap::open(std::process::id() as i32).expect("pagemap");
        let entries = pm.range(stack.end - PAGE, stack.end).expect("range");
        assert_eq!(entries.len(), 1);
        assert!(entries[0].present(), "the top stack page is in memory");
    }
}
