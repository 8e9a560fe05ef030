//! Upkeep of the network's box-to-box shortcut map (see [`crate::bpf`]): the
//! map's id is kept in the state directory; while a program on a box's veth
//! refers to the map it lives on, and when it is gone it is made again with an
//! entry for every attached box.

use std::fs;
use std::os::fd::{AsFd, OwnedFd};

use super::Network;
use crate::error::{NetError, Result};
use crate::netlink::Netlink;
use crate::state::Locked;
use crate::{bpf, link};

/// File in the state directory with the id of the network's shortcut map.
const SHORTCUT_MAP_FILE: &str = "shortcut-map";

/// `Ok(None)` for the errors that mean BPF (or the BPF classifier) is not
/// available or not permitted here.
pub(super) fn unsupported_is_none<T>(r: Result<T>) -> Result<Option<T>> {
    match r {
        Ok(v) => Ok(Some(v)),
        Err(e)
            if matches!(
                e.errno(),
                Some(libc::ENOSYS | libc::EPERM | libc::EACCES | libc::EOPNOTSUPP)
            ) =>
        {
            Ok(None)
        }
        Err(e) => Err(e),
    }
}
impl Network {
    /// The network's shortcut map, if it still exists (while a program on a
    /// box's veth refers to it) and BPF is permitted here.
    pub(super) fn existing_shortcut_map(&self) -> Result<Option<OwnedFd>> {
        let path = self.config.state_dir.join(SHORTCUT_MAP_FILE);
        let id = match fs::read_to_string(&path) {
            Ok(s) => match s.trim().parse::<u32>() {
                Ok(id) => Some(id),
                Err(e) => {
                    // Made anew (with every attached box) by `shortcut_map`.
                    tracing::warn!(path = %path.display(), "shortcut map id {s:?} unreadable ({e}): treated as no map");
                    None
                }
            },
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => None,
            Err(e) => return Err(NetError::io("read", &path, e)),
        };
        match id {
            Some(id) => Ok(unsupported_is_none(bpf::open_map(
                id,
                &bpf::object_name(&self.config.bridge),
            ))?
            .flatten()),
            None => Ok(None),
        }
    }

    /// The network's shortcut map; if it is gone, a new one with an entry for
    /// every attached box whose veth exists, its id saved.
    pub(super) fn shortcut_map(&self, nl: &mut Netlink, locked: &Locked) -> Result<OwnedFd> {
        if let Some(map) = self.existing_shortcut_map()? {
            return Ok(map);
        }
        let range = self.config.subnet.box_offsets();
        let max = range.end().saturating_sub(*range.start()) + 1;
        let map = bpf::create_map(&bpf::object_name(&self.config.bridge), max)?;
        for e in locked.state.boxes.values() {
            let Some(a) = &e.attachment else { continue };
            if let Some(ifindex) = link::index(nl, &a.host_veth)? {
                let peer = a.ingress_rate.is_none();
                bpf::map_set(map.as_fd(), e.address, bpf::Target { ifindex, peer })?;
            }
        }
        let path = self.config.state_dir.join(SHORTCUT_MAP_FILE);
        let id = bpf::map_id(map.as_fd())?;
        fs::write(&path, format!("{id}\n")).map_err(|e| NetError::io("write", &path, e))?;
        Ok(map)
    }
}
