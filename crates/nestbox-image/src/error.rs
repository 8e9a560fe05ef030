//! Errors of image preparation, each naming the image or path involved.

use std::path::PathBuf;

/// Why an image could not be prepared.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    /// No image of that name exists.
    #[error(
        "image {0:?} not found (see `nestbox image ls`; import one with `nestbox image import`)"
    )]
    Unknown(String),
    /// The image exists but cannot serve this box.
    #[error("image {image:?}: {why}")]
    Unsupported {
        /// The image.
        image: String,
        /// Why not.
        why: String,
    },
    /// The image store failed.
    #[error("image store: {0}")]
    Store(#[from] nestbox_store::StoreError),
    /// A filesystem operation on a path failed.
    #[error("image: {op} {path}: {source}")]
    Io {
        /// What was being done.
        op: &'static str,
        /// The path it was done to.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
}

impl ImageError {
    pub(crate) fn io(
        op: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Self {
        let path = path.into();
        move |source| ImageError::Io { op, path, source }
    }
}
