//! The step path and the backend trait, one test binary: the step runner (`step`) and
//! one serving test body run on every backend (`backend`).

mod backend;
#[path = "../common/mod.rs"]
mod common;
mod step;
