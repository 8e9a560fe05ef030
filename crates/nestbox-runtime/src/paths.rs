//! Where nestbox keeps things: runtime state (per-boot: box records, locks, mount
//! points) and persistent data (writable layers, logs, image caches). Both live
//! under one root that `--root` / `NESTBOX_ROOT` override, so tests are hermetic.

use std::path::{Path, PathBuf};

/// The two state directories of one nestbox root.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roots {
    /// Runtime state: box records, locks, root mount points.
    pub run: PathBuf,
    /// Persistent data: box layers and logs, image caches.
    pub lib: PathBuf,
}

impl Roots {
    /// `DIR/run` and `DIR/lib` for an explicit root.
    pub fn under(dir: &Path) -> Self {
        Roots { run: dir.join("run"), lib: dir.join("lib") }
    }

    /// `--root` if given, else `NESTBOX_ROOT`, else the system locations
    /// (`/run/nestbox`, `/var/lib/nestbox`) for root, or the user's runtime and
    /// data directories otherwise.
    pub fn resolve(explicit: Option<&Path>) -> Self {
        if let Some(dir) = explicit {
            return Self::under(dir);
        }
        if let Some(dir) = std::env::var_os("NESTBOX_ROOT").filter(|v| !v.is_empty()) {
            return Self::under(Path::new(&dir));
        }
        if nix::unistd::geteuid().is_root() {
            return Roots { run: "/run/nestbox".into(), lib: "/var/lib/nestbox".into() };
        }
        let uid = nix::unistd::geteuid();
        let run = std::env::var_os("XDG_RUNTIME_DIR")
            .map(|d| PathBuf::from(d).join("nestbox"))
            .unwrap_or_else(|| PathBuf::from(format!("/tmp/nestbox-{uid}/run")));
        let lib = std::env::var_os("HOME")
            .map(|h| PathBuf::from(h).join(".local/share/nestbox"))
            .unwrap_or_else(|| PathBuf::from(format!("/tmp/nestbox-{uid}/lib")));
        Roots { run, lib }
    }

    /// Directory of box records.
    pub fn boxes(&self) -> PathBuf {
        self.run.join("boxes")
    }
    /// Record directory of the box `name`.
    pub fn box_run(&self, name: &str) -> PathBuf {
        self.boxes().join(name)
    }
    /// Persistent data of the box with id `id`.
    pub fn box_lib(&self, id: &str) -> PathBuf {
        self.lib.join("boxes").join(id)
    }
    /// Image caches.
    pub fn images(&self) -> PathBuf {
        self.lib.join("images")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_root_wins() {
        let r = Roots::resolve(Some(Path::new("/x")));
        assert_eq!(r.run, PathBuf::from("/x/run"));
        assert_eq!(r.box_run("a"), PathBuf::from("/x/run/boxes/a"));
        assert_eq!(r.box_lib("id"), PathBuf::from("/x/lib/boxes/id"));
    }
}
