//! Compiles every rendered kernel for every target with what is installed (NVRTC for `sm_*`,
//! clang for `gfx*`), one row per (target, family, kernel). Used by `fp4spec kernels --check`
//! and by the codegen tests. A missing compiler is its own status, never "ok".

use crate::backend::KernelResources;
use crate::backend::cuda::nvrtc;
use crate::backend::hip::{clang, code_object};
use crate::kernels::table::{self, RenderedSource};
use crate::target::{TargetFacts, Vendor};

/// The outcome for one kernel.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CheckStatus {
    /// Compiled, and the kernel symbol is in the output.
    Ok,
    /// The compiler rejected the source, or the kernel is missing from its output; the log.
    Failed(String),
    /// No compiler (or headers) for this target on this machine; what is missing.
    CompilerMissing(String),
}

/// One row of the check.
#[derive(Debug, Clone)]
pub struct CheckRow {
    /// Target name.
    pub target: String,
    /// Kernel family.
    pub family: String,
    /// Kernel name.
    pub kernel: String,
    /// Outcome.
    pub status: CheckStatus,
    /// Resources the compiler reported for the kernel, when it did.
    pub resources: Option<KernelResources>,
    /// The compiler's log for the kernel's family (empty when it did not run).
    pub log: String,
}

/// What one successful compile of a family produced.
struct Compiled {
    resources: Vec<KernelResources>,
    /// Kernels found in the output (PTX entries, or clang's resource remarks).
    present: Vec<String>,
    log: String,
}

/// Compiles every family of every target in `targets`.
pub fn check(targets: &[TargetFacts]) -> Vec<CheckRow> {
    let mut rows = Vec::new();
    for target in targets {
        let sources: Vec<&RenderedSource> = table::rendered_for_target(&target.name).collect();
        match target.vendor {
            Vendor::Nvidia => check_nvidia(target, &sources, &mut rows),
            Vendor::Amd => check_amd(target, &sources, &mut rows),
        }
    }
    rows
}

fn check_nvidia(target: &TargetFacts, sources: &[&RenderedSource], rows: &mut Vec<CheckRow>) {
    let toolchain = nvrtc::version().and_then(|_| nvrtc::cuda_include_dir());
    for source in sources {
        let outcome = match &toolchain {
            Err(e) => Err(CheckStatus::CompilerMissing(e.to_string())),
            Ok(include) => nvrtc::compile(source, target, include)
                .map(|out| Compiled {
                    present: source
                        .kernels
                        .iter()
                        .filter(|k| out.ptx.contains(&format!(".entry {k}(")))
                        .map(|k| k.to_string())
                        .collect(),
                    resources: out.resources,
                    log: out.log,
                })
                .map_err(|e| CheckStatus::Failed(e.to_string())),
        };
        push_rows(target, source, outcome, rows, "PTX has no .entry");
    }
}

fn check_amd(target: &TargetFacts, sources: &[&RenderedSource], rows: &mut Vec<CheckRow>) {
    let compiler = clang::find();
    for source in sources {
        let outcome = match &compiler {
            Err(e) => Err(CheckStatus::CompilerMissing(e.to_string())),
            Ok(clang_path) => clang::compile(clang_path, source, target)
                .and_then(|out| {
                    // present = the kernel's entry, descriptor and metadata are in the code
                    // object, which is for this target
                    let object = code_object::check(&out.object, source, target)?;
                    Ok(Compiled {
                        present: object.kernels.iter().map(|k| k.name.clone()).collect(),
                        resources: out.resources,
                        log: out.log,
                    })
                })
                .map_err(|e| CheckStatus::Failed(e.to_string())),
        };
        push_rows(
            target,
            source,
            outcome,
            rows,
            "the code object has no metadata for",
        );
    }
}

/// One row per kernel of `source`: `Ok` when the compiler's output names it.
fn push_rows(
    target: &TargetFacts,
    source: &RenderedSource,
    outcome: Result<Compiled, CheckStatus>,
    rows: &mut Vec<CheckRow>,
    absent: &str,
) {
    for kernel in source.kernels {
        let (status, resources, log) = match &outcome {
            Err(status) => (status.clone(), None, String::new()),
            Ok(compiled) => {
                let found = compiled
                    .resources
                    .iter()
                    .find(|r| r.kernel == *kernel)
                    .cloned();
                let status = if compiled.present.iter().any(|p| p == kernel) {
                    CheckStatus::Ok
                } else {
                    CheckStatus::Failed(format!("{absent} `{kernel}`"))
                };
                (status, found, compiled.log.clone())
            }
        };
        rows.push(CheckRow {
            target: target.name.clone(),
            family: source.family.to_string(),
            kernel: kernel.to_string(),
            status,
            resources,
            log,
        });
    }
}
