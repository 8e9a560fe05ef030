//! The content-addressed image store of nestbox.
//!
//! File contents are stored once, as *objects* named by their BLAKE3 digest (and
//! by a key of the inode metadata they carry, since hardlinked names share one
//! inode). An image is a *manifest* — every path with its kind, object and
//! metadata — stored as an object itself, so an image id is a digest. A box root
//! is an overlay whose read-only lower layer is the image's *tree*: directories
//! plus hardlinks into the store, built once per image, so every box of an image
//! and every image holding the same file shares one inode and one page-cache copy.
//!
//! See `docs/store.md` for the layout, the crash-safety argument and the limits.

mod commit;
mod dedup;
mod error;
mod export;
mod gc;
mod hash;
pub mod import;
mod layer;
mod manifest;
mod meta;
mod pages;
mod progress;
mod refs;
mod snapshot;
mod store;
mod tree;
mod txn;
mod usage;
mod verify;
mod walk;

pub use dedup::{DedupLayer, DedupOptions, DedupReport, LevelStats};
pub use error::{Result, StoreError};
pub use gc::GcReport;
pub use hash::Digest;
pub use import::{import, Format, ImportOptions, ImportReport};
pub use layer::{Layer, Op, RootBuilder};
pub use manifest::{Entry, Kind, Manifest};
pub use meta::{Meta, XattrValue};
pub use pages::{PagePool, PageWriter, PoolUsage, PAGE_SIZE};
pub use progress::Progress;
pub use refs::{validate_name, ImageRef, RESERVED_NAME};
pub use snapshot::{
    diff as diff_layers, materialise, scan_upper, Below, Change, Contents, LayerEntry,
    LayerManifest, LowerDirs, ScanStats, Stamp,
};
pub use store::{Store, StoreLock};
pub use tree::ensure_tree;
pub use txn::{Txn, TxnStats};
pub use usage::Usage;
pub use verify::VerifyReport;
