//! `checkpoint` and `restore`, with nestbox's own checkpoint engine (no
//! CRIU), for both kinds of container:
//!
//! - a container **started cold** (the usual one): its whole pid namespace,
//!   pid 1 (the container's program) and its descendants, is saved
//!   (`nestbox_runtime::nscheckpoint`: the engine's capture root for a pid
//!   namespace) into an image of its own (`namespace.json`, page records,
//!   a page pool; not the rootfs, which is the bundle's, as with runc and
//!   CRIU). `restore` makes the container from the bundle's config as
//!   `create` does (cgroup, namespaces, root, mounts, create-stage hooks),
//!   with a *stub* as its process, which the engine makes the image's
//!   pid 1 (the engine's restore root for a pid namespace); pid 1 forks its
//!   children again. The stub is the child of `nestbox-runc restore`, so the
//!   caller's subreaper (conmon, the containerd shim) adopts and reaps the
//!   restored pid 1 exactly as it does a created container's process.
//! - a container that is a **nestbox box** (forked from a template, or
//!   restored from such an image): saved as a box checkpoint
//!   (`checkpoint.json`) and restored as a box ([`crate::clone`]).
//!
//! As runc does, `checkpoint` without `--leave-running` stops the container
//! and deletes it (its poststop hooks run, its record and cgroup go), so the
//! same id can be restored at once. A checkpoint that fails leaves the
//! container running as it was, and no image.

use std::path::{Path, PathBuf};

use nestbox_runtime::nscheckpoint;
use nestbox_sys::ns::Namespace;

use crate::create::CreateOpts;
use crate::state::{self, Record, Root, Status};
use crate::{OciError, Result};

/// A checkpoint image directory as the OCI caller gives it, made absolute
/// (nestbox's engine resolves a relative one against its own idea of the
/// current directory otherwise).
fn image_dir(path: &Path) -> Result<PathBuf> {
    std::path::absolute(path).map_err(|e| OciError::io("resolve", path, e))
}

/// `checkpoint ID`: save the running container to `image`; then stop and
/// delete it unless `leave_running`.
pub fn checkpoint(root: &Root, id: &str, image: &Path, leave_running: bool) -> Result<()> {
    let rec = root.load(id)?;
    let status = root.status(&rec);
    if status != Status::Running {
        return Err(crate::create::wrong(
            id,
            status,
            "only a running container can be checkpointed",
        ));
    }
    let image = image_dir(image)?;
    let prior = Prior::take(&image)?;
    let saved = match &rec.clone {
        Some(link) => crate::clone::checkpoint(link, &image, leave_running),
        None => checkpoint_cold(&rec, &image, leave_running),
    };
    if let Err(e) = saved {
        prior.put_back(&image);
        return Err(OciError::Nestbox {
            what: format!("checkpoint of container {id:?}"),
            error: Box::new(e),
        });
    }
    prior.forget();
    mark_complete(&image)?;
    if !leave_running {
        // As runc: the container checkpointed is gone (its processes were
        // killed once saved); its id is free for the restore.
        crate::ops::delete(root, id, true)?;
    }
    Ok(())
}

/// What was at the image path before a checkpoint: the engine writes the
/// image under a temporary name and renames it into place, so anything
/// there is moved away first, and put back if the checkpoint fails.
enum Prior {
    /// Nothing.
    Nothing,
    /// An empty directory (podman makes one), removed.
    Empty,
    /// An earlier image of nestbox's (podman checkpoints a container into
    /// the same directory each time, as runc lets CRIU overwrite its
    /// files), moved aside to this path; removed once the new one is made.
    Image(PathBuf),
}

impl Prior {
    /// Clear `image` for the checkpoint: a directory holding anything but
    /// an image of nestbox's is refused.
    fn take(image: &Path) -> Result<Prior> {
        let mut entries = match std::fs::read_dir(image) {
            Ok(entries) => entries,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Prior::Nothing),
            Err(e) => return Err(OciError::io("read", image, e)),
        };
        if entries.next().is_none() {
            std::fs::remove_dir(image).map_err(|e| OciError::io("remove", image, e))?;
            return Ok(Prior::Empty);
        }
        let ours = nscheckpoint::is_image(image) || image.join("checkpoint.json").is_file();
        if !ours {
            return Err(OciError::Usage(format!(
                "checkpoint --image-path {}: the directory is not empty (and holds no nestbox image to replace)",
                image.display()
            )));
        }
        let aside = image.with_file_name(format!(
            ".{}.replaced-{}",
            image
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            std::process::id()
        ));
        std::fs::rename(image, &aside).map_err(|e| OciError::io("rename", image, e))?;
        Ok(Prior::Image(aside))
    }

    /// The checkpoint failed: put back what was there (unless the new
    /// image was made, and what failed came after: the container could not
    /// be stopped; the new image then stays).
    fn put_back(self, image: &Path) {
        if image.exists() {
            return self.forget();
        }
        let back = match &self {
            Prior::Nothing => Ok(()),
            Prior::Empty => std::fs::create_dir(image),
            Prior::Image(aside) => std::fs::rename(aside, image),
        };
        if let Err(e) = back {
            tracing::warn!("putting back {}: {e}", image.display());
        }
    }

    /// The checkpoint is made: what it replaced goes.
    fn forget(self) {
        if let Prior::Image(aside) = self {
            if let Err(e) = std::fs::remove_dir_all(&aside) {
                tracing::warn!("removing the replaced image {}: {e}", aside.display());
            }
        }
    }
}

/// The file podman looks for before it restores a checkpoint (CRIU's
/// inventory, "a minimal check if a checkpoint exists"): written, with a
/// note saying what it is, so that `podman container restore` takes a
/// nestbox image. No CRIU tool can read the image.
pub const PODMAN_MARKER: &str = "inventory.img";

/// Write [`PODMAN_MARKER`] into the finished image `image`.
fn mark_complete(image: &Path) -> Result<()> {
    let path = image.join(PODMAN_MARKER);
    std::fs::write(
        &path,
        "not a CRIU image: a checkpoint of nestbox's own engine (namespace.json or checkpoint.json); this file marks it complete for podman\n",
    )
    .map_err(|e| OciError::io("write", &path, e))
}

/// Save the pid namespace of container `rec`, started cold.
fn checkpoint_cold(rec: &Record, image: &Path, leave_running: bool) -> nestbox_runtime::Result<()> {
    let cgroup = rec.cgroup.as_ref().ok_or_else(|| {
        nestbox_runtime::RuntimeError::InvalidInput(
            "the container has no cgroup to freeze it in".into(),
        )
    })?;
    nscheckpoint::checkpoint(&nscheckpoint::NamespaceRequest {
        what: &rec.id,
        pid1: rec.pid,
        cgroup,
        output: image,
        leave_running,
    })
    .map(|_| ())
}

/// `restore ID`: a new container made from the image in `image` and the
/// bundle's config, running: from an image of a container started cold, a
/// container whose pid 1 is the image's (see the module documentation);
/// from a box checkpoint, a nestbox box ([`crate::clone`]).
pub fn restore(root: &Root, opts: &CreateOpts, image: &Path) -> Result<Record> {
    let image = image_dir(image)?;
    if nscheckpoint::is_image(&image) {
        return restore_cold(root, opts, &image);
    }
    if image.join("checkpoint.json").is_file() {
        return crate::clone::restore(root, opts, &image);
    }
    Err(OciError::Usage(if image.is_dir() {
        format!(
            "restore of {}: not a checkpoint image (it has no {} nor checkpoint.json)",
            image.display(),
            nscheckpoint::IMAGE_FILE
        )
    } else {
        format!("restore of {}: no such directory", image.display())
    }))
}

/// The config of a container to restore as `opts.id`, which must be a free
/// id; refused with a terminal (`why_no_terminal`: what it gets instead).
pub(crate) fn restore_plan(
    root: &Root,
    opts: &CreateOpts,
    why_no_terminal: &str,
) -> Result<crate::config::Plan> {
    state::validate_id(&opts.id)?;
    if root.container_dir(&opts.id).exists() {
        return Err(OciError::Exists(opts.id.clone()));
    }
    let plan = crate::config::load(&opts.bundle)?;
    if plan.process.terminal || opts.console_socket.is_some() {
        return Err(OciError::Unsupported(format!(
            "process.terminal: {why_no_terminal}"
        )));
    }
    Ok(plan)
}

/// [`restore`] of the image of a container started cold.
fn restore_cold(root: &Root, opts: &CreateOpts, image: &Path) -> Result<Record> {
    let plan = restore_plan(
        root,
        opts,
        "a restored container has the caller's standard streams, not a terminal",
    )?;
    if !plan.new_namespace(Namespace::Pid) {
        return Err(OciError::Unsupported(
            "linux.namespaces: the image's pid 1 is restored as the pid 1 of a new pid namespace, which the config must ask for (a pid namespace without a path)".into(),
        ));
    }
    let img = nscheckpoint::open(image).map_err(|e| OciError::Nestbox {
        what: format!("restore of {}", image.display()),
        error: Box::new(e),
    })?;
    crate::create::restore(root, opts, &plan, &img)
}
