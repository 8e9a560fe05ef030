//! The store's layout on disk and its locks.
//!
//! ```text
//! STORE/lock                         flock: shared for imports and views, exclusive for gc and dedup
//! STORE/objects/ab/abcd….<metakey>   one inode per (content digest, metadata key); manifests too
//! STORE/images/NAME.json             image name → manifest id (written once, never rewritten)
//! STORE/trees/<image id>/            the image's lower tree: directories + hardlinks into objects/
//! STORE/tmp/<txn>/                   a transaction's staging directory (with its own flock)
//! ```
//!
//! All of it must be on one filesystem (hardlinks); box layers that `dedup` links
//! to objects must be on it too (the default layout puts both under the same
//! nestbox data directory).

use std::fs;
use std::os::fd::AsRawFd;
use std::os::unix::fs::DirBuilderExt;
use std::path::{Path, PathBuf};

use nix::fcntl::{Flock, FlockArg};

use crate::error::{Result, StoreError};
use crate::hash::Digest;
use crate::manifest::Manifest;
use crate::meta::Meta;

/// An image store rooted at one directory.
#[derive(Debug, Clone)]
pub struct Store {
    root: PathBuf,
}

/// A held store lock (released on drop).
#[derive(Debug)]
pub struct StoreLock {
    _lock: Flock<fs::File>,
}

impl Store {
    /// Open the store at `root`, creating its directories if needed.
    pub fn open(root: &Path) -> Result<Self> {
        let store = Store { root: root.into() };
        for dir in [
            store.root.clone(),
            store.objects_dir(),
            store.images_dir(),
            store.trees_dir(),
            store.tmp_dir(),
        ] {
            fs::DirBuilder::new()
                .recursive(true)
                .mode(0o755)
                .create(&dir)
                .map_err(StoreError::io("mkdir", &dir))?;
        }
        Ok(store)
    }

    /// Open the store at `root` only if it exists (looking an image up must not
    /// create anything).
    pub fn open_existing(root: &Path) -> Option<Self> {
        root.join("images")
            .is_dir()
            .then(|| Store { root: root.into() })
    }

    /// The store directory.
    pub fn root(&self) -> &Path {
        &self.root
    }
    /// Directory of objects.
    pub fn objects_dir(&self) -> PathBuf {
        self.root.join("objects")
    }
    /// Directory of image names.
    pub fn images_dir(&self) -> PathBuf {
        self.root.join("images")
    }
    /// Directory of materialised lower trees.
    pub fn trees_dir(&self) -> PathBuf {
        self.root.join("trees")
    }
    /// Directory of transaction staging areas.
    pub fn tmp_dir(&self) -> PathBuf {
        self.root.join("tmp")
    }
    /// The lower tree of image `id`.
    pub fn tree_path(&self, id: &Digest) -> PathBuf {
        self.trees_dir().join(id.to_hex())
    }

    /// Where the inode of `digest` with metadata key `key` lives.
    pub fn object_path(&self, digest: &Digest, key: &str) -> PathBuf {
        let hex = digest.to_hex();
        self.objects_dir()
            .join(&hex[..2])
            .join(format!("{hex}.{key}"))
    }

    /// Where manifest `id` lives.
    pub fn manifest_path(&self, id: &Digest) -> PathBuf {
        self.object_path(id, &Meta::internal().key())
    }

    /// Read manifest `id`.
    pub fn manifest(&self, id: &Digest) -> Result<Manifest> {
        let path = self.manifest_path(id);
        let data = fs::read(&path).map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                StoreError::MissingObject(id.to_hex())
            } else {
                StoreError::io("read", &path)(e)
            }
        })?;
        if Digest::of(&data) != *id {
            return Err(StoreError::BadManifest {
                id: id.to_hex(),
                why: "content does not match its digest".into(),
            });
        }
        Manifest::from_bytes(&data).map_err(|e| StoreError::BadManifest {
            id: id.to_hex(),
            why: e.to_string(),
        })
    }

    fn lock(&self, arg: FlockArg) -> Result<StoreLock> {
        let path = self.root.join("lock");
        let file = fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .read(true)
            .write(true)
            .open(&path)
            .map_err(StoreError::io("open", &path))?;
        let lock = Flock::lock(file, arg).map_err(|(_, e)| StoreError::sys("flock", &path)(e))?;
        Ok(StoreLock { _lock: lock })
    }

    /// Shared lock: imports, commits, views, removal of names.
    pub fn lock_shared(&self) -> Result<StoreLock> {
        self.lock(FlockArg::LockShared)
    }

    /// Exclusive lock: gc and dedup (they delete or relink objects).
    pub fn lock_exclusive(&self) -> Result<StoreLock> {
        self.lock(FlockArg::LockExclusive)
    }

    /// Flush every dirty page and metadata change of the store's filesystem.
    pub fn sync(&self) -> Result<()> {
        let dir = fs::File::open(&self.root).map_err(StoreError::io("open", &self.root))?;
        // SAFETY: syncfs takes an open descriptor, which `dir` owns for the call.
        let rc = unsafe { libc::syncfs(dir.as_raw_fd()) };
        if rc != 0 {
            return Err(StoreError::io("syncfs", &self.root)(
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

/// Remove the temporary file `path` an operation leaves once it has failed or
/// is done with it. Best effort: the operation's own result is what the caller
/// reports, so a file that cannot be removed is logged, not returned.
pub(crate) fn discard_file(path: &Path) {
    match fs::remove_file(path) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => tracing::warn!(path = %path.display(), error = %e, "temporary file left behind"),
    }
}

/// [`discard_file`] for a temporary directory tree.
pub(crate) fn discard_tree(path: &Path) {
    if let Err(e) = crate::tree::remove_tree(path) {
        tracing::warn!(path = %path.display(), error = %e, "temporary tree left behind");
    }
}

/// fsync the directory `dir` (makes a rename or link in it durable).
pub fn fsync_dir(dir: &Path) -> Result<()> {
    let f = fs::File::open(dir).map_err(StoreError::io("open", dir))?;
    f.sync_all().map_err(StoreError::io("fsync", dir))
}
