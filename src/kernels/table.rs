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

/// Asserts that `family`'s source for every target `on` accepts defines each of `defines` as
/// `#define NAME VALUE`: the launch sizes and limits the Rust side writes again (block threads,
/// maxima) must be the template's, or a launch runs a kernel with the wrong block.
#[cfg(test)]
pub(crate) fn assert_defines(
    family: &str,
    on: impl Fn(&crate::target::TargetFacts) -> bool,
    defines: &[(&str, String)],
) {
    let mut checked = 0;
    for target in crate::target::all().iter().filter(|t| on(t)) {
        let source = rendered(&target.name, family)
            .unwrap_or_else(|| panic!("{family} is rendered for {}", target.name))
            .source;
        for (name, value) in defines {
            let define = format!("#define {name} {value}");
            assert!(
                source
                    .lines()
                    .any(|l| l.trim_end() == define || l.starts_with(&format!("{define} "))),
                "{} {family}: no `{define}` (the Rust side's value)",
                target.name
            );
        }
        checked += 1;
    }
    assert!(checked > 0, "{family}: no target to check");
}
