//! Address leases: a box's address (and its names in the hosts file), handed
//! out round-robin from the subnet before the box exists, renamed when a
//! pooled clone is claimed, moved from a pool entry to a box.

use std::collections::BTreeSet;

use super::{hosts, Attachment, Lease, Network};
use crate::config::NetworkConfig;
use crate::error::{NetError, Result};
use crate::state::{self, BoxEntry};

impl Network {
    pub(super) fn lease_of(&self, box_id: &str, e: &BoxEntry) -> Lease {
        Lease {
            box_id: box_id.to_string(),
            names: e.names.clone(),
            address: e.address,
            prefix: self.config.subnet.prefix(),
            gateway: self.config.subnet.gateway(),
        }
    }

    /// Give box `box_id` an address (the same one again if it has one), add it
    /// to the hosts file under `names`, and write resolv.conf. Persistent and
    /// safe under concurrent callers.
    pub fn allocate(&self, box_id: &str, names: &[&str]) -> Result<Lease> {
        self.allocate_preferring(box_id, names, None)
    }

    /// [`Network::allocate`], giving the box address `prefer` when it is one
    /// of the subnet's box addresses and free (a box started again takes back
    /// the address it had); otherwise the next free one.
    pub fn allocate_preferring(
        &self,
        box_id: &str,
        names: &[&str],
        prefer: Option<std::net::Ipv4Addr>,
    ) -> Result<Lease> {
        if box_id.is_empty()
            || box_id.len() > 128
            || !box_id
                .bytes()
                .all(|c| c.is_ascii_alphanumeric() || b"-_.".contains(&c))
        {
            return Err(NetError::Invalid(format!("invalid box id {box_id:?}")));
        }
        if let Some(bad) = names.iter().find(|n| !hosts::valid_name(n)) {
            return Err(NetError::Invalid(format!("invalid host name {bad:?}")).for_box(box_id));
        }
        // Makes the network's state anew if it was removed meanwhile
        // (`network rm`), configuration included, so that what the attach
        // makes next has an owner that `detach`, `gc` and `destroy` find.
        let mut locked = state::lock(&self.config.state_dir)?;
        if NetworkConfig::load(&self.config.state_dir)?.is_none() {
            self.config.save()?;
        }
        if let Some(e) = locked.state.boxes.get(box_id) {
            return Ok(self.lease_of(box_id, e));
        }
        let subnet = self.config.subnet;
        let used: BTreeSet<u32> = locked
            .state
            .boxes
            .values()
            .map(|e| subnet.offset(e.address))
            .collect();
        let range = subnet.box_offsets();
        let (lo, hi) = (*range.start(), *range.end());
        let count = hi.saturating_sub(lo) + 1;
        let preferred = prefer
            .filter(|a| subnet.contains(*a))
            .map(|a| subnet.offset(a))
            .filter(|o| range.contains(o) && !used.contains(o));
        let offset = match preferred {
            Some(o) => o,
            None => {
                let start = locked.state.next.clamp(lo, hi);
                let offset = (0..count)
                    .map(|i| lo + (start - lo + i) % count)
                    .find(|o| !used.contains(o))
                    .ok_or_else(|| NetError::PoolExhausted {
                        network: self.config.name.clone(),
                        subnet: subnet.to_string(),
                        used: used.len(),
                    })?;
                locked.state.next = if offset == hi { lo } else { offset + 1 };
                offset
            }
        };
        let entry = BoxEntry {
            names: names.iter().map(|s| s.to_string()).collect(),
            address: subnet.host(offset),
            attachment: None,
        };
        let lease = self.lease_of(box_id, &entry);
        locked.state.boxes.insert(box_id.to_string(), entry);
        locked.save()?;
        self.write_hosts(&locked)?;
        if !self.resolv_path().exists() {
            self.write_resolv()?;
        }
        Ok(lease)
    }

    /// Give box `box_id` new names in the hosts file (a pooled clone claimed
    /// under its own name); its address and attachment are unchanged.
    pub fn rename(&self, box_id: &str, names: &[&str]) -> Result<()> {
        if let Some(bad) = names.iter().find(|n| !hosts::valid_name(n)) {
            return Err(NetError::Invalid(format!("invalid host name {bad:?}")).for_box(box_id));
        }
        let mut locked = self.lock_existing()?;
        let Some(entry) = locked.state.boxes.get_mut(box_id) else {
            return Err(NetError::NoLease(box_id.to_string()));
        };
        entry.names = names.iter().map(|s| s.to_string()).collect();
        locked.save()?;
        self.write_hosts(&locked)
    }

    /// Hand the address and attachment held under id `from` (a pre-attached
    /// network namespace of a pool) to box `to`, named `names` in the hosts
    /// file. The veth, class and filter stay as they are: they are found
    /// through the attachment record, not the id. Returns the attachment as
    /// the box now holds it.
    pub fn reassign(&self, from: &str, to: &str, names: &[&str]) -> Result<Attachment> {
        if let Some(bad) = names.iter().find(|n| !hosts::valid_name(n)) {
            return Err(NetError::Invalid(format!("invalid host name {bad:?}")).for_box(to));
        }
        let mut locked = self.lock_existing()?;
        if locked.state.boxes.contains_key(to) {
            return Err(NetError::Conflict(format!(
                "box {to} already has an address"
            )));
        }
        let Some(mut entry) = locked.state.boxes.remove(from) else {
            return Err(NetError::NoLease(from.to_string()));
        };
        let Some(record) = entry.attachment.clone() else {
            return Err(NetError::NotAttached(from.to_string()));
        };
        entry.names = names.iter().map(|s| s.to_string()).collect();
        let attachment = self.attachment_of(to, &entry, &record);
        locked.state.boxes.insert(to.to_string(), entry);
        locked.save()?;
        self.write_hosts(&locked)?;
        Ok(attachment)
    }

    /// Every lease, attached or not.
    pub fn leases(&self) -> Result<Vec<Lease>> {
        let s = state::read(&self.config.state_dir.join("state.json"))?;
        Ok(s.boxes.iter().map(|(id, e)| self.lease_of(id, e)).collect())
    }
}
