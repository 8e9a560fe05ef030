//! The life of one box, whatever it is: the monitor that supervises it, the launch
//! of its first process, its init, `exec` into it, its logs, the residency of its
//! idle processes, the pool of box shells made ahead (`shell`), same-page
//! merging of its memory (ksm), and the operations on a plain box (run, stop,
//! kill, rm, stats, inspect, gc), boxes in boxes (`nest`), and the fresh
//! image a long-lived monitor or init takes (`lean`). (Time travel of a
//! box's writable layer is a layer up, with templates and checkpoints: a
//! snapshot may hold a checkpoint of the box's processes.)
//!
//! This layer imports the records (spec, state, registry, …) and the network glue,
//! never the templates layer or the API: what it needs to know about templates and
//! clones comes through [`ops::Relations`] or [`nested`].

pub mod exec;
pub mod init;
pub mod ksm;
pub mod launch;
pub mod lean;
pub mod logs;
pub mod monitor;
pub mod nest;
pub mod nested;
pub mod ops;
pub mod residency;
pub mod shell;
