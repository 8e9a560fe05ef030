//! Shared memory made private to a clone.
//!
//! A process forked from the template still shares every `MAP_SHARED` mapping
//! with it: a write by the clone into shared anonymous memory, a memfd, a
//! `/dev/shm` file or a System V segment would be seen by the template and its
//! other clones. In the clone's final process (while it still holds every
//! capability in its user namespace), each object behind a writable shared
//! mapping, and each memfd or deleted file open for writing
//! ([`FdAction::CopyShared`]), is replaced by a new object of the clone:
//!
//! | template object | the clone's new object |
//! |---|---|
//! | shared anonymous (`/dev/zero (deleted)`) | a new shared anonymous object of the same size |
//! | memfd (`/memfd:NAME (deleted)`) | `memfd_create(NAME)`, same size and seals |
//! | deleted file | a memfd named after the file's path |
//! | file with a path (`/dev/shm/x`, a file on the root) | the same path opened read-write in the clone's root (an overlay copies it up into the clone's layer; a path missing in the clone, as in its fresh `/dev/shm`, is created with the same mode); when that path still leads to the template's own object (a shared tmpfs or volume), a memfd named after the path |
//! | System V segment (`/SYSV<key>`) | a segment with the same key, id (`shm_next_id` of the clone's IPC namespace) and permission bits |
//!
//! Contents are copied tracer-side from the template's object (read through
//! `/proc/PID/map_files` or `/proc/PID/fd`, only its data ranges, by
//! `SEEK_DATA`/`SEEK_HOLE`, and without writing pages that are all zero), then
//! every shared mapping of the object is mapped over at the same range, offset and
//! protection (`MAP_SHARED | MAP_FIXED`, or `shmat(SHM_REMAP)`), and every fd of
//! the process on it is reopened on the new object with its access mode, status
//! flags and offset. The tracer keeps a table of the new objects keyed by the
//! template's object (device, inode), [`SharedObjects`], so that several processes
//! of one clone (a process tree) get the same new objects.

use std::collections::HashMap;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::{FileExt, MetadataExt, OpenOptionsExt, PermissionsExt};

use serde::Serialize;

use crate::error::{RemoteError, Result};
use crate::fdinfo::{pidfd_getfd, pidfd_open, FdAction, FdEntry, FdKind};
use crate::fdtransfer::install_fds_with;
use crate::maps::{self, Vma, PAGE};
use crate::memory::Scratch;
use crate::procfs::proc_path;
use crate::tracee::Tracee;

/// The identity of a template's object: (device, inode).
pub type ObjectKey = (u64, u64);

/// `SHM_DEST`: the segment is marked for removal (`IPC_RMID` with attachments).
const SHM_DEST: u32 = 0o1000;
/// The largest memfd name (`MFD_NAME_MAX_LEN`).
const MEMFD_NAME_MAX: usize = 249;

/// What kind of shared object the template had.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum SharedKind {
    /// Shared anonymous memory.
    Anonymous,
    /// A memfd with this name.
    Memfd(String),
    /// An unlinked file (its last path).
    DeletedFile(String),
    /// A file with a path.
    File(String),
    /// A System V shared memory segment.
    SysV {
        /// Its key.
        key: i32,
        /// Its id.
        shmid: i32,
    },
}

/// What was done for one object in one process.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SharedCopy {
    /// The template's object.
    pub kind: SharedKind,
    /// Mappings replaced.
    pub mappings: usize,
    /// Fds replaced.
    pub fds: Vec<i32>,
    /// Bytes copied from the template's object (0 when the object already existed
    /// for another process of the clone, or an overlay copied the file up).
    pub bytes_copied: u64,
    /// What the clone's object is (`memfd`, `anonymous`, `file`, `sysv`).
    pub new_object: &'static str,
}

/// The clone's new object for one template object.
#[derive(Debug)]
struct NewObject {
    /// A tracer-held fd on it (none for System V).
    fd: Option<OwnedFd>,
    /// What it is.
    what: &'static str,
    /// Seals to add once mapped (memfd).
    seals: i32,
}

/// The clone's new shared objects, keyed by the template's object: one table per
/// clone, used for each of its processes.
#[derive(Debug, Default)]
pub struct SharedObjects {
    objects: HashMap<ObjectKey, NewObject>,
    /// The template's System V segments (id -> (key, mode, size)), read once.
    sysv: Option<HashMap<i32, (i32, u32, u64)>>,
}

/// Where the template's object is read from.
#[derive(Debug, Clone)]
enum Source {
    /// `/proc/PID/map_files/<range>`.
    Mapping(String),
    /// `/proc/PID/fd/<n>`.
    Fd(i32),
}

/// One object to replace in a process.
#[derive(Debug)]
struct Work {
    key: ObjectKey,
    /// The process whose mapping or fd the template's object is read through.
    source_pid: i32,
    kind: SharedKind,
    source: Source,
    vmas: Vec<Vma>,
    fds: Vec<FdEntry>,
}

/// Make every writable shared object of `g` (a fresh fork of the template, its
/// fds re-targeted except the [`FdAction::CopyShared`] ones) private to it. See
/// the module documentation. `template_pid` is read for its System V segments.
///
/// # Errors
/// An injected call that fails, a mapping of an object that is not a regular
/// file (a device), or a System V segment attached partly.
pub(crate) fn make_private(
    g: &mut Tracee,
    scratch: &mut Scratch,
    template_pid: i32,
    entries: &[FdEntry],
) -> Result<Vec<SharedCopy>> {
    SharedObjects::default().make_private(g, scratch, template_pid, entries)
}

/// Refuse, before anything is forked (at freeze time), a process whose shared
/// memory a clone could not get its own copy of: a writable shared mapping of
/// something that is not a regular file (a device), or a System V segment
/// attached only in part.
///
/// # Errors
/// [`RemoteError::UnsupportedMapping`] naming the first such mapping.
pub fn ensure_memory_clonable(pid: i32) -> Result<()> {
    if !maps::has_shared_mapping(pid)? {
        return Ok(());
    }
    let vmas = maps::read_smaps(pid)?;
    for v in vmas
        .iter()
        .filter(|v| v.shared && v.is_file() && v.has_flag("mw"))
    {
        let refuse = |reason: &str| RemoteError::UnsupportedMapping {
            pid,
            range: v.range_name(),
            name: v.name.clone(),
            reason: reason.to_string(),
        };
        let meta = open_map_file(pid, &v.range_name(), false)?
            .metadata()
            .map_err(|e| sys("fstat (a shared mapping)", pid, e))?;
        if !meta.file_type().is_file() {
            return Err(refuse("it is not a regular file (a device?)"));
        }
        if let SharedKind::SysV { .. } = kind_of_mapping(v) {
            let all: Vec<Vma> = vmas
                .iter()
                .filter(|w| w.shared && w.object() == v.object())
                .cloned()
                .collect();
            if attachments(&all, meta.len()).is_none() {
                return Err(refuse(
                    "the System V segment is attached only in part (partly unmapped)",
                ));
            }
        }
    }
    Ok(())
}

fn kind_of_mapping(vma: &Vma) -> SharedKind {
    let path = vma.path();
    // Named shared anonymous memory (`PR_SET_VMA_ANON_NAME`) shows its name.
    if vma.name == "/dev/zero (deleted)" || vma.name.starts_with("[anon_shmem:") {
        SharedKind::Anonymous
    } else if let (Some(key), true) = (path.strip_prefix("/SYSV"), vma.deleted()) {
        SharedKind::SysV {
            key: u32::from_str_radix(key, 16).unwrap_or(0) as i32,
            shmid: vma.ino as i32,
        }
    } else if let Some(name) = path.strip_prefix("/memfd:").filter(|_| vma.deleted()) {
        SharedKind::Memfd(name.to_string())
    } else if vma.deleted() {
        SharedKind::DeletedFile(path.to_string())
    } else {
        SharedKind::File(path.to_string())
    }
}

fn kind_of_fd(entry: &FdEntry) -> Option<SharedKind> {
    match &entry.kind {
        FdKind::File { path, deleted } => Some(match path.strip_prefix("/memfd:") {
            Some(name) => SharedKind::Memfd(name.to_string()),
            None if *deleted => SharedKind::DeletedFile(path.clone()),
            // A file of the box's own /dev/shm (see FdEntry::action).
            None => SharedKind::File(path.clone()),
        }),
        _ => None,
    }
}

fn proc_err(path: std::path::PathBuf) -> impl FnOnce(io::Error) -> RemoteError {
    move |source| RemoteError::Proc { path, source }
}

/// The (device, inode) of what `/proc/PID/fd/N` leads to.
fn fd_object(pid: i32, fd: i32) -> Result<ObjectKey> {
    let path = proc_path(pid, &format!("fd/{fd}"));
    let meta = std::fs::metadata(&path).map_err(proc_err(path))?;
    Ok((meta.dev(), meta.ino()))
}

impl SharedObjects {
    /// [`make_private`] for one process of a clone, reusing the new objects made
    /// for its other processes.
    pub(crate) fn make_private(
        &mut self,
        g: &mut Tracee,
        scratch: &mut Scratch,
        template_pid: i32,
        entries: &[FdEntry],
    ) -> Result<Vec<SharedCopy>> {
        let pid = g.pid();
        let copy_fds: Vec<&FdEntry> = entries
            .iter()
            .filter(|e| e.action() == FdAction::CopyShared)
            .collect();
        if copy_fds.is_empty() && !maps::has_shared_mapping(pid)? {
            return Ok(Vec::new());
        }
        let vmas = maps::read_smaps(pid)?;
        let mut work: Vec<Work> = Vec::new();
        let index = |work: &Vec<Work>, key: ObjectKey| work.iter().position(|w| w.key == key);
        for vma in vmas
            .iter()
            .filter(|v| v.shared && v.is_file() && v.has_flag("mw"))
        {
            if index(&work, vma.object()).is_none() {
                work.push(Work {
                    key: vma.object(),
                    source_pid: pid,
                    kind: kind_of_mapping(vma),
                    source: Source::Mapping(vma.range_name()),
                    vmas: Vec::new(),
                    fds: Vec::new(),
                });
            }
        }
        for entry in &copy_fds {
            let key = fd_object(pid, entry.fd)?;
            if index(&work, key).is_none() {
                if let Some(kind) = kind_of_fd(entry) {
                    work.push(Work {
                        key,
                        source_pid: pid,
                        kind,
                        source: Source::Fd(entry.fd),
                        vmas: Vec::new(),
                        fds: Vec::new(),
                    });
                }
            }
        }
        if work.is_empty() {
            return Ok(Vec::new());
        }
        // Every shared mapping and every fd of those objects (read-only ones too:
        // they must not keep seeing the template's object).
        for vma in vmas.iter().filter(|v| v.shared && v.is_file()) {
            if let Some(i) = index(&work, vma.object()) {
                work[i].vmas.push(vma.clone());
            }
        }
        for entry in entries
            .iter()
            .filter(|e| e.fd > 2 && e.flags & libc::O_PATH == 0)
        {
            if !matches!(entry.kind, FdKind::File { .. }) {
                continue;
            }
            let key = match fd_object(pid, entry.fd) {
                Ok(key) => key,
                // Closed by the fd re-targeting.
                Err(RemoteError::Proc { source, .. })
                    if source.kind() == io::ErrorKind::NotFound =>
                {
                    continue
                }
                Err(e) => return Err(e),
            };
            if let Some(i) = index(&work, key) {
                work[i].fds.push(entry.clone());
            }
        }
        let mut done = Vec::with_capacity(work.len());
        for item in work {
            done.push(self.replace(g, scratch, template_pid, item)?);
        }
        Ok(done)
    }

    /// Map the shared mappings `vmas` of `source_pid` (a template process) into
    /// `x` at the same ranges, on the clone's objects for their template objects
    /// (made now, with the contents copied from `source_pid`'s, if the clone has
    /// none yet). Used by the rebuild engine for mappings `x` lacks.
    pub(crate) fn map_from(
        &mut self,
        x: &mut Tracee,
        scratch: &mut Scratch,
        source_pid: i32,
        template_pid: i32,
        vmas: &[Vma],
    ) -> Result<Vec<SharedCopy>> {
        let mut work: Vec<Work> = Vec::new();
        for vma in vmas.iter().filter(|v| v.shared && v.is_file()) {
            match work.iter_mut().find(|w| w.key == vma.object()) {
                Some(w) => w.vmas.push(vma.clone()),
                None => work.push(Work {
                    key: vma.object(),
                    source_pid,
                    kind: kind_of_mapping(vma),
                    source: Source::Mapping(vma.range_name()),
                    vmas: vec![vma.clone()],
                    fds: Vec::new(),
                }),
            }
        }
        let mut done = Vec::with_capacity(work.len());
        for item in work {
            done.push(self.replace(x, scratch, template_pid, item)?);
        }
        Ok(done)
    }

    fn replace(
        &mut self,
        g: &mut Tracee,
        scratch: &mut Scratch,
        template_pid: i32,
        item: Work,
    ) -> Result<SharedCopy> {
        if let SharedKind::SysV { key, shmid } = item.kind {
            return self.replace_sysv(g, template_pid, item, key, shmid);
        }
        let pid = g.pid();
        let mut bytes_copied = 0;
        let gfd = match self.objects.get(&item.key) {
            Some(obj) => {
                let fd = obj.fd.as_ref().ok_or_else(|| {
                    RemoteError::Plan("a System V key reused for a file object".into())
                })?;
                install_one(g, scratch, fd.as_fd())?
            }
            None => {
                let source = open_source(item.source_pid, &item.source)?;
                let size = source
                    .metadata()
                    .map_err(|e| sys("fstat (template's shared object)", pid, e))?;
                if !size.file_type().is_file() {
                    return Err(unsupported(
                        pid,
                        &item,
                        "it is not a regular file (a device?)",
                    ));
                }
                let (mode, size) = (size.mode() & 0o7777, size.len());
                let made = create(g, scratch, &item, mode, size)?;
                if made.needs_copy {
                    bytes_copied = copy_sparse(&source, &made.tracer_fd, size)
                        .map_err(|e| sys("copying the template's shared object", pid, e))?;
                }
                let seals = match item.kind {
                    SharedKind::Memfd(_) => seals_of(&source),
                    _ => 0,
                };
                self.objects.insert(
                    item.key,
                    NewObject {
                        fd: Some(OwnedFd::from(made.tracer_fd)),
                        what: made.what,
                        seals,
                    },
                );
                made.gfd
            }
        };
        let obj = &self.objects[&item.key];
        for vma in &item.vmas {
            let got = g.syscall(
                "mmap",
                || format!("{} over {} ({})", obj.what, vma.range_name(), vma.name),
                libc::SYS_mmap,
                &[
                    vma.start,
                    vma.len(),
                    vma.prot as u64,
                    (libc::MAP_SHARED | libc::MAP_FIXED) as u64,
                    gfd as u64,
                    vma.offset,
                ],
            )?;
            if got != vma.start {
                return Err(unsupported(
                    pid,
                    &item,
                    "mmap did not map at the same address",
                ));
            }
        }
        g.syscall(
            "close",
            || "the clone's shared object".into(),
            libc::SYS_close,
            &[gfd as u64],
        )?;
        let tracer_fd = obj.fd.as_ref().map(|f| f.as_fd());
        if let Some(fd) = tracer_fd {
            install_fds_for(g, scratch, fd, &item.fds)?;
        }
        if obj.seals != 0 {
            if let Some(fd) = tracer_fd {
                // SAFETY: fcntl(F_ADD_SEALS) on an fd we hold; no pointers.
                let rc = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_ADD_SEALS, obj.seals) };
                if rc < 0 {
                    return Err(sys("fcntl(F_ADD_SEALS)", pid, io::Error::last_os_error()));
                }
            }
        }
        Ok(SharedCopy {
            kind: item.kind,
            mappings: item.vmas.len(),
            fds: item.fds.iter().map(|e| e.fd).collect(),
            bytes_copied,
            new_object: obj.what,
        })
    }

    fn replace_sysv(
        &mut self,
        g: &mut Tracee,
        template_pid: i32,
        item: Work,
        key: i32,
        shmid: i32,
    ) -> Result<SharedCopy> {
        let pid = g.pid();
        if self.sysv.is_none() {
            self.sysv = Some(in_ipc_ns(template_pid, read_sysvipc_shm)?);
        }
        let (_, mode, size) = *self
            .sysv
            .as_ref()
            .and_then(|s| s.get(&shmid))
            .ok_or_else(|| {
                unsupported(
                    pid,
                    &item,
                    "the segment is not in the template's IPC namespace",
                )
            })?;
        let attachments = attachments(&item.vmas, size).ok_or_else(|| {
            unsupported(
                pid,
                &item,
                "the segment is attached partly (munmapped in parts)",
            )
        })?;
        let mut bytes_copied = 0;
        let fresh = !self.objects.contains_key(&item.key);
        let source = if fresh {
            Some(open_source(item.source_pid, &item.source)?)
        } else {
            None
        };
        if fresh {
            let next = shmid.to_string();
            in_ipc_ns(pid, move || {
                std::fs::write("/proc/sys/kernel/shm_next_id", next)
            })?;
            let got = g.syscall(
                "shmget",
                || format!("System V segment key {key:#x} id {shmid}"),
                libc::SYS_shmget,
                &[
                    key as u64,
                    size,
                    u64::from(mode & 0o777) | (libc::IPC_CREAT | libc::IPC_EXCL) as u64,
                ],
            )?;
            if got != shmid as u64 {
                return Err(unsupported(
                    pid,
                    &item,
                    &format!("the clone's segment got id {got}, not {shmid}"),
                ));
            }
        }
        for group in &attachments {
            let base = group[0].start;
            let writable = group.iter().any(|v| v.has_flag("mw"));
            let exec = group
                .iter()
                .any(|v| v.has_flag("me") && v.prot & libc::PROT_EXEC != 0);
            let mut flags = libc::SHM_REMAP;
            let mut prot = libc::PROT_READ | libc::PROT_WRITE;
            if !writable {
                flags |= libc::SHM_RDONLY;
                prot = libc::PROT_READ;
            }
            if exec {
                flags |= libc::SHM_EXEC;
                prot |= libc::PROT_EXEC;
            }
            let got = g.syscall(
                "shmat",
                || format!("System V segment {shmid} at {base:#x}"),
                libc::SYS_shmat,
                &[shmid as u64, base, flags as u64],
            )?;
            if got != base {
                return Err(unsupported(
                    pid,
                    &item,
                    "shmat did not attach at the same address",
                ));
            }
            for vma in group.iter().filter(|v| v.prot != prot) {
                g.syscall(
                    "mprotect",
                    || format!("System V segment {shmid} at {:#x}", vma.start),
                    libc::SYS_mprotect,
                    &[vma.start, vma.len(), vma.prot as u64],
                )?;
            }
        }
        if let (Some(source), Some(first)) = (source, attachments.first()) {
            let range = format!("{:x}-{:x}", first[0].start, first[first.len() - 1].end);
            let dest = open_map_file(pid, &range, true)?;
            bytes_copied = copy_sparse(&source, &dest, size)
                .map_err(|e| sys("copying the template's System V segment", pid, e))?;
            if mode & SHM_DEST != 0 {
                g.syscall(
                    "shmctl(IPC_RMID)",
                    || format!("System V segment {shmid}, removed in the template"),
                    libc::SYS_shmctl,
                    &[shmid as u64, libc::IPC_RMID as u64, 0],
                )?;
            }
            self.objects.insert(
                item.key,
                NewObject {
                    fd: None,
                    what: "sysv",
                    seals: 0,
                },
            );
        }
        Ok(SharedCopy {
            kind: item.kind,
            mappings: item.vmas.len(),
            fds: Vec::new(),
            bytes_copied,
            new_object: "sysv",
        })
    }
}

/// The attachments of a segment: runs of adjacent VMAs with consecutive offsets
/// from 0 covering the whole (page-rounded) segment; `None` if some VMA is not in
/// such a run.
fn attachments(vmas: &[Vma], size: u64) -> Option<Vec<Vec<Vma>>> {
    let full = size.next_multiple_of(PAGE);
    let mut sorted = vmas.to_vec();
    sorted.sort_by_key(|v| v.start);
    let mut out: Vec<Vec<Vma>> = Vec::new();
    for vma in sorted {
        match out.last_mut() {
            Some(run)
                if run
                    .last()
                    .is_some_and(|l| l.end == vma.start && l.offset + l.len() == vma.offset) =>
            {
                run.push(vma)
            }
            _ => {
                if vma.offset != 0 {
                    return None;
                }
                out.push(vec![vma])
            }
        }
    }
    out.iter()
        .all(|run| run.last().is_some_and(|l| l.offset + l.len() == full))
        .then_some(out)
}

fn sys(op: &'static str, pid: i32, source: io::Error) -> RemoteError {
    RemoteError::Sys { op, pid, source }
}

fn unsupported(pid: i32, item: &Work, reason: &str) -> RemoteError {
    let (range, name) = match (&item.source, item.vmas.first()) {
        (_, Some(v)) => (v.range_name(), v.name.clone()),
        (Source::Fd(fd), None) => (format!("fd {fd}"), format!("{:?}", item.kind)),
        (Source::Mapping(r), None) => (r.clone(), format!("{:?}", item.kind)),
    };
    RemoteError::UnsupportedMapping {
        pid,
        range,
        name,
        reason: reason.to_string(),
    }
}

fn open_map_file(pid: i32, range: &str, write: bool) -> Result<File> {
    let path = proc_path(pid, &format!("map_files/{range}"));
    OpenOptions::new()
        .read(true)
        .write(write)
        .open(&path)
        .map_err(proc_err(path))
}

fn open_source(pid: i32, source: &Source) -> Result<File> {
    match source {
        Source::Mapping(range) => open_map_file(pid, range, false),
        Source::Fd(fd) => {
            let path = proc_path(pid, &format!("fd/{fd}"));
            File::open(&path).map_err(proc_err(path))
        }
    }
}

/// A new object made in the clone's process.
struct Made {
    /// Its fd in the process.
    gfd: i32,
    /// The tracer's fd on it.
    tracer_fd: File,
    /// The contents must be copied from the template's object.
    needs_copy: bool,
    what: &'static str,
}

fn memfd_name(name: &str) -> &[u8] {
    let bytes = name.as_bytes();
    &bytes[..bytes.len().min(MEMFD_NAME_MAX)]
}

/// Make the clone's object for `item` in `g`.
fn create(
    g: &mut Tracee,
    scratch: &mut Scratch,
    item: &Work,
    mode: u32,
    size: u64,
) -> Result<Made> {
    let pid = g.pid();
    let pidfd = pidfd_open(pid)?;
    let take = |gfd: i32| -> Result<File> { pidfd_getfd(&pidfd, pid, gfd).map(File::from) };
    match &item.kind {
        SharedKind::Anonymous => {
            let len = size.next_multiple_of(PAGE).max(PAGE);
            let addr = g.syscall(
                "mmap",
                || "new shared anonymous memory".into(),
                libc::SYS_mmap,
                &[
                    0,
                    len,
                    (libc::PROT_READ | libc::PROT_WRITE) as u64,
                    (libc::MAP_SHARED | libc::MAP_ANONYMOUS) as u64,
                    u64::MAX,
                    0,
                ],
            )?;
            let opened = open_map_file(pid, &format!("{addr:x}-{:x}", addr + len), true);
            g.syscall(
                "munmap",
                || "new shared anonymous memory (the tracer holds it)".into(),
                libc::SYS_munmap,
                &[addr, len],
            )?;
            let tracer_fd = opened?;
            let gfd = install_one(g, scratch, tracer_fd.as_fd())?;
            Ok(Made {
                gfd,
                tracer_fd,
                needs_copy: true,
                what: "anonymous",
            })
        }
        SharedKind::Memfd(name) | SharedKind::DeletedFile(name) => {
            let gfd = memfd(g, scratch, name, size)?;
            Ok(Made {
                gfd,
                tracer_fd: take(gfd)?,
                needs_copy: true,
                what: "memfd",
            })
        }
        SharedKind::File(path) => {
            scratch.reset();
            let addr = scratch.put_path(g, path.as_bytes())?;
            let flags = libc::O_RDWR | libc::O_CLOEXEC | libc::O_NOCTTY;
            let created = g.inject_syscall(
                libc::SYS_openat,
                &[
                    libc::AT_FDCWD as u64,
                    addr,
                    (flags | libc::O_CREAT | libc::O_EXCL) as u64,
                    u64::from(mode),
                ],
            )?;
            let (gfd, fresh) = if created >= 0 {
                (created as i32, true)
            } else if created == -i64::from(libc::EEXIST) {
                let fd = g.syscall(
                    "openat",
                    || format!("{path} in the clone's root"),
                    libc::SYS_openat,
                    &[libc::AT_FDCWD as u64, addr, flags as u64, 0],
                )?;
                (fd as i32, false)
            } else {
                return Err(RemoteError::Injected {
                    syscall: "openat",
                    pid,
                    context: format!("{path} in the clone's root"),
                    source: io::Error::from_raw_os_error(-created as i32),
                });
            };
            let tracer_fd = take(gfd)?;
            let meta = tracer_fd
                .metadata()
                .map_err(|e| sys("fstat (the clone's file)", pid, e))?;
            if (meta.dev(), meta.ino()) == item.key {
                // The path leads to the template's own object (a tmpfs or volume
                // shared with it): the clone gets a memfd instead.
                drop(tracer_fd);
                g.syscall("close", String::new, libc::SYS_close, &[gfd as u64])?;
                let gfd = memfd(g, scratch, path, size)?;
                return Ok(Made {
                    gfd,
                    tracer_fd: take(gfd)?,
                    needs_copy: true,
                    what: "memfd",
                });
            }
            if fresh {
                tracer_fd
                    .set_permissions(std::fs::Permissions::from_mode(mode))
                    .map_err(|e| sys("fchmod (the clone's file)", pid, e))?;
                tracer_fd
                    .set_len(size)
                    .map_err(|e| sys("ftruncate (the clone's file)", pid, e))?;
            }
            Ok(Made {
                gfd,
                tracer_fd,
                // An existing path is the overlay's copy-up of the template's file.
                needs_copy: fresh,
                what: "file",
            })
        }
        SharedKind::SysV { .. } => Err(RemoteError::Plan(
            "System V segments are attached, not created as files".into(),
        )),
    }
}

/// `memfd_create(name, MFD_CLOEXEC | MFD_ALLOW_SEALING)` + `ftruncate(size)` in `g`.
fn memfd(g: &mut Tracee, scratch: &mut Scratch, name: &str, size: u64) -> Result<i32> {
    scratch.reset();
    let addr = scratch.put_path(g, memfd_name(name))?;
    let fd = g.syscall(
        "memfd_create",
        || format!("copy of {name}"),
        libc::SYS_memfd_create,
        &[addr, u64::from(libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)],
    )? as i32;
    g.syscall(
        "ftruncate",
        || format!("copy of {name} to {size} bytes"),
        libc::SYS_ftruncate,
        &[fd as u64, size],
    )?;
    Ok(fd)
}

/// The seals of a memfd (`F_GET_SEALS`; 0 for other files).
fn seals_of(file: &File) -> i32 {
    // SAFETY: fcntl(F_GET_SEALS) on an fd we own; no pointers.
    unsafe { libc::fcntl(file.as_raw_fd(), libc::F_GET_SEALS) }.max(0)
}

/// Install one tracer fd in `g`; its number there.
fn install_one(g: &mut Tracee, scratch: &mut Scratch, fd: BorrowedFd<'_>) -> Result<i32> {
    let got = install_fds_with(g, scratch, &[fd])?;
    got.first()
        .copied()
        .ok_or_else(|| RemoteError::Plan("no fd installed".into()))
}

/// Give each of `entries` (fds of `g`) a new open file description of the object
/// `object` holds, with the entry's access mode, status flags, close-on-exec flag
/// and offset.
fn install_fds_for(
    g: &mut Tracee,
    scratch: &mut Scratch,
    object: BorrowedFd<'_>,
    entries: &[FdEntry],
) -> Result<()> {
    if entries.is_empty() {
        return Ok(());
    }
    let pid = g.pid();
    let via = format!("/proc/self/fd/{}", object.as_raw_fd());
    let keep = libc::O_APPEND | libc::O_NONBLOCK | libc::O_NOATIME | libc::O_SYNC | libc::O_DSYNC;
    let mut opened = Vec::with_capacity(entries.len());
    for entry in entries {
        let acc = entry.flags & libc::O_ACCMODE;
        let file = OpenOptions::new()
            .read(acc != libc::O_WRONLY)
            .write(acc != libc::O_RDONLY)
            .custom_flags(entry.flags & keep)
            .open(&via)
            .map_err(|e| sys("reopening the clone's shared object", pid, e))?;
        opened.push(OwnedFd::from(file));
    }
    for (chunk, fds) in entries
        .chunks(crate::fdtransfer::MAX_FDS)
        .zip(opened.chunks(crate::fdtransfer::MAX_FDS))
    {
        let borrowed: Vec<BorrowedFd<'_>> = fds.iter().map(|f| f.as_fd()).collect();
        let installed = install_fds_with(g, scratch, &borrowed)?;
        for (entry, tmp) in chunk.iter().zip(installed) {
            let ctx = || format!("fd {} on the clone's copy of {}", entry.fd, entry.target);
            let cloexec = (entry.flags & libc::O_CLOEXEC) as u64;
            g.syscall(
                "dup3",
                ctx,
                libc::SYS_dup3,
                &[tmp as u64, entry.fd as u64, cloexec],
            )?;
            g.syscall("close", ctx, libc::SYS_close, &[tmp as u64])?;
            g.syscall(
                "lseek",
                ctx,
                libc::SYS_lseek,
                &[entry.fd as u64, entry.pos, libc::SEEK_SET as u64],
            )?;
        }
    }
    Ok(())
}

/// `lseek(fd, offset, whence)`; `None` for ENXIO (no more data).
fn seek(file: &File, offset: u64, whence: i32) -> io::Result<Option<u64>> {
    // SAFETY: lseek on an fd we own; no pointers.
    let rc = unsafe { libc::lseek(file.as_raw_fd(), offset as libc::off_t, whence) };
    if rc < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENXIO) {
            Ok(None)
        } else {
            Err(e)
        };
    }
    Ok(Some(rc as u64))
}

/// Copy the data ranges of `source` (`SEEK_DATA`/`SEEK_HOLE`) below `size` into
/// `dest` at the same offsets, skipping pages that are all zero (the new object
/// reads them as zero without holding memory for them). Returns the bytes
/// written.
pub(crate) fn copy_sparse(source: &File, dest: &File, size: u64) -> io::Result<u64> {
    const CHUNK: usize = 1 << 20;
    let mut buf = vec![0u8; CHUNK];
    let mut pos = 0;
    let mut written = 0;
    while pos < size {
        let Some(data) = seek(source, pos, libc::SEEK_DATA)? else {
            break;
        };
        if data >= size {
            break;
        }
        let hole = seek(source, data, libc::SEEK_HOLE)?
            .unwrap_or(size)
            .min(size);
        let mut off = data;
        while off < hole {
            let n = ((hole - off) as usize).min(CHUNK);
            source.read_exact_at(&mut buf[..n], off)?;
            for (i, page) in buf[..n].chunks(PAGE as usize).enumerate() {
                if page.iter().any(|b| *b != 0) {
                    dest.write_all_at(page, off + (i as u64) * PAGE)?;
                    written += page.len() as u64;
                }
            }
            off += n as u64;
        }
        pos = hole;
    }
    Ok(written)
}

/// Run `f` on a thread of ours that has joined `pid`'s IPC namespace (the
/// System V tables and `/proc/sys/kernel/shm*` are those of the caller's IPC
/// namespace).
fn in_ipc_ns<T: Send>(pid: i32, f: impl FnOnce() -> io::Result<T> + Send) -> Result<T> {
    let path = proc_path(pid, "ns/ipc");
    let ns = File::open(&path).map_err(proc_err(path))?;
    let joined = std::thread::scope(|s| {
        s.spawn(move || {
            // SAFETY: setns on this thread only, with an fd we own.
            if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWIPC) } != 0 {
                return Err(io::Error::last_os_error());
            }
            f()
        })
        .join()
    });
    match joined {
        Ok(result) => {
            result.map_err(|e| sys("System V shared memory in the IPC namespace", pid, e))
        }
        Err(_) => Err(RemoteError::Plan(
            "the IPC namespace thread panicked".into(),
        )),
    }
}

/// `/proc/sysvipc/shm` of the caller's IPC namespace: id -> (key, mode, size).
fn read_sysvipc_shm() -> io::Result<HashMap<i32, (i32, u32, u64)>> {
    let text = std::fs::read_to_string("/proc/sysvipc/shm")?;
    let mut out = HashMap::new();
    for line in text.lines().skip(1) {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 4 {
            continue;
        }
        let (Ok(key), Ok(id), Ok(mode), Ok(size)) = (
            f[0].parse::<i64>(),
            f[1].parse::<i32>(),
            u32::from_str_radix(f[2], 8),
            f[3].parse::<u64>(),
        ) else {
            continue;
        };
        out.insert(id, (key as i32, mode, size));
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vma(start: u64, end: u64, offset: u64) -> Vma {
        Vma {
            start,
            end,
            prot: libc::PROT_READ,
            shared: true,
            offset,
            dev: 1,
            ino: 7,
            name: "/SYSV00000001 (deleted)".into(),
            flags: Vec::new(),
            rss_kb: 0,
            private_dirty_kb: 0,
            swap_kb: 0,
        }
    }

    #[test]
    fn attachments_need_whole_segments() {
        let a = vma(0x10000, 0x12000, 0);
        let b = vma(0x12000, 0x13000, 0x2000);
        let c = vma(0x20000, 0x23000, 0);
        let runs = attachments(&[b.clone(), c.clone(), a.clone()], 0x2800).expect("whole");
        assert_eq!(runs.len(), 2);
        assert_eq!(runs[0], vec![a.clone(), b.clone()]);
        assert!(
            attachments(std::slice::from_ref(&a), 0x2800).is_none(),
            "tail missing"
        );
        assert!(attachments(&[b], 0x2800).is_none(), "head missing");
    }

    #[test]
    fn kinds_from_names() {
        let mut v = vma(0, 0x1000, 0);
        assert_eq!(kind_of_mapping(&v), SharedKind::SysV { key: 1, shmid: 7 });
        v.name = "/dev/zero (deleted)".into();
        assert_eq!(kind_of_mapping(&v), SharedKind::Anonymous);
        v.name = "[anon_shmem:cache]".into();
        assert_eq!(kind_of_mapping(&v), SharedKind::Anonymous);
        v.name = "/memfd:a b (deleted)".into();
        assert_eq!(kind_of_mapping(&v), SharedKind::Memfd("a b".into()));
        v.name = "/tmp/x (deleted)".into();
        assert_eq!(
            kind_of_mapping(&v),
            SharedKind::DeletedFile("/tmp/x".into())
        );
        v.name = "/dev/shm/x".into();
        assert_eq!(kind_of_mapping(&v), SharedKind::File("/dev/shm/x".into()));
    }

    #[test]
    fn sparse_copy_skips_holes_and_zero_pages() {
        let dir = std::env::temp_dir();
        let src_path = dir.join(format!("nbshm-src-{}", std::process::id()));
        let dst_path = dir.join(format!("nbshm-dst-{}", std::process::id()));
        let src = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&src_path)
            .expect("src");
        let dst = OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&dst_path)
            .expect("dst");
        let size = 64 * PAGE;
        src.set_len(size).expect("len");
        dst.set_len(size).expect("len");
        src.write_all_at(b"hello", 3 * PAGE + 10).expect("w");
        src.write_all_at(&[0u8; 4096], 10 * PAGE)
            .expect("zero page");
        src.write_all_at(b"end", size - 3).expect("w");
        let written = copy_sparse(&src, &dst, size).expect("copy");
        assert_eq!(written, 2 * PAGE, "two non-zero pages");
        let mut a = vec![0u8; size as usize];
        let mut b = vec![0u8; size as usize];
        src.read_exact_at(&mut a, 0).expect("r");
        dst.read_exact_at(&mut b, 0).expect("r");
        assert!(a == b);
        let _ = std::fs::remove_file(src_path);
        let _ = std::fs::remove_file(dst_path);
    }
}
