//! The life of a box: its spec, its on-disk state, the monitor that supervises it,
//! the init that is its pid 1, and every operation the CLI offers on it.
//!
//! Data flow of `run`: [`spec::BoxSpec`] → [`registry`] reserves the name and
//! records the box → the image yields a root view → the [`monitor`] creates the
//! cgroup, forks the box's first process into new namespaces, which assembles the
//! root ([`launch`]) and becomes the box [`init`]; init starts the command; the
//! monitor relays output to the [`logs`], and records the exit status in the
//! [`state`].

pub mod api;
pub mod clone;
pub mod error;
pub mod exec;
pub mod init;
pub mod launch;
pub mod liveness;
pub mod logs;
pub mod monitor;
pub mod network;
pub mod network_pool;
pub mod ops;
pub mod paths;
pub mod prepared_claim;
pub mod process;
pub mod registry;
pub mod residency;
pub mod size;
pub mod spec;
pub mod state;
pub mod store_ops;
pub mod template;
pub mod working_set;

pub use error::{Result, RuntimeError};
