//! Templates and clones: freezing a box into a template, forking clones from it
//! by remote fork, pools of clones forked ahead of time, the working set copied
//! into pooled clones, and claims prepared ahead of a request.
//!
//! This layer builds on the life of a box ([`crate::lifecycle`]) and the network
//! glue; neither imports it. [`ops`] holds the box operations that must know
//! about templates and clones (stop, rm, inspect).

pub mod clone;
pub mod ops;
pub mod prepared_claim;
pub mod template;
pub mod working_set;
