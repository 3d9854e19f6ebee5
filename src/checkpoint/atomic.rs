//! Output that is never left partial: a command that writes a checkpoint folder builds it under
//! a temporary name beside the destination (`.NAME.fp4spec-partial-PID-N` in the same parent
//! folder, so the final rename cannot cross file systems), syncs every file and the folder, and
//! renames it into place only when everything is written and checked. On any error, and on an
//! interrupt the command turns into an error ([`request_cancel`]), the temporary folder is
//! removed; the destination either does not exist or is complete.

use crate::error::{Error, Result};
use indicatif::ProgressBar;
use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

static CANCELLED: AtomicBool = AtomicBool::new(false);
static STAGING_COUNTER: AtomicUsize = AtomicUsize::new(0);

/// Bytes copied per read/write when a file is copied.
const COPY_CHUNK: usize = 8 << 20;

/// Asks every running write to stop at its next check (safe to call from a signal handler: one
/// atomic store).
pub fn request_cancel() {
    CANCELLED.store(true, Ordering::SeqCst);
}

/// Fails when [`request_cancel`] was called.
///
/// # Errors
/// [`Error::Invalid`] saying the command was interrupted.
pub fn check_cancelled() -> Result<()> {
    if CANCELLED.load(Ordering::SeqCst) {
        return Err(Error::invalid(
            "interrupted",
            "stopped on request; the partial output was removed",
        ));
    }
    Ok(())
}

/// A folder being built under a temporary name, renamed to its destination by
/// [`StagedDir::commit`] and removed if dropped uncommitted.
#[derive(Debug)]
pub struct StagedDir {
    target: PathBuf,
    staging: PathBuf,
    committed: bool,
}

impl StagedDir {
    /// Starts building `target`, which must not exist; its parent folder must.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when `target` exists or its parent is not a folder, [`Error::Io`]
    /// when the temporary folder cannot be created.
    pub fn create(target: &Path) -> Result<Self> {
        if target.symlink_metadata().is_ok() {
            return Err(Error::Checkpoint {
                path: target.to_path_buf(),
                reason: "already exists; refusing to overwrite it (choose a new output folder)"
                    .into(),
            });
        }
        let name = target.file_name().ok_or_else(|| Error::Checkpoint {
            path: target.to_path_buf(),
            reason: "is not a folder name".into(),
        })?;
        let parent = match target.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        if !parent.is_dir() {
            return Err(Error::Checkpoint {
                path: parent,
                reason: format!(
                    "the parent folder of the output {} does not exist",
                    target.display()
                ),
            });
        }
        let staging = parent.join(format!(
            ".{}.fp4spec-partial-{}-{}",
            name.to_string_lossy(),
            std::process::id(),
            STAGING_COUNTER.fetch_add(1, Ordering::SeqCst)
        ));
        std::fs::create_dir(&staging).map_err(|e| Error::io(&staging, e))?;
        Ok(Self {
            target: target.to_path_buf(),
            staging,
            committed: false,
        })
    }

    /// The temporary folder to write into.
    pub fn path(&self) -> &Path {
        &self.staging
    }

    /// The destination.
    pub fn target(&self) -> &Path {
        &self.target
    }

    /// Writes `bytes` to the new file `name` in the temporary folder and syncs it.
    ///
    /// # Errors
    /// [`Error::Io`], also when the file exists.
    pub fn write_file(&self, name: &str, bytes: &[u8]) -> Result<()> {
        let path = self.staging.join(name);
        let mut file = File::create_new(&path).map_err(|e| Error::io(&path, e))?;
        file.write_all(bytes)
            .and_then(|()| file.sync_all())
            .map_err(|e| Error::io(&path, e))
    }

    /// Writes `value` as pretty JSON (with a final newline) to the new file `name`.
    ///
    /// # Errors
    /// As [`StagedDir::write_file`].
    pub fn write_json(&self, name: &str, value: &serde_json::Value) -> Result<()> {
        let mut text = serde_json::to_string_pretty(value)
            .map_err(|e| Error::invalid(name, format!("cannot be written as JSON: {e}")))?;
        text.push('\n');
        self.write_file(name, text.as_bytes())
    }

    /// Syncs the temporary folder, renames it to the destination (which must still not exist)
    /// and syncs the parent folder.
    ///
    /// # Errors
    /// [`Error::Checkpoint`] when the destination appeared meanwhile, [`Error::Io`].
    pub fn commit(mut self) -> Result<PathBuf> {
        check_cancelled()?;
        sync_dir(&self.staging)?;
        if self.target.symlink_metadata().is_ok() {
            return Err(Error::Checkpoint {
                path: self.target.clone(),
                reason: "appeared while the output was being written; left untouched".into(),
            });
        }
        std::fs::rename(&self.staging, &self.target).map_err(|e| Error::io(&self.target, e))?;
        self.committed = true;
        if let Some(parent) = self.staging.parent() {
            sync_dir(parent)?;
        }
        Ok(self.target.clone())
    }
}

impl Drop for StagedDir {
    fn drop(&mut self) {
        if !self.committed {
            // best effort: the error that got us here is what the user needs to see
            let _ = std::fs::remove_dir_all(&self.staging);
        }
    }
}

fn sync_dir(path: &Path) -> Result<()> {
    File::open(path)
        .and_then(|dir| dir.sync_all())
        .map_err(|e| Error::io(path, e))
}

/// Copies `from` to the new file `to` in chunks (advancing `progress` by the bytes copied,
/// checking for cancellation between chunks) and syncs it; returns the bytes copied.
///
/// # Errors
/// [`Error::Io`] naming the file, or the cancellation error.
pub fn copy_synced(from: &Path, to: &Path, progress: &ProgressBar) -> Result<u64> {
    let mut source = File::open(from).map_err(|e| Error::io(from, e))?;
    let mut dest = File::create_new(to).map_err(|e| Error::io(to, e))?;
    let mut buffer = vec![0u8; COPY_CHUNK];
    let mut total = 0u64;
    loop {
        check_cancelled()?;
        let n = source.read(&mut buffer).map_err(|e| Error::io(from, e))?;
        if n == 0 {
            break;
        }
        dest.write_all(&buffer[..n]).map_err(|e| Error::io(to, e))?;
        total += n as u64;
        progress.inc(n as u64);
    }
    dest.sync_all().map_err(|e| Error::io(to, e))?;
    Ok(total)
}

/// How a file reached the output.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Placed {
    /// A hard link to the source (same file system; no bytes copied).
    Linked,
    /// A copy.
    Copied,
}

/// Hard-links `from` as `to` unless `copy` is set or linking fails (another file system, no
/// permission), in which case it copies.
///
/// # Errors
/// As [`copy_synced`].
pub fn link_or_copy(from: &Path, to: &Path, copy: bool, progress: &ProgressBar) -> Result<Placed> {
    if !copy && std::fs::hard_link(from, to).is_ok() {
        let bytes = from.metadata().map(|m| m.len()).unwrap_or(0);
        progress.inc(bytes);
        return Ok(Placed::Linked);
    }
    copy_synced(from, to, progress)?;
    Ok(Placed::Copied)
}
