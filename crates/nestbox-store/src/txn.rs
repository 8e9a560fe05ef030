//! Transactions: how objects and images enter the store without ever being seen
//! half-written.
//!
//! A transaction owns a staging directory `tmp/<id>/` (flocked for its lifetime, so
//! a staging directory whose lock can be taken belongs to a dead process and is
//! removed by the next import or `store gc`). Object contents are written, while
//! being hashed, into unnamed files (`O_TMPFILE`) of the staging directory, or
//! where the filesystem has none (or the transaction holds as many open files as
//! it may), into named files there; an object that already exists is dropped at
//! once. `tmp/` is marked as the top of directory hierarchies (`chattr +T`), so
//! ext4 places each staging directory, and the new objects' inodes with it, in a
//! block group with room to spare (see [`nestbox_sys::inode_flags`]). Publishing syncs the filesystem once (`syncfs`, instead of
//! one `fsync` per object: the cost of crash safety is one flush per import, not
//! one per file), then gives every staged object its name in `objects/` (an
//! unnamed file with `linkat`, a named one with a `RENAME_NOREPLACE` rename:
//! neither replaces an existing object), syncs again; an image's commit then
//! writes the manifest the same way, builds the lower tree and finally creates
//! the image name. Killed at any point before the name exists, an import leaves
//! at most complete, valid, unreferenced objects (which `gc` reclaims) and a
//! stale staging directory (unnamed files vanish with the process that held
//! them); nothing visible and nothing `verify` could call corrupt.

use std::collections::HashMap;
use std::fs;
use std::io::{Read, Write};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::Mutex;

use nix::fcntl::{Flock, FlockArg};

use crate::error::{Result, StoreError};
use crate::hash::Digest;
use crate::manifest::Manifest;
use crate::meta::Meta;
use crate::refs::{validate_name, ImageRef};
use crate::store::{Store, StoreLock};

/// Size of the copy buffer.
const CHUNK: usize = 1 << 20;

thread_local! {
    /// The copy buffer of [`Txn::put_reader`] on this thread.
    static COPY_BUFFER: std::cell::RefCell<Vec<u8>> = const { std::cell::RefCell::new(Vec::new()) };
}

/// Counters of one transaction.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct TxnStats {
    /// Objects added to the store.
    pub new_objects: u64,
    /// Content bytes added to the store.
    pub new_bytes: u64,
    /// Files whose object already existed.
    pub reused_objects: u64,
    /// Content bytes that were already stored.
    pub reused_bytes: u64,
}

/// An object written but not yet named in `objects/`.
#[derive(Debug)]
enum Pending {
    /// A named file in the staging directory (renamed at publish).
    Named(PathBuf),
    /// An unnamed file (`O_TMPFILE`, linked into `objects/` at publish): it
    /// disappears with its descriptor if the transaction never publishes.
    Unnamed(fs::File),
}

#[derive(Debug, Default)]
struct Staged {
    /// Final object path → the object's staged file.
    pending: HashMap<PathBuf, Pending>,
    stats: TxnStats,
}

/// One import or commit in progress. Dropping it unpublished removes its staging.
#[derive(Debug)]
pub struct Txn<'s> {
    store: &'s Store,
    dir: PathBuf,
    staged: Mutex<Staged>,
    seq: AtomicU64,
    /// The staging directory, open (unnamed files are made in it).
    dir_fd: fs::File,
    /// Who owns a file made in the staging directory (user, group), if known.
    creator: Option<(u32, u32)>,
    /// The process's umask, if a file made in the staging directory gets the
    /// mode it is asked for less these bits (known, and no default ACL).
    umask: Option<u32>,
    /// `objects/`, open if it could be (what exists is looked up in it).
    objects_fd: Option<(PathBuf, fs::File)>,
    /// At most this many unnamed files are held open at once (the rest are
    /// staged as named files; threads staging at once may each pass it by one).
    max_unnamed: usize,
    /// How many of the staged objects are unnamed (each holds a descriptor).
    unnamed: AtomicUsize,
    _own: Flock<fs::File>,
    _store_lock: StoreLock,
}

impl<'s> Txn<'s> {
    /// Start a transaction (takes the store's shared lock, removes stale staging).
    pub fn begin(store: &'s Store) -> Result<Self> {
        let store_lock = store.lock_shared()?;
        clean_stale(store, false);
        spread_staging(store);
        let mut rnd = [0u8; 6];
        getrandom(&mut rnd)?;
        let name = format!("txn-{}-{}", std::process::id(), crate::hash::hex(&rnd));
        // Made under a hidden name and renamed once locked, so a cleaner never sees
        // a live staging directory without its lock.
        let hidden = store.tmp_dir().join(format!(".{name}"));
        let dir = store.tmp_dir().join(&name);
        fs::create_dir(&hidden).map_err(StoreError::io("mkdir", &hidden))?;
        let lock_path = hidden.join(".lock");
        let own = fs::File::create(&lock_path)
            .map_err(StoreError::io("create", &lock_path))
            .and_then(|f| {
                Flock::lock(f, FlockArg::LockExclusiveNonblock)
                    .map_err(|(_, e)| StoreError::sys("flock", &lock_path)(e))
            })
            .and_then(|l| {
                fs::rename(&hidden, &dir)
                    .map(|()| l)
                    .map_err(StoreError::io("rename", &dir))
            });
        let own = match own {
            Ok(l) => l,
            Err(e) => {
                if let Err(r) = fs::remove_dir_all(&hidden) {
                    tracing::warn!("removing {}: {r}", hidden.display());
                }
                return Err(e);
            }
        };
        let dir_fd = match fs::File::open(&dir) {
            Ok(f) => f,
            Err(e) => {
                if let Err(r) = fs::remove_dir_all(&dir) {
                    tracing::warn!("removing {}: {r}", dir.display());
                }
                return Err(StoreError::io("open", &dir)(e));
            }
        };
        // The directory was made by this process: a file made in it gets the
        // same user, and the same group (the process's, or with a
        // set-group-ID parent the parent's, which the directory then has too).
        let creator = nix::sys::stat::fstat(dir_fd.as_raw_fd())
            .ok()
            .map(|st| (st.st_uid, st.st_gid));
        let umask = match nestbox_sys::xattr::get(&dir, "system.posix_acl_default") {
            Ok(None) => read_umask(),
            _ => None,
        };
        let objects = store.objects_dir();
        let objects_fd = fs::File::open(&objects).ok().map(|f| (objects, f));
        Ok(Txn {
            store,
            dir,
            dir_fd,
            creator,
            umask,
            objects_fd,
            staged: Mutex::new(Staged::default()),
            seq: AtomicU64::new(0),
            max_unnamed: unnamed_budget(),
            unnamed: AtomicUsize::new(0),
            _own: own,
            _store_lock: store_lock,
        })
    }

    /// The store.
    pub fn store(&self) -> &'s Store {
        self.store
    }

    /// A fresh path in the staging directory (scratch space removed with it).
    pub fn scratch(&self, what: &str) -> PathBuf {
        self.dir.join(format!(
            "{what}-{}",
            self.seq.fetch_add(1, Ordering::Relaxed)
        ))
    }

    /// Counters so far.
    pub fn stats(&self) -> TxnStats {
        self.staged.lock().expect("not poisoned").stats
    }

    /// Store the content read from `src` with metadata `meta`; its digest and length.
    /// Read errors become `read_err(e)` (the caller names the input); write errors
    /// name the staging file. `progress` is called with each chunk's length.
    pub fn put_reader(
        &self,
        src: &mut dyn Read,
        meta: &Meta,
        read_err: &dyn Fn(std::io::Error) -> StoreError,
        progress: &dyn Fn(u64),
    ) -> Result<(Digest, u64)> {
        if let Some((out, mode_set)) = self.unnamed_file(meta) {
            let what = &self.dir;
            let (digest, len) = copy_hashing(src, &out, what, read_err, progress)?;
            self.stage(out, None, digest, len, meta, mode_set)?;
            return Ok((digest, len));
        }
        let tmp = self.scratch("obj");
        let out = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(StoreError::io("create", &tmp))?;
        let (digest, len) = match copy_hashing(src, &out, &tmp, read_err, progress) {
            Ok(v) => v,
            Err(e) => {
                drop(out);
                if let Err(r) = fs::remove_file(&tmp) {
                    tracing::warn!("removing {}: {r}", tmp.display());
                }
                return Err(e);
            }
        };
        self.stage(out, Some(tmp), digest, len, meta, false)?;
        Ok((digest, len))
    }

    /// Make room for `objects` more objects to be staged from several threads:
    /// each unnamed one holds a descriptor until publish, so the process's
    /// descriptor table is grown once now (see
    /// [`nestbox_sys::fd::reserve_table`]) rather than step by step while the
    /// threads wait for each other's growth.
    pub fn expect_objects(&self, objects: usize) {
        let unnamed = objects.min(self.max_unnamed) as u32;
        let open = self.unnamed.load(Ordering::Relaxed) as u32;
        nestbox_sys::fd::reserve_table(&self.dir_fd, open + unnamed + 128);
    }

    /// A new unnamed file in the staging directory for an object's content, if the
    /// filesystem makes them and the transaction may hold one more open; made
    /// with `meta`'s mode when the umask leaves it whole (then `true`).
    fn unnamed_file(&self, meta: &Meta) -> Option<(fs::File, bool)> {
        if self.unnamed.load(Ordering::Relaxed) >= self.max_unnamed {
            return None;
        }
        use nix::fcntl::OFlag;
        let mode_set = self
            .umask
            .is_some_and(|u| meta.mode & 0o7000 == 0 && meta.mode & u == 0);
        let mode = if mode_set { meta.mode & 0o777 } else { 0o600 };
        nestbox_sys::at::open_at(
            &self.dir_fd,
            Path::new("."),
            OFlag::O_TMPFILE | OFlag::O_WRONLY,
            nix::sys::stat::Mode::from_bits_truncate(mode),
        )
        .map(|fd| (fs::File::from(fd), mode_set))
        // EOPNOTSUPP, EISDIR (no O_TMPFILE), anything else: the named way,
        // whose own errors are reported.
        .ok()
    }

    /// Whether the store has the object at `fin` (looked up from `objects/`).
    fn published(&self, fin: &Path) -> bool {
        match &self.objects_fd {
            Some((objects, fd)) => match fin.strip_prefix(objects) {
                Ok(rel) => nix::sys::stat::fstatat(
                    Some(fd.as_raw_fd()),
                    rel,
                    nix::fcntl::AtFlags::AT_SYMLINK_NOFOLLOW,
                )
                .is_ok(),
                Err(_) => fin.exists(),
            },
            None => fin.exists(),
        }
    }

    /// Store `data` with metadata `meta`; its digest.
    pub fn put_bytes(&self, data: &[u8], meta: &Meta) -> Result<Digest> {
        let tmp = self.scratch("obj");
        let digest = Digest::of(data);
        let mut out = fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)
            .map_err(StoreError::io("create", &tmp))?;
        if let Err(e) = out.write_all(data) {
            // In the transaction's directory, removed with it.
            let _ = fs::remove_file(&tmp);
            return Err(StoreError::io("write", &tmp)(e));
        }
        self.stage(out, Some(tmp), digest, data.len() as u64, meta, false)?;
        Ok(digest)
    }

    /// Record `out` (named `tmp` in the staging directory, or unnamed) as
    /// object `digest`, or drop it if the store or this transaction has it.
    ///
    /// Threads of one transaction stage at once: the store is looked up and
    /// `out` given its metadata without the lock, which is then taken once,
    /// only to record the object (a lookup under it made the hashing threads
    /// of a snapshot wait on each other for every file).
    fn stage(
        &self,
        out: fs::File,
        tmp: Option<PathBuf>,
        digest: Digest,
        len: u64,
        meta: &Meta,
        mode_set: bool,
    ) -> Result<()> {
        let fin = self.store.object_path(&digest, &meta.key());
        let published = self.published(&fin);
        if !published {
            let shown = tmp.clone().unwrap_or_else(|| fin.clone());
            meta.apply_fd_owned(&out, &shown, self.creator, mode_set)?;
        }
        let mut st = self.staged.lock().expect("not poisoned");
        if published || st.pending.contains_key(&fin) {
            // In the store already, or staged meanwhile by another thread
            // of this transaction: this copy is not needed.
            st.stats.reused_objects += 1;
            st.stats.reused_bytes += len;
            drop(st);
            drop(out);
            return match tmp {
                Some(tmp) => fs::remove_file(&tmp).map_err(StoreError::io("unlink", &tmp)),
                None => Ok(()),
            };
        }
        st.stats.new_objects += 1;
        st.stats.new_bytes += len;
        let pending = match tmp {
            Some(tmp) => Pending::Named(tmp),
            None => {
                self.unnamed.fetch_add(1, Ordering::Relaxed);
                Pending::Unnamed(out)
            }
        };
        st.pending.insert(fin, pending);
        Ok(())
    }

    /// Make every staged object durable and visible in `objects/`.
    pub fn publish(&self) -> Result<()> {
        let pending: Vec<(PathBuf, Pending)> = {
            let mut st = self.staged.lock().expect("not poisoned");
            self.unnamed.store(0, Ordering::Relaxed);
            st.pending.drain().collect()
        };
        if pending.is_empty() {
            return Ok(());
        }
        // Every object's content on disk before any of them has its name.
        self.store.sync()?;
        // One thread: a second one measured no faster (2026-11-26 16:19).
        link_all(&pending)?;
        self.store.sync()
    }

    /// Finish: store `manifest` as an object, publish everything, build the lower
    /// tree, then create the name. The image exists from the last step on.
    pub fn commit_image(self, name: &str, manifest: &Manifest, source: &str) -> Result<ImageRef> {
        validate_name(name)?;
        let bytes = manifest.to_bytes();
        let id = self.put_bytes(&bytes, &Meta::internal())?;
        self.publish()?;
        crate::tree::ensure_tree_locked(self.store, &id, Some(manifest))?;
        let (files, total) = manifest.file_stats();
        let r = ImageRef {
            name: name.to_string(),
            id,
            created: now(),
            source: source.to_string(),
            files,
            bytes: total,
        };
        self.store.create_ref(&r)?;
        Ok(r)
    }
}

impl Drop for Txn<'_> {
    fn drop(&mut self) {
        // A transaction's directory that cannot be removed is logged; store
        // gc removes transaction leftovers.
        if let Err(e) = fs::remove_dir_all(&self.dir) {
            if e.kind() != std::io::ErrorKind::NotFound {
                tracing::warn!("removing {}: {e}", self.dir.display());
            }
        }
    }
}

/// Give every staged object of `pending` its name in `objects/` (an object
/// published meanwhile by another transaction is kept: same content, same
/// metadata). Each of the 256 fan-out directories is opened once (made if
/// missing), not looked up again for every object.
fn link_all(pending: &[(PathBuf, Pending)]) -> Result<()> {
    let mut dirs: HashMap<&Path, fs::File> = HashMap::new();
    for (fin, staged) in pending {
        let parent = fin.parent().expect("objects have a parent");
        if !dirs.contains_key(parent) {
            let d = match fs::File::open(parent) {
                Ok(d) => d,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    match fs::create_dir(parent) {
                        Ok(()) => {}
                        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
                        Err(e) => return Err(StoreError::io("mkdir", parent)(e)),
                    }
                    fs::File::open(parent).map_err(StoreError::io("open", parent))?
                }
                Err(e) => return Err(StoreError::io("open", parent)(e)),
            };
            dirs.insert(parent, d);
        }
        let dir = &dirs[parent];
        let name = fin.file_name().expect("objects have a name");
        let done = match staged {
            Pending::Named(tmp) => nix::fcntl::renameat2(
                None,
                tmp,
                Some(dir.as_raw_fd()),
                name,
                nix::fcntl::RenameFlags::RENAME_NOREPLACE,
            ),
            Pending::Unnamed(file) => link_unnamed(file, dir, name),
        };
        match done {
            Ok(()) => {}
            // Published meanwhile by another import: same content and
            // metadata. A named copy is in the transaction's directory,
            // removed with it; an unnamed one goes when it is closed.
            Err(nix::errno::Errno::EEXIST) => {
                if let Pending::Named(tmp) = staged {
                    let _ = fs::remove_file(tmp);
                }
            }
            Err(e) => {
                let op = match staged {
                    Pending::Named(_) => "rename",
                    Pending::Unnamed(_) => "link",
                };
                return Err(StoreError::sys(op, fin)(e));
            }
        }
    }
    Ok(())
}

/// Read `src` to its end into `out` (named `what` in errors), hashing it; its
/// digest and length. Read errors become `read_err(e)`; `progress` is called
/// with each chunk's length.
fn copy_hashing(
    src: &mut dyn Read,
    mut out: &fs::File,
    what: &Path,
    read_err: &dyn Fn(std::io::Error) -> StoreError,
    progress: &dyn Fn(u64),
) -> Result<(Digest, u64)> {
    COPY_BUFFER.with_borrow_mut(|buf| {
        // One buffer per thread, allocated (and zeroed) once: a fresh
        // 1 MiB buffer per file costs more than a small file's whole copy.
        buf.resize(CHUNK, 0);
        let mut hasher = blake3::Hasher::new();
        let mut len = 0u64;
        loop {
            let n = match src.read(buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(read_err(e)),
            };
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n])
                .map_err(StoreError::io("write", what))?;
            len += n as u64;
            progress(n as u64);
        }
        Ok((Digest::from_hasher(&hasher), len))
    })
}

/// Give the unnamed file `file` the name `name` in directory `dir` (never
/// replacing an existing entry: `EEXIST`).
fn link_unnamed(file: &fs::File, dir: &fs::File, name: &std::ffi::OsStr) -> nix::Result<()> {
    use nix::fcntl::AtFlags;
    let empty: &Path = Path::new("");
    match nix::unistd::linkat(
        Some(file.as_raw_fd()),
        empty,
        Some(dir.as_raw_fd()),
        Path::new(name),
        AtFlags::AT_EMPTY_PATH,
    ) {
        // AT_EMPTY_PATH needs CAP_DAC_READ_SEARCH; without it, the link
        // through /proc does the same (as open(2) shows for O_TMPFILE).
        Err(nix::errno::Errno::ENOENT | nix::errno::Errno::EPERM) => {
            let via = PathBuf::from(format!("/proc/self/fd/{}", file.as_raw_fd()));
            nix::unistd::linkat(
                None,
                via.as_path(),
                Some(dir.as_raw_fd()),
                Path::new(name),
                AtFlags::AT_SYMLINK_FOLLOW,
            )
        }
        r => r,
    }
}

/// The process's umask, from `/proc/self/status` (read, never set: setting
/// it to read it would race with other threads making files).
fn read_umask() -> Option<u32> {
    let status = fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Umask:"))?;
    u32::from_str_radix(line.trim(), 8).ok()
}

/// Mark the store's `tmp/` as the top of directory hierarchies, once (best
/// effort: a filesystem without inode flags places directories its own way).
fn spread_staging(store: &Store) {
    let tmp = store.tmp_dir();
    match fs::File::open(&tmp).map(|d| nestbox_sys::inode_flags::set_topdir(&d)) {
        Ok(Ok(_)) => {}
        Ok(Err(e)) => tracing::debug!("chattr +T {}: {e}", tmp.display()),
        Err(e) => tracing::debug!("open {}: {e}", tmp.display()),
    }
}

/// How many unnamed files a transaction may hold open: half of what the
/// process may open beyond a reserve, at most 8192.
fn unnamed_budget() -> usize {
    match nix::sys::resource::getrlimit(nix::sys::resource::Resource::RLIMIT_NOFILE) {
        Ok((soft, _)) => (soft.saturating_sub(256) / 2).min(8192) as usize,
        Err(_) => 0,
    }
}

/// Remove staging directories of transactions whose process is gone (their lock
/// can be taken). With `all_hidden` (only under the exclusive store lock, when no
/// transaction can be starting) half-made hidden ones go too.
pub fn clean_stale(store: &Store, all_hidden: bool) -> u64 {
    let mut removed = 0;
    let Ok(entries) = fs::read_dir(store.tmp_dir()) else {
        return 0;
    };
    for e in entries.flatten() {
        let dir = e.path();
        let name = e.file_name().to_string_lossy().to_string();
        let stale = if name.starts_with('.') {
            all_hidden
        } else {
            is_stale(&dir)
        };
        if stale && fs::remove_dir_all(&dir).is_ok() {
            removed += 1;
        }
    }
    removed
}

fn is_stale(dir: &Path) -> bool {
    match fs::File::open(dir.join(".lock")) {
        Ok(f) => Flock::lock(f, FlockArg::LockExclusiveNonblock).is_ok(),
        // Locked staging directories always have their lock file.
        Err(_) => true,
    }
}

/// Unix time now, in seconds.
pub fn now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

/// Fill `buf` from the kernel's random source (blocking until it is seeded);
/// no weaker fallback.
fn getrandom(buf: &mut [u8]) -> Result<()> {
    let mut filled = 0;
    while filled < buf.len() {
        let rest = &mut buf[filled..];
        // SAFETY: `rest` is a valid writable buffer of rest.len() bytes.
        let n = unsafe { libc::getrandom(rest.as_mut_ptr().cast(), rest.len(), 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.kind() == std::io::ErrorKind::Interrupted {
                continue;
            }
            return Err(StoreError::Random(e));
        }
        filled += n as usize;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn getrandom_fills_the_whole_buffer() {
        // 64 random bytes are all zero with probability 2^-512.
        let mut a = [0u8; 64];
        getrandom(&mut a).unwrap();
        assert_ne!(a, [0u8; 64]);
        let mut b = [0u8; 64];
        getrandom(&mut b).unwrap();
        assert_ne!(a, b);
    }

    /// Every object file of `store` (fan-out directory / name).
    fn objects(store: &Store) -> Vec<String> {
        let mut out = Vec::new();
        for d in fs::read_dir(store.objects_dir()).unwrap().flatten() {
            for f in fs::read_dir(d.path()).unwrap().flatten() {
                out.push(format!(
                    "{}/{}",
                    d.file_name().to_string_lossy(),
                    f.file_name().to_string_lossy()
                ));
            }
        }
        out.sort();
        out
    }

    fn put(txn: &Txn<'_>, data: &[u8]) -> Digest {
        let meta = Meta {
            mode: 0o640,
            uid: nix::unistd::geteuid().as_raw(),
            gid: nix::unistd::getegid().as_raw(),
            mtime: 1_700_000_000,
            ..Meta::default()
        };
        let err = |e| StoreError::io("read", "test")(e);
        let (d, n) = txn
            .put_reader(&mut std::io::Cursor::new(data), &meta, &err, &|_| {})
            .unwrap();
        assert_eq!(n, data.len() as u64);
        d
    }

    /// Objects staged either way (unnamed files, or named ones once the
    /// budget of open files is spent) are invisible until published, whole
    /// after, and gone without a trace when the transaction is dropped.
    #[test]
    fn staged_objects_appear_only_at_publish_either_way() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(&tmp.path().join("store")).unwrap();
        for budget in [usize::MAX, 2, 0] {
            let before = objects(&store);
            // Dropped unpublished: nothing in objects/, no staging left.
            {
                let mut txn = Txn::begin(&store).unwrap();
                txn.max_unnamed = budget;
                for i in 0..5 {
                    put(&txn, format!("dropped {budget} {i}").as_bytes());
                }
                assert_eq!(objects(&store), before);
            }
            assert_eq!(objects(&store), before);
            assert_eq!(fs::read_dir(store.tmp_dir()).unwrap().count(), 0);
            // Published: every object whole under its name, once.
            let mut txn = Txn::begin(&store).unwrap();
            txn.max_unnamed = budget;
            let datas: Vec<Vec<u8>> = (0..5)
                .map(|i| format!("kept {budget} {i}").repeat(1000).into_bytes())
                .collect();
            let digests: Vec<Digest> = datas.iter().map(|d| put(&txn, d)).collect();
            // The same content twice in one transaction is one object.
            put(&txn, &datas[0]);
            assert_eq!(txn.stats().new_objects, 5);
            assert_eq!(txn.stats().reused_objects, 1);
            // Never more unnamed files open than the budget; the rest named
            // in the staging directory.
            let unnamed = txn.unnamed.load(Ordering::Relaxed);
            assert!(
                unnamed <= budget.min(5),
                "{unnamed} unnamed, budget {budget}"
            );
            let named = fs::read_dir(&txn.dir).unwrap().count() - 1;
            assert_eq!(unnamed + named, 5, "{unnamed} unnamed, {named} named");
            let tmpfile_made = {
                use std::os::unix::fs::OpenOptionsExt;
                fs::OpenOptions::new()
                    .write(true)
                    .custom_flags(libc::O_TMPFILE)
                    .mode(0o600)
                    .open(store.objects_dir())
                    .is_ok()
            };
            if tmpfile_made {
                assert_eq!(unnamed, budget.min(5));
            }
            assert_eq!(objects(&store), before);
            txn.publish().unwrap();
            assert_eq!(objects(&store).len(), before.len() + 5);
            let key = Meta {
                mode: 0o640,
                uid: nix::unistd::geteuid().as_raw(),
                gid: nix::unistd::getegid().as_raw(),
                mtime: 1_700_000_000,
                ..Meta::default()
            }
            .key();
            for (d, data) in digests.iter().zip(&datas) {
                let path = store.object_path(d, &key);
                assert_eq!(&fs::read(&path).unwrap(), data);
                let md = fs::metadata(&path).unwrap();
                use std::os::unix::fs::{MetadataExt, PermissionsExt};
                assert_eq!(md.permissions().mode() & 0o7777, 0o640);
                assert_eq!(md.mtime(), 1_700_000_000);
                assert_eq!(md.nlink(), 1);
            }
            drop(txn);
            // Published again by a later transaction: reused, not replaced.
            let txn = Txn::begin(&store).unwrap();
            put(&txn, &datas[1]);
            assert_eq!(txn.stats().reused_objects, 1);
            txn.publish().unwrap();
        }
    }

    #[test]
    fn an_object_published_meanwhile_by_another_transaction_is_kept() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(&tmp.path().join("store")).unwrap();
        let a = Txn::begin(&store).unwrap();
        let b = Txn::begin(&store).unwrap();
        let d = put(&a, b"same");
        assert_eq!(put(&b, b"same"), d);
        a.publish().unwrap();
        b.publish().unwrap();
        assert_eq!(objects(&store).len(), 1);
    }

    /// Objects get exactly their mode whether it is made with the file (the
    /// umask leaves it whole) or set after (set-ID bits, bits the umask takes).
    #[test]
    fn objects_get_their_mode_either_way() {
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(&tmp.path().join("store")).unwrap();
        let txn = Txn::begin(&store).unwrap();
        let modes = [0o666, 0o4755, 0o2750, 0o1777, 0o600, 0o755, 0o444, 0o000];
        let mut made = Vec::new();
        for (i, mode) in modes.iter().enumerate() {
            let meta = Meta {
                mode: *mode,
                uid: nix::unistd::geteuid().as_raw(),
                gid: nix::unistd::getegid().as_raw(),
                ..Meta::default()
            };
            let err = |e| StoreError::io("read", "test")(e);
            let data = format!("mode {i}");
            let (d, _) = txn
                .put_reader(&mut data.as_bytes(), &meta, &err, &|_| {})
                .unwrap();
            made.push((store.object_path(&d, &meta.key()), *mode));
        }
        txn.publish().unwrap();
        for (path, mode) in made {
            use std::os::unix::fs::PermissionsExt;
            let got = fs::metadata(&path).unwrap().permissions().mode() & 0o7777;
            assert_eq!(got, mode, "{}", path.display());
        }
    }
}
