//! Making a user-defined network (`nestbox network create`): unlike the
//! default network, which is made on the first attach, it is put on the host
//! at once — bridge, IFB tree and nftables tables (with its egress policy) —
//! so its subnet shows as a route that later networks avoid, and whatever is
//! wrong with it is said by `create`, not by the first box. On any failure
//! nothing of it is left.

use super::Network;
use crate::config::NetworkConfig;
use crate::error::{NetError, Result};
use crate::link;
use crate::netlink::Netlink;
use crate::state;

impl Network {
    /// Make the network `config` describes (see [`NetworkConfig::user_in`]):
    /// save it and create its bridge, IFB device and tables. Refused if a
    /// network is saved in its state directory or its bridge exists; a host
    /// name of its egress policy that does not resolve is refused too.
    pub fn create(config: NetworkConfig) -> Result<Network> {
        config.validate()?;
        config.egress.check_resolvable()?;
        if NetworkConfig::load(&config.state_dir)?.is_some() {
            return Err(NetError::Conflict(format!(
                "network {:?} already exists",
                config.name
            )));
        }
        let mut nl = Netlink::open()?;
        if link::index(&mut nl, &config.bridge)?.is_some() {
            return Err(NetError::Conflict(format!(
                "bridge {} exists: it belongs to another network",
                config.bridge
            )));
        }
        let mut locked = state::lock(&config.state_dir)?;
        let net = Network {
            config: config.clone(),
        };
        let made = (|| -> Result<()> {
            net.config.save()?;
            net.ensure_infra(&mut nl, &locked)?;
            locked.state.rules = crate::nft::RULES_VERSION;
            locked.save()
        })();
        if let Err(e) = made {
            drop(locked);
            if let Err(undo) = Network::view(config).destroy() {
                tracing::warn!(
                    "creating network {} failed ({e}); removing what was made failed too: {undo}",
                    net.config.name
                );
            }
            return Err(e);
        }
        Ok(net)
    }
}
