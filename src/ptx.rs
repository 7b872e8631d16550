//! The kernels' PTX, embedded at build time from the committed `ptx/` folder.
//!
//! One [`PtxModule`] per architecture the kernels were compiled for. A backend picks
//! the newest module the device can run with [`for_compute_capability`]; PTX is
//! forward compatible, so sm_90 PTX also runs on newer GPUs (the driver JIT-compiles it).
//!
//! ```
//! let m = pagedkv::ptx::for_compute_capability(9, 0).unwrap();
//! assert_eq!(m.arch, "sm_90");
//! assert!(m.entry_points.contains(&<pagedkv::kernels::kernels::CopyBlocks as pagedkv::kernels::Kernel>::NAME));
//! ```

/// One PTX module: every pagedkv kernel compiled for one architecture.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PtxModule {
    /// The architecture, `"sm_80"`, `"sm_90"`, ...
    pub arch: &'static str,
    /// The lowest compute capability (major, minor) that runs this module.
    pub compute_capability: (u32, u32),
    /// The PTX text.
    pub ptx: &'static str,
    /// The `.entry` names in the module (each a `Kernel::NAME`).
    pub entry_points: &'static [&'static str],
}

include!(concat!(env!("OUT_DIR"), "/ptx_modules.rs"));

/// The newest embedded module a device of compute capability `major.minor` can run,
/// or `None` when the device is older than every embedded architecture.
pub fn for_compute_capability(major: u32, minor: u32) -> Option<&'static PtxModule> {
    ALL.iter()
        .filter(|m| m.compute_capability <= (major, minor))
        .max_by_key(|m| m.compute_capability)
}
