//! Isolation of a box: namespaces, user-id maps, the box root filesystem and its
//! pivot, the minimal `/dev`, `/proc` and `/sys` with their masks, and capabilities.
//!
//! Everything here is a thin, typed layer over the kernel interfaces; policy (what a
//! box gets) is decided by the runtime and passed in as plain data.

pub mod caps;
pub mod dev;
mod error;
pub mod idmap;
pub mod mounts;
pub mod namespaces;
pub mod net;
pub mod procfs;
pub mod rootfs;

pub use error::{IsolationError, Result};
