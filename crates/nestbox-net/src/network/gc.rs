//! Garbage collection: removing what boxes that are gone left on the
//! network (leases, attachments, veths on the bridge and classes on the IFB
//! no box owns), and removing the whole network.

use std::collections::BTreeSet;

use super::bridge::{FILTER_PRIO, HTB_MAJOR};
use super::{Network, DEFAULT_CLASS_MINOR};
use crate::error::{NetError, Result};
use crate::netlink::Netlink;
use crate::state;
use crate::{link, tc};

impl Network {
    /// Remove everything of boxes not in `live`: their leases and attachments,
    /// and any veth on the bridge or class on the IFB that no box owns.
    /// Returns the ids of the boxes removed.
    pub fn gc(&self, live: &[&str]) -> Result<Vec<String>> {
        self.gc_with(&|id| live.contains(&id))
    }

    /// [`Network::gc`] with liveness asked of `live` for each leased box, while
    /// the network's state is locked: a caller whose boxes lease their address
    /// only once their record exists can look records up afresh there, so a
    /// box started while its garbage collection runs is never taken for dead.
    pub fn gc_with(&self, live: &dyn Fn(&str) -> bool) -> Result<Vec<String>> {
        let Some(mut locked) = state::lock_existing(&self.config.state_dir)? else {
            return Ok(Vec::new());
        };
        let mut nl = Netlink::open()?;
        let dead: Vec<String> = locked
            .state
            .boxes
            .keys()
            .filter(|id| !live(id.as_str()))
            .cloned()
            .collect();
        let mut nft = false;
        for id in &dead {
            let entry = locked.state.boxes.get(id).cloned();
            self.teardown(&mut nl, id, entry.as_ref(), true)
                .map_err(|e| e.for_box(id))?;
            nft |= entry
                .and_then(|e| e.attachment)
                .is_some_and(|a| a.has_rules());
            locked.state.boxes.remove(id);
        }
        // Orphans: links on our bridge and classes on our IFB that no box owns.
        let owned_veths: BTreeSet<String> = locked
            .state
            .boxes
            .values()
            .filter_map(|e| e.attachment.as_ref().map(|a| a.host_veth.clone()))
            .collect();
        let owned_classes: BTreeSet<u32> = locked
            .state
            .boxes
            .values()
            .filter_map(|e| e.attachment.as_ref().map(|a| a.class))
            .collect();
        if let Some(bridge) = link::index(&mut nl, &self.config.bridge)? {
            for l in link::list(&mut nl)? {
                if l.master == Some(bridge) && !owned_veths.contains(&l.name) {
                    link::delete(&mut nl, &l.name)?;
                }
            }
        }
        let ifb_name = self.config.ifb();
        if let Some(ifb) = link::index(&mut nl, &ifb_name)? {
            let parent = tc::handle(HTB_MAJOR, 0);
            for (fh, class) in tc::list_class_filters(&mut nl, ifb, parent)? {
                if !owned_classes.contains(&class) {
                    tc::del_u32_filter(&mut nl, ifb, &ifb_name, parent, FILTER_PRIO, fh)?;
                }
            }
            let keep = [
                tc::handle(HTB_MAJOR, 1),
                tc::handle(HTB_MAJOR, DEFAULT_CLASS_MINOR),
            ];
            for c in tc::list_classes(&mut nl, ifb)? {
                if !keep.contains(&c.handle) && !owned_classes.contains(&c.handle) {
                    tc::del_class(&mut nl, ifb, &ifb_name, c.handle)?;
                }
            }
        }
        if nft {
            self.apply_rules(&locked, "remove the rules of dead boxes")?;
        }
        locked.save()?;
        self.write_hosts(&locked)?;
        Ok(dead)
    }

    /// Remove the whole network from the host: every box's attachment and
    /// lease, the bridge, the IFB device, the NAT table and the state directory.
    pub fn destroy(self) -> Result<()> {
        self.destroy_inner(|_| true)
    }

    /// [`Network::destroy`], refused with [`NetError::InUse`] while a box holds
    /// an address, except boxes `ignore` accepts (e.g. a pool's namespaces).
    /// The check and the removal happen under the network's lock, so a box
    /// that is given an address meanwhile either stops the removal or comes
    /// after it, on a network made anew.
    pub fn destroy_unused(self, ignore: impl Fn(&str) -> bool) -> Result<()> {
        self.destroy_inner(|id| ignore(id))
    }

    fn destroy_inner(self, removable: impl Fn(&str) -> bool) -> Result<()> {
        // Made if missing: the host's devices are removed even without state.
        let locked = state::lock(&self.config.state_dir)?;
        let holding: Vec<&String> = locked
            .state
            .boxes
            .keys()
            .filter(|id| !removable(id))
            .collect();
        if let Some(first) = holding.first() {
            return Err(NetError::InUse {
                network: self.config.name.clone(),
                boxes: holding.len(),
                first: first.to_string(),
            });
        }
        let mut nl = Netlink::open()?;
        for (id, e) in &locked.state.boxes {
            self.teardown(&mut nl, id, Some(e), true)
                .map_err(|e| e.for_box(id))?;
        }
        // Each of the three is tried even if one fails; the state stays (for
        // `network rm` to be tried again) unless all are gone.
        let ifb = link::delete(&mut nl, &self.config.ifb()).map(|_| ());
        let bridge = link::delete(&mut nl, &self.config.bridge).map(|_| ());
        let table = crate::nft::delete_table(&self.config.bridge);
        ifb.and(bridge).and(table)?;
        // Under the lock to the end: a call waiting for it finds the network
        // gone, or makes it anew with state of its own (see `state::lock`).
        locked.remove()
    }
}
