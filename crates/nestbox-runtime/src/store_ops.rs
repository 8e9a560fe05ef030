//! The image store as boxes see it: the rules that need both the store and the
//! registry of boxes, for the CLI (`image`, `commit`, `store`, `dedup`) and the
//! API alike.
//!
//! - an image a box's spec names is *in use*: `image rm` refuses it;
//! - `commit` stores a box's writable root layer (its `upper-0`) over the image
//!   the box was made from; boxes of the built-in host image cannot be committed;
//! - `dedup` merges the layers of boxes that have *exited* only: a running,
//!   creating or frozen box has its overlay mounted and overlayfs writes upper
//!   files in place, so they must not become shared inodes; a dead box is left to
//!   `gc`. The lock of every box taking part is held for the whole run, so none
//!   starts meanwhile;
//! - `--allow-devices` needs root.
//!
//! Why here and not in `nestbox-store`: the store knows images, objects and
//! layers but nothing of boxes, and must stay that way (the runtime's image
//! layer, `nestbox-image`, builds on the store, so the store cannot depend on the
//! runtime without a cycle). The runtime owns the registry, so the rules that
//! join the two live in the runtime, on top of both public APIs.

use std::path::PathBuf;

use nestbox_store::{
    DedupLayer, DedupOptions, DedupReport, ImageRef, ImportOptions, ImportReport, Progress, Store,
    StoreError, TxnStats, Usage,
};
use serde::Serialize;

use crate::registry::{BoxLock, BoxRecord, Registry};
use crate::state::Status;
use crate::RuntimeError;

/// Why a store operation on boxes and images failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreOpsError {
    /// `image rm` of an image that boxes still use (a user mistake).
    #[error("image {image:?} is used by box {:?}{}; remove the box first", .boxes[0], more(.boxes))]
    ImageInUse {
        /// The image.
        image: String,
        /// The boxes using it (at least one).
        boxes: Vec<String>,
    },
    /// `commit` of a box of the built-in host image (a user mistake).
    #[error("box {0:?} runs the built-in host image, which is not in the store: commit needs a box of a store image (import a root filesystem with `nestbox image import`)")]
    HostImage(String),
    /// `--allow-devices` without root.
    #[error("--allow-devices needs root")]
    DevicesNeedRoot,
    /// A `--samples` item that is not a size.
    #[error("--samples: {item:?}: {why}")]
    BadSamples {
        /// The item as given.
        item: String,
        /// Why it is not a size.
        why: String,
    },
    /// Committing a box failed in the store.
    #[error("commit box {name:?}: {source}")]
    Commit {
        /// The box.
        name: String,
        /// The store's error.
        source: StoreError,
    },
    /// Any other store failure (missing image, corrupt input, I/O...).
    #[error(transparent)]
    Store(#[from] StoreError),
    /// Reading the registry failed, or there is no such box.
    #[error(transparent)]
    Runtime(#[from] RuntimeError),
}

fn more(boxes: &[String]) -> String {
    if boxes.len() > 1 {
        format!(" and {} more", boxes.len() - 1)
    } else {
        String::new()
    }
}

/// Result of store operations on boxes and images.
pub type Result<T, E = StoreOpsError> = std::result::Result<T, E>;

/// The store of the registry's root (`$ROOT/lib/images/store`).
pub fn open_store(reg: &Registry) -> Result<Store> {
    Ok(Store::open(&nestbox_image::store_dir(
        &reg.roots().images(),
    ))?)
}

/// The boxes whose spec names image `image`, in creation order.
pub fn users_of(reg: &Registry, image: &str) -> Result<Vec<String>> {
    Ok(reg
        .list()?
        .into_iter()
        .filter(|r| r.spec.image == image)
        .map(|r| r.name().to_string())
        .collect())
}

/// Import `src` as image `name`; device nodes only when asked for, and as root.
pub fn import(
    store: &Store,
    src: &std::path::Path,
    name: &str,
    opts: &ImportOptions,
    progress: &Progress,
) -> Result<ImportReport> {
    if opts.allow_devices && !nix::unistd::geteuid().is_root() {
        return Err(StoreOpsError::DevicesNeedRoot);
    }
    Ok(nestbox_store::import(store, src, name, opts, progress)?)
}

/// Remove image `name` unless a box uses it (its objects go at `store gc`).
pub fn remove_image(reg: &Registry, store: &Store, name: &str) -> Result<()> {
    let boxes = users_of(reg, name)?;
    if !boxes.is_empty() {
        return Err(StoreOpsError::ImageInUse {
            image: name.to_string(),
            boxes,
        });
    }
    Ok(store.remove_image(name)?)
}

/// What `image inspect` shows.
#[derive(Debug, Clone, Serialize)]
pub struct ImageInfo {
    /// The image as recorded (name, id, created, source, files, bytes).
    #[serde(flatten)]
    pub image: ImageRef,
    /// Entries of its manifest.
    pub entries: usize,
    /// Its materialised lower tree.
    pub tree: PathBuf,
    /// Boxes using it.
    pub used_by: Vec<String>,
}

/// Image `name` with its manifest size, tree and users.
pub fn inspect(reg: &Registry, store: &Store, name: &str) -> Result<ImageInfo> {
    let image = store.image(name)?;
    let manifest = store.manifest(&image.id)?;
    Ok(ImageInfo {
        entries: manifest.entries.len(),
        tree: store.tree_path(&image.id),
        used_by: users_of(reg, name)?,
        image,
    })
}

/// Store box `box_name`'s writable root layer over its image as image `name`.
pub fn commit(
    reg: &Registry,
    store: &Store,
    box_name: &str,
    name: &str,
    progress: &Progress,
) -> Result<(ImageRef, TxnStats)> {
    let record = reg.load(box_name)?;
    let base = &record.spec.image;
    if base == nestbox_image::HOST_IMAGE {
        return Err(StoreOpsError::HostImage(box_name.to_string()));
    }
    let (upper, _) = record.layer_dirs(0);
    let what = format!("commit of box {box_name} (image {base})");
    let rolled_back = crate::snapshots::rollback_layer(record.lib_dir())?;
    if !rolled_back.entries.is_empty() {
        // A box rolled back to a snapshot: its files are the snapshot's
        // layer with its writable layer on top.
        return store
            .commit_rolled_back(base, &rolled_back, &upper, name, &what)
            .map_err(|source| StoreOpsError::Commit {
                name: box_name.to_string(),
                source,
            });
    }
    store
        .commit_upper(base, &upper, name, &what, progress)
        .map_err(|source| StoreOpsError::Commit {
            name: box_name.to_string(),
            source,
        })
}

/// The writable root layers (`upper-0`) of every box.
pub fn box_layers(records: &[BoxRecord]) -> Vec<PathBuf> {
    records.iter().map(|r| r.layer_dirs(0).0).collect()
}

/// Logical size of images and box layers against physical bytes used.
pub fn usage(reg: &Registry, store: &Store) -> Result<Usage> {
    Ok(store.usage(&box_layers(&reg.list()?))?)
}

/// Parse `--samples`: sizes (`4096`, `64k`...) separated by commas; empty
/// items are ignored.
pub fn parse_samples(text: &str) -> Result<Vec<u64>> {
    text.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            crate::size::parse_size(s).map_err(|e| StoreOpsError::BadSamples {
                item: s.to_string(),
                why: e.to_string(),
            })
        })
        .collect()
}

/// Why `dedup` leaves a box's layer alone.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SkipReason {
    /// Its monitor is gone without recording an end.
    Dead,
    /// Its overlay is mounted (running, creating or frozen).
    Mounted(Status),
    /// Its record could not be read.
    Unreadable(String),
}

impl std::fmt::Display for SkipReason {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            SkipReason::Dead => write!(f, "dead (its monitor is gone; `nestbox gc` removes it)"),
            SkipReason::Mounted(status) => write!(
                f,
                "{}: its overlay is mounted and overlayfs writes upper files in place, so they must not become shared inodes",
                status.as_str()
            ),
            SkipReason::Unreadable(why) => write!(f, "its record cannot be read: {why}"),
        }
    }
}

impl Serialize for SkipReason {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        s.collect_str(self)
    }
}

/// A box whose layer `dedup` left alone.
#[derive(Debug, Clone, Serialize)]
pub struct SkippedBox {
    /// The box.
    pub name: String,
    /// Why.
    pub reason: SkipReason,
}

/// The layers a dedup run may merge, with the locks that keep their boxes
/// stopped until it is dropped.
#[derive(Debug)]
pub struct DedupSelection {
    /// Layers of exited boxes.
    pub layers: Vec<DedupLayer>,
    /// Every other box, with the reason.
    pub skipped: Vec<SkippedBox>,
    locks: Vec<BoxLock>,
}

/// Choose the boxes whose layers dedup may merge: exited ones, each locked
/// (and its status read under the lock) so it cannot start meanwhile. Boxes
/// removed while choosing are left out.
pub fn select_dedup_layers(reg: &Registry) -> Result<DedupSelection> {
    let mut sel = DedupSelection {
        layers: Vec::new(),
        skipped: Vec::new(),
        locks: Vec::new(),
    };
    for listed in reg.list()? {
        if listed.is_shell() {
            // A box shell of the pool: an empty layer, and no box.
            continue;
        }
        let name = listed.name().to_string();
        let lock = match reg.lock(&name) {
            Ok(l) => l,
            Err(RuntimeError::NoSuchBox(_)) => continue,
            Err(e) => return Err(e.into()),
        };
        let record = match reg.load(&name) {
            Ok(r) => r,
            Err(RuntimeError::NoSuchBox(_)) => continue,
            Err(e) => {
                sel.skipped.push(SkippedBox {
                    name,
                    reason: SkipReason::Unreadable(e.to_string()),
                });
                continue;
            }
        };
        match record.state.effective_status() {
            Status::Exited => {
                sel.locks.push(lock);
                sel.layers.push(DedupLayer {
                    label: name,
                    upper: record.layer_dirs(0).0,
                });
            }
            Status::Dead => sel.skipped.push(SkippedBox {
                name,
                reason: SkipReason::Dead,
            }),
            other => sel.skipped.push(SkippedBox {
                name,
                reason: SkipReason::Mounted(other),
            }),
        }
    }
    Ok(sel)
}

/// What `dedup` did, with the boxes it left alone.
#[derive(Debug, Clone, Serialize)]
pub struct DedupOutcome {
    /// The store's report.
    #[serde(flatten)]
    pub report: DedupReport,
    /// Boxes skipped.
    #[serde(rename = "skipped_boxes")]
    pub skipped: Vec<SkippedBox>,
}

/// Deduplicate the layers of exited boxes against each other and the store.
pub fn dedup(reg: &Registry, store: &Store, opts: &DedupOptions) -> Result<DedupOutcome> {
    let sel = select_dedup_layers(reg)?;
    let report = store.dedup(&sel.layers, opts)?;
    // The locks are released here, after the layers have been changed.
    drop(sel.locks);
    Ok(DedupOutcome {
        report,
        skipped: sel.skipped,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::liveness::ProcRef;
    use crate::paths::Roots;
    use crate::spec::tests_support::sample;
    use std::fs;

    fn registry() -> (tempfile::TempDir, Registry) {
        let dir = tempfile::tempdir().unwrap();
        let reg = Registry::new(Roots::under(dir.path()));
        (dir, reg)
    }

    /// A box of `image` recorded with `status`; a running or frozen one gets
    /// this process as its live monitor, so its status is not taken for dead.
    fn add_box(reg: &Registry, name: &str, image: &str, status: Status) -> BoxRecord {
        let mut spec = sample(name);
        spec.image = image.into();
        let rec = reg.create(&spec).unwrap();
        reg.update(name, |s| {
            s.status = status;
            if matches!(status, Status::Running | Status::Frozen | Status::Creating) {
                s.monitor = Some(ProcRef::current());
            }
        })
        .unwrap();
        let (upper, _) = rec.layer_dirs(0);
        fs::create_dir_all(&upper).unwrap();
        fs::write(upper.join("f"), name).unwrap();
        rec
    }

    fn import_image(reg: &Registry, name: &str) -> Store {
        let store = open_store(reg).unwrap();
        import_dir(&store, name);
        store
    }

    fn import_dir(store: &Store, name: &str) {
        let src = tempfile::tempdir().unwrap();
        fs::create_dir(src.path().join("etc")).unwrap();
        fs::write(src.path().join("etc/hostname"), "x\n").unwrap();
        import(
            store,
            src.path(),
            name,
            &ImportOptions::default(),
            &Progress::hidden(),
        )
        .unwrap();
    }

    #[test]
    fn in_use_images_are_refused_until_their_boxes_go() {
        let (_dir, reg) = registry();
        let store = import_image(&reg, "base");
        import_dir(&store, "other");
        let a = add_box(&reg, "a", "base", Status::Exited);
        add_box(&reg, "b", "base", Status::Running);
        add_box(&reg, "c", "host", Status::Exited);
        assert_eq!(users_of(&reg, "base").unwrap(), ["a", "b"]);
        assert!(users_of(&reg, "other").unwrap().is_empty());
        assert_eq!(inspect(&reg, &store, "base").unwrap().used_by, ["a", "b"]);

        let err = remove_image(&reg, &store, "base").unwrap_err();
        assert!(
            matches!(&err, StoreOpsError::ImageInUse { image, boxes } if image == "base" && boxes == &["a", "b"]),
            "{err:?}"
        );
        assert_eq!(
            err.to_string(),
            "image \"base\" is used by box \"a\" and 1 more; remove the box first"
        );
        assert!(store.has_image("base"), "refused means untouched");

        remove_image(&reg, &store, "other").unwrap();
        assert!(!store.has_image("other"));
        assert!(matches!(
            remove_image(&reg, &store, "other"),
            Err(StoreOpsError::Store(StoreError::NoSuchImage(_)))
        ));

        reg.remove(&a).unwrap();
        reg.remove(&reg.load("b").unwrap()).unwrap();
        remove_image(&reg, &store, "base").unwrap();
    }

    #[test]
    fn commit_takes_the_root_layer_and_refuses_the_host_image() {
        let (_dir, reg) = registry();
        let store = import_image(&reg, "base");
        add_box(&reg, "w", "base", Status::Exited);
        add_box(&reg, "h", "host", Status::Exited);
        let (image, _) = commit(&reg, &store, "w", "snap", &Progress::hidden()).unwrap();
        assert_eq!(image.name, "snap");
        assert_eq!(image.source, "commit of box w (image base)");
        let tree = store.tree_path(&image.id);
        nestbox_store::ensure_tree(&store, &image.id).unwrap();
        assert_eq!(fs::read_to_string(tree.join("f")).unwrap(), "w");
        assert_eq!(
            fs::read_to_string(tree.join("etc/hostname")).unwrap(),
            "x\n"
        );
        assert!(matches!(
            commit(&reg, &store, "h", "nope", &Progress::hidden()),
            Err(StoreOpsError::HostImage(b)) if b == "h"
        ));
        assert!(matches!(
            commit(&reg, &store, "missing", "nope", &Progress::hidden()),
            Err(StoreOpsError::Runtime(RuntimeError::NoSuchBox(_)))
        ));
        // A store failure names the box.
        let e = commit(&reg, &store, "w", "snap", &Progress::hidden()).unwrap_err();
        assert!(
            matches!(e, StoreOpsError::Commit { ref name, .. } if name == "w"),
            "{e:?}"
        );
        assert!(!store.has_image("nope"));
    }

    #[test]
    fn dedup_takes_exited_boxes_only_and_locks_them() {
        let (_dir, reg) = registry();
        add_box(&reg, "done", "host", Status::Exited);
        add_box(&reg, "live", "host", Status::Running);
        add_box(&reg, "frozen", "host", Status::Frozen);
        // Running on record, but no monitor: dead.
        add_box(&reg, "ghost", "host", Status::Exited);
        reg.update("ghost", |s| {
            s.status = Status::Running;
            s.monitor = None;
        })
        .unwrap();
        let sel = select_dedup_layers(&reg).unwrap();
        let labels: Vec<&str> = sel.layers.iter().map(|l| l.label.as_str()).collect();
        assert_eq!(labels, ["done"]);
        assert_eq!(
            sel.layers[0].upper,
            reg.load("done").unwrap().layer_dirs(0).0
        );
        let skipped: Vec<(&str, &SkipReason)> = sel
            .skipped
            .iter()
            .map(|s| (s.name.as_str(), &s.reason))
            .collect();
        assert_eq!(
            skipped,
            [
                ("live", &SkipReason::Mounted(Status::Running)),
                ("frozen", &SkipReason::Mounted(Status::Frozen)),
                ("ghost", &SkipReason::Dead),
            ]
        );
        assert!(SkipReason::Mounted(Status::Running)
            .to_string()
            .starts_with("running: its overlay is mounted"));

        // While the selection lives, the chosen box's lock is held: another
        // taker (here a thread, since flock locks belong to the open file) waits.
        let (tx, rx) = std::sync::mpsc::channel();
        let reg2 = reg.clone();
        let t = std::thread::spawn(move || {
            let _l = reg2.lock("done").unwrap();
            tx.send(()).unwrap();
        });
        assert!(rx
            .recv_timeout(std::time::Duration::from_millis(200))
            .is_err());
        drop(sel);
        rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
        t.join().unwrap();

        let store = open_store(&reg).unwrap();
        let out = dedup(
            &reg,
            &store,
            &DedupOptions {
                samples: vec![4096],
                dry_run: true,
            },
        )
        .unwrap();
        assert_eq!(out.report.layers, 1);
        let v = serde_json::to_value(&out).unwrap();
        assert_eq!(v["skipped_boxes"][2]["name"], "ghost");
        assert!(v["skipped_boxes"][2]["reason"]
            .as_str()
            .unwrap()
            .starts_with("dead"));
        assert_eq!(v["dry_run"], true);
    }

    #[test]
    fn samples_parse_or_name_the_bad_item() {
        assert_eq!(parse_samples("4096, 64k,,").unwrap(), [4096, 65536]);
        assert!(parse_samples("").unwrap().is_empty());
        let e = parse_samples("4k,lots").unwrap_err();
        assert!(matches!(&e, StoreOpsError::BadSamples { item, .. } if item == "lots"));
        assert!(e.to_string().starts_with("--samples: \"lots\": "), "{e}");
    }
}
