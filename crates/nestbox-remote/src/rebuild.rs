//! The rebuild engine: turn the address space of a stopped process X, a fork of
//! the clone of template process A (so, copy-on-write, A's address space), into
//! an exact copy of template process B's: B is typically A's child, forked
//! without exec and written to since, or exec'd into another program.
//!
//! What the address space should be ([`Layout`], read from `/proc/B`) is kept
//! apart from where page contents come from ([`PageSource`]: a live template
//! process now, [`LiveProcess`]; a page file for checkpoint/restore later).
//!
//! The steps, all by syscalls injected into X through a `syscall` instruction on
//! a page of our own at an address free in both layouts (the vDSO may move):
//!
//! 1. every mapping of X that B does not have identically (same range,
//!    protection, sharing, object and offset as in A) is unmapped;
//! 2. the vDSO (with its data pages) moves to B's address (`munmap` +
//!    `arch_prctl(ARCH_MAP_VDSO_64)`);
//! 3. every mapping of B that X lacks is made: private anonymous (the heap and
//!    stack included), private file mappings re-opened by path in X's root (a
//!    deleted file through `/proc/B/map_files`), shared mappings on the clone's
//!    own objects ([`SharedObjects`], contents copied from B's object once);
//! 4. contents: a page of B that is the same physical page as A's (page frame
//!    numbers of `/proc/PID/pagemap`, or the same swap entry) is already right
//!    in X and stays shared; a page of a private file mapping that B has from the
//!    page cache is left to the file; every other present or swapped page of B's
//!    private mappings is written into X through `/proc/X/mem`; pages X has in a
//!    kept private mapping but B has not are dropped (`MADV_DONTNEED`);
//! 5. the mm fields (code, data, brk, stack, arguments, environment, auxiliary
//!    vector, and the exe link when B runs another program) are set with
//!    `prctl(PR_SET_MM, PR_SET_MM_MAP)`.
//!
//! Registers are not part of the address space: give X B's registers (and
//! threads) afterwards ([`resume_with`]). Preconditions: X, A and B are stopped;
//! X has not run since it was forked; X still holds the capabilities of its user
//! namespace (`PR_SET_MM_MAP` with a new exe needs `CAP_CHECKPOINT_RESTORE` or
//! `CAP_SYS_ADMIN` there).

use std::fs::File;
use std::os::fd::AsFd;
use std::os::unix::fs::{FileExt, MetadataExt};
use std::path::PathBuf;

use serde::Serialize;

use crate::batch::Batch;
use crate::error::{RemoteError, Result};
use crate::maps::{self, PageEntry, Pagemap, Vma, PAGE};
use crate::memory::{Scratch, SCRATCH_LEN};
use crate::procfs::{proc_path, read_to_string};
use crate::shmem::SharedObjects;
use crate::tracee::{Regs, Tracee, TRACE_OPTIONS};

/// `ARCH_MAP_VDSO_64` of `arch_prctl`.
const ARCH_MAP_VDSO_64: u64 = 0x2003;
/// `PR_SET_MM` and its `PR_SET_MM_MAP` option.
const PR_SET_MM: u64 = 35;
const PR_SET_MM_MAP: u64 = 14;
/// `sizeof(struct prctl_mm_map)`.
const PRCTL_MM_MAP_SIZE: usize = 104;
/// `PR_SET_VMA` and its `PR_SET_VMA_ANON_NAME` option.
const PR_SET_VMA: u64 = 0x5356_4d41;
const PR_SET_VMA_ANON_NAME: u64 = 0;
/// `RSEQ_FLAG_UNREGISTER`.
const RSEQ_FLAG_UNREGISTER: u64 = 1;
/// `MADV_POPULATE_READ` (Linux 5.14): fault in a range's pages for reading.
const MADV_POPULATE_READ: u64 = 22;
/// pagemap bit 61: the page is a file page or shared anonymous.
const PM_FILE: u64 = 1 << 61;

/// The `mm_struct` fields `PR_SET_MM_MAP` sets (`/proc/PID/stat`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, serde::Deserialize)]
pub struct MmFields {
    /// Start of the code.
    pub start_code: u64,
    /// End of the code.
    pub end_code: u64,
    /// Start of the data.
    pub start_data: u64,
    /// End of the data.
    pub end_data: u64,
    /// Start of the heap.
    pub start_brk: u64,
    /// The program break (the end of `[heap]`, page-rounded: `/proc` does not show
    /// the exact value).
    pub brk: u64,
    /// The initial stack's start.
    pub start_stack: u64,
    /// Command-line arguments.
    pub arg_start: u64,
    /// End of the arguments.
    pub arg_end: u64,
    /// Environment.
    pub env_start: u64,
    /// End of the environment.
    pub env_end: u64,
}

/// What an address space should be: its mappings and mm fields, read from a
/// process (or from a checkpoint image).
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Layout {
    /// The mappings (smaps, with `VmFlags`).
    pub vmas: Vec<Vma>,
    /// The mm fields.
    pub mm: MmFields,
    /// The saved auxiliary vector (`/proc/PID/auxv`).
    pub auxv: Vec<u8>,
    /// The executable's path (`/proc/PID/exe`).
    pub exe: PathBuf,
    /// The executable's (device, inode).
    pub exe_object: (u64, u64),
    /// The rseq registration of the (main) thread: (area, length, signature),
    /// registered in X at the end (`/proc` does not show it: set it from
    /// `PTRACE_GET_RSEQ_CONFIGURATION`; [`make_like`] does).
    pub rseq: Option<(u64, u32, u32)>,
}

pub(crate) fn is_special(vma: &Vma) -> bool {
    matches!(
        vma.name.as_str(),
        "[vdso]" | "[vvar]" | "[vvar_vclock]" | "[vsyscall]" | "[uprobes]"
    )
}

impl Layout {
    /// Read the layout of process `pid` from `/proc`.
    pub fn read(pid: i32) -> Result<Layout> {
        let vmas = maps::read_smaps(pid)?;
        let stat_path = proc_path(pid, "stat");
        let stat = read_to_string(&stat_path)?;
        let after = stat.rsplit_once(')').map(|(_, r)| r).unwrap_or("");
        let f: Vec<u64> = after
            .split_whitespace()
            .map(|w| w.parse().unwrap_or(0))
            .collect();
        // Field N of proc(5) is f[N - 3].
        let field = |n: usize| f.get(n - 3).copied().unwrap_or(0);
        if f.len() < 49 {
            return Err(RemoteError::Parse {
                path: stat_path,
                message: "fewer than 51 fields".into(),
            });
        }
        let start_brk = field(47);
        let brk = vmas
            .iter()
            .filter(|v| v.name == "[heap]")
            .map(|h| h.end)
            .max()
            .unwrap_or(start_brk);
        let mm = MmFields {
            start_code: field(26),
            end_code: field(27),
            start_data: field(45),
            end_data: field(46),
            start_brk,
            brk,
            start_stack: field(28),
            arg_start: field(48),
            arg_end: field(49),
            env_start: field(50),
            env_end: field(51),
        };
        let auxv_path = proc_path(pid, "auxv");
        let auxv = std::fs::read(&auxv_path).map_err(|source| RemoteError::Proc {
            path: auxv_path,
            source,
        })?;
        let exe_path = proc_path(pid, "exe");
        let exe = std::fs::read_link(&exe_path).map_err(|source| RemoteError::Proc {
            path: exe_path.clone(),
            source,
        })?;
        let meta = std::fs::metadata(&exe_path).map_err(|source| RemoteError::Proc {
            path: exe_path,
            source,
        })?;
        Ok(Layout {
            vmas,
            mm,
            auxv,
            exe,
            exe_object: (meta.dev(), meta.ino()),
            rseq: None,
        })
    }

    fn vdso_block(&self) -> Option<(u64, u64)> {
        let parts: Vec<&Vma> = self
            .vmas
            .iter()
            .filter(|v| matches!(v.name.as_str(), "[vdso]" | "[vvar]" | "[vvar_vclock]"))
            .collect();
        let start = parts.iter().map(|v| v.start).min()?;
        let end = parts.iter().map(|v| v.end).max()?;
        Some((start, end))
    }

    fn vdso(&self) -> Option<u64> {
        self.vmas
            .iter()
            .find(|v| v.name == "[vdso]")
            .map(|v| v.start)
    }
}

/// What to do with one page of a private mapping of the target.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PageAction {
    /// X already has the right contents (or the page is absent in both).
    Keep,
    /// X has a page the target does not have: drop it.
    Drop,
    /// Write the target's contents.
    Write,
}

/// Where the target's page contents come from.
pub trait PageSource {
    /// For each page of the target's private mapping `vma`: what X needs.
    /// `kept`: X kept the base's mapping there (else X's mapping is new, empty).
    fn page_actions(&self, vma: &Vma, kept: bool) -> Result<Vec<PageAction>>;
    /// Read the target's memory at `addr`.
    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()>;
    /// Whether the pages of `vma`, a new private anonymous mapping of X, are
    /// left for the caller to fill later ([`RebuildStats::deferred`]).
    fn defer(&self, _vma: &Vma) -> bool {
        false
    }
}

/// Pages from a live (stopped) template process B, compared with the base A by
/// page frame number.
#[derive(Debug)]
pub struct LiveProcess {
    target: i32,
    /// Page frame number of the kernel's shared zero page (0: unknown).
    zero_pfn: u64,
    base_pm: Pagemap,
    target_pm: Pagemap,
    mem: File,
}

impl LiveProcess {
    /// Open A's and B's pagemaps and B's memory.
    pub fn open(base_pid: i32, target_pid: i32) -> Result<LiveProcess> {
        let mem_path = proc_path(target_pid, "mem");
        let mem = File::open(&mem_path).map_err(|source| RemoteError::Proc {
            path: mem_path,
            source,
        })?;
        Ok(LiveProcess {
            target: target_pid,
            zero_pfn: zero_pfn().unwrap_or(0),
            base_pm: Pagemap::open(base_pid)?,
            target_pm: Pagemap::open(target_pid)?,
            mem,
        })
    }
}

/// The page frame number of the kernel's zero page: what a read of untouched
/// anonymous memory maps (read once, in a page of our own).
pub(crate) fn zero_pfn() -> Option<u64> {
    static PFN: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *PFN.get_or_init(|| {
        // SAFETY: a new private anonymous page of our own, read once and unmapped;
        // nothing else refers to it.
        let page = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                PAGE as usize,
                libc::PROT_READ,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if page == libc::MAP_FAILED {
            return None;
        }
        // SAFETY: `page` is the readable page mapped above.
        unsafe { std::ptr::read_volatile(page.cast::<u8>()) };
        let addr = page as u64;
        let entry = Pagemap::open(std::process::id() as i32)
            .and_then(|pm| pm.range(addr, addr + PAGE))
            .ok()
            .and_then(|e| e.first().copied());
        // SAFETY: unmapping the page mapped above, no longer used.
        unsafe { libc::munmap(page, PAGE as usize) };
        entry
            .filter(|e| e.present() && e.pfn() != 0)
            .map(|e| e.pfn())
    })
}

/// The base's page is in memory as an anonymous (private, copied) page, or swapped.
pub(crate) fn private_data(e: PageEntry) -> bool {
    (e.present() && e.0 & PM_FILE == 0) || e.swapped()
}

impl PageSource for LiveProcess {
    fn page_actions(&self, vma: &Vma, kept: bool) -> Result<Vec<PageAction>> {
        let target = self.target_pm.range(vma.start, vma.end)?;
        let base = if kept {
            self.base_pm.range(vma.start, vma.end)?
        } else {
            Vec::new()
        };
        let file_backed = vma.is_file();
        Ok(target
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let b = base.get(i).copied();
                let base_private = b.is_some_and(private_data);
                if !t.present() && !t.swapped() {
                    return if base_private {
                        PageAction::Drop
                    } else {
                        PageAction::Keep
                    };
                }
                if file_backed && t.present() && t.0 & PM_FILE != 0 {
                    // The page cache's page: the file provides it.
                    return if base_private {
                        PageAction::Drop
                    } else {
                        PageAction::Keep
                    };
                }
                if !file_backed && t.present() && self.zero_pfn != 0 && t.pfn() == self.zero_pfn {
                    // The zero page: what X reads where it has no page.
                    return if base_private {
                        PageAction::Drop
                    } else {
                        PageAction::Keep
                    };
                }
                match b {
                    Some(b) if t.present() && b.present() && t.pfn() != 0 && t.pfn() == b.pfn() => {
                        PageAction::Keep
                    }
                    Some(b) if t.swapped() && b.swapped() && t.swap_entry() == b.swap_entry() => {
                        PageAction::Keep
                    }
                    _ => PageAction::Write,
                }
            })
            .collect())
    }

    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        self.mem
            .read_exact_at(buf, addr)
            .map_err(|source| RemoteError::Sys {
                op: "reading the target's memory (/proc/PID/mem)",
                pid: self.target,
                source,
            })
    }
}

/// What a rebuild did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct RebuildStats {
    /// Mappings of X unmapped.
    pub unmapped: usize,
    /// Mappings made in X.
    pub mapped: usize,
    /// Pages written into X.
    pub pages_written: u64,
    /// Pages of X dropped.
    pub pages_dropped: u64,
    /// Pages left as they were (shared with the base).
    pub pages_kept: u64,
    /// Bytes copied into new shared objects of the clone (shared memory the
    /// target has and the base has not).
    pub shared_bytes_copied: u64,
    /// The vDSO was moved.
    pub vdso_moved: bool,
    /// The exe link was changed.
    pub exe_changed: bool,
    /// Ranges of new private anonymous mappings whose pages were left
    /// unwritten because the page source defers them ([`PageSource::defer`]):
    /// the caller fills them (lazy restore). Sorted.
    #[serde(skip)]
    pub deferred: Vec<(u64, u64)>,
}

/// Fork the stopped `parent` (an injected `fork`) and return the child, stopped,
/// traced, with the parent's saved registers as the ones it resumes with; it is
/// killed if dropped. The parent's registers are put back.
pub fn fork_stopped(parent: &mut Tracee) -> Result<Tracee> {
    parent.set_options(TRACE_OPTIONS)?;
    let child = parent.fork_syscall(
        "clone",
        || "fork for a rebuild".into(),
        libc::SYS_clone,
        &[libc::SIGCHLD as u64, 0, 0, 0, 0],
    );
    let restored = parent.restore_regs();
    let pid = child?;
    let mut child = Tracee::adopt(pid, parent.syscall_insn)?;
    restored?;
    child.set_options(TRACE_OPTIONS | libc::PTRACE_O_EXITKILL)?;
    if let Some(regs) = parent.original_regs() {
        child.set_original(*regs);
    }
    Ok(child)
}

/// Make `regs` the registers X resumes with at detach (B's, after a rebuild).
pub fn resume_with(x: &mut Tracee, regs: Regs) {
    x.set_original(regs);
}

/// [`rebuild`] from live template processes: `base_pid` (A) is what X is a fork
/// of, `target` (B, stopped under our ptrace) what it must become. Shared mappings get the clone's
/// objects from `shared` (the table [`crate::remote_fork`]'s processes use).
pub fn make_like(
    x: &mut Tracee,
    shared: &mut SharedObjects,
    base_pid: i32,
    target: &Tracee,
) -> Result<RebuildStats> {
    let target_pid = target.pid();
    let mut layout = Layout::read(target_pid)?;
    layout.rseq = target.rseq_configuration().unwrap_or(None);
    let target = layout;
    let base = Layout::read(base_pid)?;
    let source = LiveProcess::open(base_pid, target_pid)?;
    rebuild(x, shared, &base, &target, target_pid, &source)
}

/// Whether X keeps the base's mapping `b` for the target's `t`.
fn same_mapping(b: &Vma, t: &Vma) -> bool {
    b.start == t.start
        && b.end == t.end
        && b.prot == t.prot
        && b.shared == t.shared
        && b.object() == t.object()
        && (b.offset == t.offset || !t.is_file())
        && b.name == t.name
}

/// Whether X may keep the base's private mapping `b` where it overlaps the
/// target's private mapping `t`: the same protection, object, file offsets
/// (for the same addresses) and stack flag, and not the vDSO and the like.
fn compatible(b: &Vma, t: &Vma) -> bool {
    let anon_name = |v: &Vma| matches!(v.name.as_str(), "" | "[heap]");
    !b.shared
        && !t.shared
        && !is_special(b)
        && b.prot == t.prot
        && b.object() == t.object()
        && b.has_flag("gd") == t.has_flag("gd")
        && if t.is_file() {
            b.name == t.name && b.offset.wrapping_sub(b.start) == t.offset.wrapping_sub(t.start)
        } else {
            b.name == t.name || (anon_name(b) && anon_name(t))
        }
}

/// `range` minus the sorted, disjoint-or-not `holes`.
fn subtract(range: (u64, u64), holes: &[(u64, u64)]) -> Vec<(u64, u64)> {
    let mut out = Vec::new();
    let mut at = range.0;
    for &(s, e) in holes {
        if e <= at || s >= range.1 {
            continue;
        }
        if s > at {
            out.push((at, s));
        }
        at = at.max(e);
        if at >= range.1 {
            break;
        }
    }
    if at < range.1 {
        out.push((at, range.1));
    }
    out
}

/// The part `[start, end)` of mapping `t`.
fn sub_vma(t: &Vma, start: u64, end: u64) -> Vma {
    let mut part = t.clone();
    if t.is_file() {
        part.offset = t.offset + (start - t.start);
    }
    part.start = start;
    part.end = end;
    part
}

/// A free range of `len` bytes in neither layout, below 128 TiB.
fn free_range(a: &[Vma], b: &[Vma], len: u64) -> Option<u64> {
    let mut taken: Vec<(u64, u64)> = a.iter().chain(b).map(|v| (v.start, v.end)).collect();
    taken.sort_unstable();
    let mut candidate = 0x1000_0000u64;
    for (start, end) in taken {
        if candidate + len + PAGE <= start {
            return Some(candidate);
        }
        candidate = candidate.max(end + PAGE);
    }
    (candidate + len < 0x7f00_0000_0000).then_some(candidate)
}

/// Make X's address space the target's: see the module documentation.
/// `target_pid` is the process the target's shared and deleted-file mappings are
/// read from (through `/proc/PID/map_files`).
pub fn rebuild(
    x: &mut Tracee,
    shared: &mut SharedObjects,
    base: &Layout,
    target: &Layout,
    target_pid: i32,
    source: &dyn PageSource,
) -> Result<RebuildStats> {
    let pid = x.pid();
    let mut stats = RebuildStats::default();
    let x_vmas = maps::read_maps(pid)?;
    x.find_syscall_insn()?;
    // The kernel writes the rseq area on every return to user space and kills
    // the process (SIGSEGV) when it is unmapped: unregister it while the memory
    // changes.
    if let Some((ptr, len, sig)) = x.rseq_configuration().unwrap_or(None) {
        x.syscall(
            "rseq(RSEQ_FLAG_UNREGISTER)",
            || format!("the rseq area at {ptr:#x}, while the memory changes"),
            libc::SYS_rseq,
            &[ptr, u64::from(len), RSEQ_FLAG_UNREGISTER, u64::from(sig)],
        )?;
    }

    // Our own syscall instruction and scratch area, free in both layouts.
    let len = PAGE + SCRATCH_LEN as u64;
    let hole = free_range(&x_vmas, &target.vmas, len)
        .ok_or_else(|| RemoteError::Plan("no free range for the rebuild's syscall page".into()))?;
    x.find_syscall_insn()?;
    let got = x.syscall(
        "mmap",
        || "the rebuild's syscall page and scratch area".into(),
        libc::SYS_mmap,
        &[
            hole,
            len,
            (libc::PROT_READ | libc::PROT_WRITE) as u64,
            (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED_NOREPLACE) as u64,
            u64::MAX,
            0,
        ],
    )?;
    if got != hole {
        return Err(RemoteError::Plan(
            "the rebuild's page was not mapped where asked".into(),
        ));
    }
    x.write_mem(hole, &[0x0f, 0x05, 0xcc, 0xcc])?;
    x.syscall(
        "mprotect",
        || "the rebuild's syscall page".into(),
        libc::SYS_mprotect,
        &[hole, PAGE, (libc::PROT_READ | libc::PROT_EXEC) as u64],
    )?;
    x.syscall_insn = hole;
    let mut scratch = Scratch::map(x)?;
    let moved = x.syscall(
        "mremap",
        || "the rebuild's scratch area".into(),
        libc::SYS_mremap,
        &[
            scratch.addr,
            SCRATCH_LEN as u64,
            SCRATCH_LEN as u64,
            (libc::MREMAP_MAYMOVE | libc::MREMAP_FIXED) as u64,
            hole + PAGE,
        ],
    )?;
    scratch.addr = moved;
    let ours = (hole, hole + len);
    crate::marks::mark("rebuild: syscall page");

    // 1. Unmap what X keeps for no mapping of the target. X keeps a shared
    // mapping the target has identically, and the part of a private mapping
    // where the target has a compatible one (same protection, object and
    // offsets): its pages are compared one by one below.
    let mut keep: Vec<(u64, u64)> = Vec::new();
    for t in target.vmas.iter().filter(|t| !is_special(t)) {
        for b in &base.vmas {
            if !x_vmas.iter().any(|v| v.start == b.start && v.end == b.end) {
                continue;
            }
            if t.shared && same_mapping(b, t) {
                keep.push((t.start, t.end));
            } else if !t.shared && compatible(b, t) {
                let (s, e) = (b.start.max(t.start), b.end.min(t.end));
                if s < e {
                    keep.push((s, e));
                }
            }
        }
    }
    keep.sort_unstable();
    for v in &x_vmas {
        if is_special(v) || (v.start >= ours.0 && v.end <= ours.1) {
            continue;
        }
        let pieces = subtract((v.start, v.end), &keep);
        for (s, e) in &pieces {
            x.syscall(
                "munmap",
                || format!("{s:#x}-{e:#x} of {} the target does not have", v.name),
                libc::SYS_munmap,
                &[*s, e - s],
            )?;
        }
        stats.unmapped += usize::from(!pieces.is_empty());
    }

    crate::marks::mark("rebuild: unmapped");
    // 2. The vDSO.
    let x_block = {
        let now = Layout {
            vmas: maps::read_maps(pid)?,
            mm: MmFields::default(),
            auxv: Vec::new(),
            exe: PathBuf::new(),
            exe_object: (0, 0),
            rseq: None,
        };
        (now.vdso(), now.vdso_block())
    };
    if let (Some(tv), Some((t_start, _))) = (target.vdso(), target.vdso_block()) {
        if x_block.0 != Some(tv) {
            if let Some((s, e)) = x_block.1 {
                x.syscall(
                    "munmap",
                    || "the vDSO, to move it".into(),
                    libc::SYS_munmap,
                    &[s, e - s],
                )?;
            }
            x.syscall(
                "arch_prctl(ARCH_MAP_VDSO_64)",
                || format!("the vDSO at {t_start:#x}"),
                libc::SYS_arch_prctl,
                &[ARCH_MAP_VDSO_64, t_start],
            )?;
            stats.vdso_moved = true;
        }
    }

    // 3. Map what X lacks.
    // Writable shared memory gets the clone's own objects; read-only shared
    // mappings of files are mapped from the file like private ones.
    let writable_shared = |t: &Vma| t.shared && t.is_file() && t.has_flag("mw");
    let mut shared_new: Vec<Vma> = Vec::new();
    // From an image (no live target): memory of its own (shared anonymous,
    // memfd, deleted files) is made anew and written from the image; a file
    // that exists is mapped shared as it is.
    let from_image = target_pid == 0;
    let mut made_objects: Vec<((u64, u64), u64)> = Vec::new();
    let mut private: Vec<Vma> = Vec::new();
    for t in target.vmas.iter().filter(|t| !is_special(t)) {
        let pieces = subtract((t.start, t.end), &keep);
        if from_image && t.shared && t.deleted() {
            if !pieces.is_empty() {
                map_shared_anew(x, &mut scratch, t, &target.vmas, &mut made_objects)?;
                stats.mapped += 1;
            }
            continue;
        }
        if writable_shared(t) && !from_image {
            if !pieces.is_empty() {
                shared_new.push(t.clone());
            }
            continue;
        }
        for (s, e) in pieces {
            private.push(sub_vma(t, s, e));
            stats.mapped += 1;
        }
    }
    map_privates(x, &mut scratch, &private, target_pid)?;
    for (_, fd) in made_objects {
        x.syscall("close", String::new, libc::SYS_close, &[fd])?;
    }
    if !shared_new.is_empty() {
        stats.mapped += shared_new.len();
        let copies = shared.map_from(x, &mut scratch, target_pid, target_pid, &shared_new)?;
        stats.shared_bytes_copied = copies.iter().map(|c| c.bytes_copied).sum();
    }

    crate::marks::mark("rebuild: mapped");
    // 4. Contents.
    let mem = open_mem(pid)?;
    let own_memory = |t: &Vma| !t.shared || (from_image && t.deleted());
    for t in target
        .vmas
        .iter()
        .filter(|t| own_memory(t) && !is_special(t))
    {
        let fresh = subtract((t.start, t.end), &keep);
        let kept = subtract((t.start, t.end), &fresh);
        for (ranges, is_kept) in [(kept, true), (fresh, false)] {
            for (s, e) in ranges {
                let part = sub_vma(t, s, e);
                if !is_kept && deferrable(&part) && source.defer(&part) {
                    stats.deferred.push((s, e));
                    continue;
                }
                let actions = source.page_actions(&part, is_kept)?;
                copy_pages(x, &mem, source, &part, &actions, !is_kept, &mut stats)?;
            }
        }
    }

    crate::marks::mark("rebuild: contents");
    // From an image, the file pages the process had in its page tables are
    // mapped again now (a fork of it, a clone of a restored template, then
    // shares them instead of faulting each in on its own); best effort: a
    // range past the end of its file is simply not populated.
    if from_image {
        let mut populate = Batch::new();
        for t in target.vmas.iter().filter(|t| {
            t.is_file() && !t.deleted() && t.rss_kb > 0 && t.prot & libc::PROT_READ != 0
        }) {
            populate.push(
                "madvise(MADV_POPULATE_READ)",
                String::new(),
                libc::SYS_madvise,
                &[t.start, t.len(), MADV_POPULATE_READ],
            );
        }
        scratch.reset();
        populate.run_each(x, &mut scratch)?;
    }

    crate::marks::mark("rebuild: file pages populated");
    // 5. mm fields and exe.
    let exe_fd = if target.exe_object != base.exe_object {
        scratch.reset();
        let path = target.exe.as_os_str().as_encoded_bytes();
        let addr = scratch.put_path(x, path)?;
        let fd = x.syscall(
            "openat",
            || format!("the target's executable {}", target.exe.display()),
            libc::SYS_openat,
            &[
                libc::AT_FDCWD as u64,
                addr,
                (libc::O_RDONLY | libc::O_CLOEXEC) as u64,
                0,
            ],
        )?;
        stats.exe_changed = true;
        Some(fd)
    } else {
        None
    };
    scratch.reset();
    let auxv_addr = scratch.put(x, &target.auxv)?;
    let map = prctl_mm_map(&target.mm, auxv_addr, target.auxv.len() as u32, exe_fd);
    let map_addr = scratch.put(x, &map)?;
    x.syscall(
        "prctl(PR_SET_MM_MAP)",
        || "the target's mm fields".into(),
        libc::SYS_prctl,
        &[
            PR_SET_MM,
            PR_SET_MM_MAP,
            map_addr,
            PRCTL_MM_MAP_SIZE as u64,
            0,
        ],
    )?;
    if let Some(fd) = exe_fd {
        x.syscall("close", String::new, libc::SYS_close, &[fd])?;
    }

    if let Some((ptr, len, sig)) = target.rseq {
        x.syscall(
            "rseq",
            || format!("registering the target's rseq area at {ptr:#x}"),
            libc::SYS_rseq,
            &[ptr, u64::from(len), 0, u64::from(sig)],
        )?;
    }

    // Our page and scratch go; injections continue through the vDSO.
    scratch.unmap(x)?;
    x.syscall_insn = 0;
    if target.vdso().is_some() {
        x.find_syscall_insn()?;
        x.syscall(
            "munmap",
            || "the rebuild's syscall page".into(),
            libc::SYS_munmap,
            &[hole, PAGE],
        )?;
    } else {
        x.syscall_insn = hole;
    }
    Ok(stats)
}

/// A mapping whose pages may be put in later with `UFFDIO_COPY` (a
/// userfaultfd in missing mode takes private anonymous memory; a locked
/// mapping was populated at mmap, so its pages are written at once).
fn deferrable(t: &Vma) -> bool {
    !t.shared && !t.is_file() && !is_special(t) && !t.has_flag("lo")
}

/// Write the pages of X's new private mappings `ranges` (of the target's
/// layout) from `source` now: what a rebuild deferred, when it cannot be
/// filled later after all.
pub(crate) fn write_deferred(
    x: &mut Tracee,
    target: &Layout,
    ranges: &[(u64, u64)],
    source: &dyn PageSource,
) -> Result<()> {
    let pid = x.pid();
    let mem = open_mem(pid)?;
    let mut stats = RebuildStats::default();
    for &(s, e) in ranges {
        let Some(t) = target.vmas.iter().find(|t| t.start <= s && e <= t.end) else {
            return Err(RemoteError::Unclonable(format!(
                "pid {pid}: the deferred range {s:#x}-{e:#x} is in no mapping of the image"
            )));
        };
        let part = sub_vma(t, s, e);
        let actions = source.page_actions(&part, false)?;
        copy_pages(x, &mem, source, &part, &actions, true, &mut stats)?;
    }
    Ok(())
}

/// `struct prctl_mm_map` as bytes.
fn prctl_mm_map(mm: &MmFields, auxv: u64, auxv_size: u32, exe_fd: Option<u64>) -> Vec<u8> {
    let mut out = Vec::with_capacity(PRCTL_MM_MAP_SIZE);
    for v in [
        mm.start_code,
        mm.end_code,
        mm.start_data,
        mm.end_data,
        mm.start_brk,
        mm.brk,
        mm.start_stack,
        mm.arg_start,
        mm.arg_end,
        mm.env_start,
        mm.env_end,
        auxv,
    ] {
        out.extend_from_slice(&v.to_ne_bytes());
    }
    out.extend_from_slice(&auxv_size.to_ne_bytes());
    out.extend_from_slice(&exe_fd.map_or(u32::MAX, |fd| fd as u32).to_ne_bytes());
    out
}

/// Map the image's shared mapping `t` of memory of its own (shared
/// anonymous memory, a memfd, a deleted file) in X on a new object: shared
/// anonymous memory for `/dev/zero`, else a memfd of the same name sized for
/// every mapping of that object in `all`; `made` (object → fd in X) lets
/// later mappings of the same object share it. The contents are written
/// afterwards, as a private mapping's.
fn map_shared_anew(
    x: &mut Tracee,
    scratch: &mut Scratch,
    t: &Vma,
    all: &[Vma],
    made: &mut Vec<((u64, u64), u64)>,
) -> Result<()> {
    let what = || format!("{} ({})", t.range_name(), t.name);
    let flags = (libc::MAP_SHARED | libc::MAP_FIXED) as u64;
    let addr = if t.path() == "/dev/zero" {
        x.syscall(
            "mmap",
            what,
            libc::SYS_mmap,
            &[
                t.start,
                t.len(),
                t.prot as u64,
                flags | libc::MAP_ANONYMOUS as u64,
                u64::MAX,
                0,
            ],
        )?
    } else {
        let fd = match made.iter().find(|(o, _)| *o == t.object()) {
            Some((_, fd)) => *fd,
            None => {
                let name = t.path().rsplit('/').next().unwrap_or("restored");
                let name = name.strip_prefix("memfd:").unwrap_or(name);
                scratch.reset();
                let name_addr = scratch.put_path(x, name.as_bytes())?;
                let fd = x.syscall(
                    "memfd_create",
                    what,
                    libc::SYS_memfd_create,
                    &[name_addr, libc::MFD_CLOEXEC as u64],
                )?;
                let size = all
                    .iter()
                    .filter(|v| v.object() == t.object())
                    .map(|v| v.offset + v.len())
                    .max()
                    .unwrap_or(t.offset + t.len());
                x.syscall("ftruncate", what, libc::SYS_ftruncate, &[fd, size])?;
                made.push((t.object(), fd));
                fd
            }
        };
        x.syscall(
            "mmap",
            what,
            libc::SYS_mmap,
            &[t.start, t.len(), t.prot as u64, flags, fd, t.offset],
        )?
    };
    mapped_where_asked(x, t, addr)?;
    Ok(())
}

/// The mapping of `t` came at `addr`: refused unless that is `t`'s place.
fn mapped_where_asked(x: &Tracee, t: &Vma, addr: u64) -> Result<()> {
    if addr == t.start {
        return Ok(());
    }
    Err(RemoteError::UnsupportedMapping {
        pid: x.pid(),
        range: t.range_name(),
        name: t.name.clone(),
        reason: format!("mapped at {addr:#x} instead"),
    })
}

/// Map the target's private mappings (and read-only shared file mappings)
/// `ts` in X, as [`map_private`] maps one, in two injected batches rather
/// than a few calls each: the files opened, then the mappings made and
/// advised and the files closed. Each file mapping gets an open file of its
/// own, as [`map_private`] gives it: two adjacent mappings of one open file
/// would be merged by the kernel where the target has two. A mapping of a
/// deleted file, or a set of paths too long for the scratch area, is mapped
/// one by one.
fn map_privates(x: &mut Tracee, scratch: &mut Scratch, ts: &[Vma], target_pid: i32) -> Result<()> {
    let (batched, alone): (Vec<&Vma>, Vec<&Vma>) =
        ts.iter().partition(|t| !t.is_file() || !t.deleted());
    let paths: Vec<&str> = batched
        .iter()
        .filter(|t| t.is_file())
        .map(|t| t.path())
        .collect();
    // The paths, the tables of the batches (64 bytes a call) and the batch
    // program must fit in the scratch area with room to spare.
    let room = paths.iter().map(|p| p.len() + 1).sum::<usize>() + 64 * (5 * ts.len() + 8) + 128;
    if room > SCRATCH_LEN {
        for t in ts {
            map_private(x, scratch, t, target_pid)?;
        }
        return Ok(());
    }
    scratch.reset();
    let mut open = Batch::new();
    for path in &paths {
        let addr = scratch.put_path(x, path.as_bytes())?;
        open.push(
            "openat",
            (*path).to_string(),
            libc::SYS_openat,
            &[
                libc::AT_FDCWD as u64,
                addr,
                (libc::O_RDONLY | libc::O_CLOEXEC) as u64,
                0,
            ],
        );
    }
    let fds = open.run(x, scratch)?;
    let mut opened = fds.iter().copied();
    scratch.reset();
    let mut maps = Batch::new();
    let mut mmaps = Vec::with_capacity(batched.len());
    for t in &batched {
        let what = format!("{} ({})", t.range_name(), t.name);
        let fd = if t.is_file() {
            Some(opened.next().ok_or_else(|| {
                RemoteError::Plan(format!("no file opened for the mapping {what}"))
            })?)
        } else {
            None
        };
        mmaps.push(maps.len());
        maps.push("mmap", what.clone(), libc::SYS_mmap, &mmap_args(t, fd));
        for advice in advices(t) {
            maps.push(
                "madvise",
                what.clone(),
                libc::SYS_madvise,
                &[t.start, t.len(), advice],
            );
        }
    }
    for fd in &fds {
        maps.push("close", String::new(), libc::SYS_close, &[*fd]);
    }
    let got = maps.run(x, scratch)?;
    for (t, i) in batched.iter().zip(mmaps) {
        mapped_where_asked(x, t, got.get(i).copied().unwrap_or(u64::MAX))?;
    }
    for t in &batched {
        name_anonymous(x, scratch, t)?;
    }
    for t in alone {
        map_private(x, scratch, t, target_pid)?;
    }
    Ok(())
}

/// The `mmap` flags of the target's mapping `t` (without `MAP_ANONYMOUS`).
/// The `mmap` arguments that map the target's mapping `t` in place, from
/// file descriptor `fd` (in the process mapping it), or anonymous memory for
/// a mapping that is not a file's.
fn mmap_args(t: &Vma, fd: Option<u64>) -> [u64; 6] {
    let anonymous = if t.is_file() { 0 } else { libc::MAP_ANONYMOUS };
    [
        t.start,
        t.len(),
        t.prot as u64,
        (private_flags(t) | anonymous) as u64,
        fd.unwrap_or(u64::MAX),
        if fd.is_some() { t.offset } else { 0 },
    ]
}

fn private_flags(t: &Vma) -> libc::c_int {
    let mut flags = libc::MAP_FIXED
        | if t.shared {
            libc::MAP_SHARED
        } else {
            libc::MAP_PRIVATE
        };
    if t.has_flag("gd") {
        flags |= libc::MAP_GROWSDOWN;
    }
    flags
}

/// The `madvise` advice the target's mapping `t` was given (its VmFlags).
fn advices(t: &Vma) -> Vec<u64> {
    [
        ("dd", libc::MADV_DONTDUMP),
        ("dc", libc::MADV_DONTFORK),
        ("wf", libc::MADV_WIPEONFORK),
        ("hg", libc::MADV_HUGEPAGE),
        ("nh", libc::MADV_NOHUGEPAGE),
    ]
    .into_iter()
    .filter(|(flag, _)| t.has_flag(flag))
    .map(|(_, advice)| advice as u64)
    .collect()
}

/// Give X's anonymous mapping `t` the name the target's has (`[anon:NAME]`).
/// The name is bookkeeping only: a kernel without CONFIG_ANON_VMA_NAME
/// refuses it and the mapping stays unnamed.
fn name_anonymous(x: &mut Tracee, scratch: &mut Scratch, t: &Vma) -> Result<()> {
    if let Some(name) = t
        .name
        .strip_prefix("[anon:")
        .and_then(|n| n.strip_suffix(']'))
        .filter(|_| !t.is_file())
    {
        scratch.reset();
        let addr = scratch.put_path(x, name.as_bytes())?;
        x.inject_syscall(
            libc::SYS_prctl,
            &[PR_SET_VMA, PR_SET_VMA_ANON_NAME, t.start, t.len(), addr],
        )?;
    }
    Ok(())
}

/// Map the target's private mapping (or read-only shared file mapping) `t` in X.
fn map_private(x: &mut Tracee, scratch: &mut Scratch, t: &Vma, target_pid: i32) -> Result<()> {
    let what = || format!("{} ({})", t.range_name(), t.name);
    let fd = if !t.is_file() {
        None
    } else if !t.deleted() {
        scratch.reset();
        let addr = scratch.put_path(x, t.path().as_bytes())?;
        let fd = x.syscall(
            "openat",
            what,
            libc::SYS_openat,
            &[
                libc::AT_FDCWD as u64,
                addr,
                (libc::O_RDONLY | libc::O_CLOEXEC) as u64,
                0,
            ],
        )?;
        Some(fd)
    } else {
        let path = proc_path(target_pid, &format!("map_files/{}", t.range_name()));
        let file = File::open(&path).map_err(|source| RemoteError::Proc { path, source })?;
        let got = crate::fdtransfer::install_fds_with(x, scratch, &[file.as_fd()])?;
        got.first().map(|fd| *fd as u64)
    };
    let addr = x.syscall("mmap", what, libc::SYS_mmap, &mmap_args(t, fd))?;
    if let Some(fd) = fd {
        x.syscall("close", String::new, libc::SYS_close, &[fd])?;
    }
    mapped_where_asked(x, t, addr)?;
    name_anonymous(x, scratch, t)?;
    for advice in advices(t) {
        x.syscall(
            "madvise",
            what,
            libc::SYS_madvise,
            &[t.start, t.len(), advice],
        )?;
    }
    Ok(())
}

/// Write `data` at `addr` of X's mapping `t`: with `process_vm_writev(2)`
/// into a writable mapping (the pages of a whole run pinned at once), else,
/// or if that is refused, through `/proc/X/mem` (which may write where X
/// itself may not, one page at a time).
fn write_remote(pid: i32, mem: &File, t: &Vma, data: &[u8], addr: u64) -> std::io::Result<()> {
    if t.prot & libc::PROT_WRITE != 0 {
        let local = [std::io::IoSlice::new(data)];
        let remote = [nix::sys::uio::RemoteIoVec {
            base: addr as usize,
            len: data.len(),
        }];
        if let Ok(n) =
            nix::sys::uio::process_vm_writev(nix::unistd::Pid::from_raw(pid), &local, &remote)
        {
            if n == data.len() {
                return Ok(());
            }
            // A short write: the rest the slow way.
            return mem.write_all_at(&data[n..], addr + n as u64);
        }
    }
    mem.write_all_at(data, addr)
}

/// Apply `actions` to the pages of `t` in X: write runs through `/proc/X/mem`,
/// drop runs with `MADV_DONTNEED`. In a new (`fresh`) mapping, zero pages are
/// not written.
fn copy_pages(
    x: &mut Tracee,
    mem: &File,
    source: &dyn PageSource,
    t: &Vma,
    actions: &[PageAction],
    fresh: bool,
    stats: &mut RebuildStats,
) -> Result<()> {
    let pid = x.pid();
    let mut i = 0;
    let mut buf = Vec::new();
    while i < actions.len() {
        let action = actions[i];
        let mut j = i + 1;
        while j < actions.len() && actions[j] == action && j - i < 256 {
            j += 1;
        }
        let start = t.start + i as u64 * PAGE;
        let len = (j - i) as u64 * PAGE;
        match action {
            PageAction::Keep => stats.pages_kept += (j - i) as u64,
            PageAction::Drop => {
                // A locked mapping refuses MADV_DONTNEED; its pages are then
                // overwritten with zeros instead.
                let dropped =
                    x.inject_syscall(libc::SYS_madvise, &[start, len, libc::MADV_DONTNEED as u64])?;
                if dropped < 0 {
                    buf.clear();
                    buf.resize(len as usize, 0);
                    mem.write_all_at(&buf, start)
                        .map_err(|source| RemoteError::Sys {
                            op: "writing zeros into X (/proc/PID/mem)",
                            pid,
                            source,
                        })?;
                }
                stats.pages_dropped += (j - i) as u64;
            }
            PageAction::Write => {
                buf.resize(len as usize, 0);
                source.read(start, &mut buf)?;
                // Runs of pages to write, each in one call; in a new mapping a
                // zero page is skipped (over a file it hides the file's
                // contents, so there it is written).
                let skip = |page: &[u8]| fresh && !t.is_file() && page.iter().all(|b| *b == 0);
                let pages: Vec<&[u8]> = buf.chunks(PAGE as usize).collect();
                let mut k = 0;
                while k < pages.len() {
                    if skip(pages[k]) {
                        k += 1;
                        continue;
                    }
                    let mut end = k + 1;
                    while end < pages.len() && !skip(pages[end]) {
                        end += 1;
                    }
                    let from = k * PAGE as usize;
                    let to = end * PAGE as usize;
                    write_remote(pid, mem, t, &buf[from..to], start + from as u64).map_err(
                        |source| RemoteError::Sys {
                            op: "writing the target's page into X (/proc/PID/mem)",
                            pid,
                            source,
                        },
                    )?;
                    stats.pages_written += (end - k) as u64;
                    k = end;
                }
            }
        }
        i = j;
    }
    Ok(())
}

/// `/proc/PID/mem` of process `pid`, for reading and writing its memory.
fn open_mem(pid: i32) -> Result<std::fs::File> {
    let mem_path = proc_path(pid, "mem");
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(&mem_path)
        .map_err(|source| RemoteError::Proc {
            path: mem_path,
            source,
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vma(start: u64, end: u64) -> Vma {
        Vma {
            start,
            end,
            prot: libc::PROT_READ,
            shared: false,
            offset: 0,
            dev: 0,
            ino: 0,
            name: String::new(),
            flags: Vec::new(),
            rss_kb: 0,
            private_dirty_kb: 0,
            swap_kb: 0,
        }
    }

    #[test]
    fn free_range_avoids_both_layouts() {
        let a = [vma(0x1000_0000, 0x1001_0000)];
        let b = [vma(0x1001_1000, 0x1002_0000)];
        let got = free_range(&a, &b, 0x11000).expect("free");
        assert!(got >= 0x1002_0000 + PAGE, "{got:#x}");
        let got = free_range(&[], &[], 0x11000).expect("free");
        assert_eq!(got, 0x1000_0000);
    }

    #[test]
    fn subtract_ranges() {
        assert_eq!(subtract((0, 100), &[]), vec![(0, 100)]);
        assert_eq!(
            subtract((0, 100), &[(10, 20), (15, 30), (90, 200)]),
            vec![(0, 10), (30, 90)]
        );
        assert_eq!(subtract((50, 60), &[(0, 100)]), vec![]);
        assert_eq!(subtract((50, 60), &[(0, 10), (70, 80)]), vec![(50, 60)]);
    }

    #[test]
    fn prctl_mm_map_layout() {
        let mm = MmFields {
            start_code: 1,
            env_end: 11,
            ..MmFields::default()
        };
        let b = prctl_mm_map(&mm, 0xabc, 48, None);
        assert_eq!(b.len(), PRCTL_MM_MAP_SIZE);
        let word = |i: usize| u64::from_ne_bytes(b[i * 8..i * 8 + 8].try_into().expect("8"));
        assert_eq!((word(0), word(10), word(11)), (1, 11, 0xabc));
        assert_eq!(&b[96..100], &48u32.to_ne_bytes());
        assert_eq!(&b[100..104], &u32::MAX.to_ne_bytes());
    }
}
