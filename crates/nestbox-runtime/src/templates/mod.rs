//! Templates and clones: freezing a box into a template, forking clones from it
//! by remote fork, pools of clones forked ahead of time, the working set copied
//! into pooled clones, claims prepared ahead of a request, and checkpoints
//! (a box saved to disk and restored from it, on the clone's rebuild engine),
//! migrations (a running box moved to another host by pre-copy), and the time
//! travel of a box's writable layer (snapshot, rollback, diff; a snapshot may
//! hold a checkpoint of its processes: [`time_travel`]); the boxes inside a
//! nest box are suspended and resumed around its save ([`subtree`]).
//!
//! This layer builds on the life of a box ([`crate::lifecycle`]) and the network
//! glue; neither imports it. [`ops`] holds the box operations that must know
//! about templates and clones (stop, rm, inspect).

pub mod attach;
pub mod checkpoint;
pub mod clone;
pub(crate) mod kept_state;
pub mod migrate;
pub mod nscheckpoint;
pub mod ops;
pub mod prepared_claim;
pub mod subtree;
pub mod template;
pub mod time_travel;
pub mod working_set;
