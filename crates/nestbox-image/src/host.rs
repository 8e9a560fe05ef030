//! The built-in default image: the host's own system directories, read-only.
//!
//! The box root is an overlay over a small *skeleton* directory that holds the
//! top-level names of a Linux root: the host's `/usr`, `/etc` (and `/bin`, `/sbin`,
//! `/lib*` when they are real directories rather than merged-usr symlinks) become
//! mount points for read-only binds of the host directories; `/tmp`, `/var`, `/run`,
//! `/home` and `/root` are empty and private to the box; `/proc`, `/sys` and `/dev`
//! are mount points for the isolation layer. Everything a box writes lands in its
//! private writable layer of the root. Nothing else of the host — its data, home
//! directories, nestbox's own state — exists in the box.
//!
//! The skeleton is built once and cached; it is created under a temporary name and
//! renamed into place, so concurrent first runs never see a half-made one.

use std::fs;
use std::os::unix::fs::{symlink, DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};

use crate::{Image, ImageError, Layer, ReadOnlyBind, RootView, HOST_IMAGE};

/// Top-level host entries shared read-only with boxes (directory or symlink).
const SYSTEM_DIRS: &[&str] = &[
    "usr", "bin", "sbin", "lib", "lib32", "lib64", "libx32", "etc",
];
/// Empty, private top-level directories, with their modes.
const PRIVATE_DIRS: &[(&str, u32)] = &[
    ("tmp", 0o1777),
    ("var", 0o755),
    ("run", 0o755),
    ("home", 0o755),
    ("root", 0o700),
    ("proc", 0o555),
    ("sys", 0o555),
    ("dev", 0o755),
];
/// Bump when the skeleton's layout changes so stale caches are not reused.
const SKELETON_VERSION: u32 = 1;

/// The host's system directories as an image.
#[derive(Debug, Clone)]
pub struct HostImage {
    cache: PathBuf,
    host_root: PathBuf,
}

impl HostImage {
    /// An image whose prepared skeleton lives under `cache`.
    pub fn new(cache: PathBuf) -> Self {
        HostImage {
            cache,
            host_root: PathBuf::from("/"),
        }
    }

    /// Same, reading system directories from `host_root` instead of `/` (tests).
    pub fn with_host_root(cache: PathBuf, host_root: PathBuf) -> Self {
        HostImage { cache, host_root }
    }

    fn skeleton_path(&self, owner: Option<(u32, u32)>) -> PathBuf {
        match owner {
            None => self.cache.join(format!("skeleton-v{SKELETON_VERSION}")),
            Some((u, g)) => self
                .cache
                .join(format!("skeleton-v{SKELETON_VERSION}-{u}-{g}")),
        }
    }

    /// Host system directories that are real directories (each gets an overlay).
    fn shared_dirs(&self) -> Vec<&'static str> {
        SYSTEM_DIRS
            .iter()
            .copied()
            .filter(|d| {
                fs::symlink_metadata(self.host_root.join(d))
                    .map(|m| m.is_dir())
                    .unwrap_or(false)
            })
            .collect()
    }

    fn ensure_skeleton(&self, owner: Option<(u32, u32)>) -> Result<PathBuf, ImageError> {
        let skel = self.skeleton_path(owner);
        if skel.is_dir() {
            return Ok(skel);
        }
        fs::create_dir_all(&self.cache).map_err(ImageError::io("create", &self.cache))?;
        let tmp = self
            .cache
            .join(format!(".skeleton-tmp-{}", std::process::id()));
        // A leftover of an earlier attempt of this pid; absent is the usual case.
        let _ = fs::remove_dir_all(&tmp);
        self.build_skeleton(&tmp, owner).inspect_err(|_| {
            if let Err(e) = fs::remove_dir_all(&tmp) {
                tracing::warn!("removing {}: {e}", tmp.display());
            }
        })?;
        fs::set_permissions(&tmp, fs::Permissions::from_mode(0o755))
            .map_err(ImageError::io("chmod", &tmp))?;
        match fs::rename(&tmp, &skel) {
            Ok(()) => Ok(skel),
            // Another process won the race: use its skeleton.
            Err(_) if skel.is_dir() => {
                let _ = fs::remove_dir_all(&tmp);
                Ok(skel)
            }
            Err(e) => {
                let _ = fs::remove_dir_all(&tmp);
                Err(ImageError::io("rename", &skel)(e))
            }
        }
    }

    fn build_skeleton(&self, dir: &Path, owner: Option<(u32, u32)>) -> Result<(), ImageError> {
        let mut builder = fs::DirBuilder::new();
        builder.mode(0o755);
        builder.create(dir).map_err(ImageError::io("mkdir", dir))?;
        for name in SYSTEM_DIRS {
            let host = self.host_root.join(name);
            let Ok(meta) = fs::symlink_metadata(&host) else {
                continue;
            };
            let path = dir.join(name);
            if meta.file_type().is_symlink() {
                let target = fs::read_link(&host).map_err(ImageError::io("readlink", &host))?;
                symlink(&target, &path).map_err(ImageError::io("symlink", &path))?;
            } else if meta.is_dir() {
                builder
                    .create(&path)
                    .map_err(ImageError::io("mkdir", &path))?;
            }
        }
        for (name, mode) in PRIVATE_DIRS {
            let path = dir.join(name);
            builder
                .create(&path)
                .map_err(ImageError::io("mkdir", &path))?;
            fs::set_permissions(&path, fs::Permissions::from_mode(*mode))
                .map_err(ImageError::io("chmod", &path))?;
        }
        if let Some((uid, gid)) = owner {
            for (name, _) in PRIVATE_DIRS {
                let path = dir.join(name);
                std::os::unix::fs::chown(&path, Some(uid), Some(gid))
                    .map_err(ImageError::io("chown", &path))?;
            }
            std::os::unix::fs::chown(dir, Some(uid), Some(gid))
                .map_err(ImageError::io("chown", dir))?;
        }
        Ok(())
    }
}

impl Image for HostImage {
    fn name(&self) -> &str {
        HOST_IMAGE
    }

    fn root_view(&self, owner: Option<(u32, u32)>) -> Result<RootView, ImageError> {
        let skel = self.ensure_skeleton(owner)?;
        let layers = vec![Layer {
            target: PathBuf::from("/"),
            lowers: vec![skel],
        }];
        let read_only = self
            .shared_dirs()
            .into_iter()
            .map(|dir| ReadOnlyBind {
                source: self.host_root.join(dir),
                target: PathBuf::from("/").join(dir),
            })
            .collect();
        Ok(RootView { layers, read_only })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::open_image;

    fn fake_host() -> tempfile::TempDir {
        let host = tempfile::tempdir().unwrap();
        fs::create_dir(host.path().join("usr")).unwrap();
        fs::create_dir(host.path().join("etc")).unwrap();
        fs::create_dir(host.path().join("work")).unwrap();
        symlink("usr/bin", host.path().join("bin")).unwrap();
        host
    }

    #[test]
    fn view_binds_real_system_dirs_read_only_and_mirrors_symlinks() {
        let host = fake_host();
        let cache = tempfile::tempdir().unwrap();
        let img = HostImage::with_host_root(cache.path().into(), host.path().into());
        let view = img.root_view(None).unwrap();
        let targets: Vec<_> = view.layers.iter().map(|l| l.target.clone()).collect();
        assert_eq!(targets, vec![PathBuf::from("/")]);
        let binds: Vec<_> = view
            .read_only
            .iter()
            .map(|b| (b.source.clone(), b.target.clone()))
            .collect();
        assert_eq!(
            binds,
            vec![
                (host.path().join("usr"), "/usr".into()),
                (host.path().join("etc"), "/etc".into())
            ]
        );
        let skel = &view.layers[0].lowers[0];
        assert_eq!(
            fs::read_link(skel.join("bin")).unwrap(),
            PathBuf::from("usr/bin")
        );
        assert!(skel.join("usr").is_dir());
        assert!(
            !skel.join("work").exists(),
            "host data must not be in the skeleton"
        );
        let tmp_mode = fs::metadata(skel.join("tmp")).unwrap().permissions().mode();
        assert_eq!(tmp_mode & 0o7777, 0o1777);
        assert_eq!(fs::read_dir(skel.join("root")).unwrap().count(), 0);
    }

    #[test]
    fn skeleton_is_cached_and_reused() {
        let host = fake_host();
        let cache = tempfile::tempdir().unwrap();
        let img = HostImage::with_host_root(cache.path().into(), host.path().into());
        let a = img.root_view(None).unwrap();
        fs::write(a.layers[0].lowers[0].join("marker"), b"x").unwrap();
        let b = img.root_view(None).unwrap();
        assert!(b.layers[0].lowers[0].join("marker").exists());
        let entries = fs::read_dir(cache.path()).unwrap().count();
        assert_eq!(entries, 1, "only the skeleton, no temporary leftovers");
    }

    #[test]
    fn unknown_image_is_a_clear_error() {
        let cache = tempfile::tempdir().unwrap();
        let err = open_image("debian", cache.path()).err().unwrap();
        assert!(err.to_string().contains("\"debian\" not found"));
    }
}
