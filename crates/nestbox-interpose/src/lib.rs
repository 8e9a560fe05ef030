//! Monitors and interposition (`nestbox run --monitor …`): a box runs under a
//! stack of monitors, each subscribed to some system calls; only those calls
//! stop (seccomp user notification), everything else runs at full speed.
//!
//! * [`spec`]: the `--monitor` forms, parsed and checked;
//! * [`event`]: a stopped call as monitors see it;
//! * [`monitors`]: the built-in monitors and the Unix-socket protocol;
//! * [`engine`]: the loop that answers the kernel;
//! * [`packets`]: the packet inspector (`packets:`), which judges the box's
//!   packets rather than its calls.
//!
//! The filter itself is `nestbox_seccomp::monitor_profile`; the box's first
//! process installs it after the box's own filter and hands its listener to
//! the box's monitor process (`nestbox_sys::seccomp_notify`), which runs
//! [`engine::serve`] in a thread of its own. `docs/monitors.md` has the
//! protocol, the order and what is and is not protected.

pub mod engine;
pub mod event;
pub mod monitors;
pub mod packets;
pub mod spec;

pub use engine::{serve, serve_shared, Shared, Stack};
pub use spec::{split_packets, subscribed, MonitorSpec};

/// What can go wrong setting up monitors.
#[derive(Debug, thiserror::Error)]
pub enum InterposeError {
    /// A `--monitor` value that cannot be used.
    #[error("--monitor {spec}: {why}")]
    Spec {
        /// The value as given.
        spec: String,
        /// What is wrong with it.
        why: String,
    },
    /// A file or socket a monitor needs.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: String,
        /// The error.
        #[source]
        source: std::io::Error,
    },
}
