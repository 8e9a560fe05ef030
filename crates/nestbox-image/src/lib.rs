//! Images: what a box's root filesystem is made of.
//!
//! An image yields a [`RootView`]: the read-only lower trees a box root is
//! assembled from, each mounted at a path of the box root under a private,
//! per-box writable overlay layer, plus directories shared strictly read-only. Every image kind (the built-in host image,
//! images imported into the content-addressed store) goes through this one interface, so the code
//! that builds a box root never needs to know where an image came from.

mod error;
mod host;
mod store;
mod view;

pub use error::ImageError;
pub use host::HostImage;
pub use store::{store_dir, StoreImage};
pub use view::{Layer, ReadOnlyBind, RootView};

/// Something a box root can be built from.
pub trait Image {
    /// The name users refer to the image by.
    fn name(&self) -> &str;
    /// Prepare (or reuse the cached) lower trees and describe how to stack them.
    /// `owner` is the host (uid, gid) that root of the box maps to when the box has
    /// a user namespace: the image's private top-level directories belong to it.
    fn root_view(&self, owner: Option<(u32, u32)>) -> Result<RootView, ImageError>;
}

/// Name of the built-in image made of the host's system directories.
pub const HOST_IMAGE: &str = "host";

/// Look an image up by name. `cache_dir` is the images directory
/// (`Roots::images()`): the host image keeps its skeleton under `host/`, the
/// content-addressed store lives under `store/`.
pub fn open_image(name: &str, cache_dir: &std::path::Path) -> Result<Box<dyn Image>, ImageError> {
    match name {
        HOST_IMAGE => Ok(Box::new(HostImage::new(cache_dir.join("host")))),
        other => Ok(Box::new(StoreImage::open(other, cache_dir)?)),
    }
}
