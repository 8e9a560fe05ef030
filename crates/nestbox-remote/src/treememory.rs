//! The memory of a process of a clone's process tree that its parent's clone
//! forked (see tree.rs): made equal to the memory of its own template process.
//!
//! The new process `x` starts as a copy of its parent's clone, whose memory is
//! the parent template process's (copy-on-write). Its own template process
//! (`target`) was forked from that parent (`base`) and has since written some
//! pages, and perhaps mapped or unmapped some memory (a prefork worker). So:
//!
//! - a mapping of `x` that `target` does not have with the same range,
//!   protection and backing is unmapped;
//! - a mapping of `target` that `x` lacks is mapped: private anonymous memory,
//!   or a private mapping of the same file opened by its path in the clone's
//!   root, at the same offset;
//! - in a mapping both have, a page of `target` that is the same physical page
//!   as `base`'s at that address (both template processes' `/proc/PID/pagemap`
//!   show it, as root) is already right in `x` and stays shared; any other page
//!   `target` has (present or swapped) is copied into `x`; a page `x` has that
//!   `target` does not is dropped (`MADV_DONTNEED`: zero, or the file's);
//! - in a newly mapped range every page `target` holds privately is copied;
//! - a `[vdso]` elsewhere (the child ran `exec`) is moved there
//!   (`arch_prctl(ARCH_MAP_VDSO_64)`), while injected calls run from a
//!   `syscall` instruction in the scratch area;
//! - the layout fields of the memory descriptor (code, data, program break,
//!   stack, arguments, environment, auxiliary vector) and the executable are
//!   set to `target`'s (`PR_SET_MM_MAP`).
//!
//! The scratch area of `x` (inherited from its parent's clone) is moved first
//! if `target` has memory where it is. A shared mapping the parent lacks, or a
//! mapping of something that has no path, is refused with one line naming it.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::batch::Batch;
use crate::error::{RemoteError, Result};
use crate::memory::Scratch;
use crate::procfs::proc_path;
use crate::tracee::Tracee;

const PAGE: u64 = 4096;
const PRESENT: u64 = 1 << 63;
const SWAPPED: u64 = 1 << 62;
const FILE_OR_SHARED: u64 = 1 << 61;
const PFN_MASK: u64 = (1 << 55) - 1;

/// One line of `/proc/PID/maps`, all of it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Vma {
    start: u64,
    end: u64,
    perms: String,
    offset: u64,
    inode: u64,
    name: String,
}

impl Vma {
    fn same_as(&self, other: &Vma) -> bool {
        self.start == other.start
            && self.end == other.end
            && self.perms == other.perms
            && self.offset == other.offset
            && self.inode == other.inode
            && self.name == other.name
    }

    fn private(&self) -> bool {
        self.perms.ends_with('p')
    }

    fn anonymous(&self) -> bool {
        self.inode == 0
            && (self.name.is_empty()
                || self.name == "[heap]"
                || self.name == "[stack]"
                || self.name.starts_with("[anon:"))
    }

    fn special(&self) -> bool {
        self.name.starts_with("[v") // [vdso], [vvar], [vvar_vclock], [vsyscall]
    }

    fn prot(&self) -> u64 {
        let b = self.perms.as_bytes();
        let mut prot = 0;
        if b.first() == Some(&b'r') {
            prot |= libc::PROT_READ;
        }
        if b.get(1) == Some(&b'w') {
            prot |= libc::PROT_WRITE;
        }
        if b.get(2) == Some(&b'x') {
            prot |= libc::PROT_EXEC;
        }
        prot as u64
    }
}

fn read_maps(pid: i32) -> Result<Vec<Vma>> {
    let path = proc_path(pid, "maps");
    let text = std::fs::read_to_string(&path).map_err(|source| match source.kind() {
        std::io::ErrorKind::NotFound => RemoteError::NoSuchProcess { pid },
        _ => RemoteError::Proc {
            path: path.clone(),
            source,
        },
    })?;
    let bad = |line: &str| RemoteError::Parse {
        path: path.clone(),
        message: format!("bad line {line:?}"),
    };
    text.lines()
        .map(|line| {
            let mut f = line.splitn(6, ' ');
            let range = f.next().ok_or_else(|| bad(line))?;
            let perms = f.next().ok_or_else(|| bad(line))?.to_string();
            let offset = f.next().ok_or_else(|| bad(line))?;
            let _dev = f.next();
            let inode = f.next().ok_or_else(|| bad(line))?;
            let name = f.next().unwrap_or("").trim_start().to_string();
            let (start, end) = range.split_once('-').ok_or_else(|| bad(line))?;
            Ok(Vma {
                start: u64::from_str_radix(start, 16).map_err(|_| bad(line))?,
                end: u64::from_str_radix(end, 16).map_err(|_| bad(line))?,
                perms,
                offset: u64::from_str_radix(offset, 16).map_err(|_| bad(line))?,
                inode: inode.parse().map_err(|_| bad(line))?,
                name,
            })
        })
        .collect()
}

/// The pagemap entries of `[start, end)` of `pid`.
fn pagemap(file: &File, pid: i32, start: u64, end: u64) -> Result<Vec<u64>> {
    let mut raw = vec![0u8; ((end - start) / PAGE * 8) as usize];
    file.read_exact_at(&mut raw, start / PAGE * 8)
        .map_err(|source| RemoteError::Proc {
            path: proc_path(pid, "pagemap"),
            source,
        })?;
    Ok(raw
        .chunks_exact(8)
        .map(|c| u64::from_ne_bytes(c.try_into().unwrap_or_default()))
        .collect())
}

fn open_proc(pid: i32, name: &str, write: bool) -> Result<File> {
    let path = proc_path(pid, name);
    std::fs::OpenOptions::new()
        .read(true)
        .write(write)
        .open(&path)
        .map_err(|source| RemoteError::Proc { path, source })
}

/// What [`make_like_sibling`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryCopied {
    /// Pages copied from the template process.
    pub pages_copied: usize,
    /// Pages left shared with the parent's clone.
    pub pages_shared: usize,
    /// Mappings made or unmapped.
    pub mappings_changed: usize,
}

/// Make the memory of `x` (stopped; a fork of the clone of template process
/// `base`) equal to template process `target`'s (a child of `base`), as the
/// module documentation says. `scratch` is mapped in `x` where `target` has
/// nothing (checked).
pub(crate) fn make_like_sibling(
    x: &mut Tracee,
    scratch: &mut Scratch,
    scratch_len: u64,
    base: i32,
    target: i32,
) -> Result<MemoryCopied> {
    let refuse = |why: String| {
        RemoteError::Unclonable(format!(
            "process {target} cannot be re-created from its parent's clone: {why}"
        ))
    };
    let t_maps = read_maps(target)?;
    let overlaps = |addr: u64, maps: &[Vma]| {
        maps.iter()
            .any(|v| v.start < addr + scratch_len && addr < v.end)
    };
    if overlaps(scratch.addr, &t_maps) {
        let x_maps = read_maps(x.pid())?;
        let addr = free_range(&t_maps, &x_maps, scratch_len).ok_or_else(|| {
            refuse("no room for the clone's scratch area in its address space".into())
        })?;
        let moved = Scratch::map_at(x, addr)?;
        scratch.unmap(x)?;
        *scratch = moved;
    }
    let x_maps = read_maps(x.pid())?;
    let special = |maps: &[Vma]| -> Vec<(u64, u64, String)> {
        maps.iter()
            .filter(|v| v.special())
            .map(|v| (v.start, v.end, v.name.clone()))
            .collect()
    };
    let move_vdso = special(&x_maps) != special(&t_maps);
    let mut done = MemoryCopied::default();
    // A shared mapping the child inherited from its parent (the same object at
    // the same range in both template processes) is, in `x`, the one its
    // parent's clone has: the clone's own copy of the object (shmem.rs), shared
    // by the clone's processes as the template's processes share theirs.
    let b_maps = read_maps(base)?;
    let inherited_shared = |t: &Vma, v: &Vma| {
        !t.private()
            && !v.private()
            && t.start == v.start
            && t.end == v.end
            && t.perms == v.perms
            && b_maps.iter().any(|b| b.same_as(t))
    };
    let matches = |t: &Vma, v: &Vma| v.same_as(t) || inherited_shared(t, v);
    let kept: Vec<&Vma> = t_maps
        .iter()
        .filter(|t| x_maps.iter().any(|v| matches(t, v)))
        .collect();
    let fresh: Vec<&Vma> = t_maps
        .iter()
        .filter(|t| !t.special() && !x_maps.iter().any(|v| matches(t, v)))
        .collect();
    for v in &fresh {
        // A read-only shared mapping of a file (opened read-only: it can never
        // be made writable) is mapped again from the clone's root.
        if !v.private() && (v.anonymous() || v.perms.as_bytes().get(1) == Some(&b'w')) {
            return Err(refuse(format!(
                "it has a writable or anonymous shared mapping its parent lacks ({:#x}-{:#x} {})",
                v.start, v.end, v.name
            )));
        }
        if !v.anonymous() && !v.name.starts_with('/') {
            return Err(refuse(format!(
                "it maps {:?} at {:#x}, which cannot be mapped again",
                v.name, v.start
            )));
        }
    }

    // Unmap what target lacks (never the scratch area), then map what it has.
    let mut batch = Batch::new();
    for v in x_maps
        .iter()
        .filter(|v| !t_maps.iter().any(|t| matches(t, v)))
    {
        if v.start == scratch.addr || v.special() {
            continue;
        }
        batch.push(
            "munmap",
            format!("{:#x}-{:#x} {}", v.start, v.end, v.name),
            libc::SYS_munmap,
            &[v.start, v.end - v.start],
        );
        done.mappings_changed += 1;
    }
    scratch.reset();
    batch.run(x, scratch)?;
    for v in &fresh {
        scratch.reset();
        let sharing = if v.private() {
            libc::MAP_PRIVATE
        } else {
            libc::MAP_SHARED
        };
        let mut flags = (sharing | libc::MAP_FIXED) as u64;
        let (fd, offset) = if v.anonymous() {
            flags |= libc::MAP_ANONYMOUS as u64;
            if v.name == "[stack]" {
                flags |= libc::MAP_GROWSDOWN as u64;
            }
            (u64::MAX, 0)
        } else {
            let path = scratch.put_path(x, v.name.as_bytes())?;
            let fd = x.syscall(
                "openat",
                || format!("{} to map it again", v.name),
                libc::SYS_openat,
                &[
                    libc::AT_FDCWD as u64,
                    path,
                    (libc::O_RDONLY | libc::O_CLOEXEC) as u64,
                ],
            )?;
            (fd, v.offset)
        };
        let mapped = x.syscall(
            "mmap",
            || format!("{:#x}-{:#x} {}", v.start, v.end, v.name),
            libc::SYS_mmap,
            &[v.start, v.end - v.start, v.prot(), flags, fd, offset],
        );
        if fd != u64::MAX {
            x.syscall("close", String::new, libc::SYS_close, &[fd])?;
        }
        mapped?;
        done.mappings_changed += 1;
    }

    if move_vdso {
        relocate_vdso(x, scratch, &x_maps, &t_maps)?;
        done.mappings_changed += 1;
    }

    // Contents.
    let t_pagemap = open_proc(target, "pagemap", false)?;
    let b_pagemap = open_proc(base, "pagemap", false)?;
    let t_mem = open_proc(target, "mem", false)?;
    let x_mem = open_proc(x.pid(), "mem", true)?;
    let mut page = vec![0u8; PAGE as usize];
    let mut copy = |addr: u64| -> Result<()> {
        t_mem
            .read_exact_at(&mut page, addr)
            .map_err(|source| RemoteError::Proc {
                path: proc_path(target, "mem"),
                source,
            })?;
        x_mem
            .write_all_at(&page, addr)
            .map_err(|source| RemoteError::Proc {
                path: proc_path(x.pid(), "mem"),
                source,
            })
    };
    let mut drop_ranges: Vec<(u64, u64)> = Vec::new();
    for v in &kept {
        if !v.private() || v.special() || !v.perms.starts_with('r') {
            continue;
        }
        let t = pagemap(&t_pagemap, target, v.start, v.end)?;
        let b = pagemap(&b_pagemap, base, v.start, v.end)?;
        for (i, (te, be)) in t.iter().zip(&b).enumerate() {
            let addr = v.start + i as u64 * PAGE;
            let t_has = te & (PRESENT | SWAPPED) != 0;
            let b_has = be & (PRESENT | SWAPPED) != 0;
            let same = te & PRESENT != 0 && be & PRESENT != 0 && te & PFN_MASK == be & PFN_MASK;
            if same || (!t_has && !b_has) {
                done.pages_shared += usize::from(same);
            } else if t_has && te & FILE_OR_SHARED == 0 {
                copy(addr)?;
                done.pages_copied += 1;
            } else {
                // target has no private page here: x must not have one either.
                match drop_ranges.last_mut() {
                    Some((_, end)) if *end == addr => *end += PAGE,
                    _ => drop_ranges.push((addr, addr + PAGE)),
                }
            }
        }
    }
    for v in &fresh {
        let t = pagemap(&t_pagemap, target, v.start, v.end)?;
        for (i, te) in t.iter().enumerate() {
            if te & (PRESENT | SWAPPED) != 0 && te & FILE_OR_SHARED == 0 {
                copy(v.start + i as u64 * PAGE)?;
                done.pages_copied += 1;
            }
        }
    }
    let mut drop_pages = Batch::new();
    for (start, end) in drop_ranges {
        drop_pages.push(
            "madvise(MADV_DONTNEED)",
            format!("{start:#x}-{end:#x}"),
            libc::SYS_madvise,
            &[start, end - start, libc::MADV_DONTNEED as u64],
        );
    }
    scratch.reset();
    drop_pages.run(x, scratch)?;
    set_layout_like(x, scratch, target)?;
    Ok(done)
}

/// A range of `len` bytes free in both layouts, high in the address space
/// (below the highest mapping under 2^47 of either, page-aligned).
fn free_range(a: &[Vma], b: &[Vma], len: u64) -> Option<u64> {
    let mut used: Vec<(u64, u64)> = a
        .iter()
        .chain(b)
        .filter(|v| v.end <= 1 << 47)
        .map(|v| (v.start, v.end))
        .collect();
    used.sort_unstable();
    // Walk the gaps from the top down; keep a page of guard on both sides.
    let guard = PAGE;
    for pair in used.windows(2).rev() {
        let (lo, hi) = (pair[0].1, pair[1].0);
        if hi > lo && hi - lo >= len + 2 * guard {
            return Some((hi - guard - len) & !(PAGE - 1));
        }
    }
    None
}

/// Move the vDSO (and its data pages) of `x` to where `target` has them.
fn relocate_vdso(
    x: &mut Tracee,
    scratch: &mut Scratch,
    x_maps: &[Vma],
    t_maps: &[Vma],
) -> Result<()> {
    /// `ARCH_MAP_VDSO_64` (asm/prctl.h).
    const ARCH_MAP_VDSO_64: u64 = 0x2003;
    let start = t_maps
        .iter()
        .filter(|v| v.special() && v.name != "[vsyscall]")
        .map(|v| v.start)
        .min()
        .ok_or_else(|| RemoteError::Unclonable("the template process has no vDSO".into()))?;
    // Injected calls run from a `syscall` instruction of our own meanwhile.
    scratch.reset();
    let insn = scratch.put(x, &[0x0f, 0x05])?;
    x.syscall_insn = insn;
    for v in x_maps
        .iter()
        .filter(|v| v.special() && v.name != "[vsyscall]")
    {
        x.syscall(
            "munmap",
            || format!("{} at {:#x}", v.name, v.start),
            libc::SYS_munmap,
            &[v.start, v.end - v.start],
        )?;
    }
    x.syscall(
        "arch_prctl(ARCH_MAP_VDSO_64)",
        || format!("at {start:#x}"),
        libc::SYS_arch_prctl,
        &[ARCH_MAP_VDSO_64, start],
    )?;
    x.syscall_insn = 0;
    x.find_syscall_insn()?;
    Ok(())
}

/// `/proc/PID/stat` fields 26.. (1-based field numbers of proc(5)).
fn stat_fields(pid: i32) -> Result<Vec<u64>> {
    let path = proc_path(pid, "stat");
    let text = std::fs::read_to_string(&path).map_err(|source| RemoteError::Proc {
        path: path.clone(),
        source,
    })?;
    let after = text.rsplit_once(')').map(|(_, a)| a).unwrap_or("");
    // Field 3 (state) is the first after the name.
    Ok(after
        .split_whitespace()
        .map(|f| f.parse::<i64>().map(|v| v as u64).unwrap_or(0))
        .collect())
}

/// The layout fields of `pid`'s memory descriptor, in `struct prctl_mm_map`
/// order (start and end of code and data, start of the break, the break,
/// start of the stack, arguments, environment).
fn layout_of(pid: i32) -> Result<[u64; 11]> {
    let f = stat_fields(pid)?;
    // proc(5) field n is index n - 3 here.
    let field = |n: usize| f.get(n - 3).copied().unwrap_or(0);
    let start_brk = field(47);
    // The current break is not in /proc: it ends the [heap] mapping, or is
    // start_brk when there is none (page-aligned, within the mapping brk(2)
    // keeps).
    let brk = read_maps(pid)?
        .iter()
        .find(|v| v.name == "[heap]")
        .map(|v| v.end)
        .unwrap_or(start_brk);
    Ok([
        field(26),
        field(27),
        field(45),
        field(46),
        start_brk,
        brk,
        field(28),
        field(48),
        field(49),
        field(50),
        field(51),
    ])
}

/// Give `x` the layout fields, auxiliary vector and executable of `target`
/// with `PR_SET_MM_MAP`, when any differs.
fn set_layout_like(x: &mut Tracee, scratch: &mut Scratch, target: i32) -> Result<()> {
    let want = layout_of(target)?;
    let read = |pid: i32, name: &str| {
        std::fs::read(proc_path(pid, name)).map_err(|source| RemoteError::Proc {
            path: proc_path(pid, name),
            source,
        })
    };
    let auxv = read(target, "auxv")?;
    let exe = std::fs::read_link(proc_path(target, "exe")).ok();
    let same_exe = exe == std::fs::read_link(proc_path(x.pid(), "exe")).ok();
    if want == layout_of(x.pid())? && auxv == read(x.pid(), "auxv")? && same_exe {
        return Ok(());
    }
    scratch.reset();
    let exe_fd = match (&exe, same_exe) {
        (Some(path), false) => {
            let addr = scratch.put_path(x, path.as_os_str().as_encoded_bytes())?;
            x.syscall(
                "openat",
                || format!("the executable {}", path.display()),
                libc::SYS_openat,
                &[
                    libc::AT_FDCWD as u64,
                    addr,
                    (libc::O_RDONLY | libc::O_CLOEXEC) as u64,
                ],
            )? as u32
        }
        _ => u32::MAX,
    };
    let auxv_addr = scratch.put(x, &auxv)?;
    // struct prctl_mm_map (linux/prctl.h).
    let mut map = Vec::with_capacity(104);
    for value in want.iter().chain([&auxv_addr]) {
        map.extend_from_slice(&value.to_ne_bytes());
    }
    map.extend_from_slice(&(auxv.len() as u32).to_ne_bytes());
    map.extend_from_slice(&exe_fd.to_ne_bytes());
    let map_addr = scratch.put(x, &map)?;
    let set = x.syscall(
        "prctl(PR_SET_MM, PR_SET_MM_MAP)",
        || format!("program break {:#x}", want[5]),
        libc::SYS_prctl,
        &[
            libc::PR_SET_MM as u64,
            libc::PR_SET_MM_MAP as u64,
            map_addr,
            map.len() as u64,
        ],
    );
    if exe_fd != u32::MAX {
        x.syscall("close", String::new, libc::SYS_close, &[u64::from(exe_fd)])?;
    }
    set?;
    Ok(())
}
