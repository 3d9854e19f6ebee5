//! clang for amdgcn: compiles a rendered HIP source for a gfx target with no ROCm install
//! (`-x hip -nogpuinc -nogpulib --cuda-device-only`, flags in `toolchain`) into a code object,
//! and reads clang's per-kernel resource remarks (VGPRs, SGPRs, scratch, spills, LDS).

use super::toolchain;
use crate::backend::KernelResources;
use crate::error::{Error, Result};
use crate::kernels::table::RenderedSource;
use crate::target::TargetFacts;
use std::path::PathBuf;
use std::process::Command;
use std::sync::atomic::{AtomicUsize, Ordering};

pub use super::toolchain::MIN_CLANG_MAJOR;

/// What clang produced for one source.
#[derive(Debug, Clone)]
pub struct ClangOutput {
    /// The code object clang wrote (an AMDGPU ELF, loadable with `hipModuleLoadData`).
    pub object: Vec<u8>,
    /// clang's diagnostics (the resource remarks).
    pub log: String,
    /// Per-kernel resources parsed from the remarks.
    pub resources: Vec<KernelResources>,
}

/// Finds a clang that can compile HIP for amdgcn: `$FP4SPEC_HIP_CLANG`, ROCm's
/// (`$ROCM_PATH/llvm/bin/clang++`, `$HIP_PATH/llvm/bin/clang++`), then `clang++-19` .. `clang++-22`
/// and `clang++` on `PATH` when its major version is at least [`MIN_CLANG_MAJOR`].
///
/// # Errors
/// [`Error::Invalid`] (what = "HIP compiler") listing what was tried.
pub fn find() -> Result<PathBuf> {
    toolchain::find_clang().map_err(|tried| Error::invalid("HIP compiler", tried))
}

/// Compiles `source` for `target` with `clang` at -O3 and collects the resource remarks.
///
/// # Errors
/// [`Error::Io`] when the scratch folder cannot be written or clang cannot start,
/// [`Error::Compile`] with clang's output when compilation fails.
pub fn compile(
    clang: &PathBuf,
    source: &RenderedSource,
    target: &TargetFacts,
) -> Result<ClangOutput> {
    let (object, log) = run(clang, source, target, "-c", "o")?;
    Ok(ClangOutput {
        object,
        resources: parse_resource_remarks(&log),
        log,
    })
}

/// The AMDGPU assembly clang generates for `source` (for checks on the instructions used).
///
/// # Errors
/// As [`compile`].
pub fn assembly(clang: &PathBuf, source: &RenderedSource, target: &TargetFacts) -> Result<String> {
    let (text, _) = run(clang, source, target, "-S", "s")?;
    Ok(String::from_utf8_lossy(&text).into_owned())
}

/// Runs clang on `source` with `mode` (`-c` or `-S`); returns the output file and the log.
fn run(
    clang: &PathBuf,
    source: &RenderedSource,
    target: &TargetFacts,
    mode: &str,
    extension: &str,
) -> Result<(Vec<u8>, String)> {
    // unique per call: checks may run concurrently in one process
    static CALLS: AtomicUsize = AtomicUsize::new(0);
    let call = CALLS.fetch_add(1, Ordering::Relaxed);
    let dir = std::env::temp_dir().join(format!(
        "fp4spec-clang-{}-{call}-{}-{}",
        std::process::id(),
        target.name,
        source.family
    ));
    std::fs::create_dir_all(&dir).map_err(|e| Error::io(&dir, e))?;
    let input = dir.join(source.file_name);
    let output = dir.join(format!("{}.{extension}", source.family));
    std::fs::write(&input, source.source).map_err(|e| Error::io(&input, e))?;
    let run = Command::new(clang)
        .args(toolchain::device_args(
            &target.compiler_arch,
            mode,
            &input,
            &output,
        ))
        .output()
        .map_err(|e| Error::io(clang, e))?;
    let log = String::from_utf8_lossy(&run.stderr).into_owned();
    let produced = std::fs::read(&output);
    let _ = std::fs::remove_dir_all(&dir);
    if !run.status.success() {
        return Err(Error::Compile {
            compiler: clang.display().to_string(),
            target: target.name.clone(),
            family: source.family.into(),
            log,
        });
    }
    Ok((produced.map_err(|e| Error::io(&output, e))?, log))
}

/// Parses `-Rpass-analysis=kernel-resource-usage` remarks into per-kernel resources.
pub fn parse_resource_remarks(log: &str) -> Vec<KernelResources> {
    let mut kernels: Vec<KernelResources> = Vec::new();
    for line in log.lines() {
        let Some(remark) = line.split("remark: ").nth(1) else {
            continue;
        };
        let remark = remark
            .split(" [-Rpass-analysis")
            .next()
            .unwrap_or(remark)
            .trim();
        if let Some(name) = remark.strip_prefix("Function Name: ") {
            kernels.push(KernelResources {
                kernel: name.trim().to_string(),
                ..Default::default()
            });
            continue;
        }
        let Some(current) = kernels.last_mut() else {
            continue;
        };
        let value = |key: &str| {
            remark
                .strip_prefix(key)
                .and_then(|v| v.trim().parse::<u32>().ok())
        };
        if let Some(n) = value("VGPRs:") {
            current.registers = Some(n);
        } else if let Some(n) = value("SGPRs:") {
            current.scalar_registers = Some(n);
        } else if let Some(n) = value("ScratchSize [bytes/lane]:") {
            current.stack_bytes = Some(n);
        } else if let Some(n) = value("LDS Size [bytes/block]:") {
            current.shared_bytes = Some(n);
        } else if let Some(n) = value("VGPRs Spill:").or_else(|| value("SGPRs Spill:")) {
            current.spill_bytes = Some(current.spill_bytes.unwrap_or(0) + 4 * n);
        }
    }
    kernels
}
