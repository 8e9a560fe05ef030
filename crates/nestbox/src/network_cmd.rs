//! `nestbox network ls|inspect`: box networks from the CLI.
//! (Being filled in by the networking work; the shapes below are the contract with cli.rs.)

use anyhow::{bail, Result};
use clap::Subcommand;
use nestbox_runtime::registry::Registry;

/// `nestbox network ...`
#[derive(Debug, Subcommand)]
pub enum NetworkCommand {
    /// List networks.
    Ls,
}

/// Run a `network` subcommand.
pub fn network(_reg: &Registry, _cmd: NetworkCommand) -> Result<i32> {
    bail!("networking not built yet")
}
