//! Layer snapshots: a box's writable layer (an overlayfs upper directory) as
//! plain data — every path with its kind, content object and metadata, plus
//! overlayfs' own markers (whiteouts: character devices 0/0; opaque
//! directories) — with file contents stored once in the object store.
//!
//! A snapshot is incremental: each regular file carries a [`Stamp`] (size,
//! mtime, ctime, inode), and a file whose stamp equals the previous snapshot's
//! at the same path keeps that snapshot's object without being read. Only the
//! others are hashed and stored.
//!
//! A layer is turned back into a directory by [`materialise`]: directories,
//! whiteouts and opaque markers made anew, regular files hardlinked to their
//! objects. Such a directory is only ever used as a *read-only* lower layer
//! (overlayfs writes upper files in place, which would change a shared
//! object). [`LayerManifest::compose`] stacks a layer read from an upper
//! directory onto the lower layer it was mounted over, and [`diff`] lists what
//! a box sees differently between two layers over the same image.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt};
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Result, StoreError};
use crate::hash::Digest;
use crate::import::dir::is_opaque;
use crate::manifest::{parent, Entry, Kind};
use crate::meta::Meta;
use crate::store::Store;
use crate::txn::Txn;
use crate::walk::walk;

/// Current layer manifest format.
pub const LAYER_VERSION: u32 = 1;

/// The xattr overlayfs reads to make a directory opaque.
const OPAQUE_XATTR: &str = "trusted.overlay.opaque";
/// The same for an overlay mounted with `userxattr` (in a user namespace).
const USER_OPAQUE_XATTR: &str = "user.overlay.opaque";

/// What changes whenever a regular file's content or metadata can have changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Stamp {
    /// Length.
    pub size: u64,
    /// Inode number.
    pub ino: u64,
    /// Modification time (seconds, nanoseconds).
    pub mtime: (i64, i64),
    /// Status change time (seconds, nanoseconds): any chmod, chown, xattr or
    /// write moves it, and it cannot be set back from user space.
    pub ctime: (i64, i64),
}

impl Stamp {
    fn of(md: &fs::Metadata) -> Self {
        Stamp {
            size: md.len(),
            ino: md.ino(),
            mtime: (md.mtime(), md.mtime_nsec()),
            ctime: (md.ctime(), md.ctime_nsec()),
        }
    }
}

/// One path of a layer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct LayerEntry {
    /// Kind, object and metadata (a whiteout is a character device 0/0).
    pub entry: Entry,
    /// A directory that hides what lower layers hold in it.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub opaque: bool,
    /// Regular files read from an upper directory: their stamp then.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub stamp: Option<Stamp>,
}

impl LayerEntry {
    /// Whether this is an overlayfs whiteout.
    pub fn is_whiteout(&self) -> bool {
        matches!(self.entry.kind, Kind::Char { major: 0, minor: 0 })
    }
}

/// A whole layer: path → entry (the layer root itself is not listed).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, Default)]
pub struct LayerManifest {
    /// Format version.
    pub version: u32,
    /// Every path, sorted (parents first).
    pub entries: BTreeMap<String, LayerEntry>,
}

/// How to treat the contents of files that must be read.
#[derive(Debug, Clone, Copy)]
pub enum Contents<'a> {
    /// Store them through this transaction.
    Store(&'a Txn<'a>),
    /// Only hash them (for `diff`: nothing is written).
    HashOnly,
}

/// Figures of one [`scan_upper`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ScanStats {
    /// Paths in the upper directory.
    pub paths: u64,
    /// Regular files read (new or changed since the previous layer).
    pub files_read: u64,
    /// Their bytes.
    pub bytes_read: u64,
    /// Regular files whose stamp matched the previous layer's (not read).
    pub files_reused: u64,
}

impl LayerManifest {
    /// A layer with nothing in it.
    pub fn empty() -> Self {
        LayerManifest {
            version: LAYER_VERSION,
            entries: BTreeMap::new(),
        }
    }

    /// Every (content digest, metadata key) a regular file of the layer uses.
    pub fn inodes(&self) -> impl Iterator<Item = (Digest, String)> + '_ {
        self.entries.values().filter_map(|e| match e.entry.kind {
            Kind::File { object, .. } => Some((object, e.entry.meta.key())),
            _ => None,
        })
    }

    /// Number of regular files and their content bytes.
    pub fn file_stats(&self) -> (u64, u64) {
        self.entries
            .values()
            .filter_map(|e| match e.entry.kind {
                Kind::File { size, .. } => Some(size),
                _ => None,
            })
            .fold((0, 0), |(n, b), s| (n + 1, b + s))
    }

    fn remove_children(&mut self, dir: &str) {
        let lo = format!("{dir}/");
        let hi = format!("{dir}0");
        let keys: Vec<String> = self.entries.range(lo..hi).map(|(k, _)| k.clone()).collect();
        for k in keys {
            self.entries.remove(&k);
        }
    }

    /// The single layer equal to `upper` mounted over `self` (both over the
    /// same image): what `upper` whites out or makes opaque hides `self`'s
    /// entries; a directory over a directory keeps what is below it (and stays
    /// opaque if the lower one was); anything else replaces.
    pub fn compose(&self, upper: &LayerManifest) -> LayerManifest {
        let mut out = self.clone();
        for (path, e) in &upper.entries {
            let below = out.entries.get(path).cloned();
            if !e.entry.is_dir() || e.opaque {
                out.remove_children(path);
            }
            let mut e = e.clone();
            if e.entry.is_dir() {
                if let Some(b) = below {
                    // A directory made where a lower whiteout or file was hides
                    // the image's directory too (overlayfs made it opaque).
                    e.opaque |= b.opaque || !b.entry.is_dir();
                }
            }
            out.entries.insert(path.clone(), e);
        }
        out
    }
}

/// Read the upper directory `upper` into a layer. A regular file whose stamp
/// equals `previous`'s entry at the same path takes that entry's object
/// unread; the others are read through `contents`.
pub fn scan_upper(
    upper: &Path,
    previous: Option<&LayerManifest>,
    contents: Contents<'_>,
) -> Result<(LayerManifest, ScanStats)> {
    let mut out = LayerManifest::empty();
    let mut stats = ScanStats::default();
    let mut jobs: Vec<(String, PathBuf, Meta, Stamp)> = Vec::new();
    for e in walk(upper, true)? {
        if e.rel.is_empty() {
            // The upper root's own metadata is the runtime's, not the box's.
            continue;
        }
        stats.paths += 1;
        let ft = e.md.file_type();
        let refused = |why: &str| StoreError::refused(upper, e.rel.clone(), why);
        let with_xattrs = !ft.is_symlink();
        let meta = Meta::from_metadata(&e.path, &e.md, with_xattrs)?;
        let (kind, opaque) = if ft.is_dir() {
            (Kind::Dir, is_opaque(&e.path))
        } else if ft.is_file() {
            let stamp = Stamp::of(&e.md);
            let reuse = previous
                .and_then(|p| p.entries.get(&e.rel))
                .filter(|p| p.stamp == Some(stamp) && p.entry.meta == meta);
            if let Some(p) = reuse {
                stats.files_reused += 1;
                out.entries.insert(e.rel.clone(), p.clone());
            } else {
                jobs.push((e.rel.clone(), e.path.clone(), meta, stamp));
            }
            continue;
        } else if ft.is_symlink() {
            let t = fs::read_link(&e.path).map_err(StoreError::io("readlink", &e.path))?;
            let target = t
                .to_str()
                .ok_or_else(|| refused("symlink target is not UTF-8"))?
                .to_string();
            (Kind::Symlink { target }, false)
        } else if ft.is_char_device() || ft.is_block_device() {
            let (major, minor) = (
                nix::sys::stat::major(e.md.rdev()) as u32,
                nix::sys::stat::minor(e.md.rdev()) as u32,
            );
            if ft.is_char_device() {
                (Kind::Char { major, minor }, false)
            } else {
                (Kind::Block { major, minor }, false)
            }
        } else if ft.is_fifo() {
            (Kind::Fifo, false)
        } else {
            // Sockets: a bound socket's inode cannot be recreated by a file
            // operation; like a directory import, they are left out.
            continue;
        };
        out.entries.insert(
            e.rel.clone(),
            LayerEntry {
                entry: Entry { kind, meta },
                opaque,
                stamp: None,
            },
        );
    }
    let read = read_files(&jobs, contents)?;
    for ((rel, _, meta, stamp), (object, size)) in jobs.into_iter().zip(read) {
        stats.files_read += 1;
        stats.bytes_read += size;
        out.entries.insert(
            rel,
            LayerEntry {
                entry: Entry {
                    kind: Kind::File { object, size },
                    meta,
                },
                opaque: false,
                stamp: Some(stamp),
            },
        );
    }
    Ok((out, stats))
}

/// Hash (and with [`Contents::Store`], store) every job's file, on up to two
/// threads; results in job order.
fn read_files(
    jobs: &[(String, PathBuf, Meta, Stamp)],
    contents: Contents<'_>,
) -> Result<Vec<(Digest, u64)>> {
    // Each thread opens every directory it reads from once, and each file
    // relative to it.
    type Dirs = HashMap<PathBuf, fs::File>;
    let open = |dirs: &mut Dirs, path: &Path| -> Result<fs::File> {
        let (Some(dir), Some(name)) = (path.parent(), path.file_name()) else {
            return fs::File::open(path).map_err(StoreError::io("open", path));
        };
        if !dirs.contains_key(dir) {
            let d = fs::File::open(dir).map_err(StoreError::io("open", dir))?;
            dirs.insert(dir.to_path_buf(), d);
        }
        nestbox_sys::at::open_at(
            &dirs[dir],
            Path::new(name),
            nix::fcntl::OFlag::O_RDONLY,
            nix::sys::stat::Mode::empty(),
        )
        .map(fs::File::from)
        .map_err(StoreError::sys("open", path))
    };
    let one = |dirs: &mut Dirs, path: &Path, meta: &Meta| -> Result<(Digest, u64)> {
        let mut f = open(dirs, path)?;
        match contents {
            Contents::Store(txn) => {
                let read_err = |e| StoreError::io("read", path)(e);
                txn.put_reader(&mut f, meta, &read_err, &|_| {})
            }
            Contents::HashOnly => {
                let mut h = blake3::Hasher::new();
                let n = std::io::copy(&mut f, &mut h).map_err(StoreError::io("read", path))?;
                Ok((Digest::from_hasher(&h), n))
            }
        }
    };
    let all = |jobs: &[(String, PathBuf, Meta, Stamp)]| -> Result<Vec<(Digest, u64)>> {
        let mut dirs = Dirs::new();
        jobs.iter()
            .map(|(_, p, m, _)| one(&mut dirs, p, m))
            .collect()
    };
    if jobs.len() < 64 {
        return all(jobs);
    }
    if let Contents::Store(txn) = contents {
        txn.expect_objects(jobs.len());
    }
    let half = jobs.len() / 2;
    let (a, b) = jobs.split_at(half);
    let (ra, rb) = std::thread::scope(|s| {
        let t = s.spawn(|| all(b));
        let ra = all(a);
        (ra, t.join().expect("hashing thread does not panic"))
    });
    let mut out = ra?;
    out.extend(rb?);
    Ok(out)
}

/// Build `layer` as a directory at `root` (which must not exist): directories
/// (opaque ones marked so), whiteouts, symlinks and special files made anew,
/// regular files hardlinked to their objects in `store` (so the directory is
/// for a read-only lower layer only). `root` gets mode 0755. With
/// `user_xattrs`, opaque directories are marked for an overlay mounted in a
/// user namespace (`user.overlay.opaque`).
pub fn materialise(
    store: &Store,
    layer: &LayerManifest,
    root: &Path,
    user_xattrs: bool,
) -> Result<()> {
    let opaque_xattr = if user_xattrs {
        USER_OPAQUE_XATTR
    } else {
        OPAQUE_XATTR
    };
    let mut dirs = fs::DirBuilder::new();
    dirs.mode(0o700);
    dirs.create(root).map_err(StoreError::io("mkdir", root))?;
    // Directories (parents first), whiteouts, symlinks and special files by
    // path; then the regular files, hardlinked relative to open directories.
    let mut files: Vec<(&str, &Entry)> = Vec::new();
    for (path, e) in &layer.entries {
        if matches!(e.entry.kind, Kind::File { .. }) {
            files.push((path, &e.entry));
        } else {
            crate::tree::make_entry(store, &dirs, path, &e.entry, &root.join(path))?;
        }
    }
    link_files(store, &files, root)?;
    // Directory metadata last, children first, so nothing moves an mtime once set.
    for (path, e) in layer.entries.iter().rev() {
        if e.entry.is_dir() {
            let mut meta = e.entry.meta.clone();
            if e.opaque {
                meta.xattrs
                    .insert(opaque_xattr.into(), crate::meta::XattrValue(b"y".to_vec()));
            }
            meta.apply_path(&root.join(path), false)?;
        }
    }
    fs::set_permissions(root, std::os::unix::fs::PermissionsExt::from_mode(0o755))
        .map_err(StoreError::io("chmod", root))?;
    Ok(())
}

/// Hardlink each regular file of `files` (layer path, entry) under `root` to
/// its object in `store`. Every directory linked into, and every fan-out
/// directory of `objects/` linked from, is opened once: a link is one
/// `linkat` of two names, not two path walks.
fn link_files(store: &Store, files: &[(&str, &Entry)], root: &Path) -> Result<()> {
    let part = |files: &[(&str, &Entry)]| -> Result<()> {
        let mut targets: HashMap<&str, fs::File> = HashMap::new();
        let mut sources: HashMap<PathBuf, fs::File> = HashMap::new();
        for &(path, entry) in files {
            let Kind::File { object, .. } = &entry.kind else {
                continue;
            };
            let (dir, name) = match path.rsplit_once('/') {
                Some((d, n)) => (d, n),
                None => ("", path),
            };
            let target = root.join(path);
            if !targets.contains_key(dir) {
                let d = root.join(dir);
                let f = fs::File::open(&d).map_err(StoreError::io("open", &d))?;
                targets.insert(dir, f);
            }
            let src = store.object_path(object, &entry.meta.key());
            let (sdir, sname) = (
                src.parent().expect("objects have a parent"),
                src.file_name().expect("objects have a name"),
            );
            if !sources.contains_key(sdir) {
                match fs::File::open(sdir) {
                    Ok(f) => {
                        sources.insert(sdir.to_path_buf(), f);
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                        return Err(StoreError::MissingObject(format!("{object} ({path})")));
                    }
                    Err(e) => return Err(StoreError::io("open", sdir)(e)),
                }
            }
            nix::unistd::linkat(
                Some(sources[sdir].as_raw_fd()),
                Path::new(sname),
                Some(targets[dir].as_raw_fd()),
                Path::new(name),
                nix::fcntl::AtFlags::empty(),
            )
            .map_err(|e| {
                if e == nix::errno::Errno::ENOENT && !src.exists() {
                    StoreError::MissingObject(format!("{object} ({path})"))
                } else {
                    StoreError::sys("link", &target)(e)
                }
            })?;
        }
        Ok(())
    };
    // One thread: links into one directory take its lock in turn, and a
    // second thread measured slower (contention, its start).
    part(files)
}

/// How a path differs between two layers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Change {
    /// Present now, absent before.
    Added,
    /// Present in both, different kind, content or metadata.
    Changed,
    /// Absent now, present before (a deleted directory is listed alone, not
    /// its contents).
    Deleted,
}

impl Change {
    /// `A`, `C` or `D`, as `docker diff` prints them.
    pub fn letter(self) -> char {
        match self {
            Change::Added => 'A',
            Change::Changed => 'C',
            Change::Deleted => 'D',
        }
    }
}

/// What lies below the layers: the image, as the overlay's lower directories.
pub trait Below {
    /// Whether the image has `path`.
    fn has(&self, path: &str) -> bool;
    /// The names in the image's directory `path` (empty if none).
    fn children(&self, path: &str) -> Vec<String>;
}

/// What a box sees at a path with `layer` over the image.
#[derive(PartialEq)]
enum Seen<'a> {
    Absent,
    Image,
    Layer(&'a Entry),
}

fn seen<'a>(layer: &'a LayerManifest, below: &dyn Below, path: &str) -> Seen<'a> {
    if let Some(e) = layer.entries.get(path) {
        return if e.is_whiteout() {
            Seen::Absent
        } else {
            Seen::Layer(&e.entry)
        };
    }
    let mut p = path;
    while let Some(up) = parent(p) {
        if up.is_empty() {
            break;
        }
        if let Some(a) = layer.entries.get(up) {
            if !a.entry.is_dir() || a.opaque {
                return Seen::Absent;
            }
        }
        p = up;
    }
    if below.has(path) {
        Seen::Image
    } else {
        Seen::Absent
    }
}

/// The paths a box sees differently with layer `to` than with layer `from`
/// (both over the image `below`), sorted. Directories whose own metadata
/// changed (as every parent of a changed path does) are listed as changed,
/// as `docker diff` does.
pub fn diff(from: &LayerManifest, to: &LayerManifest, below: &dyn Below) -> Vec<(Change, String)> {
    let mut paths: BTreeSet<&str> = BTreeSet::new();
    let mut hidden: BTreeSet<String> = BTreeSet::new();
    for layer in [from, to] {
        for (p, e) in &layer.entries {
            paths.insert(p);
            if e.opaque || e.is_whiteout() || !e.entry.is_dir() {
                for c in below.children(p) {
                    hidden.insert(crate::manifest::join(p, &c));
                }
            }
        }
    }
    let all: BTreeSet<String> = paths
        .into_iter()
        .map(str::to_string)
        .chain(hidden)
        .collect();
    let mut out: Vec<(Change, String)> = Vec::new();
    let mut deleted: Option<String> = None;
    for p in all {
        if let Some(d) = &deleted {
            if p.starts_with(d.as_str()) && p.as_bytes().get(d.len()) == Some(&b'/') {
                continue;
            }
        }
        let change = match (seen(from, below, &p), seen(to, below, &p)) {
            (Seen::Absent, Seen::Absent) => None,
            (Seen::Absent, _) => Some(Change::Added),
            (_, Seen::Absent) => Some(Change::Deleted),
            (Seen::Image, Seen::Image) => None,
            (Seen::Layer(a), Seen::Layer(b)) if a == b => None,
            _ => Some(Change::Changed),
        };
        if let Some(c) = change {
            if c == Change::Deleted {
                deleted = Some(p.clone());
            }
            out.push((c, p));
        }
    }
    out
}

/// [`Below`] for an overlay's lower directories (top first) on the host.
#[derive(Debug, Clone)]
pub struct LowerDirs(pub Vec<PathBuf>);

impl Below for LowerDirs {
    fn has(&self, path: &str) -> bool {
        self.0
            .iter()
            .any(|d| fs::symlink_metadata(d.join(path)).is_ok())
    }
    fn children(&self, path: &str) -> Vec<String> {
        let mut out = BTreeSet::new();
        for d in &self.0 {
            let dir = d.join(path);
            if !fs::symlink_metadata(&dir).is_ok_and(|m| m.is_dir()) {
                continue;
            }
            if let Ok(rd) = fs::read_dir(&dir) {
                for e in rd.flatten() {
                    if let Some(n) = e.file_name().to_str() {
                        out.insert(n.to_string());
                    }
                }
            }
        }
        out.into_iter().collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(obj: &[u8]) -> LayerEntry {
        LayerEntry {
            entry: Entry {
                kind: Kind::File {
                    object: Digest::of(obj),
                    size: obj.len() as u64,
                },
                meta: Meta {
                    mode: 0o644,
                    ..Meta::default()
                },
            },
            opaque: false,
            stamp: None,
        }
    }

    fn dir(opaque: bool) -> LayerEntry {
        LayerEntry {
            entry: Entry {
                kind: Kind::Dir,
                meta: Meta {
                    mode: 0o755,
                    ..Meta::default()
                },
            },
            opaque,
            stamp: None,
        }
    }

    fn whiteout() -> LayerEntry {
        LayerEntry {
            entry: Entry {
                kind: Kind::Char { major: 0, minor: 0 },
                meta: Meta::default(),
            },
            opaque: false,
            stamp: None,
        }
    }

    fn layer(items: &[(&str, LayerEntry)]) -> LayerManifest {
        let mut l = LayerManifest::empty();
        for (p, e) in items {
            l.entries.insert(p.to_string(), e.clone());
        }
        l
    }

    struct Img(BTreeSet<&'static str>);
    impl Below for Img {
        fn has(&self, path: &str) -> bool {
            self.0.contains(path)
        }
        fn children(&self, path: &str) -> Vec<String> {
            self.0
                .iter()
                .filter(|p| parent(p) == Some(path))
                .map(|p| p.rsplit('/').next().unwrap().to_string())
                .collect()
        }
    }

    #[test]
    fn compose_stacks_like_overlayfs() {
        let base = layer(&[
            ("etc", dir(false)),
            ("etc/a", file(b"a")),
            ("etc/gone", whiteout()),
            ("d", dir(false)),
            ("d/x", file(b"x")),
        ]);
        let upper = layer(&[
            ("etc", dir(false)),
            ("etc/gone", dir(false)),
            ("d", dir(true)),
            ("d/y", file(b"y")),
            ("etc/a", whiteout()),
        ]);
        let c = base.compose(&upper);
        assert!(c.entries["etc/a"].is_whiteout());
        assert!(
            c.entries["etc/gone"].opaque,
            "a dir over a whiteout hides the image's"
        );
        assert!(
            !c.entries.contains_key("d/x"),
            "opaque hides the lower layer's"
        );
        assert!(c.entries.contains_key("d/y"));
        assert!(c.entries["d"].opaque);
    }

    #[test]
    fn diff_lists_what_the_box_sees() {
        let img = Img(["etc", "etc/hello", "etc/d", "etc/d/one", "bin", "bin/sh"].into());
        let snap = layer(&[
            ("etc", dir(false)),
            ("etc/new", file(b"1")),
            ("etc/hello", whiteout()),
        ]);
        let mut later = snap.clone();
        later.entries.insert("etc/new".into(), file(b"2"));
        later.entries.insert("etc/d".into(), dir(true));
        later.entries.insert("etc/d/two".into(), file(b"t"));
        later.entries.insert("bin".into(), whiteout());
        let got: Vec<(char, String)> = diff(&snap, &later, &img)
            .into_iter()
            .map(|(c, p)| (c.letter(), p))
            .collect();
        let want: Vec<(char, String)> = vec![
            ('D', "bin".into()),
            ('C', "etc/d".into()),
            ('D', "etc/d/one".into()),
            ('A', "etc/d/two".into()),
            ('C', "etc/new".into()),
        ];
        assert_eq!(got, want);
        let from_image: Vec<(char, String)> = diff(&LayerManifest::empty(), &snap, &img)
            .into_iter()
            .map(|(c, p)| (c.letter(), p))
            .collect();
        assert_eq!(
            from_image,
            vec![
                ('C', "etc".to_string()),
                ('D', "etc/hello".into()),
                ('A', "etc/new".into())
            ]
        );
    }

    #[test]
    fn scan_reuses_unchanged_files_and_materialise_round_trips() {
        // Whiteouts (mknod) and trusted.* xattrs need root.
        if !nestbox_testkit::require_root("scan_reuses_unchanged_files_and_materialise_round_trips")
        {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(&tmp.path().join("store")).unwrap();
        let upper = tmp.path().join("upper");
        fs::create_dir_all(upper.join("d/e")).unwrap();
        fs::write(upper.join("d/e/f"), b"hello").unwrap();
        fs::write(upper.join("g"), b"other").unwrap();
        nix::sys::stat::mknod(
            &upper.join("wh"),
            nix::sys::stat::SFlag::S_IFCHR,
            nix::sys::stat::Mode::from_bits_truncate(0),
            0,
        )
        .unwrap();
        crate::meta::Meta {
            mode: 0o755,
            xattrs: [(
                OPAQUE_XATTR.to_string(),
                crate::meta::XattrValue(b"y".to_vec()),
            )]
            .into(),
            ..Meta::default()
        }
        .apply_path(&upper.join("d"), false)
        .unwrap();
        let txn = Txn::begin(&store).unwrap();
        let (first, s1) = scan_upper(&upper, None, Contents::Store(&txn)).unwrap();
        txn.publish().unwrap();
        drop(txn);
        assert_eq!(s1.files_read, 2);
        assert!(first.entries["d"].opaque);
        assert!(first.entries["wh"].is_whiteout());
        fs::write(upper.join("g"), b"changed").unwrap();
        let (second, s2) = scan_upper(&upper, Some(&first), Contents::HashOnly).unwrap();
        assert_eq!((s2.files_read, s2.files_reused), (1, 1));
        let got: Vec<String> = diff(&first, &second, &LowerDirs(vec![]))
            .into_iter()
            .map(|(c, p)| format!("{} {p}", c.letter()))
            .collect();
        assert_eq!(got, vec!["C g"]);
        let out = tmp.path().join("out");
        materialise(&store, &first, &out, false).unwrap();
        assert_eq!(fs::read(out.join("d/e/f")).unwrap(), b"hello");
        assert!(is_opaque(&out.join("d")));
        let md = fs::symlink_metadata(out.join("wh")).unwrap();
        assert!(md.file_type().is_char_device() && md.rdev() == 0);
        let (again, _) = scan_upper(&out, None, Contents::HashOnly).unwrap();
        let strip = |l: &LayerManifest| {
            l.entries
                .iter()
                .map(|(p, e)| (p.clone(), e.entry.clone(), e.opaque))
                .collect::<Vec<_>>()
        };
        assert_eq!(strip(&again), strip(&first));
    }

    /// Many files in several directories, each a
    /// hardlink to its object; a missing object is named in the error.
    #[test]
    fn materialise_links_many_files_relative_to_directories() {
        if !nestbox_testkit::require_root("materialise_links_many_files_relative_to_directories") {
            return;
        }
        let tmp = tempfile::tempdir().unwrap();
        let store = Store::open(&tmp.path().join("store")).unwrap();
        let upper = tmp.path().join("upper");
        for d in ["a", "b/c"] {
            fs::create_dir_all(upper.join(d)).unwrap();
        }
        for i in 0..600 {
            let dir = ["", "a/", "b/c/"][i % 3];
            fs::write(upper.join(format!("{dir}f{i}")), format!("file {i}")).unwrap();
        }
        let txn = Txn::begin(&store).unwrap();
        let (layer, stats) = scan_upper(&upper, None, Contents::Store(&txn)).unwrap();
        txn.publish().unwrap();
        drop(txn);
        assert_eq!(stats.files_read, 600);
        let out = tmp.path().join("out");
        materialise(&store, &layer, &out, false).unwrap();
        for i in 0..600 {
            let dir = ["", "a/", "b/c/"][i % 3];
            let p = out.join(format!("{dir}f{i}"));
            assert_eq!(fs::read_to_string(&p).unwrap(), format!("file {i}"));
            let Kind::File { object, .. } = &layer.entries[&format!("{dir}f{i}")].entry.kind else {
                panic!("a file");
            };
            let key = layer.entries[&format!("{dir}f{i}")].entry.meta.key();
            assert_eq!(
                fs::metadata(&p).unwrap().ino(),
                fs::metadata(store.object_path(object, &key)).unwrap().ino()
            );
        }
        let (again, _) = scan_upper(&out, None, Contents::HashOnly).unwrap();
        let strip = |l: &LayerManifest| {
            l.entries
                .iter()
                .map(|(p, e)| (p.clone(), e.entry.clone()))
                .collect::<Vec<_>>()
        };
        assert_eq!(strip(&again), strip(&layer));
        // An object gone from the store: the error names it.
        let mut broken = layer.clone();
        broken.entries.insert("a/f3".into(), file(b"never stored"));
        let err = materialise(&store, &broken, &tmp.path().join("out2"), false).unwrap_err();
        assert!(
            matches!(err, StoreError::MissingObject(ref m) if m.contains("a/f3")),
            "{err}"
        );
    }
}
