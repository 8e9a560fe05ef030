//! `nestbox image|commit|store|dedup`: the content-addressed image store from the CLI.
//! (Being filled in by the image-store work; the shapes below are the contract with cli.rs.)

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use nestbox_runtime::registry::Registry;

/// `nestbox image ...`
#[derive(Debug, Subcommand)]
pub enum ImageCommand {
    /// List images.
    Ls,
}

/// `nestbox commit BOX NAME`
#[derive(Debug, Args)]
pub struct CommitArgs {
    /// Box to commit.
    pub r#box: String,
    /// Name of the new image.
    pub name: String,
}

/// `nestbox store ...`
#[derive(Debug, Subcommand)]
pub enum StoreCommand {
    /// Logical against physical size.
    Df,
}

/// `nestbox dedup`
#[derive(Debug, Args)]
pub struct DedupArgs {
    /// Report only.
    #[arg(long)]
    pub dry_run: bool,
}

/// Run an `image` subcommand.
pub fn image(_reg: &Registry, _cmd: ImageCommand) -> Result<i32> {
    bail!("image store not built yet")
}

/// Run `commit`.
pub fn commit(_reg: &Registry, _args: CommitArgs) -> Result<i32> {
    bail!("image store not built yet")
}

/// Run a `store` subcommand.
pub fn store(_reg: &Registry, _cmd: StoreCommand) -> Result<i32> {
    bail!("image store not built yet")
}

/// Run `dedup`.
pub fn dedup(_reg: &Registry, _args: DedupArgs) -> Result<i32> {
    bail!("image store not built yet")
}
