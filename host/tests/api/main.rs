//! The public API's argument checks, one test binary: the block API, backend and
//! scheduler configs, sizes near the type limits.

mod block_api;
mod config_validation;
mod sizes;
