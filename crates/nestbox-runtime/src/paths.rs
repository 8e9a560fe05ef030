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
        Roots {
            run: dir.join("run"),
            lib: dir.join("lib"),
        }
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
            return Roots {
                run: "/run/nestbox".into(),
                lib: "/var/lib/nestbox".into(),
            };
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
    /// Where every box assembles its root, each inside its own mount
    /// namespace: one directory for all, never mounted on in the host's
    /// namespace, made once and never removed with a box (removing a mount
    /// point would detach the mounts on it in every namespace).
    pub fn root_mountpoint(&self) -> PathBuf {
        self.run.join("mnt")
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

    /// A short tag naming this root (FNV-1a of its runtime directory), put in the
    /// names of the cgroups its boxes own, so garbage collection of one root never
    /// touches the boxes of another root under the same parent cgroup.
    pub fn tag(&self) -> String {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in self.run.as_os_str().as_encoded_bytes() {
            h ^= u64::from(*b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        format!("{:08x}", h as u32)
    }

    /// The cgroup id of box `box_id` of this root: `<tag>-<box id>`.
    pub fn cgroup_id(&self, box_id: &str) -> String {
        format!("{}-{box_id}", self.tag())
    }

    /// The box id inside a cgroup id, if the cgroup belongs to this root.
    pub fn box_id_of_cgroup<'a>(&self, cgroup_id: &'a str) -> Option<&'a str> {
        cgroup_id.strip_prefix(&self.tag())?.strip_prefix('-')
    }
}

/// The checkpoint directories whose layers make a restored box's root below
/// its own writable layer, top first: checkpoint `dir` itself, then those
/// its `lowers` file names (one per line; a relative name is in `dir`).
pub fn layer_chain(dir: &Path) -> Vec<PathBuf> {
    let mut chain = vec![dir.to_path_buf()];
    if let Ok(text) = std::fs::read_to_string(dir.join("lowers")) {
        chain.extend(text.lines().filter(|l| !l.is_empty()).map(|l| dir.join(l)));
    }
    chain
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

    #[test]
    fn cgroup_ids_are_tagged_by_root() {
        let a = Roots::under(Path::new("/a"));
        let b = Roots::under(Path::new("/b"));
        assert_ne!(a.tag(), b.tag());
        let id = a.cgroup_id("0123456789ab");
        assert_eq!(a.box_id_of_cgroup(&id), Some("0123456789ab"));
        assert_eq!(b.box_id_of_cgroup(&id), None);
    }
}
