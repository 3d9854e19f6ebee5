//! The table of generated kernels: every (target, family) source `build.rs` rendered from
//! `kernels/templates/` with `kernels/targets.toml`, embedded in the binary.

/// One rendered kernel source: a family's kernels for one target.
#[derive(Debug, Clone, Copy)]
pub struct RenderedSource {
    /// Target name (`sm_90a`, `sm_121a`, `gfx1151`).
    pub target: &'static str,
    /// Kernel family (`dequant`, `gemm`, ...): the template `kernels/templates/<family>.cu`.
    pub family: &'static str,
    /// File name the source is written under (`<family>.cu` for CUDA, `<family>.hip` for HIP).
    pub file_name: &'static str,
    /// `extern "C"` names of the kernels the source defines.
    pub kernels: &'static [&'static str],
    /// The complete, self-contained source text.
    pub source: &'static str,
    /// The AMDGPU code object compiled from `source` at build time (AMD targets, `hip` feature,
    /// a clang >= 19 found by build.rs); `None` otherwise, and the HIP backend compiles the
    /// source at run time.
    pub code_object: Option<&'static [u8]>,
}

include!(concat!(env!("OUT_DIR"), "/kernel_table.rs"));

/// The rendered source of `family` for `target`, if that pair exists.
pub fn rendered(target: &str, family: &str) -> Option<&'static RenderedSource> {
    RENDERED_SOURCES
        .iter()
        .find(|s| s.target == target && s.family == family)
}

/// Every rendered source of one target, in family order.
pub fn rendered_for_target(target: &str) -> impl Iterator<Item = &'static RenderedSource> {
    RENDERED_SOURCES.iter().filter(move |s| s.target == target)
}
