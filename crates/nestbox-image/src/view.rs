//! The description of a box root that an image hands to the isolation layer.

use std::path::PathBuf;

/// One overlay of the box root: read-only `lowers` (top first) mounted at `target`
/// (a path inside the box, `/` for the root itself) under a private writable layer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Layer {
    /// Where in the box this layer is mounted ("/" first, then sub-paths).
    pub target: PathBuf,
    /// Host directories stacked read-only, topmost first.
    pub lowers: Vec<PathBuf>,
}

/// A host directory shown read-only at `target` in the box (no writable layer).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReadOnlyBind {
    /// Host directory.
    pub source: PathBuf,
    /// Path in the box.
    pub target: PathBuf,
}

/// How to assemble a box root: the root layer first, then layers mounted on it,
/// then read-only binds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RootView {
    /// The overlay layers in mount order (each gets a private writable layer).
    pub layers: Vec<Layer>,
    /// Directories shared read-only, mounted after the layers.
    pub read_only: Vec<ReadOnlyBind>,
}
