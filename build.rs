//! Embeds the committed PTX (ptx/*.ptx) into the crate as typed constants.
//!
//! Inputs: every `ptx/pagedkv_kernels.<arch>.ptx` file and `ptx/manifest.toml`. The
//! output, `$OUT_DIR/ptx_modules.rs`, holds one `PtxModule` constant per architecture
//! (`SM_80`, `SM_90`, ...) with the PTX text, the architecture and the kernel entry
//! points parsed from `.entry` lines, plus `ALL` and the manifest's source hash.
//!
//! By default nothing is compiled: users on stable Rust with no nightly and no CUDA
//! toolkit build the crate from the committed PTX. With `PAGEDKV_REGENERATE_PTX=1` the
//! script first runs `scripts/build-ptx.sh` (pinned nightly, NVPTX backend), says so
//! with a cargo warning, and then also reruns when a kernel source changes.

use std::env;
use std::fmt::Write as _;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    let root = PathBuf::from(env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let ptx_dir = root.join("ptx");
    println!("cargo::rerun-if-changed=build.rs");
    println!("cargo::rerun-if-env-changed=PAGEDKV_REGENERATE_PTX");
    // The directory itself: a PTX file added or removed reruns the script.
    println!("cargo::rerun-if-changed={}", ptx_dir.display());
    println!(
        "cargo::rerun-if-changed={}",
        ptx_dir.join("manifest.toml").display()
    );

    if env::var("PAGEDKV_REGENERATE_PTX").is_ok_and(|v| v == "1") {
        regenerate(&root);
    }

    let mut files: Vec<(String, PathBuf)> = fs::read_dir(&ptx_dir)
        .unwrap_or_else(|e| panic!("reading {}: {e}", ptx_dir.display()))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter_map(|p| {
            let name = p.file_name()?.to_str()?.to_owned();
            let arch = name
                .strip_prefix("pagedkv_kernels.")?
                .strip_suffix(".ptx")?
                .to_owned();
            Some((arch, p))
        })
        .collect();
    files.sort();
    assert!(
        !files.is_empty(),
        "no PTX under {}: run scripts/build-ptx.sh",
        ptx_dir.display()
    );

    let manifest = fs::read_to_string(ptx_dir.join("manifest.toml")).unwrap_or_default();
    let field = |key: &str| -> String {
        manifest
            .lines()
            .find_map(|l| {
                l.strip_prefix(key)?
                    .trim()
                    .strip_prefix('=')?
                    .trim()
                    .strip_prefix('"')?
                    .strip_suffix('"')
                    .map(str::to_owned)
            })
            .unwrap_or_default()
    };

    let mut out = String::new();
    let mut all = Vec::new();
    let mut first_entries: Option<Vec<String>> = None;
    for (arch, path) in &files {
        println!("cargo::rerun-if-changed={}", path.display());
        let text = fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let sm: u32 = arch
            .strip_prefix("sm_")
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("{}: architecture `{arch}` is not sm_NN", path.display()));
        let entries = entry_points(&text);
        match &first_entries {
            None => first_entries = Some(entries.clone()),
            Some(e) if *e != entries => panic!(
                "{} has entry points {entries:?}, but the first PTX file has {e:?}: rerun scripts/build-ptx.sh",
                path.display()
            ),
            Some(_) => {}
        }
        let konst = arch.to_uppercase();
        writeln!(
            out,
            "/// The kernels compiled for `{arch}` (compute capability {}.{}).\n\
             pub const {konst}: PtxModule = PtxModule {{\n    \
                 arch: \"{arch}\",\n    \
                 compute_capability: ({}, {}),\n    \
                 ptx: include_str!({:?}),\n    \
                 entry_points: &{entries:?},\n\
             }};",
            sm / 10,
            sm % 10,
            sm / 10,
            sm % 10,
            path.display(),
        )
        .unwrap();
        all.push(konst);
    }
    writeln!(
        out,
        "/// Every embedded module, oldest architecture first.\npub const ALL: &[PtxModule] = &[{}];",
        all.join(", ")
    )
    .unwrap();
    writeln!(
        out,
        "/// The nightly toolchain that produced the PTX (from ptx/manifest.toml).\npub const TOOLCHAIN: &str = {:?};",
        field("toolchain")
    )
    .unwrap();
    writeln!(
        out,
        "/// SHA-256 over the kernel sources the PTX was built from (from ptx/manifest.toml).\npub const SOURCES_SHA256: &str = {:?};",
        field("sources_sha256")
    )
    .unwrap();

    let dest = Path::new(&env::var("OUT_DIR").expect("OUT_DIR")).join("ptx_modules.rs");
    fs::write(&dest, out).unwrap_or_else(|e| panic!("{}: {e}", dest.display()));
}

/// Names of `.visible .entry NAME(` lines, in file order.
fn entry_points(ptx: &str) -> Vec<String> {
    ptx.lines()
        .filter_map(|l| l.trim().strip_prefix(".visible .entry "))
        .map(|rest| rest.split('(').next().unwrap_or(rest).trim().to_owned())
        .collect()
}

/// Runs scripts/build-ptx.sh, in an environment cleaned of what cargo set for this
/// build script (so the inner cargo uses the pinned nightly, not this build's rustc).
fn regenerate(root: &Path) {
    println!(
        "cargo::warning=PAGEDKV_REGENERATE_PTX=1: regenerating ptx/ with scripts/build-ptx.sh (pinned nightly)"
    );
    for input in [
        "kernels-rs/src",
        "kernels-rs/Cargo.toml",
        "Cargo.toml",
        "scripts/build-ptx.sh",
    ] {
        println!("cargo::rerun-if-changed={}", root.join(input).display());
    }
    let mut cmd = Command::new("bash");
    cmd.arg(root.join("scripts/build-ptx.sh")).current_dir(root);
    for (k, _) in env::vars() {
        if k.starts_with("CARGO")
            || k.starts_with("RUSTC")
            || k.starts_with("RUSTUP_TOOLCHAIN")
            || k == "RUSTFLAGS"
            || k == "RUSTDOC"
            || k == "TARGET"
            || k == "HOST"
            || k == "OUT_DIR"
            || k == "PROFILE"
            || k == "OPT_LEVEL"
            || k == "DEBUG"
            || k == "NUM_JOBS"
        {
            cmd.env_remove(k);
        }
    }
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("running scripts/build-ptx.sh: {e}"));
    assert!(status.success(), "scripts/build-ptx.sh failed ({status})");
}
