//! Where the amdgcn compiler is and how it is called: one place for `build.rs` (code objects at
//! build time) and the crate (`clang.rs`: checks, and compiling at run time when the kernel table
//! has no code object).
//!
//! This file is compiled twice, like `src/target/facts.rs`: keep it free of crate imports.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::process::Command;

/// The oldest clang whose amdgcn backend knows gfx1151 well enough (LLVM 17 added it; 19 is
/// what the checks run with).
pub const MIN_CLANG_MAJOR: u32 = 19;

/// Environment variables that decide which compiler [`find_clang`] picks (for
/// `cargo:rerun-if-env-changed`; only build.rs reads it).
#[allow(dead_code)]
pub const COMPILER_ENV: [&str; 3] = ["FP4SPEC_HIP_CLANG", "ROCM_PATH", "HIP_PATH"];

/// Finds a clang that can compile HIP for amdgcn: `$FP4SPEC_HIP_CLANG`, ROCm's
/// (`$ROCM_PATH/llvm/bin/clang++`, `$HIP_PATH/llvm/bin/clang++`), then `clang++-19` ..
/// `clang++-22` and `clang++` on `PATH`, the first whose major version is at least
/// [`MIN_CLANG_MAJOR`].
///
/// # Errors
/// A sentence listing every candidate and why it was not used.
pub fn find_clang() -> Result<PathBuf, String> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(clang) = std::env::var_os("FP4SPEC_HIP_CLANG") {
        candidates.push(clang.into());
    }
    for var in ["ROCM_PATH", "HIP_PATH"] {
        if let Some(root) = std::env::var_os(var) {
            candidates.push(PathBuf::from(root).join("llvm/bin/clang++"));
        }
    }
    candidates.extend(
        [
            "clang++-19",
            "clang++-20",
            "clang++-21",
            "clang++-22",
            "clang++",
        ]
        .map(PathBuf::from),
    );
    let mut tried = Vec::new();
    for candidate in &candidates {
        match major_version(candidate) {
            Some(major) if major >= MIN_CLANG_MAJOR => return Ok(candidate.clone()),
            Some(major) => tried.push(format!("{} (clang {major}, too old)", candidate.display())),
            None => tried.push(format!("{} (not found)", candidate.display())),
        }
    }
    Err(format!(
        "no clang >= {MIN_CLANG_MAJOR} for amdgcn; tried {} (install clang-19 and lld-19, or \
         `source tools/toolchains.sh`, or point ROCM_PATH at a ROCm install)",
        tried.join(", ")
    ))
}

/// The major version `clang --version` reports, `None` when it does not run.
pub fn major_version(clang: &Path) -> Option<u32> {
    let output = Command::new(clang).arg("--version").output().ok()?;
    let text = String::from_utf8_lossy(&output.stdout);
    let after = text.split("clang version ").nth(1)?;
    after.split('.').next()?.trim().parse().ok()
}

/// The arguments that compile one rendered HIP source for `arch` into `output`, with no ROCm
/// install (`-nogpuinc -nogpulib`: the sources include nothing and call no device library).
/// `mode` is `-c` for a code object (an AMDGPU ELF that `hipModuleLoadData` loads:
/// `--no-gpu-bundle-output` keeps clang from wrapping it in an offload bundle) or `-S` for
/// assembly. clang's per-kernel resource remarks go to stderr.
pub fn device_args(arch: &str, mode: &str, input: &Path, output: &Path) -> Vec<OsString> {
    let mut args: Vec<OsString> = [
        "-x",
        "hip",
        &format!("--offload-arch={arch}"),
        "-nogpuinc",
        "-nogpulib",
        "--cuda-device-only",
        "--no-gpu-bundle-output",
        "-O3",
        "-std=c++17",
        mode,
        "-Rpass-analysis=kernel-resource-usage",
    ]
    .map(OsString::from)
    .to_vec();
    args.push(input.into());
    args.push("-o".into());
    args.push(output.into());
    args
}
