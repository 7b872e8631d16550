//! The proptest seeds of the workspace are where proptest reads them. Under its
//! default persistence (`FileFailurePersistence::SourceParallel("proptest-regressions")`)
//! the seeds of `<dir>/<bin>/<file>.rs`, whose test binary's root `main.rs` or `lib.rs`
//! is in `<dir>/<bin>`, are `<dir>/proptest-regressions/<file>.txt`; a file beside the
//! source (`<file>.proptest-regressions`, another persistence's name) is never read,
//! so its seeds never run again.

use std::path::{Path, PathBuf};

/// Every file under `dir` (not `target/`, `.git/` or other build output).
fn files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name();
        let name = name.to_string_lossy();
        if p.is_dir() {
            if !matches!(&*name, "target" | ".git" | "corpus" | "artifacts") {
                files(&p, out);
            }
        } else {
            out.push(p);
        }
    }
}

#[test]
fn every_proptest_seed_file_is_one_proptest_reads() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut all = Vec::new();
    files(root, &mut all);
    let mut read = 0;
    for f in &all {
        let rel = f.strip_prefix(root).unwrap().display().to_string();
        assert!(
            f.extension().is_none_or(|e| e != "proptest-regressions"),
            "{rel}: proptest never reads a seed file beside its source; move its seeds to \
             ../proptest-regressions/<file>.txt"
        );
        let dir = f.parent().unwrap();
        if dir.file_name().is_none_or(|n| n != "proptest-regressions") {
            continue;
        }
        // The source it belongs to: <dir>/<bin>/<stem>.rs in a test binary's folder.
        let stem = f.file_stem().unwrap().to_string_lossy().to_string();
        let parent = dir.parent().unwrap();
        let sources: Vec<PathBuf> = std::fs::read_dir(parent)
            .unwrap()
            .flatten()
            .map(|e| e.path())
            .filter(|d| d.join("main.rs").is_file() || d.join("lib.rs").is_file())
            .map(|d| d.join(format!("{stem}.rs")))
            .filter(|s| s.is_file())
            .collect();
        // Exactly one with proptests: proptest would replay one file's seeds for two.
        let with_proptests: Vec<&PathBuf> = sources
            .iter()
            .filter(|s| std::fs::read_to_string(s).unwrap().contains("proptest!"))
            .collect();
        assert!(
            with_proptests.len() == 1,
            "{rel}: not the seeds of exactly one proptest source (a <bin>/{stem}.rs beside \
             a main.rs or lib.rs, with a proptest! block): {with_proptests:?}"
        );
        for line in std::fs::read_to_string(f).unwrap().lines() {
            let seed = line
                .strip_prefix("cc ")
                .map(|l| l.split(' ').next().unwrap());
            assert!(
                line.starts_with('#')
                    || line.trim().is_empty()
                    || seed
                        .is_some_and(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit())),
                "{rel}: not a seed line: {line}"
            );
        }
        read += 1;
    }
    // The workspace keeps seeds for its test binaries (tests/ and host/tests/).
    assert!(read >= 10, "{read} seed files found");
}
