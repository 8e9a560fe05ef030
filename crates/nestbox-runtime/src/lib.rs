//! The life of a box: its spec, its on-disk state, the monitor that supervises it,
//! the init that is its pid 1, and every operation the CLI offers on it.
//!
//! Data flow of `run`: [`spec::BoxSpec`] → [`registry`] reserves the name and
//! records the box → the image yields a root view → the [`monitor`] creates the
//! cgroup, forks the box's first process into new namespaces, which assembles the
//! root ([`launch`]) and becomes the box [`init`]; init starts the command; the
//! monitor relays output to the [`logs`], and records the exit status in the
//! [`state`].
//!
//! The modules form layers whose imports run one way (see `docs/architecture.md`,
//! checked by `tests/layering.rs`):
//!
//! ```text
//! api         the `nestbox serve` request loop; services (rejuvenated clone pools)
//!  └ templates   freeze, templates, clones, pools, working sets, prepared claims
//!     └ lifecycle   monitor, launch, init, exec, logs, residency, plain-box operations,
//!                   time travel (snapshot, rollback, diff)
//!        └ network     network glue of a box (leases, attach, release) and the network pool
//!           └ records     error, diag, disk, paths, phases, size, snapshots, spec, state, registry,
//!                         liveness, process
//! ```
//!
//! A lower layer never names a higher one. Where the life of a box needs what a
//! higher layer knows (a template's clones when it is stopped or removed), the
//! higher layer passes it down through [`lifecycle::ops::Relations`]; [`ops`]
//! is the full set of operations with the templates layer's relations plugged in.

pub mod api;
pub mod copy;
pub mod diag;
pub mod disk;
pub mod error;
pub mod lifecycle;
pub mod liveness;
pub mod network;
pub mod paths;
pub mod phases;
pub mod process;
pub mod registry;
pub mod service;
pub mod size;
pub mod snapshots;
pub mod spec;
pub mod state;
pub mod store_ops;
pub mod templates;
pub mod watchdog;

pub use error::{Result, RuntimeError};

// The modules' paths before they were grouped, kept so that callers (the CLI and
// other crates) need not change.
pub use lifecycle::{exec, init, ksm, launch, logs, monitor, nest, residency, shell};
pub use network::pool as network_pool;
pub use templates::{
    attach, checkpoint, clone, migrate, nscheckpoint, prepared_claim, subtree, template,
    time_travel, working_set,
};

/// The operations the CLI offers on boxes, templates and clones included: the
/// plain-box operations of [`lifecycle::ops`], with `stop`, `rm` and `inspect`
/// aware of templates and clones ([`templates::ops`]).
pub mod ops {
    pub use crate::lifecycle::ops::*;
    pub use crate::templates::ops::{inspect, remove, remove_many, stop};
}
