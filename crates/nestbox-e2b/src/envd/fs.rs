//! envd's files: `/files` (download; upload as multipart or octet-stream)
//! and the filesystem service (`/filesystem.Filesystem/…`: Stat, ListDir,
//! MakeDir, Move, Remove, and the watchers the SDK polls: CreateWatcher,
//! GetWatcherEvents, RemoveWatcher).
//!
//! The server works on the box's root from the host: every path is opened
//! with `openat2(RESOLVE_IN_ROOT)` below a descriptor of `/proc/PID/root` of
//! the box's init, so `..` and symbolic links (absolute ones included)
//! resolve inside the box as they would for a process there, never to the
//! host; the walk sees the box's own mounts. What is created is given to the
//! sandbox user (mapped through the box's user namespace, if it has one).
//! Paths are relative to that user's home unless absolute.

use std::collections::HashMap;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::MetadataExt;
use std::sync::{Arc, Condvar, Mutex};

use nix::fcntl::{OFlag, OpenHow, ResolveFlag};
use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor};
use nix::sys::stat::{FileStat, Mode, SFlag};
use nix::unistd::{Gid, Uid};
use serde_json::{json, Value};

use crate::envd::connect;
use crate::error::{E2bError, Result};
use crate::http::{Request, Response};
use crate::sandbox::{Sandbox, User};
use crate::Server;

/// A box's root, as a descriptor, and the host ids of the sandbox user.
#[derive(Debug)]
struct BoxFs {
    root: OwnedFd,
    user: User,
    host_uid: u32,
    host_gid: u32,
    passwd: String,
    group: String,
}

impl BoxFs {
    fn open_root(server: &Server, sandbox: &Sandbox, user: Option<&str>) -> Result<Self> {
        let pid = sandbox.root_pid(&server.reg)?;
        let user = sandbox.user(&server.reg, user)?;
        let path = format!("/proc/{pid}/root");
        let root: OwnedFd = File::open(&path)
            .map_err(E2bError::io("open", &path))?
            .into();
        let map = |file: &str, id: u32| -> u32 {
            map_id(
                &std::fs::read_to_string(format!("/proc/{pid}/{file}")).unwrap_or_default(),
                id,
            )
            .unwrap_or(id)
        };
        let read =
            |p: &str| std::fs::read_to_string(format!("/proc/{pid}/root{p}")).unwrap_or_default();
        Ok(BoxFs {
            host_uid: map("uid_map", user.uid),
            host_gid: map("gid_map", user.gid),
            passwd: read("/etc/passwd"),
            group: read("/etc/group"),
            root,
            user,
        })
    }

    /// Open `path` (absolute in the box) with `flags`.
    fn open(&self, path: &str, flags: OFlag, mode: u32) -> Result<OwnedFd> {
        let how = OpenHow::new()
            .flags(flags | OFlag::O_CLOEXEC)
            .mode(Mode::from_bits_truncate(mode))
            .resolve(ResolveFlag::RESOLVE_IN_ROOT | ResolveFlag::RESOLVE_NO_MAGICLINKS);
        let rel = path.trim_start_matches('/');
        let rel = if rel.is_empty() { "." } else { rel };
        let fd = nix::fcntl::openat2(self.root.as_raw_fd(), rel, how)
            .map_err(|e| io_err("open", path, e))?;
        // SAFETY: openat2 returned a new descriptor that nothing else owns.
        Ok(unsafe { OwnedFd::from_raw_fd(fd) })
    }

    /// The directory holding `path` and its last component.
    fn parent(&self, path: &str) -> Result<(OwnedFd, String)> {
        let path = normalize(path);
        let (dir, name) = match path.rfind('/') {
            Some(i) => (&path[..i], &path[i + 1..]),
            None => ("", path.as_str()),
        };
        if name.is_empty() {
            return Err(E2bError::Invalid(format!("{path:?} names no entry")));
        }
        let fd = self.open(
            if dir.is_empty() { "/" } else { dir },
            OFlag::O_PATH | OFlag::O_DIRECTORY,
            0,
        )?;
        Ok((fd, name.to_string()))
    }

    /// Create the directories of `path` that are missing, owned by the user;
    /// whether the last one was created.
    fn mkdir_all(&self, path: &str) -> Result<bool> {
        let path = normalize(path);
        let mut so_far = String::new();
        let mut created = false;
        for comp in path.split('/').filter(|c| !c.is_empty()) {
            let dir = so_far.clone();
            so_far.push('/');
            so_far.push_str(comp);
            let dirfd = self.open(
                if dir.is_empty() { "/" } else { &dir },
                OFlag::O_PATH | OFlag::O_DIRECTORY,
                0,
            )?;
            match nix::sys::stat::mkdirat(
                Some(dirfd.as_raw_fd()),
                comp,
                Mode::from_bits_truncate(0o755),
            ) {
                Ok(()) => {
                    self.chown(&dirfd, comp)?;
                    created = true;
                }
                Err(nix::errno::Errno::EEXIST) => {
                    created = false;
                    // It must be a directory (or lead to one).
                    self.open(&so_far, OFlag::O_PATH | OFlag::O_DIRECTORY, 0)?;
                }
                Err(e) => return Err(io_err("mkdir", &so_far, e)),
            }
        }
        Ok(created)
    }

    fn chown(&self, dirfd: &OwnedFd, name: &str) -> Result<()> {
        nix::unistd::fchownat(
            Some(dirfd.as_raw_fd()),
            name,
            Some(Uid::from_raw(self.host_uid)),
            Some(Gid::from_raw(self.host_gid)),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| io_err("chown", name, e))
    }

    /// Write `data` to `path` (parents made as needed), owned by the user.
    fn write(&self, path: &str, data: &[u8]) -> Result<Value> {
        let path = normalize(path);
        if let Some(i) = path.rfind('/') {
            if i > 0 {
                self.mkdir_all(&path[..i])?;
            }
        }
        let (dirfd, name) = self.parent(&path)?;
        let fd = self.open(
            &path,
            OFlag::O_WRONLY | OFlag::O_CREAT | OFlag::O_TRUNC | OFlag::O_NOFOLLOW,
            0o644,
        )?;
        let mut file = File::from(fd);
        file.write_all(data).map_err(E2bError::io("write", &path))?;
        self.chown(&dirfd, &name)?;
        Ok(json!({"name": name, "type": "file", "path": path}))
    }

    fn read(&self, path: &str) -> Result<Vec<u8>> {
        let fd = self.open(path, OFlag::O_RDONLY, 0)?;
        let file = File::from(fd);
        let meta = file.metadata().map_err(E2bError::io("stat", path))?;
        if meta.is_dir() {
            return Err(E2bError::Invalid(format!("{path:?} is a directory")));
        }
        let mut data = Vec::with_capacity(meta.size() as usize);
        std::io::Read::read_to_end(&mut &file, &mut data).map_err(E2bError::io("read", path))?;
        Ok(data)
    }

    /// The `EntryInfo` of `path`.
    fn entry(&self, path: &str) -> Result<Value> {
        let path = normalize(path);
        if path == "/" {
            let st =
                nix::sys::stat::fstat(self.root.as_raw_fd()).map_err(|e| io_err("stat", "/", e))?;
            return Ok(self.entry_json("/", "", &st, None));
        }
        let (dirfd, name) = self.parent(&path)?;
        let st = nix::sys::stat::fstatat(
            Some(dirfd.as_raw_fd()),
            name.as_str(),
            nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
        )
        .map_err(|e| io_err("stat", &path, e))?;
        let mut target = None;
        let mut shown = st;
        if SFlag::from_bits_truncate(st.st_mode & libc::S_IFMT) == SFlag::S_IFLNK {
            // Shown as envd shows it: an absolute path in the box (a
            // relative target taken from the link's directory).
            target = nix::fcntl::readlinkat(Some(dirfd.as_raw_fd()), name.as_str())
                .ok()
                .map(|t| link_target(&path, &t.to_string_lossy()));
            // The type shown is the target's, as envd shows it.
            if let Ok(fd) = self.open(&path, OFlag::O_PATH, 0) {
                if let Ok(t) = nix::sys::stat::fstat(fd.as_raw_fd()) {
                    shown = t;
                }
            }
        }
        Ok(self.entry_json(&path, &name, &shown, target))
    }

    fn entry_json(&self, path: &str, name: &str, st: &FileStat, target: Option<String>) -> Value {
        let kind = SFlag::from_bits_truncate(st.st_mode & libc::S_IFMT);
        let (type_, letter) = match kind {
            SFlag::S_IFDIR => ("FILE_TYPE_DIRECTORY", 'd'),
            _ => ("FILE_TYPE_FILE", '-'),
        };
        let letter = if target.is_some() { 'l' } else { letter };
        let mut perms = String::from(letter);
        for shift in [6u32, 3, 0] {
            let bits = (st.st_mode >> shift) & 7;
            perms.push(if bits & 4 != 0 { 'r' } else { '-' });
            perms.push(if bits & 2 != 0 { 'w' } else { '-' });
            perms.push(if bits & 1 != 0 { 'x' } else { '-' });
        }
        let mut v = json!({
            "name": name,
            "type": type_,
            "path": path,
            "size": st.st_size.to_string(),
            "mode": st.st_mode & 0o7777,
            "permissions": perms,
            "owner": name_of(&self.passwd, st.st_uid),
            "group": name_of(&self.group, st.st_gid),
            "modifiedTime": crate::util::rfc3339(st.st_mtime as f64 + st.st_mtime_nsec as f64 / 1e9),
        });
        if let Some(t) = target {
            v["symlinkTarget"] = json!(t);
        }
        v
    }

    /// The entries of directory `path`, down to `depth` levels.
    fn list(&self, path: &str, depth: u32, out: &mut Vec<Value>) -> Result<()> {
        let path = normalize(path);
        let fd = self.open(&path, OFlag::O_RDONLY | OFlag::O_DIRECTORY, 0)?;
        let mut dir =
            nix::dir::Dir::from_fd(fd.as_raw_fd()).map_err(|e| io_err("opendir", &path, e))?;
        // The Dir owns the descriptor now.
        std::mem::forget(fd);
        let mut names: Vec<String> = dir
            .iter()
            .filter_map(|e| e.ok())
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n != "." && n != "..")
            .collect();
        names.sort();
        for name in names {
            let child = if path == "/" {
                format!("/{name}")
            } else {
                format!("{path}/{name}")
            };
            let entry = self.entry(&child)?;
            let is_dir =
                entry["type"] == "FILE_TYPE_DIRECTORY" && entry.get("symlinkTarget").is_none();
            out.push(entry);
            if is_dir && depth > 1 {
                self.list(&child, depth - 1, out)?;
            }
        }
        Ok(())
    }

    /// Remove `path`, a directory with all it holds; nothing to do if it is
    /// not there (as envd's Remove).
    fn remove(&self, path: &str) -> Result<()> {
        let (dirfd, name) = match self.parent(path) {
            Err(E2bError::NotFound(_)) => return Ok(()),
            other => other?,
        };
        match remove_at(&dirfd, &name) {
            Ok(()) | Err(nix::errno::Errno::ENOENT) => Ok(()),
            Err(e) => Err(io_err("remove", path, e)),
        }
    }

    fn rename(&self, from: &str, to: &str) -> Result<()> {
        let (fd1, n1) = self.parent(from)?;
        let to_norm = normalize(to);
        if let Some(i) = to_norm.rfind('/') {
            if i > 0 {
                self.mkdir_all(&to_norm[..i])?;
            }
        }
        let (fd2, n2) = self.parent(&to_norm)?;
        nix::fcntl::renameat(
            Some(fd1.as_raw_fd()),
            n1.as_str(),
            Some(fd2.as_raw_fd()),
            n2.as_str(),
        )
        .map_err(|e| io_err("rename", from, e))
    }
}

/// Remove `name` in `dirfd`, recursively.
fn remove_at(dirfd: &OwnedFd, name: &str) -> nix::Result<()> {
    use nix::unistd::UnlinkatFlags;
    match nix::unistd::unlinkat(Some(dirfd.as_raw_fd()), name, UnlinkatFlags::NoRemoveDir) {
        Err(nix::errno::Errno::EISDIR) => {}
        other => return other,
    }
    let fd = nix::fcntl::openat(
        Some(dirfd.as_raw_fd()),
        name,
        OFlag::O_RDONLY | OFlag::O_DIRECTORY | OFlag::O_NOFOLLOW | OFlag::O_CLOEXEC,
        Mode::empty(),
    )?;
    // SAFETY: openat returned a new descriptor that nothing else owns.
    let sub = unsafe { OwnedFd::from_raw_fd(fd) };
    let dup = nix::unistd::dup(sub.as_raw_fd())?;
    let mut dir = nix::dir::Dir::from_fd(dup)?;
    let names: Vec<String> = dir
        .iter()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != "." && n != "..")
        .collect();
    for n in names {
        remove_at(&sub, &n)?;
    }
    nix::unistd::unlinkat(Some(dirfd.as_raw_fd()), name, UnlinkatFlags::RemoveDir)
}

fn io_err(op: &'static str, path: &str, e: nix::errno::Errno) -> E2bError {
    let source = std::io::Error::from_raw_os_error(e as i32);
    let message = match e {
        nix::errno::Errno::ENOENT => format!("path {path:?} does not exist"),
        nix::errno::Errno::EEXIST => format!("path {path:?} already exists"),
        nix::errno::Errno::ENOTDIR => format!("path {path:?}: a component is not a directory"),
        _ => {
            return E2bError::Io {
                op,
                path: path.into(),
                source,
            }
        }
    };
    match e {
        nix::errno::Errno::ENOENT => E2bError::NotFound(message),
        nix::errno::Errno::EEXIST => E2bError::Exists(message),
        _ => E2bError::Invalid(message),
    }
}

/// The target of the symbolic link at `link` (a normalized absolute path
/// in the box), read as `target`, as an absolute path in the box.
fn link_target(link: &str, target: &str) -> String {
    if target.starts_with('/') {
        return normalize(target);
    }
    let dir = link.rsplit_once('/').map_or("", |(d, _)| d);
    normalize(&format!("{dir}/{target}"))
}

/// `path` without `.`, empty components and `..` above the root.
fn normalize(path: &str) -> String {
    let mut parts: Vec<&str> = Vec::new();
    for c in path.split('/') {
        match c {
            "" | "." => {}
            ".." => {
                parts.pop();
            }
            c => parts.push(c),
        }
    }
    format!("/{}", parts.join("/"))
}

/// The host id of box id `id` under an `uid_map`/`gid_map` text.
fn map_id(map: &str, id: u32) -> Option<u32> {
    map.lines().find_map(|l| {
        let f: Vec<u64> = l
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        let (inside, outside, count) = (*f.first()?, *f.get(1)?, *f.get(2)?);
        let id = u64::from(id);
        (id >= inside && id < inside + count).then(|| (outside + id - inside) as u32)
    })
}

/// The name of `id` in a passwd or group text (the number if none).
fn name_of(table: &str, id: u32) -> String {
    table
        .lines()
        .find_map(|l| {
            let f: Vec<&str> = l.split(':').collect();
            (f.len() > 2 && f[2].parse() == Ok(id)).then(|| f[0].to_string())
        })
        .unwrap_or_else(|| id.to_string())
}

fn envd_error(e: &E2bError) -> Response {
    // envd's own error shape: {"code": HTTP status, "message"}.
    let status = e.status();
    Response::json(status, &json!({"code": status, "message": e.to_string()}))
}

/// Answer `/files`.
pub fn files(server: &Server, sandbox: &Sandbox, req: &Request) -> Response {
    match files_inner(server, sandbox, req) {
        Ok(r) => r,
        Err(e) => envd_error(&e),
    }
}

fn files_inner(server: &Server, sandbox: &Sandbox, req: &Request) -> Result<Response> {
    let user = req
        .query("username")
        .map(String::from)
        .or_else(|| crate::sandbox::user_of_authorization(req.header("authorization")));
    let fs = BoxFs::open_root(server, sandbox, user.as_deref())?;
    match req.method.as_str() {
        "GET" => {
            let path = fs.user.resolve(
                req.query("path")
                    .ok_or_else(|| E2bError::Invalid("download needs ?path=".into()))?,
            );
            let data = fs.read(&path)?;
            let name = path.rsplit('/').next().unwrap_or("file").to_string();
            Ok(
                Response::bytes(200, "application/octet-stream", data).with_header(
                    "Content-Disposition",
                    &format!("attachment; filename=\"{name}\""),
                ),
            )
        }
        "POST" => {
            let ctype = req.header("content-type").unwrap_or("");
            let body = upload_body(req)?;
            let mut written = Vec::new();
            if ctype.starts_with("multipart/form-data") {
                let parts = crate::util::multipart(ctype, &body)
                    .ok_or_else(|| E2bError::Invalid("malformed multipart body".into()))?;
                let single = parts.len() == 1;
                for part in parts {
                    let name = match (req.query("path"), part.filename.as_deref()) {
                        (Some(p), _) if single => p.to_string(),
                        (_, Some(f)) if !f.is_empty() => f.to_string(),
                        _ => {
                            return Err(E2bError::Invalid(
                                "an uploaded part has no file name and no ?path=".into(),
                            ))
                        }
                    };
                    written.push(fs.write(&fs.user.resolve(&name), &part.data)?);
                }
            } else {
                let path = req.query("path").ok_or_else(|| {
                    E2bError::Invalid("an octet-stream upload needs ?path=".into())
                })?;
                written.push(fs.write(&fs.user.resolve(path), &body)?);
            }
            Ok(Response::json(200, &Value::Array(written)))
        }
        other => Err(E2bError::Unsupported(format!("{other} /files"))),
    }
}

/// The body of an upload, gunzipped if its `Content-Encoding` is gzip (the
/// SDK's `gzip=True`).
fn upload_body(req: &Request) -> Result<std::borrow::Cow<'_, [u8]>> {
    match req.header("content-encoding").map(str::trim) {
        None | Some("") => Ok(std::borrow::Cow::Borrowed(&req.body)),
        Some(c) if c.eq_ignore_ascii_case("identity") => Ok(std::borrow::Cow::Borrowed(&req.body)),
        Some(c) if c.eq_ignore_ascii_case("gzip") => {
            let mut out = Vec::new();
            std::io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&req.body[..]), &mut out)
                .map_err(|e| {
                    E2bError::Invalid(format!("the gzip upload does not decompress: {e}"))
                })?;
            Ok(std::borrow::Cow::Owned(out))
        }
        Some(c) => Err(E2bError::Unsupported(format!(
            "an upload of Content-Encoding {c:?}"
        ))),
    }
}

/// Answer `/filesystem.Filesystem/METHOD`.
pub fn handle(server: &Server, sandbox: &Sandbox, method: &str, req: &Request) -> Response {
    if method == "WatchDir" {
        return watch_dir(server, sandbox, req);
    }
    connect::unary((|| {
        let msg = connect::message(req)?;
        let user = crate::sandbox::user_of_authorization(req.header("authorization"));
        let fs = BoxFs::open_root(server, sandbox, user.as_deref())?;
        let path = |key: &str| -> Result<String> {
            msg.get(key)
                .and_then(Value::as_str)
                .map(|p| fs.user.resolve(p))
                .ok_or_else(|| E2bError::Invalid(format!("{method} needs {key}")))
        };
        match method {
            "Stat" => Ok(json!({"entry": fs.entry(&path("path")?)?})),
            "ListDir" => {
                let p = path("path")?;
                let depth = msg.get("depth").and_then(Value::as_u64).unwrap_or(1).max(1) as u32;
                let mut entries = Vec::new();
                fs.list(&p, depth, &mut entries)?;
                Ok(json!({"entries": entries}))
            }
            "MakeDir" => {
                let p = path("path")?;
                if !fs.mkdir_all(&p)? {
                    return Err(E2bError::Exists(format!("directory {p:?} already exists")));
                }
                Ok(json!({"entry": fs.entry(&p)?}))
            }
            "Move" => {
                let (from, to) = (path("source")?, path("destination")?);
                fs.rename(&from, &to)?;
                Ok(json!({"entry": fs.entry(&to)?}))
            }
            "Remove" => {
                fs.remove(&path("path")?)?;
                Ok(json!({}))
            }
            "CreateWatcher" => {
                let p = path("path")?;
                let recursive = msg
                    .get("recursive")
                    .and_then(Value::as_bool)
                    .unwrap_or(false);
                let id = sandbox.watchers.create(fs, &p, recursive)?;
                Ok(json!({"watcherId": id}))
            }
            "GetWatcherEvents" => {
                let id = msg.get("watcherId").and_then(Value::as_str).unwrap_or("");
                Ok(json!({"events": sandbox.watchers.events(id)?}))
            }
            "RemoveWatcher" => {
                let id = msg.get("watcherId").and_then(Value::as_str).unwrap_or("");
                sandbox.watchers.remove(id)?;
                Ok(json!({}))
            }
            other => Err(E2bError::Unsupported(format!(
                "filesystem.Filesystem/{other}"
            ))),
        }
    })())
}

/// `WatchDir`: a stream of a directory's events (the async SDK's
/// `watch_dir`), opened by a start event; keep-alive events when idle, ended
/// by the client closing it or its deadline.
fn watch_dir(server: &Server, sandbox: &Sandbox, req: &Request) -> Response {
    let opened = (|| {
        let msg = connect::message(req)?;
        let user = crate::sandbox::user_of_authorization(req.header("authorization"));
        let fs = BoxFs::open_root(server, sandbox, user.as_deref())?;
        let path = msg
            .get("path")
            .and_then(Value::as_str)
            .map(|p| fs.user.resolve(p))
            .ok_or_else(|| E2bError::Invalid("WatchDir needs path".into()))?;
        let recursive = msg
            .get("recursive")
            .and_then(Value::as_bool)
            .unwrap_or(false);
        Watcher::new(fs, &path, recursive)
    })();
    let events = match opened {
        Ok(w) => w.spawn_reader(),
        Err(e) => return connect::stream_error(e),
    };
    let deadline = req
        .header("connect-timeout-ms")
        .and_then(|t| t.parse::<u64>().ok())
        .map(|ms| std::time::Instant::now() + std::time::Duration::from_millis(ms));
    let keepalive = std::time::Duration::from_secs(
        req.header("keepalive-ping-interval")
            .and_then(|t| t.parse().ok())
            .unwrap_or(50),
    );
    Response::stream(
        200,
        "application/connect+json",
        Box::new(move |w| {
            connect::send(w, &json!({"start": {}}))?;
            let mut quiet_since = std::time::Instant::now();
            loop {
                let now = std::time::Instant::now();
                if deadline.is_some_and(|d| now >= d) {
                    return connect::end(w, None);
                }
                let mut wait = keepalive.saturating_sub(quiet_since.elapsed());
                if let Some(d) = deadline {
                    wait = wait.min(d.saturating_duration_since(now));
                }
                match events.wait(wait) {
                    Ok(batch) if batch.is_empty() => {}
                    Ok(batch) => {
                        for e in batch {
                            connect::send(w, &json!({"filesystem": e}))?;
                        }
                        quiet_since = std::time::Instant::now();
                    }
                    Err(e) => return connect::end(w, Some(&e)),
                }
                if quiet_since.elapsed() >= keepalive {
                    connect::send(w, &json!({"keepalive": {}}))?;
                    quiet_since = std::time::Instant::now();
                }
            }
        }),
    )
}

/// A directory watched for the SDK's `watch_dir` (CreateWatcher, then
/// GetWatcherEvents polls): an inotify instance on the directory (opened
/// inside the box's root like every path, watched through its descriptor),
/// and on its subdirectories when recursive, new ones included.
#[derive(Debug)]
struct Watcher {
    fs: BoxFs,
    inotify: Inotify,
    /// Each watch's directory, relative to the watched one ("" for itself).
    dirs: HashMap<WatchDescriptor, String>,
    root: String,
    recursive: bool,
}

// The events envd's watcher (fsnotify) reports: a write is IN_MODIFY, not
// also IN_CLOSE_WRITE (a file written once is create, write, chmod).
const WATCHED: AddWatchFlags = AddWatchFlags::IN_CREATE
    .union(AddWatchFlags::IN_MODIFY)
    .union(AddWatchFlags::IN_DELETE)
    .union(AddWatchFlags::IN_MOVED_FROM)
    .union(AddWatchFlags::IN_MOVED_TO)
    .union(AddWatchFlags::IN_ATTRIB)
    .union(AddWatchFlags::IN_ONLYDIR);

impl Watcher {
    fn new(fs: BoxFs, path: &str, recursive: bool) -> Result<Self> {
        let inotify = Inotify::init(InitFlags::IN_NONBLOCK | InitFlags::IN_CLOEXEC)
            .map_err(|e| io_err("inotify_init", path, e))?;
        let mut w = Watcher {
            fs,
            inotify,
            dirs: HashMap::new(),
            root: normalize(path),
            recursive,
        };
        w.add("")?;
        Ok(w)
    }

    /// Watch directory `rel` (relative to the watched one) and, when
    /// recursive, the directories below it.
    fn add(&mut self, rel: &str) -> Result<()> {
        let path = if rel.is_empty() {
            self.root.clone()
        } else {
            format!("{}/{rel}", self.root)
        };
        let fd = self.fs.open(&path, OFlag::O_PATH | OFlag::O_DIRECTORY, 0)?;
        let wd = self
            .inotify
            .add_watch(
                format!("/proc/self/fd/{}", fd.as_raw_fd()).as_str(),
                WATCHED,
            )
            .map_err(|e| io_err("inotify_add_watch", &path, e))?;
        self.dirs.insert(wd, rel.to_string());
        if self.recursive {
            let mut entries = Vec::new();
            self.fs.list(&path, 1, &mut entries)?;
            for e in entries {
                if e["type"] == "FILE_TYPE_DIRECTORY" && e.get("symlinkTarget").is_none() {
                    let name = e["name"].as_str().unwrap_or_default();
                    let sub = if rel.is_empty() {
                        name.to_string()
                    } else {
                        format!("{rel}/{name}")
                    };
                    self.add(&sub)?;
                }
            }
        }
        Ok(())
    }

    /// Read the events in a thread of their own as they come, so that a new
    /// subdirectory is watched at once (not when the client next asks), as
    /// envd's watcher does. The thread ends after an error or once the
    /// reader is dropped (seen within a second).
    fn spawn_reader(self) -> Reader {
        let dup = self.inotify.as_fd().try_clone_to_owned();
        let reader = Reader(Arc::new((
            Mutex::new(Polled {
                watcher: self,
                pending: Vec::new(),
                error: None,
            }),
            Condvar::new(),
        )));
        let Ok(fd) = dup else {
            // No thread: events are then read when asked for.
            return reader;
        };
        let shared = reader.0.clone();
        std::thread::spawn(move || loop {
            let mut fds = [PollFd::new(fd.as_fd(), PollFlags::POLLIN)];
            let _ = poll(&mut fds, PollTimeout::from(1000u16));
            if Arc::strong_count(&shared) == 1 {
                return;
            }
            let mut polled = shared.0.lock().unwrap_or_else(|p| p.into_inner());
            if polled.read_now() {
                shared.1.notify_all();
            }
            if polled.error.is_some() {
                return;
            }
        });
        reader
    }

    /// The events since the last call.
    fn events(&mut self) -> Result<Vec<Value>> {
        let mut out = Vec::new();
        loop {
            let batch = match self.inotify.read_events() {
                Ok(b) => b,
                Err(nix::errno::Errno::EAGAIN) => return Ok(out),
                Err(e) => return Err(io_err("read inotify events of", &self.root, e)),
            };
            for ev in batch {
                let (Some(dir), Some(name)) = (self.dirs.get(&ev.wd).cloned(), ev.name) else {
                    continue;
                };
                let name = name.to_string_lossy().into_owned();
                let rel = if dir.is_empty() {
                    name
                } else {
                    format!("{dir}/{name}")
                };
                let m = ev.mask;
                let created = m.contains(AddWatchFlags::IN_CREATE);
                let moved_in = m.contains(AddWatchFlags::IN_MOVED_TO);
                if (created || moved_in) && m.contains(AddWatchFlags::IN_ISDIR) && self.recursive {
                    // A new directory is watched too (best effort: it may be gone).
                    let _ = self.add(&rel);
                }
                let kind = if created {
                    "EVENT_TYPE_CREATE"
                } else if moved_in || m.contains(AddWatchFlags::IN_MOVED_FROM) {
                    "EVENT_TYPE_RENAME"
                } else if m.contains(AddWatchFlags::IN_DELETE) {
                    "EVENT_TYPE_REMOVE"
                } else if m.contains(AddWatchFlags::IN_ATTRIB) {
                    "EVENT_TYPE_CHMOD"
                } else {
                    "EVENT_TYPE_WRITE"
                };
                out.push(json!({"name": rel, "type": kind}));
            }
        }
    }
}

/// The watchers of one sandbox, by id.
#[derive(Debug, Default)]
pub struct Watchers {
    map: Mutex<HashMap<String, Reader>>,
}

/// A watcher and the events read from it not yet handed out.
#[derive(Debug)]
struct Polled {
    watcher: Watcher,
    pending: Vec<Value>,
    error: Option<E2bError>,
}

impl Polled {
    /// Read what the watcher has now; whether anything (or an error) came.
    fn read_now(&mut self) -> bool {
        if self.error.is_some() {
            return false;
        }
        match self.watcher.events() {
            Ok(events) if events.is_empty() => false,
            Ok(events) => {
                self.pending.extend(events);
                true
            }
            Err(e) => {
                self.error = Some(e);
                true
            }
        }
    }

    /// The events read so far and those there now (an error once).
    fn take(&mut self) -> Result<Vec<Value>> {
        self.read_now();
        if let Some(e) = self.error.take() {
            return Err(e);
        }
        Ok(std::mem::take(&mut self.pending))
    }
}

/// A watcher read by its thread ([`Watcher::spawn_reader`]).
#[derive(Debug, Clone)]
struct Reader(Arc<(Mutex<Polled>, Condvar)>);

impl Reader {
    fn lock(&self) -> std::sync::MutexGuard<'_, Polled> {
        self.0 .0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every event up to now: those the thread read and those not read yet
    /// (so a change made just before the call is in its answer).
    fn take(&self) -> Result<Vec<Value>> {
        self.lock().take()
    }

    /// The events, waiting up to `limit` for some.
    fn wait(&self, limit: std::time::Duration) -> Result<Vec<Value>> {
        let mut polled = self.lock();
        if polled.pending.is_empty() && polled.error.is_none() {
            polled = self
                .0
                 .1
                .wait_timeout(polled, limit)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        polled.take()
    }
}

impl Watchers {
    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Reader>> {
        self.map.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn create(&self, fs: BoxFs, path: &str, recursive: bool) -> Result<String> {
        let w = Watcher::new(fs, path, recursive)?;
        let id = crate::util::random_hex(8);
        self.lock().insert(id.clone(), w.spawn_reader());
        Ok(id)
    }

    fn events(&self, id: &str) -> Result<Vec<Value>> {
        let reader = self
            .lock()
            .get(id)
            .cloned()
            .ok_or_else(|| E2bError::NotFound(format!("watcher {id:?} not found")))?;
        reader.take()
    }

    fn remove(&self, id: &str) -> Result<()> {
        self.lock()
            .remove(id)
            .map(drop)
            .ok_or_else(|| E2bError::NotFound(format!("watcher {id:?} not found")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_normalize_inside_the_root() {
        assert_eq!(normalize("/home/user/../../.."), "/");
        assert_eq!(normalize("/a/./b//c/"), "/a/b/c");
    }

    #[test]
    fn link_targets_are_absolute_paths_in_the_box() {
        assert_eq!(link_target("/home/user/d/l", "t.txt"), "/home/user/d/t.txt");
        assert_eq!(link_target("/home/user/l", "../x/./y"), "/home/x/y");
        assert_eq!(link_target("/l", "/etc//passwd"), "/etc/passwd");
    }

    #[test]
    fn ids_map_through_user_namespaces() {
        let map = "         0     100000      65536\n";
        assert_eq!(map_id(map, 1000), Some(101_000));
        assert_eq!(map_id(map, 70000), None);
        assert_eq!(map_id("0 0 4294967295\n", 5), Some(5));
    }

    #[test]
    fn ids_have_names() {
        let passwd = "root:x:0:0::/root:/bin/sh\nuser:x:1000:1000::/home/user:/bin/bash\n";
        assert_eq!(name_of(passwd, 1000), "user");
        assert_eq!(name_of(passwd, 7), "7");
    }
}
