//! nestbox as an OCI runtime: the command line that runc defines (`create`,
//! `start`, `state`, `kill`, `delete`, `run`, `exec`, `ps`, `pause`,
//! `resume`, `events --stats`, `list`, `update`, `features`, `spec`,
//! `checkpoint`, `restore`) over the nestbox
//! libraries, so podman, containerd and Kubernetes can drive nestbox as they
//! drive runc. The binary is `nestbox-runc`; `docs/oci.md` says how to
//! register it and what is and is not supported.
//!
//! Data flow of `create`: [`config`] reads the bundle's `config.json` (with
//! the `oci-spec` crate) into a checked [`config::Plan`] → [`create`] makes
//! the cgroup (nestbox-cgroup), forks the container's process into its new
//! pid and user namespaces, writes its id maps and lets it go → the process
//! ([`child`]) makes the other namespaces, assembles its root ([`mounts`],
//! nestbox-isolation), sets credentials, capabilities and seccomp
//! (nestbox-seccomp), reports ready and waits on the `exec.fifo` → [`create`]
//! runs the hooks and records the container in [`state`]. `start` opens the
//! fifo and the process execs the program. A config annotated
//! `nestbox.template=NAME` is forked from a nestbox template instead
//! ([`clone`]). [`checkpoint`] saves and restores both kinds with nestbox's
//! own checkpoint engine.

pub mod checkpoint;
pub mod child;
pub mod clone;
pub mod config;
pub mod console;
pub mod create;
mod error;
pub mod hooks;
pub mod info;
pub mod mounts;
pub mod ops;
pub mod resources;
pub mod state;
pub mod streams;

pub use error::{OciError, Result};
