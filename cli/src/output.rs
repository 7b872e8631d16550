//! Writing the command's output files whole, safely, or not at all.
//!
//! [`write_all`] takes every output of a run (`--json`, `--plot`) as bytes already
//! produced, and:
//! 1. resolves each path: a regular file (or a symlink to one) is *replaced* by a new
//!    file in the target's folder, keeping the original's mode (and owner, where the
//!    process may set it); a path that does not exist is created; any other existing
//!    thing (`/dev/null`, a FIFO, a terminal) is *written through*, never replaced; a
//!    folder or a dangling symlink is refused;
//! 2. stages every replaced file in a temporary created exclusively with an
//!    unpredictable name in the target's folder (`tempfile`), written and synced;
//! 3. only when every output is staged, commits them: renames each temporary over its
//!    target, then writes the write-through outputs.
//!
//! Nothing is left behind on failure: a temporary not committed is removed when it is
//! dropped, and an error before step 3 leaves every target as it was.
//!
//! [`check_paths`] runs step 1 on the paths alone, before a run produces anything: a
//! folder, a path named twice, a missing or unwritable folder is an error at once, not
//! after the whole run.

use std::fs::{self, OpenOptions, Permissions};
use std::io::Write as _;
use std::os::unix::fs::{MetadataExt as _, PermissionsExt as _};
use std::path::{Path, PathBuf};

use tempfile::NamedTempFile;

/// An output that could not be written, with its path.
#[derive(Debug)]
pub struct OutputError {
    /// The path as the user gave it.
    pub path: PathBuf,
    /// What went wrong.
    pub reason: String,
}

impl std::fmt::Display for OutputError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.reason)
    }
}

impl std::error::Error for OutputError {}

/// How one output reaches its path.
enum Plan {
    /// A new file renamed over `target` (a regular file, or nothing yet).
    Replace { target: PathBuf, tmp: NamedTempFile },
    /// An existing non-regular file (a device, a FIFO) opened and written.
    WriteThrough { target: PathBuf },
}

/// Writes every `(path, bytes)` whole (see the module docs); returns the paths written,
/// in order. On an error no output has been committed, except when a commit itself
/// fails (a rename or a device write): outputs committed before it stay.
pub fn write_all(outputs: &[(PathBuf, Vec<u8>)]) -> Result<Vec<PathBuf>, OutputError> {
    let mut plans = Vec::with_capacity(outputs.len());
    let mut seen: Vec<PathBuf> = Vec::new();
    for (path, bytes) in outputs {
        let fail = |reason: String| OutputError {
            path: path.clone(),
            reason,
        };
        let plan = stage(path, bytes).map_err(fail)?;
        let target = match &plan {
            Plan::Replace { target, .. } | Plan::WriteThrough { target } => target,
        };
        not_seen(&mut seen, target).map_err(fail)?;
        plans.push((path.clone(), bytes, plan));
    }
    let mut written = Vec::with_capacity(plans.len());
    for (path, bytes, plan) in plans {
        let fail = |reason: String| OutputError {
            path: path.clone(),
            reason,
        };
        match plan {
            Plan::Replace { target, tmp } => {
                tmp.persist(&target)
                    .map_err(|e| fail(format!("cannot rename into place: {}", e.error)))?;
            }
            Plan::WriteThrough { target } => {
                OpenOptions::new()
                    .write(true)
                    .open(&target)
                    .and_then(|mut f| f.write_all(bytes))
                    .map_err(|e| fail(e.to_string()))?;
            }
        }
        written.push(path);
    }
    Ok(written)
}

/// Checks every path as [`write_all`] would before writing (step 1 of the module docs),
/// without producing anything: each resolves to a file that can be replaced or written
/// through (not a folder, not a dangling symlink), no two name the same file, and the
/// folder of each replaced file exists and takes a new file (a temporary is created
/// there and removed). Returns the first error, with its path.
pub fn check_paths(paths: &[PathBuf]) -> Result<(), OutputError> {
    let mut seen: Vec<PathBuf> = Vec::new();
    for path in paths {
        let fail = |reason: String| OutputError {
            path: path.clone(),
            reason,
        };
        let target = match resolve(path).map_err(fail)? {
            Resolved::WriteThrough(target) => target,
            Resolved::Replace { target, .. } => {
                drop(temporary_beside(&target).map_err(fail)?);
                target
            }
        };
        not_seen(&mut seen, &target).map_err(fail)?;
    }
    Ok(())
}

/// An error when `target` names the same file as one in `seen`, which it joins.
fn not_seen(seen: &mut Vec<PathBuf>, target: &Path) -> Result<(), String> {
    let parent = target.parent().filter(|d| !d.as_os_str().is_empty());
    let key = fs::canonicalize(parent.unwrap_or(Path::new(".")))
        .map(|d| d.join(target.file_name().unwrap_or_default()))
        .unwrap_or_else(|_| target.to_path_buf());
    if seen.contains(&key) {
        return Err("named by two outputs".into());
    }
    seen.push(key);
    Ok(())
}

/// Where an output goes (see [`resolve`]).
enum Resolved {
    /// A regular file (`existing`: its metadata) or nothing yet, to be replaced.
    Replace {
        target: PathBuf,
        existing: Option<fs::Metadata>,
    },
    /// An existing non-regular file (a device, a FIFO), to be written through.
    WriteThrough(PathBuf),
}

/// Resolves `path`: a symlink to its target; a folder or a dangling symlink is an error.
fn resolve(path: &Path) -> Result<Resolved, String> {
    let (target, existing) = match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_symlink() => {
            let target = fs::canonicalize(path)
                .map_err(|e| format!("a symlink whose target cannot be resolved ({e})"))?;
            let m = fs::metadata(&target).map_err(|e| e.to_string())?;
            (target, Some(m))
        }
        Ok(m) => (path.to_path_buf(), Some(m)),
        // (A path under a file is not there either: its folder is then said not to be one.)
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::NotFound | std::io::ErrorKind::NotADirectory
            ) =>
        {
            (path.to_path_buf(), None)
        }
        Err(e) => return Err(e.to_string()),
    };
    match existing {
        Some(m) if m.is_dir() => Err("is a folder, not a file".into()),
        Some(m) if !m.is_file() => Ok(Resolved::WriteThrough(target)),
        existing => Ok(Resolved::Replace { target, existing }),
    }
}

/// A new temporary file beside `target`, created exclusively with an unpredictable name
/// (mode 0666 less the umask); an error saying why when its folder is missing, is not
/// a folder, or refuses a new file.
fn temporary_beside(target: &Path) -> Result<NamedTempFile, String> {
    let name = target
        .file_name()
        .ok_or_else(|| "not a file name".to_string())?;
    let dir = target
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    match fs::metadata(dir) {
        Ok(m) if m.is_dir() => {}
        Ok(_) => return Err(format!("{} is not a folder", dir.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(format!("the folder {} does not exist", dir.display()));
        }
        Err(e) => return Err(format!("the folder {}: {e}", dir.display())),
    }
    let mut prefix = std::ffi::OsString::from(".");
    prefix.push(name);
    prefix.push(".");
    tempfile::Builder::new()
        .prefix(&prefix)
        .suffix(".tmp")
        .permissions(Permissions::from_mode(0o666))
        .tempfile_in(dir)
        .map_err(|e| {
            format!(
                "cannot create a file in the folder {}: {}",
                dir.display(),
                e.kind()
            )
        })
}

/// Resolves `path` and, for a replaced file, writes `bytes` to its staged temporary.
fn stage(path: &Path, bytes: &[u8]) -> Result<Plan, String> {
    let (target, existing) = match resolve(path)? {
        Resolved::WriteThrough(target) => return Ok(Plan::WriteThrough { target }),
        Resolved::Replace { target, existing } => (target, existing),
    };
    // A new file gets the usual 0666 less the umask (applied by open(2)); an existing
    // one keeps its mode, set below without the umask.
    let tmp = temporary_beside(&target)?;
    let io = |e: std::io::Error| e.to_string();
    tmp.as_file().write_all(bytes).map_err(io)?;
    if let Some(m) = &existing {
        // Keep the owner where this process may (root, or a group it is in); a file it
        // cannot give away is left owned by the writer, as any editor would.
        let _ = std::os::unix::fs::fchown(tmp.as_file(), Some(m.uid()), Some(m.gid()));
        tmp.as_file()
            .set_permissions(Permissions::from_mode(m.mode() & 0o7777))
            .map_err(io)?;
    }
    tmp.as_file().sync_all().map_err(io)?;
    Ok(Plan::Replace { target, tmp })
}
