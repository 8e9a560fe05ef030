//! A process as plain data, for checkpoint and restore: [`capture`] reads a
//! stopped process (every thread held) into a [`ProcessImage`] and hands its
//! page contents to a sink; [`restore`] turns a stub process, born in the
//! restored box's namespaces with the image's pid, into that process again.
//!
//! Restore runs the machinery a clone uses, with a page store in place of the
//! live template: the rebuild engine (rebuild.rs) makes the stub's address
//! space the image's, an empty base layout meaning nothing of the stub is kept,
//! pages coming from [`StoredPages`]; the process state, the threads
//! (threads.rs, with their tids), capabilities and fds (the clone fd matrix's
//! rules, retarget.rs) follow as for a clone. What a clone shares with its
//! template by the kernel's fork, a restore makes from the image: read-only
//! files, directories and devices are opened again by path, and the box's
//! seccomp filter (compiled by the caller with the new box's cookie) is
//! installed before the threads are re-created, which inherit it.
//!
//! What an image cannot hold yet is refused at capture, naming the process
//! and what: writable shared memory (memfd, System V, shared anonymous), a
//! mapping of a deleted file, a writable memfd or deleted file open,
//! datagrams buffered in a socket pair of the box, a Unix connection to
//! outside the box, more than one seccomp filter. Bytes buffered in the box's
//! pipes and stream socket pairs are saved and written into the new objects.

use std::collections::HashSet;
use std::fs::File;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::batch::Batch;
use crate::buffered::{copy_pipe, copy_queue, CopyError};
use crate::error::{RemoteError, Result};
use crate::fdinfo::{
    ensure_clonable, inspect_fds, pidfd_getfd, pidfd_open, FdAction, FdEntry, FdKind,
};
use crate::fdtransfer::install_fds_with;
use crate::fork::{
    ensure_all_threads_held, fix_up, read_template, CloneTables, Made, TemplateState,
};
use crate::lazy::{LazyPlan, LazyServer};
use crate::maps::{Pagemap, Vma, PAGE};
use crate::memory::Scratch;
use crate::objects::{object_of, CloneObjects};
use crate::procfs::{proc_path, Status};
use crate::procstate::ProcessState;
use crate::rebuild::{is_special, private_data, rebuild, zero_pfn, Layout, PageAction, PageSource};
use crate::retarget::{box_pidfds, move_onto, own_pidfds, retarget_with};
use crate::shmem::SharedObjects;
use crate::threads::ThreadState;
use crate::tracee::{Tracee, TRACE_OPTIONS};
use crate::tree::{Membership, Origin, Step, INIT_PID, OUTSIDE_PID};
use crate::treefork::{fork_held, mark_box, set_membership};

/// Bump when the image's layout changes: an image of another version is refused.
pub const IMAGE_VERSION: u32 = 1;

/// `seccomp(2)` operation `SECCOMP_SET_MODE_FILTER`.
const SECCOMP_SET_MODE_FILTER: u64 = 1;

/// One process of a box, as a checkpoint keeps it (its page contents are kept
/// apart, by address: see [`capture`]).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct ProcessImage {
    /// Its pid in the box's pid namespace.
    pub ns_pid: i32,
    /// Its parent's pid in the box (1: the box's init; 0, `OUTSIDE_PID`:
    /// outside its pid namespace, for the pid 1 of a namespace saved whole).
    pub parent: i32,
    /// What it does about its session and group once made.
    pub membership: Membership,
    /// Its fds that are the same open file as its parent's fd of the same
    /// number (inherited at fork and still shared): they stay the restored
    /// parent's.
    pub inherited_fds: Vec<i32>,
    /// Its address space: mappings, mm fields, auxiliary vector, executable.
    pub layout: Layout,
    /// Working directory, umask, limits, signal dispositions, name,
    /// credentials.
    pub state: ProcessState,
    /// The main thread.
    pub leader: ThreadState,
    /// The other threads.
    pub threads: Vec<ThreadState>,
    /// Its fds.
    pub fds: Vec<FdEntry>,
    /// `prctl(PR_GET_SECUREBITS)`.
    pub securebits: u64,
    /// User and group ids as its own user namespace sees them.
    pub credentials: Credentials,
    /// Data buffered in the box's pipes and stream socket pairs: (an fd
    /// reading it, the bytes), written into the new object at restore.
    #[serde(default)]
    pub buffered: Vec<(i32, Vec<u8>)>,
}

impl ProcessImage {
    /// Every thread id of the process (in the box's pid namespace).
    pub fn tids(&self) -> impl Iterator<Item = i32> + '_ {
        std::iter::once(self.leader.ns_tid).chain(self.threads.iter().map(|t| t.ns_tid))
    }
}

/// A process's user ids (real, effective, saved, filesystem), group ids (the
/// same four) and supplementary groups, in its own user namespace (an id
/// with no mapping there is `u64::MAX`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Credentials {
    /// `Uid:` of its status.
    pub uid: Vec<u64>,
    /// `Gid:` of its status.
    pub gid: Vec<u64>,
    /// `Groups:` of its status.
    pub groups: Vec<u64>,
}

impl Credentials {
    /// Read `pid`'s ids (shown in the reader's user namespace by `status`)
    /// and map them into its own user namespace (`uid_map`, `gid_map`).
    pub fn read(pid: i32) -> Result<Credentials> {
        let status = Status::read(pid)?;
        let ids = |key: &str| -> Vec<u64> {
            status
                .get(key)
                .unwrap_or("")
                .split_whitespace()
                .filter_map(|w| w.parse().ok())
                .collect()
        };
        let map = |name: &str| -> Result<Vec<(u64, u64, u64)>> {
            let path = proc_path(pid, name);
            let text = crate::procfs::read_to_string(&path)?;
            Ok(text
                .lines()
                .filter_map(|l| {
                    let v: Vec<u64> = l
                        .split_whitespace()
                        .filter_map(|w| w.parse().ok())
                        .collect();
                    (v.len() == 3).then(|| (v[0], v[1], v[2]))
                })
                .collect())
        };
        let inside = |map: &[(u64, u64, u64)], id: u64| {
            map.iter()
                .find(|(_, out, len)| id >= *out && id - out < *len)
                .map_or(u64::MAX, |(ins, out, _)| ins + (id - out))
        };
        let (uids, gids) = (map("uid_map")?, map("gid_map")?);
        Ok(Credentials {
            uid: ids("Uid").into_iter().map(|i| inside(&uids, i)).collect(),
            gid: ids("Gid").into_iter().map(|i| inside(&gids, i)).collect(),
            groups: ids("Groups")
                .into_iter()
                .map(|i| inside(&gids, i))
                .collect(),
        })
    }
}

/// Pages of a restored process, by address: what an image has contents for.
pub trait PageStore {
    /// The content digest of the page the image holds at `addr`
    /// (page-aligned), if it holds one; a page it does not hold is zero in
    /// anonymous memory and the file's in a private file mapping.
    fn id(&self, addr: u64) -> Option<[u8; 32]>;
    /// Read the page at `addr` into `buf` (one page), checked against its
    /// content hash.
    fn read_page(&self, addr: u64, buf: &mut [u8]) -> std::io::Result<()>;
    /// Every address the image holds a page at, sorted (what a lazy restore
    /// puts in: found without walking the mappings page by page, which may
    /// reserve gigabytes they never touch).
    fn held(&self) -> Vec<u64>;
}

/// A [`PageSource`] over a [`PageStore`], for the rebuild engine: the
/// target's pages, and (for a process forked from its restored parent) the
/// parent's, which X has where it kept the parent's mappings: a page both
/// hold with the same contents is kept.
struct StoredPages<'a> {
    target: &'a dyn PageStore,
    base: Option<&'a dyn PageStore>,
    /// New private anonymous mappings are left empty, for a lazy restore
    /// (lazy.rs) to fill.
    lazy: bool,
}

impl PageSource for StoredPages<'_> {
    fn page_actions(&self, vma: &Vma, kept: bool) -> Result<Vec<PageAction>> {
        Ok((vma.start..vma.end)
            .step_by(PAGE as usize)
            .map(|addr| {
                let base = self.base.filter(|_| kept).and_then(|b| b.id(addr));
                match (self.target.id(addr), base) {
                    (Some(t), Some(b)) if t == b => PageAction::Keep,
                    (Some(_), _) => PageAction::Write,
                    (None, Some(_)) => PageAction::Drop,
                    (None, None) => PageAction::Keep,
                }
            })
            .collect())
    }

    fn read(&self, addr: u64, buf: &mut [u8]) -> Result<()> {
        for (i, page) in buf.chunks_mut(PAGE as usize).enumerate() {
            let at = addr + i as u64 * PAGE;
            if self.target.id(at).is_some() {
                self.target
                    .read_page(at, page)
                    .map_err(|source| RemoteError::Image {
                        what: format!("page {at:#x}"),
                        source,
                    })?;
            } else {
                page.fill(0);
            }
        }
        Ok(())
    }

    fn defer(&self, _vma: &Vma) -> bool {
        self.lazy
    }
}

/// Where [`capture_box`] puts pages: (pid in the box, address, contents).
pub type PageSink<'a> = dyn FnMut(i32, u64, PageData<'_>) -> std::io::Result<()> + 'a;

/// A page [`capture_box`] gives its sink.
#[derive(Debug, Clone, Copy)]
pub enum PageData<'a> {
    /// Its contents (never all zero for anonymous memory).
    Bytes(&'a [u8]),
    /// A page the caller said is unchanged since it last read it (see
    /// [`capture_box_incremental`]): not read again.
    Unchanged,
}

/// What [`read_own_pages`] does with a page of a mapping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Select {
    /// Read it (when the process has its own contents there).
    Read,
    /// Report it as [`PageData::Unchanged`] (when the process has its own
    /// contents there) without reading it.
    Unchanged,
    /// Leave it out.
    Skip,
}

/// Read the stopped processes of a box (`tracees`, each seized with every
/// thread by [`Tracee::seize_and_interrupt`] and waited for, in the order of
/// `steps` from [`crate::tree::plan`]) into images. Every page of their
/// private memory that is their own (anonymous, or a private copy of a
/// file's page) and not zero is given to `sink` with the process's pid in
/// the box and the page's address. The processes are left stopped, their
/// registers intact.
///
/// # Errors
/// What the image cannot hold (see the module documentation), or a failed
/// read of `/proc` or of a process's memory; `sink`'s error as
/// [`RemoteError::Image`].
pub fn capture_box(
    tracees: &mut [Tracee],
    steps: &[Step],
    sink: &mut PageSink<'_>,
) -> Result<Vec<ProcessImage>> {
    capture_box_incremental(tracees, steps, &|_, _| false, sink)
}

/// [`capture_box`], where a private page for which `unchanged(host pid,
/// address)` holds is not read but given to `sink` as
/// [`PageData::Unchanged`] (the last stop of a pre-copied migration: the
/// caller has its contents from an earlier round and knows, from
/// [`crate::DirtyTracker`], that it was not written since).
///
/// # Errors
/// As [`capture_box`].
pub fn capture_box_incremental(
    tracees: &mut [Tracee],
    steps: &[Step],
    unchanged: &dyn Fn(i32, u64) -> bool,
    sink: &mut PageSink<'_>,
) -> Result<Vec<ProcessImage>> {
    if tracees.len() != steps.len() || steps.is_empty() {
        return Err(RemoteError::Plan(format!(
            "{} processes for {} steps of the tree",
            tracees.len(),
            steps.len()
        )));
    }
    let host_pids: Vec<i32> = tracees.iter().map(Tracee::pid).collect();
    let mut inventories = host_pids
        .iter()
        .map(|p| inspect_fds(*p))
        .collect::<Result<Vec<_>>>()?;
    mark_box(&mut inventories, &host_pids);
    let host_of: std::collections::BTreeMap<i32, i32> = steps
        .iter()
        .map(|s| (s.process.pid, s.process.host_pid))
        .collect();
    let mut seen = HashSet::new();
    let mut images: Vec<ProcessImage> = Vec::with_capacity(steps.len());
    for ((tracee, step), fds) in tracees.iter_mut().zip(steps).zip(inventories) {
        let pid = tracee.pid();
        // A process made from outside keeps its parent's pid as its tree
        // has it: INIT_PID in a box, OUTSIDE_PID for a pid namespace's pid 1.
        let parent = match step.origin {
            Origin::RemoteFork => step.process.ppid,
            Origin::ForkedBy(p) => p,
        };
        let inherited_fds: Vec<i32> = match step.origin {
            Origin::RemoteFork => Vec::new(),
            Origin::ForkedBy(p) => fds
                .iter()
                .filter(|e| e.fd > 2 || e.not_box_stdio)
                .filter(|e| {
                    nestbox_sys::process::same_open_file(host_of[&p], e.fd, pid, e.fd)
                        .unwrap_or(false)
                })
                .map(|e| e.fd)
                .collect(),
        };
        let host_pid = tracee.pid();
        let select = |v: &Vma, addr: u64| {
            if !v.shared && unchanged(host_pid, addr) {
                Select::Unchanged
            } else {
                Select::Read
            }
        };
        let mut image = capture_one(tracee, fds, &mut seen, &select, &mut |addr, page| {
            sink(step.process.pid, addr, page)
        })?;
        if let Some(p) = images.iter().find(|i| i.ns_pid == parent) {
            image.state.check_inherits(pid, &p.state)?;
        }
        image.parent = parent;
        image.membership = step.membership;
        image.inherited_fds = inherited_fds;
        images.push(image);
    }
    Ok(images)
}

/// `Seccomp_filters` of a process's status (0 when the kernel does not say).
fn seccomp_filters(status: &Status) -> u32 {
    status
        .get("Seccomp_filters")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(0)
}

/// One process of [`capture_box`]; `seen`: the connected objects whose
/// buffered data an earlier process saved.
fn capture_one(
    tracee: &mut Tracee,
    fds: Vec<FdEntry>,
    seen: &mut HashSet<(crate::objects::ObjectKey, usize)>,
    select: &dyn Fn(&Vma, u64) -> Select,
    sink: &mut dyn FnMut(u64, PageData<'_>) -> std::io::Result<()>,
) -> Result<ProcessImage> {
    let pid = tracee.pid();
    ensure_all_threads_held(tracee)?;
    let status = Status::read(pid)?;
    let filters = seccomp_filters(&status);
    // Filters this process has too were inherited from the box that holds
    // nestbox (a nest box's: `docs/nesting.md`); a restore made by nestbox
    // there inherits them again, and installs the box's own on top.
    let inherited = Status::read(std::process::id() as i32)
        .map(|s| seccomp_filters(&s))
        .unwrap_or(0);
    if filters > inherited + 1 {
        return Err(RemoteError::Unclonable(format!(
            "process {pid} has {filters} seccomp filters; a checkpoint restores only the box's own{}",
            if inherited > 0 {
                format!(" (over the {inherited} nestbox runs under)")
            } else {
                String::new()
            }
        )));
    }
    let buffered = ensure_restorable(pid, &fds, seen)?;
    let mut layout = Layout::read(pid)?;
    layout.rseq = None;
    ensure_memory_restorable(pid, &layout.vmas)?;
    let template = read_template(tracee, &status)?;
    let state = ProcessState::capture(tracee)?;
    tracee.find_syscall_insn()?;
    let securebits = tracee.syscall(
        "prctl(PR_GET_SECUREBITS)",
        String::new,
        libc::SYS_prctl,
        &[libc::PR_GET_SECUREBITS as u64],
    );
    tracee.restore_regs()?;
    let securebits = securebits?;
    let credentials = Credentials::read(pid)?;
    if credentials.uid.contains(&u64::MAX) || credentials.gid.contains(&u64::MAX) {
        return Err(RemoteError::Unclonable(format!(
            "process {pid} runs with ids its user namespace does not map ({credentials:?})"
        )));
    }
    read_own_pages(pid, &layout.vmas, select, sink)?;
    Ok(ProcessImage {
        ns_pid: template.ns_pid,
        parent: INIT_PID,
        membership: Membership::Inherit,
        inherited_fds: Vec::new(),
        layout,
        state,
        leader: template.leader,
        threads: template.threads,
        fds,
        securebits,
        credentials,
        buffered,
    })
}

/// The fd rules a restore can follow (the clone fd matrix's, less what needs
/// the live template); returns the data buffered in the box's connected
/// objects, by an fd that reads it.
fn ensure_restorable(
    pid: i32,
    fds: &[FdEntry],
    seen: &mut HashSet<(crate::objects::ObjectKey, usize)>,
) -> Result<Vec<(i32, Vec<u8>)>> {
    ensure_clonable(pid, fds)?;
    let pidfd = pidfd_open(pid)?;
    let mut buffered = Vec::new();
    for entry in fds {
        let refuse = |reason: &str| RemoteError::UnsupportedFd {
            pid,
            fd: entry.fd,
            kind: entry.target.clone(),
            reason: format!("{reason} (not in a checkpoint yet)"),
        };
        match (entry.action(), &entry.kind) {
            (FdAction::CopyShared, _) => {
                return Err(refuse("a writable memfd or deleted file"));
            }
            (FdAction::Placeholder, FdKind::Socket(sock)) if sock.domain == libc::AF_UNIX => {
                return Err(refuse("a Unix connection to outside the box"));
            }
            (FdAction::Shared, FdKind::File { deleted: true, .. }) => {
                return Err(refuse("a deleted file"));
            }
            (FdAction::Shared, FdKind::Pipe | FdKind::Socket(_) | FdKind::Other) => {
                return Err(refuse("an object shared with the template"));
            }
            (FdAction::Pair, _) => {
                let dup = pidfd_getfd(&pidfd, pid, entry.fd)?;
                let mut queued: libc::c_int = 0;
                // SAFETY: FIONREAD writes one int to the live local `queued`;
                // `dup` is our own open fd.
                let r = unsafe {
                    libc::ioctl(
                        std::os::fd::AsRawFd::as_raw_fd(&dup),
                        libc::FIONREAD,
                        &mut queued,
                    )
                };
                // (FIONREAD on a pipe's write end counts the pipe too: its
                // read end, if the box has it, saves the data.)
                let write_end = matches!(entry.kind, FdKind::Pipe)
                    && entry.flags & libc::O_ACCMODE == libc::O_WRONLY;
                if r != 0 || queued == 0 || write_end {
                    continue;
                }
                let Some(end) = object_of(entry) else {
                    continue;
                };
                if !seen.insert(end) {
                    continue;
                }
                let data = match &entry.kind {
                    FdKind::Pipe => read_pipe_queue(&dup),
                    FdKind::Socket(sock) if sock.sock_type == libc::SOCK_STREAM => {
                        read_stream_queue(&dup)
                    }
                    _ => {
                        return Err(refuse(&format!(
                            "{queued} bytes of datagrams buffered in it"
                        )))
                    }
                }
                .map_err(|source| RemoteError::Sys {
                    op: "reading the data buffered in a pipe or socket pair",
                    pid,
                    source,
                })?;
                buffered.push((entry.fd, data));
            }
            _ => {}
        }
    }
    Ok(buffered)
}

/// Everything buffered in the pipe behind the read end `from`, left in it
/// (`tee` into a pipe of ours, read back from there).
fn read_pipe_queue(from: &OwnedFd) -> std::io::Result<Vec<u8>> {
    let (r, w) = nix::unistd::pipe2(nix::fcntl::OFlag::O_CLOEXEC | nix::fcntl::OFlag::O_NONBLOCK)
        .map_err(std::io::Error::from)?;
    copy_pipe(from, &w)?;
    drop(w);
    read_all(&r)
}

/// Everything queued for reading on the stream socket `from`, left in it
/// (peeked and sent into a socket pair of ours, read back from there).
fn read_stream_queue(from: &OwnedFd) -> std::io::Result<Vec<u8>> {
    use nix::sys::socket::{socketpair, AddressFamily, SockFlag, SockType};
    let (a, b) = socketpair(
        AddressFamily::Unix,
        SockType::Stream,
        None,
        SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
    )
    .map_err(std::io::Error::from)?;
    copy_queue(from, libc::SOCK_STREAM, &a).map_err(|e| match e {
        CopyError::Io(_, source) => source,
        other => std::io::Error::other(format!("{other:?}")),
    })?;
    drop(a);
    read_all(&b)
}

/// Read a non-blocking fd until it has nothing more.
fn read_all(fd: &OwnedFd) -> std::io::Result<Vec<u8>> {
    let mut out = Vec::new();
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        match nix::unistd::read(std::os::fd::AsRawFd::as_raw_fd(fd), &mut buf) {
            Ok(0) => return Ok(out),
            Ok(n) => out.extend_from_slice(&buf[..n]),
            Err(nix::errno::Errno::EAGAIN) => return Ok(out),
            Err(nix::errno::Errno::EINTR) => continue,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Refuse process `pid` while a lazy restore's page server still fills it:
/// a mapping of `vmas` (from smaps) registered for missing pages (`um`) would
/// read as zeros where a page is not in yet.
fn refuse_lazy_fill(pid: i32, vmas: &[Vma]) -> Result<()> {
    match vmas.iter().find(|v| !is_special(v) && v.has_flag("um")) {
        Some(v) => Err(RemoteError::UnsupportedMapping {
            pid,
            range: v.range_name(),
            name: v.name.clone(),
            reason: "a lazy restore's page server is still filling it: try again once it has ended"
                .into(),
        }),
        None => Ok(()),
    }
}

/// [`refuse_lazy_fill`] for a running process, before it is frozen or
/// stopped: a checkpoint of a box still being filled is refused at once
/// (frozen, a process waiting in a fault for a slow page server could hold
/// the freeze up). Advisory: the fill may end meanwhile (the check made
/// once the process is stopped is the one that counts).
pub fn ensure_not_lazily_filled(pid: i32) -> Result<()> {
    match crate::maps::read_smaps(pid) {
        Ok(vmas) => refuse_lazy_fill(pid, &vmas),
        // Gone meanwhile: the checkpoint finds out and says so.
        Err(_) => Ok(()),
    }
}

/// The mappings a restore can make: private ones of files that exist,
/// shared ones of files that exist (mapped again by path), and shared memory
/// of the box's own (shared anonymous memory, memfds, deleted files: its
/// contents are saved and put in a new object).
fn ensure_memory_restorable(pid: i32, vmas: &[Vma]) -> Result<()> {
    refuse_lazy_fill(pid, vmas)?;
    for v in vmas.iter().filter(|v| !is_special(v)) {
        let reason = if v.shared && v.name.starts_with("/SYSV") {
            Some("a System V shared memory segment")
        } else if v.shared && !v.is_file() {
            Some("shared memory without an object")
        } else if v.shared && v.path().starts_with("/dev/") && v.path() != "/dev/zero" {
            Some("a device mapping")
        } else if !v.shared && v.is_file() && v.deleted() {
            Some("a private mapping of a deleted file")
        } else {
            None
        };
        if let Some(reason) = reason {
            return Err(RemoteError::UnsupportedMapping {
                pid,
                range: v.range_name(),
                name: v.name.clone(),
                reason: format!("{reason} (not in a checkpoint yet)"),
            });
        }
    }
    Ok(())
}

/// Give `sink` every page of the private mappings that is the process's own
/// and not zero, and every page of its shared memory of its own (shared
/// anonymous, memfd, deleted files) that is not zero, in address order, as
/// `select` says for each (a page it reads is given as
/// [`PageData::Bytes`]; zero pages of anonymous memory are left out).
///
/// # Errors
/// A failed read of the pagemap or of the memory (a mapping removed while
/// a running process is read), or `sink`'s error as [`RemoteError::Image`].
pub(crate) fn read_own_pages(
    pid: i32,
    vmas: &[Vma],
    select: &dyn Fn(&Vma, u64) -> Select,
    sink: &mut dyn FnMut(u64, PageData<'_>) -> std::io::Result<()>,
) -> Result<()> {
    let pagemap = Pagemap::open(pid)?;
    let mem_path = proc_path(pid, "mem");
    let mem = File::open(&mem_path).map_err(|source| RemoteError::Proc {
        path: mem_path,
        source,
    })?;
    let zero = zero_pfn().unwrap_or(0);
    let mut buf = Vec::new();
    let saved = |v: &&Vma| !is_special(v) && (!v.shared || v.deleted());
    let image_err = |at: u64, source| RemoteError::Image {
        what: format!("page {at:#x} of process {pid}"),
        source,
    };
    for v in vmas.iter().filter(saved) {
        let entries = pagemap.range(v.start, v.end)?;
        // Shared memory: every page (one this process has not touched may
        // hold what another wrote); zero ones are skipped below.
        let own = |i: usize| {
            let e = entries[i];
            v.shared || (private_data(e) && !(e.present() && zero != 0 && e.pfn() == zero))
        };
        let choice = |i: usize| {
            if own(i) {
                select(v, v.start + i as u64 * PAGE)
            } else {
                Select::Skip
            }
        };
        let mut i = 0;
        while i < entries.len() {
            match choice(i) {
                Select::Skip => {
                    i += 1;
                    continue;
                }
                Select::Unchanged => {
                    let at = v.start + i as u64 * PAGE;
                    sink(at, PageData::Unchanged).map_err(|e| image_err(at, e))?;
                    i += 1;
                    continue;
                }
                Select::Read => {}
            }
            let mut j = i + 1;
            while j < entries.len() && choice(j) == Select::Read && j - i < 256 {
                j += 1;
            }
            let start = v.start + i as u64 * PAGE;
            buf.resize((j - i) * PAGE as usize, 0);
            mem.read_exact_at(&mut buf, start)
                .map_err(|source| RemoteError::Sys {
                    op: "reading the process's memory (/proc/PID/mem)",
                    pid,
                    source,
                })?;
            for (k, page) in buf.chunks(PAGE as usize).enumerate() {
                // A zero page of anonymous or new shared memory is what a
                // restore maps anyway; over a file it hides the file's contents.
                if (!v.is_file() || v.shared) && page.iter().all(|b| *b == 0) {
                    continue;
                }
                let at = start + k as u64 * PAGE;
                sink(at, PageData::Bytes(page)).map_err(|e| image_err(at, e))?;
            }
            i = j;
        }
    }
    Ok(())
}

/// What [`restore_box`] needs besides the images.
#[derive(Debug)]
pub struct RestorePlan<'a> {
    /// The restored box's stdin, stdout, stderr (for the images' fds 0–2).
    pub stdio: [BorrowedFd<'a>; 3],
    /// The new box's setns/clone3 cookie (its seccomp filter checks it).
    pub setns_cookie: [u64; 2],
    /// The box's seccomp filter (`struct sock_filter` array), installed when
    /// the image's process had one.
    pub seccomp: Option<Vec<u8>>,
    /// Restore lazily (lazy.rs): the process runs before its private
    /// anonymous memory is filled. Only a box of one process is restored so;
    /// any other is filled at once.
    pub lazy: Option<LazyPlan>,
    /// Suspend the restored processes' seccomp filter while they are made
    /// (`PTRACE_O_SUSPEND_SECCOMP` on every tracee, cleared at release): for
    /// a filter that does not let the restore's injected calls through
    /// (an OCI config's, which knows no setns/clone3 cookie and may refuse
    /// `clone3`, `mmap` of a kind, `prctl`…). nestbox's own box filter
    /// needs no suspension.
    pub suspend_seccomp: bool,
}

/// Make a box's processes from their images (in the order
/// [`capture_box`] gave them: every parent before its children) and let
/// them run. A process whose parent is the box's init (or, for a pid
/// namespace saved whole, its pid 1, whose parent is outside) is made from
/// its stub in `stubs` ((pid in the box, host pid): born in the restored
/// box's namespaces and cgroup with that pid, by
/// `nestbox_sys::process::spawn_stub`, or the pid 1 of a new pid namespace
/// set up by the caller);
/// any other is forked by its restored parent (`clone3` with `set_tid`) and
/// made its image's from there, keeping what it shares with its parent.
/// `pages[i]` are the pages of `images[i]`. Every process is held until the
/// whole tree is made, then all are let go, children first. Returns the host
/// pids, in the images' order, and the page server of a lazy restore.
///
/// # Errors
/// A failed call, naming it; a page whose contents do not match their digest
/// (found before any restored process runs). Every process made is killed.
pub fn restore_box(
    stubs: &[(i32, i32)],
    images: &[ProcessImage],
    pages: &[&dyn PageStore],
    plan: &RestorePlan<'_>,
) -> Result<(Vec<i32>, Option<LazyServer>)> {
    if images.is_empty() || images.len() != pages.len() {
        return Err(RemoteError::Plan(format!(
            "{} images with {} page sets",
            images.len(),
            pages.len()
        )));
    }
    let fds: Vec<(i32, &[FdEntry])> = images
        .iter()
        .map(|i| (i.ns_pid, i.fds.as_slice()))
        .collect();
    let buffered: Vec<_> = images
        .iter()
        .flat_map(|image| {
            image.buffered.iter().filter_map(|(fd, data)| {
                let entry = image.fds.iter().find(|e| e.fd == *fd)?;
                let (key, side) = object_of(entry)?;
                Some((key, side, data.clone()))
            })
        })
        .collect();
    let mut tables = CloneTables {
        objects: CloneObjects::plan(&fds).with_data(buffered),
        shared: SharedObjects::default(),
    };
    let mut made: Vec<Made> = Vec::with_capacity(images.len());
    let mut server = None;
    for (i, image) in images.iter().enumerate() {
        // The parent made before it, if it is one of the images (a pid
        // namespace's pid 1 is; a box's init never is).
        let parent_at = images[..i].iter().position(|p| p.ns_pid == image.parent);
        let mut process = if parent_at.is_none() && is_made_outside(image.parent) {
            let stub = stubs
                .iter()
                .find(|(ns, _)| *ns == image.ns_pid)
                .map(|(_, host)| *host)
                .ok_or_else(|| {
                    RemoteError::Plan(format!("no stub for process {}", image.ns_pid))
                })?;
            let lazy = plan.lazy.filter(|_| images.len() == 1);
            let (made, lazy) = restore_root(stub, image, pages[i], plan, lazy, &mut tables)?;
            server = server.or(lazy);
            made
        } else {
            let parent_at = parent_at.ok_or_else(|| {
                RemoteError::Plan(format!(
                    "the parent {} of {} comes after it",
                    image.parent, image.ns_pid
                ))
            })?;
            let parent = Parent {
                made: &mut made[parent_at],
                image: &images[parent_at],
                pages: pages[parent_at],
            };
            restore_child(parent, image, pages[i], plan, &mut tables)?
        };
        set_membership(&mut process, image.membership)?;
        made.push(process);
    }
    for (m, image) in made.iter_mut().zip(images) {
        box_pidfds(&mut m.process, &image.fds)?;
    }
    // The tracer's duplicates of the new objects' ends go before anything
    // runs (see treefork: an end no process holds must already be closed).
    drop(tables);
    let mut pids = Vec::with_capacity(made.len());
    while let Some(m) = made.pop() {
        pids.push(m.release(None)?);
    }
    pids.reverse();
    crate::marks::mark("restore: released");
    Ok((pids, server))
}

/// Whether a process whose parent is `parent` (and not one of the images)
/// is made from a stub: a child of a box's init, or a pid namespace's pid 1.
fn is_made_outside(parent: i32) -> bool {
    parent == INIT_PID || parent == OUTSIDE_PID
}

/// A process whose parent is the box's init (or the pid 1 of a pid
/// namespace of its own), made from its stub.
fn restore_root(
    stub: i32,
    image: &ProcessImage,
    pages: &dyn PageStore,
    plan: &RestorePlan<'_>,
    lazy: Option<LazyPlan>,
    tables: &mut CloneTables,
) -> Result<(Made, Option<LazyServer>)> {
    let mut x = Tracee::seize_and_interrupt(stub)?.owned();
    x.wait_stopped(std::time::Duration::from_secs(2))?;
    if plan.suspend_seccomp {
        // Kept by every later change of options, and by the threads and
        // children it makes (auto-attached with its options, or given them
        // by fork_held).
        x.keep_options(crate::tracee::PTRACE_O_SUSPEND_SECCOMP);
    }
    x.set_options(TRACE_OPTIONS | libc::PTRACE_O_EXITKILL)?;
    crate::marks::mark("restore: stub seized");
    let status = Status::read(stub)?;
    if status.innermost_pid()? != image.ns_pid {
        return Err(RemoteError::Plan(format!(
            "the stub has pid {} in the box, the image's process {}",
            status.innermost_pid()?,
            image.ns_pid
        )));
    }
    let empty = Layout {
        vmas: Vec::new(),
        mm: Default::default(),
        auxv: Vec::new(),
        exe: PathBuf::new(),
        exe_object: (0, 0),
        rseq: None,
    };
    let source = StoredPages {
        target: pages,
        base: None,
        lazy: lazy.is_some(),
    };
    let stats = rebuild(
        &mut x,
        &mut tables.shared,
        &empty,
        &image.layout,
        0,
        &source,
    )?;
    crate::marks::mark("restore: rebuilt");
    let mut server = None;
    if let Some(lazy) = lazy.filter(|_| !stats.deferred.is_empty()) {
        // Before anything else touches the deferred memory (an injected call
        // returning to user space writes the rseq area): faults are served
        // from here on.
        server = crate::lazy::start(
            &mut x,
            &image.layout,
            &stats.deferred,
            pages,
            &source,
            &lazy,
            TRACE_OPTIONS | libc::PTRACE_O_EXITKILL,
        )?;
    }
    crate::marks::mark("restore: lazy server");
    let mut scratch = Scratch::map(&mut x)?;
    image.state.apply(&mut x, &mut scratch)?;
    set_credentials(&mut x, &mut scratch, &image.credentials)?;
    crate::marks::mark("restore: state, credentials");
    let creator = !tables.objects.is_created();
    let fds = restore_fds(
        &mut x,
        &mut scratch,
        image,
        plan,
        &mut tables.objects,
        creator,
    )?;
    crate::marks::mark("restore: fds");
    if image.leader.caps.no_new_privs {
        x.syscall(
            "prctl(PR_SET_NO_NEW_PRIVS)",
            String::new,
            libc::SYS_prctl,
            &[libc::PR_SET_NO_NEW_PRIVS as u64, 1, 0, 0, 0],
        )?;
    }
    if image.leader.caps.seccomp == 2 {
        let program = plan.seccomp.as_deref().ok_or_else(|| {
            RemoteError::Plan(format!(
                "process {} had a seccomp filter and the restored box has none",
                image.ns_pid
            ))
        })?;
        install_filter(&mut x, &mut scratch, program)?;
    }
    crate::marks::mark("restore: seccomp");
    // The stub holds every capability (in the box's user namespace, or as
    // the host's root): the bounding set is narrowed to the image's as after
    // joining a user namespace.
    let held = Held {
        x,
        scratch,
        fds,
        securebits: image.securebits,
        set_caps: true,
    };
    let made = held.with_threads(image, plan.setns_cookie)?;
    crate::marks::mark("restore: threads");
    Ok((made, server))
}

/// A restored process whose memory, state and fds are made: what its
/// threads need.
struct Held {
    x: Tracee,
    scratch: Scratch,
    fds: Vec<crate::retarget::FdOutcome>,
    /// Securebits to set (0: as inherited).
    securebits: u64,
    /// The bounding set and capability sets are to be made the image's (a
    /// process made from a stub; a child of a restored parent has its
    /// parent's, which are the same).
    set_caps: bool,
}

impl Held {
    /// Re-create the image's threads with their state (threads.rs), own
    /// pidfds, and the registers the main thread resumes with: the process,
    /// held until released.
    fn with_threads(self, image: &ProcessImage, cookie: [u64; 2]) -> Result<Made> {
        let Held {
            mut x,
            mut scratch,
            fds,
            securebits,
            set_caps,
        } = self;
        let threads = fix_up(
            &mut x,
            &mut scratch,
            &thread_plan(image),
            securebits,
            set_caps,
            cookie,
        )?;
        own_pidfds(&mut x, &image.fds)?;
        x.set_original(image.leader.resume_regs());
        Ok(Made {
            process: x,
            threads,
            scratch,
            ns_pid: image.ns_pid,
            caps: set_caps.then_some(image.leader.caps),
            fds,
        })
    }
}

/// What a thread re-creation needs of an image.
fn thread_plan(image: &ProcessImage) -> TemplateState {
    TemplateState {
        cwd: image.state.cwd.clone(),
        ns_pid: image.ns_pid,
        leader: image.leader.clone(),
        threads: image.threads.clone(),
        free_floor: 0,
    }
}

/// The restored parent of a process being restored: held, with its image
/// and pages.
struct Parent<'a> {
    made: &'a mut Made,
    image: &'a ProcessImage,
    pages: &'a dyn PageStore,
}

/// A process forked by its restored parent (held), then made its image's:
/// memory (the parent's pages it has unchanged are kept), state, fds (those
/// it shares with its parent stay), threads. Credentials and the seccomp
/// filter are its parent's (checked equal at capture).
fn restore_child(
    parent: Parent<'_>,
    image: &ProcessImage,
    pages: &dyn PageStore,
    plan: &RestorePlan<'_>,
    tables: &mut CloneTables,
) -> Result<Made> {
    let mut x = fork_held(parent.made, image.ns_pid, plan.setns_cookie)?;
    rebuild(
        &mut x,
        &mut tables.shared,
        &parent.image.layout,
        &image.layout,
        0,
        &StoredPages {
            target: pages,
            base: Some(parent.pages),
            lazy: false,
        },
    )?;
    let mut scratch = Scratch::map(&mut x)?;
    image.state.apply(&mut x, &mut scratch)?;
    let fds = child_fds(&mut x, &mut scratch, image, &mut tables.objects)?;
    let held = Held {
        x,
        scratch,
        fds,
        securebits: 0,
        set_caps: parent.made.caps.is_some(),
    };
    held.with_threads(image, plan.setns_cookie)
}

/// The fds of a child forked by its restored parent: the parent's fds it
/// shared in the box stay, the parent's others go, its own are made as a
/// root's are (objects of the box handed over from the table).
fn child_fds(
    x: &mut Tracee,
    scratch: &mut Scratch,
    image: &ProcessImage,
    objects: &mut CloneObjects,
) -> Result<Vec<crate::retarget::FdOutcome>> {
    let have = inspect_fds(x.pid())?;
    let own: Vec<FdEntry> = image
        .fds
        .iter()
        .filter(|e| (e.fd > 2 || e.not_box_stdio) && !image.inherited_fds.contains(&e.fd))
        .cloned()
        .collect();
    let mut batch = Batch::new();
    for e in &have {
        if e.fd > 2 && !image.inherited_fds.contains(&e.fd) {
            batch.push(
                "close",
                format!("fd {} of the parent, not the child's", e.fd),
                libc::SYS_close,
                &[e.fd as u64],
            );
        }
    }
    for e in &own {
        batch.push(
            "dup3",
            format!("holding fd {}", e.fd),
            libc::SYS_dup3,
            &[0, e.fd as u64, libc::O_CLOEXEC as u64],
        );
    }
    scratch.reset();
    batch.run(x, scratch)?;
    let mut outcomes = retarget_with(
        x,
        scratch,
        image.ns_pid,
        &own,
        [0, 1, 2],
        Some((objects, false)),
    )?;
    for entry in &own {
        if entry.action() == FdAction::Shared {
            reopen_shared(x, scratch, entry)?;
        }
    }
    outcomes.sort_by_key(|o| o.fd);
    Ok(outcomes)
}

/// Give the stub the image's user and group ids and supplementary groups
/// (keeping its capabilities, which the rest of the restore needs; the
/// image's sets are put back at release). In a user namespace whose
/// `setgroups` is denied, the groups cannot be set: the stub then keeps the
/// (unmapped) groups it has, as the box's own processes do.
pub(crate) fn set_credentials(
    x: &mut Tracee,
    scratch: &mut Scratch,
    want: &Credentials,
) -> Result<()> {
    let have = Credentials::read(x.pid())?;
    if *want == have {
        return Ok(());
    }
    let (uid, gid) = (&want.uid, &want.gid);
    if uid.len() < 3 || gid.len() < 3 {
        return Err(RemoteError::Plan(
            "the image has no user or group ids".into(),
        ));
    }
    let setgroups_denied = crate::procfs::read_to_string(&proc_path(x.pid(), "setgroups"))
        .is_ok_and(|t| t.trim() == "deny");
    scratch.reset();
    let list: Vec<u8> = want
        .groups
        .iter()
        .flat_map(|g| (*g as u32).to_ne_bytes())
        .collect();
    let list_addr = if list.is_empty() {
        0
    } else {
        scratch.put(x, &list)?
    };
    let mut batch = Batch::new();
    batch.push(
        "prctl(PR_SET_KEEPCAPS)",
        String::new(),
        libc::SYS_prctl,
        &[libc::PR_SET_KEEPCAPS as u64, 1],
    );
    if !setgroups_denied && want.groups != have.groups {
        batch.push(
            "setgroups",
            format!("{:?}", want.groups),
            libc::SYS_setgroups,
            &[want.groups.len() as u64, list_addr],
        );
    }
    batch.push(
        "setresgid",
        format!("{gid:?}"),
        libc::SYS_setresgid,
        &[gid[0], gid[1], gid[2]],
    );
    batch.push(
        "setresuid",
        format!("{uid:?}"),
        libc::SYS_setresuid,
        &[uid[0], uid[1], uid[2]],
    );
    batch.run(x, scratch)?;
    // setresuid cleared the effective set (kept in the permitted one):
    // everything permitted is made effective again for the rest.
    let caps = crate::caps::CapState::read(x.pid())?;
    let full = crate::caps::CapState {
        effective: caps.permitted,
        ..caps
    };
    crate::caps::restore_sets(x, scratch, &full)
}

/// The image's fds in the stub: every number it uses is held first (so that
/// no object is made on a number still to come), then the clone fd matrix's
/// rules run as for a clone (re-created objects, connected objects made anew
/// and empty, placeholders), fds a clone shares with its template are opened
/// again by path, and the box's stdio takes fds 0–2.
fn restore_fds(
    x: &mut Tracee,
    scratch: &mut Scratch,
    image: &ProcessImage,
    plan: &RestorePlan<'_>,
    objects: &mut CloneObjects,
    creator: bool,
) -> Result<Vec<crate::retarget::FdOutcome>> {
    let used: HashSet<i32> = image.fds.iter().map(|e| e.fd).collect();
    x.syscall(
        "close_range",
        || "the stub's own fds".into(),
        libc::SYS_close_range,
        &[3, u64::from(u32::MAX), 0],
    )?;
    let mut batch = Batch::new();
    for fd in used.iter().filter(|fd| **fd > 2) {
        batch.push(
            "dup3",
            format!("holding fd {fd}"),
            libc::SYS_dup3,
            &[0, *fd as u64, libc::O_CLOEXEC as u64],
        );
    }
    scratch.reset();
    batch.run(x, scratch)?;
    let installed = install_fds_with(x, scratch, &plan.stdio)?;
    let stdio = [installed[0], installed[1], installed[2]];
    let outcomes = retarget_with(
        x,
        scratch,
        image.ns_pid,
        &image.fds,
        stdio,
        Some((objects, creator)),
    )?;
    for entry in &image.fds {
        if entry.action() == FdAction::Shared {
            reopen_shared(x, scratch, entry)?;
        }
    }
    let mut close: Vec<i32> = installed.clone();
    close.extend((0..3).filter(|fd| !used.contains(fd)));
    close.extend(
        image
            .fds
            .iter()
            .filter(|e| e.action() == FdAction::Close)
            .map(|e| e.fd),
    );
    let mut batch = Batch::new();
    for fd in close {
        batch.push("close", format!("fd {fd}"), libc::SYS_close, &[fd as u64]);
    }
    scratch.reset();
    batch.run(x, scratch)?;
    Ok(outcomes)
}

/// An fd a clone shares with its template (read-only file, directory,
/// device, `O_PATH`), opened again by path in the restored root with its
/// flags and offset.
fn reopen_shared(x: &mut Tracee, scratch: &mut Scratch, entry: &FdEntry) -> Result<()> {
    let fd = entry.fd;
    let path = entry.target.trim_end_matches(" (deleted)");
    if !path.starts_with('/') {
        return Err(RemoteError::UnsupportedFd {
            pid: x.pid(),
            fd,
            kind: entry.target.clone(),
            reason: "no path to open it again by".into(),
        });
    }
    let keep = libc::O_ACCMODE
        | libc::O_APPEND
        | libc::O_NONBLOCK
        | libc::O_PATH
        | libc::O_DIRECTORY
        | libc::O_NOFOLLOW
        | libc::O_NOATIME
        | libc::O_DIRECT
        | libc::O_SYNC
        | libc::O_DSYNC;
    let flags = if entry.flags & libc::O_PATH != 0 {
        libc::O_PATH | (entry.flags & (libc::O_DIRECTORY | libc::O_NOFOLLOW))
    } else {
        entry.flags & keep
    } | libc::O_CLOEXEC
        | libc::O_NOCTTY;
    scratch.reset();
    let addr = scratch.put_path(x, path.as_bytes())?;
    let tmp = x.syscall(
        "openat",
        || format!("reopening {path} for fd {fd}"),
        libc::SYS_openat,
        &[libc::AT_FDCWD as u64, addr, flags as u64, 0],
    )?;
    if entry.pos != 0 && entry.flags & libc::O_PATH == 0 {
        x.syscall(
            "lseek",
            || format!("fd {fd} to {}", entry.pos),
            libc::SYS_lseek,
            &[tmp, entry.pos, libc::SEEK_SET as u64],
        )?;
    }
    move_onto(x, tmp, entry)
}

/// Install the seccomp filter `program` (`struct sock_filter` array) in `x`'s
/// main thread; threads cloned afterwards inherit it.
fn install_filter(x: &mut Tracee, scratch: &mut Scratch, program: &[u8]) -> Result<()> {
    if program.is_empty() || !program.len().is_multiple_of(8) {
        return Err(RemoteError::Plan(format!(
            "a seccomp program of {} bytes",
            program.len()
        )));
    }
    scratch.reset();
    let filter = scratch.put(x, program)?;
    let mut fprog = Vec::with_capacity(16);
    fprog.extend_from_slice(&((program.len() / 8) as u16).to_ne_bytes());
    fprog.extend_from_slice(&[0u8; 6]);
    fprog.extend_from_slice(&filter.to_ne_bytes());
    let fprog = scratch.put(x, &fprog)?;
    x.syscall(
        "seccomp(SECCOMP_SET_MODE_FILTER)",
        || "the box's filter".into(),
        libc::SYS_seccomp,
        &[SECCOMP_SET_MODE_FILTER, 0, fprog],
    )?;
    Ok(())
}
