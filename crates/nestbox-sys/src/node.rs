//! Device nodes: `mknod(2)` of a character or block device, or a FIFO.

use std::path::Path;

use nix::sys::stat::{makedev, mknod, Mode, SFlag};

use crate::Result;

/// The kind of node [`make_node`] creates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeKind {
    /// A character device.
    Char,
    /// A block device.
    Block,
    /// A named pipe (major and minor are ignored).
    Fifo,
}

/// Create the node `path` of `kind` with permission bits `mode` and device
/// number `major:minor` (needs `CAP_MKNOD` for devices; the caller's umask
/// applies to `mode`).
pub fn make_node(path: &Path, kind: NodeKind, mode: u32, major: u64, minor: u64) -> Result<()> {
    let kind = match kind {
        NodeKind::Char => SFlag::S_IFCHR,
        NodeKind::Block => SFlag::S_IFBLK,
        NodeKind::Fifo => SFlag::S_IFIFO,
    };
    mknod(
        path,
        kind,
        Mode::from_bits_truncate(mode),
        makedev(major, minor),
    )
}
