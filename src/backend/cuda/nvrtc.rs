//! NVRTC: compiles rendered CUDA sources for a target (PTX + CUBIN + the ptxas resource report),
//! finds the CUDA headers, and keeps compiled CUBINs in an on-disk cache keyed by
//! (source and flags hash, arch, NVRTC version), which `fp4spec kernels --fill-cache` fills ahead.
//!
//! Needs only `libnvrtc.so.13` on the loader path and the CUDA headers: no driver, no GPU.

use crate::backend::KernelResources;
use crate::error::{Error, Result};
use crate::kernels::table::RenderedSource;
use crate::target::TargetFacts;
use cudarc::nvrtc::{result as nvrtc, sys};
use sha2::{Digest, Sha256};
use std::ffi::{CStr, CString};
use std::path::{Path, PathBuf};

/// The header every rendered CUDA source includes; its presence marks a usable include dir.
const MARKER_HEADER: &str = "cuda_bf16.h";

/// What NVRTC produced for one source.
#[derive(Debug, Clone)]
pub struct NvrtcOutput {
    /// PTX text.
    pub ptx: String,
    /// Device code for the target's real architecture, loadable without JIT.
    pub cubin: Vec<u8>,
    /// The compile log (includes ptxas' resource report).
    pub log: String,
    /// Per-kernel resources parsed from the log.
    pub resources: Vec<KernelResources>,
}

/// The NVRTC version `(major, minor)`, or why NVRTC cannot be used.
///
/// # Errors
/// [`Error::CudaUnavailable`] when `libnvrtc` is not on the loader path.
pub fn version() -> Result<(i32, i32)> {
    // SAFETY: only probes whether the library can be opened.
    if !unsafe { sys::is_culib_present() } {
        return Err(Error::CudaUnavailable(
            "libnvrtc (NVRTC 13) is not on the loader path: set LD_LIBRARY_PATH to a CUDA 13 lib \
             folder (e.g. the pip wheel nvidia-cuda-nvrtc==13.0.88's nvidia/cu13/lib), or run \
             `source tools/toolchains.sh`"
                .into(),
        ));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: both pointers are valid for writes.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .map_err(|e| Error::CudaUnavailable(format!("nvrtcVersion failed: {e}")))?;
    Ok((major, minor))
}

/// Finds the CUDA include folder (the one holding `cuda_bf16.h`), searching in order:
/// `$FP4SPEC_CUDA_INCLUDE`, `$CUDA_HOME/include`, `$CUDA_PATH/include`, `/usr/local/cuda/include`,
/// the pip `nvidia/cu13/include` next to any `nvidia/cu13/lib` on `$LD_LIBRARY_PATH`, and the
/// pip layout inside `$VIRTUAL_ENV`.
///
/// # Errors
/// [`Error::CudaUnavailable`] listing every place searched.
pub fn cuda_include_dir() -> Result<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(dir) = std::env::var_os("FP4SPEC_CUDA_INCLUDE") {
        candidates.push(dir.into());
    }
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(dir) = std::env::var_os(var) {
            candidates.push(PathBuf::from(dir).join("include"));
        }
    }
    candidates.push("/usr/local/cuda/include".into());
    if let Some(paths) = std::env::var_os("LD_LIBRARY_PATH") {
        for lib in std::env::split_paths(&paths) {
            if lib.ends_with("nvidia/cu13/lib") {
                if let Some(parent) = lib.parent() {
                    candidates.push(parent.join("include"));
                }
            }
        }
    }
    if let Some(venv) = std::env::var_os("VIRTUAL_ENV") {
        let lib = PathBuf::from(venv).join("lib");
        if let Ok(entries) = std::fs::read_dir(&lib) {
            for entry in entries.flatten() {
                candidates.push(entry.path().join("site-packages/nvidia/cu13/include"));
            }
        }
    }
    candidates
        .iter()
        .find(|dir| dir.join(MARKER_HEADER).is_file())
        .cloned()
        .ok_or_else(|| {
            let searched: Vec<String> =
                candidates.iter().map(|p| p.display().to_string()).collect();
            Error::CudaUnavailable(format!(
                "no CUDA include folder with {MARKER_HEADER} found; searched: {} \
                 (set FP4SPEC_CUDA_INCLUDE or CUDA_HOME, or `source tools/toolchains.sh`)",
                searched.join(", ")
            ))
        })
}

/// Stack of the thread NVRTC compiles on. NVRTC's front end recurses on the caller's stack:
/// the `verify` family overflowed the 2 MiB of a Rust test thread on the H200 (a SIGSEGV inside
/// NVRTC, 2026-12-03; the same tests passed with 64 MiB), and a caller's thread (a test
/// harness, an async runtime's worker) may be that small or smaller, so compilation always runs
/// on a thread of its own with this much.
const COMPILER_STACK_BYTES: usize = 64 << 20;

/// Compiles `source` for `target` (its real architecture, so the output holds a CUBIN and the
/// ptxas resource report), on a thread of `COMPILER_STACK_BYTES` whatever the caller's stack.
///
/// # Errors
/// [`Error::CudaUnavailable`] without NVRTC, [`Error::Compile`] with NVRTC's log on failure (or
/// when the compiling thread cannot be started).
pub fn compile(
    source: &RenderedSource,
    target: &TargetFacts,
    include_dir: &Path,
) -> Result<NvrtcOutput> {
    version()?;
    let compile_error = |log: String| compile_error(source, target, log);
    std::thread::scope(|scope| {
        std::thread::Builder::new()
            .name(format!("nvrtc {}/{}", target.name, source.family))
            .stack_size(COMPILER_STACK_BYTES)
            .spawn_scoped(scope, || compile_here(source, target, include_dir))
            .map_err(|e| compile_error(format!("cannot start the compiling thread: {e}")))?
            .join()
            .unwrap_or_else(|_| Err(compile_error("the compiling thread panicked".into())))
    })
}

/// The [`Error::Compile`] of NVRTC compiling `source` for `target`, with `log`.
fn compile_error(source: &RenderedSource, target: &TargetFacts, log: String) -> Error {
    Error::Compile {
        compiler: "NVRTC".into(),
        target: target.name.clone(),
        family: source.family.to_string(),
        log,
    }
}

/// [`compile`] on the calling thread.
fn compile_here(
    source: &RenderedSource,
    target: &TargetFacts,
    include_dir: &Path,
) -> Result<NvrtcOutput> {
    let compile_error = |log: String| compile_error(source, target, log);
    let text = CString::new(source.source)
        .map_err(|_| compile_error("source contains a NUL byte".into()))?;
    let name = CString::new(source.file_name)
        .map_err(|_| compile_error("file name contains a NUL byte".into()))?;
    let program = nvrtc::create_program(&text, Some(&name))
        .map_err(|e| compile_error(format!("nvrtcCreateProgram: {e}")))?;
    let options = options(target, include_dir);
    // SAFETY: `program` is a live program handle until destroyed below.
    let compiled = unsafe { nvrtc::compile_program(program, &options) };
    let log = unsafe { nvrtc::get_program_log(program) }.map_or_else(
        |e| format!("(the compiler's log could not be read: nvrtcGetProgramLog: {e})"),
        |raw| c_chars_to_string(&raw),
    );
    let result = compiled
        .map_err(|e| compile_error(format!("{e}\n{log}")))
        .and_then(|()| {
            let ptx = unsafe { nvrtc::get_ptx(program) }
                .map_err(|e| compile_error(format!("nvrtcGetPTX: {e}")))?;
            let cubin = unsafe { get_cubin(program) }
                .map_err(|e| compile_error(format!("nvrtcGetCUBIN: {e}")))?;
            Ok(NvrtcOutput {
                ptx: c_chars_to_string(&ptx),
                cubin,
                resources: parse_ptxas_report(&log),
                log,
            })
        });
    // SAFETY: destroyed once, after its last use.
    let _ = unsafe { nvrtc::destroy_program(program) };
    result
}

/// The CUBIN of `source` for `target`, from the on-disk cache when present, else compiled and
/// stored there. The cache lives in `$FP4SPEC_CACHE_DIR`, else `$XDG_CACHE_HOME/fp4spec`, else
/// `~/.cache/fp4spec`; a cache that cannot be written only costs a recompile next time.
///
/// # Errors
/// As [`compile`].
pub fn cached_cubin(
    source: &RenderedSource,
    target: &TargetFacts,
    include_dir: &Path,
) -> Result<Vec<u8>> {
    cached_cubin_in(cache_dir().as_deref(), source, target, include_dir)
}

/// [`cached_cubin`] with the cache in `dir` (none: compile).
fn cached_cubin_in(
    dir: Option<&Path>,
    source: &RenderedSource,
    target: &TargetFacts,
    include_dir: &Path,
) -> Result<Vec<u8>> {
    let name = cache_file_name(source, target, version()?);
    let path = dir.map(|dir| dir.join(name));
    if let Some(path) = &path {
        if let Ok(bytes) = std::fs::read(path) {
            return Ok(bytes);
        }
    }
    let cubin = compile(source, target, include_dir)?.cubin;
    if let Some(path) = &path {
        let _ = store_atomically(path, &cubin);
    }
    Ok(cubin)
}

/// Whether [`fill_cache`] found a family's CUBIN in the cache or compiled it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheFill {
    /// Already there.
    Present,
    /// Compiled now and stored.
    Compiled,
}

/// Puts the CUBIN of `source` for `target` in the cache [`cached_cubin`] reads, compiling it
/// unless it is there, so that a machine without a GPU can prepare what a GPU host with the
/// same NVRTC version then loads without compiling (the key holds the source, the target's
/// architecture, the compile flags and the NVRTC version, not where the headers lie). Returns
/// the file and whether it was compiled.
///
/// # Errors
/// As [`compile`]; [`Error::Invalid`] when there is no cache folder (neither
/// `$FP4SPEC_CACHE_DIR`, `$XDG_CACHE_HOME` nor `$HOME` set), [`Error::Io`] naming the file when
/// it cannot be written.
pub fn fill_cache(
    source: &RenderedSource,
    target: &TargetFacts,
    include_dir: &Path,
) -> Result<(PathBuf, CacheFill)> {
    let dir = cache_dir().ok_or_else(|| {
        Error::invalid(
            "kernel cache folder",
            "none: set FP4SPEC_CACHE_DIR, XDG_CACHE_HOME or HOME",
        )
    })?;
    fill_cache_in(&dir, source, target, include_dir)
}

/// [`fill_cache`] with the cache in `dir`.
fn fill_cache_in(
    dir: &Path,
    source: &RenderedSource,
    target: &TargetFacts,
    include_dir: &Path,
) -> Result<(PathBuf, CacheFill)> {
    let path = dir.join(cache_file_name(source, target, version()?));
    if path.is_file() {
        return Ok((path, CacheFill::Present));
    }
    let cubin = compile(source, target, include_dir)?.cubin;
    store_atomically(&path, &cubin).map_err(|e| Error::io(path.display().to_string(), e))?;
    Ok((path, CacheFill::Compiled))
}

/// The cache's name for the CUBIN of `source` for `target` by NVRTC `version`: family, arch, and
/// a hash of the source and the flags. The include folder's path is left out: the same headers
/// lie in different places on different machines (a pip wheel here, /usr/local/cuda there), and
/// the NVRTC version in the name stands for them.
fn cache_file_name(source: &RenderedSource, target: &TargetFacts, version: (i32, i32)) -> String {
    let mut hash = Sha256::new();
    hash.update(source.source.as_bytes());
    for flag in flags(target) {
        hash.update(flag.as_bytes());
    }
    let digest: String = hash
        .finalize()
        .iter()
        .take(12)
        .map(|b| format!("{b:02x}"))
        .collect();
    format!(
        "{}-{}-{}-nvrtc{}.{}.cubin",
        source.family, target.compiler_arch, digest, version.0, version.1
    )
}

/// NVRTC's options for `target` with the headers in `include_dir`.
fn options(target: &TargetFacts, include_dir: &Path) -> Vec<String> {
    let mut options = vec![format!("--include-path={}", include_dir.display())];
    options.extend(flags(target));
    options
}

/// The options but the include path: what the output depends on.
fn flags(target: &TargetFacts) -> Vec<String> {
    vec![
        format!("--gpu-architecture={}", target.compiler_arch),
        "--std=c++17".into(),
        "-lineinfo".into(),
        "-Xptxas".into(),
        "-v".into(),
    ]
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("FP4SPEC_CACHE_DIR") {
        return Some(dir.into());
    }
    if let Some(dir) = std::env::var_os("XDG_CACHE_HOME") {
        return Some(PathBuf::from(dir).join("fp4spec"));
    }
    std::env::var_os("HOME").map(|home| PathBuf::from(home).join(".cache/fp4spec"))
}

/// Writes to a temporary name in the same folder, then renames, so a reader never sees a
/// partial file.
fn store_atomically(path: &Path, bytes: &[u8]) -> std::io::Result<()> {
    let dir = path
        .parent()
        .ok_or_else(|| std::io::Error::other("the cache file has no folder"))?;
    std::fs::create_dir_all(dir)?;
    let temporary = dir.join(format!(
        ".{}.{}.tmp",
        path.file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default(),
        std::process::id()
    ));
    let stored = std::fs::write(&temporary, bytes).and_then(|()| std::fs::rename(&temporary, path));
    if stored.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    stored
}

unsafe fn get_cubin(program: sys::nvrtcProgram) -> std::result::Result<Vec<u8>, nvrtc::NvrtcError> {
    let mut size = 0usize;
    unsafe { sys::nvrtcGetCUBINSize(program, &mut size) }.result()?;
    let mut cubin = vec![0u8; size];
    unsafe { sys::nvrtcGetCUBIN(program, cubin.as_mut_ptr().cast()) }.result()?;
    Ok(cubin)
}

fn c_chars_to_string(raw: &[std::ffi::c_char]) -> String {
    let bytes: Vec<u8> = raw.iter().map(|&c| c as u8).collect();
    CStr::from_bytes_until_nul(&bytes)
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_else(|_| String::from_utf8_lossy(&bytes).into_owned())
}

/// Parses ptxas' `-v` report: per entry function, registers, stack frame, spill stores, and
/// static shared memory. The stack and spill line after "Function properties for NAME" belongs
/// to NAME: an out-of-line callee's (reported after its caller) is not the entry's.
pub fn parse_ptxas_report(log: &str) -> Vec<KernelResources> {
    let mut kernels: Vec<KernelResources> = Vec::new();
    let mut properties_of_entry = true;
    for line in log.lines() {
        if let Some(rest) = line.split("Compiling entry function '").nth(1) {
            let name = rest.split('\'').next().unwrap_or_default();
            kernels.push(KernelResources {
                kernel: name.to_string(),
                ..Default::default()
            });
            properties_of_entry = true;
            continue;
        }
        let Some(current) = kernels.last_mut() else {
            continue;
        };
        if let Some(rest) = line.split("Function properties for ").nth(1) {
            properties_of_entry = rest.trim() == current.kernel;
            continue;
        }
        if properties_of_entry {
            if let Some(n) = number_before(line, " bytes stack frame") {
                current.stack_bytes = Some(n);
            }
            if let Some(n) = number_before(line, " bytes spill stores") {
                current.spill_bytes = Some(n);
            }
        }
        if let Some(n) = number_before(line, " registers") {
            current.registers = Some(n);
        }
        if let Some(n) = number_before(line, " bytes smem") {
            current.shared_bytes = Some(n);
        }
    }
    kernels
}

/// The integer right before `suffix` in `line`, if any.
fn number_before(line: &str, suffix: &str) -> Option<u32> {
    let end = line.find(suffix)?;
    let digits: String = line[..end]
        .chars()
        .rev()
        .take_while(|c| c.is_ascii_digit())
        .collect();
    digits.chars().rev().collect::<String>().parse().ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::table;

    /// A CUBIN filled into the cache is found again through headers in another folder, without
    /// compiling (the include folder given the second time does not exist, so a compile would
    /// fail): the cache serves a machine whose headers lie elsewhere. Needs NVRTC and the CUDA
    /// headers (`bash tools/toolchains.sh cargo test`).
    #[test]
    fn a_filled_cubin_is_found_from_another_include_folder() {
        let include = cuda_include_dir().expect("CUDA headers: run under tools/toolchains.sh");
        let target = crate::target::by_name("sm_90a").expect("sm_90a");
        let source = table::rendered_for_target("sm_90a")
            .find(|s| s.family == "dequant")
            .expect("the dequant family for sm_90a");
        let dir = tempfile::tempdir().expect("temporary folder");
        let (path, fill) = fill_cache_in(dir.path(), source, target, &include).expect("fill");
        assert_eq!(fill, CacheFill::Compiled);
        assert_eq!(
            fill_cache_in(dir.path(), source, target, &include).expect("fill again"),
            (path.clone(), CacheFill::Present)
        );
        let elsewhere = dir.path().join("no-such-include-folder");
        let cubin = cached_cubin_in(Some(dir.path()), source, target, &elsewhere).expect("cached");
        assert_eq!(cubin, std::fs::read(&path).expect("the cache file"));
        assert!(
            compile(source, target, &elsewhere).is_err(),
            "compiled without headers"
        );
    }

    /// An entry's stack and spills are its own, not those of the out-of-line callee ptxas
    /// reports after it.
    #[test]
    fn a_callee_report_does_not_overwrite_its_caller() {
        let log = "\
ptxas info    : Compiling entry function 'kernel_a' for 'sm_90a'
ptxas info    : Function properties for kernel_a
ptxas         .     400 bytes stack frame, 296 bytes spill stores, 580 bytes spill loads
ptxas info    : Used 64 registers, used 1 barriers, 400 bytes cumulative stack size, 13640 bytes smem
ptxas info    : Function properties for _Z6calleev
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Compiling entry function 'kernel_b' for 'sm_90a'
ptxas info    : Function properties for kernel_b
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 32 registers, used 0 barriers, 0 bytes smem
";
        let report = parse_ptxas_report(log);
        assert_eq!(report.len(), 2);
        assert_eq!(report[0].kernel, "kernel_a");
        assert_eq!(report[0].spill_bytes, Some(296));
        assert_eq!(report[0].stack_bytes, Some(400));
        assert_eq!(report[0].registers, Some(64));
        assert_eq!(report[0].shared_bytes, Some(13640));
        assert_eq!(report[1].spill_bytes, Some(0));
        assert_eq!(report[1].registers, Some(32));
    }
}
