//! Test support: a family's launch argument lists checked against the kernels' real parameters
//! without a device, so a wrong count, order of kinds or scalar width (u32 vs u64 vs f32) shows
//! here rather than as a launch error or wrong numbers on the GPU host.
//!
//! - NVIDIA targets: the `.entry` parameter list of the PTX NVRTC writes for the rendered source
//!   (pointers and u64 are `.u64`, then `.u32`, `.s32`, `.f32`).
//! - AMD targets: the code object's metadata (the table's embedded one, else compiled by clang),
//!   through the HIP backend's own launch check ([`KernelInfo::check_launch`]).
//!
//! Compiles are cached per (target, family) for the test process. Needs NVRTC, the CUDA headers
//! and clang-19 (`bash tools/toolchains.sh cargo test`).

use crate::backend::KernelArg;
use crate::backend::LaunchDims;
use crate::backend::cuda::nvrtc;
use crate::backend::hip::{clang, code_object};
use crate::kernels::table;
use crate::target::{self, Vendor};
use std::collections::HashMap;
use std::sync::{Mutex, OnceLock};

/// What one compile of a family says about its kernels' parameters.
enum Parameters {
    /// PTX text (NVIDIA).
    Ptx(String),
    /// The checked code object (AMD).
    CodeObject(code_object::CodeObject),
}

fn parameters(target_name: &str, family: &str) -> &'static Parameters {
    static CACHE: OnceLock<Mutex<HashMap<(String, String), &'static Parameters>>> = OnceLock::new();
    let mut cache = CACHE
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let key = (target_name.to_string(), family.to_string());
    if let Some(found) = cache.get(&key) {
        return found;
    }
    let t = target::by_name(target_name).expect("a target of kernels/targets.toml");
    let source = table::rendered(target_name, family).expect("the family is rendered");
    let compiled = match t.vendor {
        Vendor::Nvidia => {
            let include = nvrtc::cuda_include_dir()
                .expect("CUDA headers: run as `bash tools/toolchains.sh cargo test`");
            Parameters::Ptx(
                nvrtc::compile(source, t, &include)
                    .expect("NVRTC compiles")
                    .ptx,
            )
        }
        Vendor::Amd => {
            let object = match source.code_object {
                Some(object) => object.to_vec(),
                None => {
                    let clang = clang::find()
                        .expect("clang-19: run as `bash tools/toolchains.sh cargo test`");
                    clang::compile(&clang, source, t)
                        .expect("clang compiles")
                        .object
                }
            };
            Parameters::CodeObject(code_object::check(&object, source, t).expect("valid object"))
        }
    };
    let leaked: &'static Parameters = Box::leak(Box::new(compiled));
    cache.insert(key, leaked);
    leaked
}

/// The PTX parameter types of `kernel` (`.u64`, `.u32`, `.f32`, ...; a struct passed by value,
/// `.param .align A .b8 name[N]`, as `.b8[N]`), in order.
fn ptx_parameter_types(ptx: &str, kernel: &str) -> Option<Vec<String>> {
    let header = format!(".entry {kernel}(");
    let start = ptx.find(&header)? + header.len();
    let end = start + ptx[start..].find(')')?;
    Some(
        ptx[start..end]
            .split(',')
            .filter_map(|p| {
                let mut words = p.split_whitespace();
                if words.next() != Some(".param") {
                    return None;
                }
                let mut kind = words.next().unwrap_or("");
                if kind == ".align" {
                    kind = words.nth(1).unwrap_or("");
                }
                let length = words
                    .next()
                    .and_then(|name| name.find('[').map(|at| &name[at..]))
                    .unwrap_or("");
                Some(format!("{kind}{length}"))
            })
            .collect(),
    )
}

/// The PTX type a launch argument must meet.
fn ptx_type_of(arg: &KernelArg<'_>) -> String {
    let described = arg.describe();
    if arg.is_pointer() || described.starts_with("a u64") {
        ".u64".into()
    } else if described.starts_with("a u32") {
        ".u32".into()
    } else if described.starts_with("an i32") {
        ".s32".into()
    } else if described.starts_with("an f32") {
        ".f32".into()
    } else if described.ends_with("-byte struct") {
        format!(".b8[{}]", arg.size())
    } else {
        "?".into()
    }
}

/// Every mismatch of one family's argument lists against its compiled kernels, collected over
/// all targets and kernels so that one test run reports them all.
pub(crate) struct ArgumentChecks {
    family: &'static str,
    failures: Vec<String>,
}

impl ArgumentChecks {
    pub(crate) fn new(family: &'static str) -> Self {
        Self {
            family,
            failures: Vec::new(),
        }
    }

    /// [`check_arguments`] of `args` for `kernel` on `target_name`, a mismatch kept.
    pub(crate) fn check(&mut self, target_name: &str, kernel: &str, args: &[KernelArg<'_>]) {
        if let Err(e) = check_arguments(target_name, self.family, kernel, args) {
            self.failures.push(e);
        }
    }

    /// # Panics
    /// If any check failed, listing every mismatch.
    pub(crate) fn assert_all_match(self) {
        assert!(self.failures.is_empty(), "{}", self.failures.join("\n"));
    }
}

/// Checks `args` against `kernel` of `family` as compiled for `target_name`.
///
/// # Errors
/// A sentence naming the target, kernel and first mismatch.
fn check_arguments(
    target_name: &str,
    family: &str,
    kernel: &str,
    args: &[KernelArg<'_>],
) -> Result<(), String> {
    match parameters(target_name, family) {
        Parameters::Ptx(ptx) => {
            let types = ptx_parameter_types(ptx, kernel)
                .ok_or_else(|| format!("{target_name}: no `.entry {kernel}(` in the PTX"))?;
            if types.len() != args.len() {
                return Err(format!(
                    "{target_name} {kernel}: {} parameters, the launch passes {}",
                    types.len(),
                    args.len()
                ));
            }
            for (i, (want, arg)) in types.iter().zip(args).enumerate() {
                if *want != ptx_type_of(arg) {
                    return Err(format!(
                        "{target_name} {kernel} parameter {i}: the kernel takes {want}, the \
                         launch passes {}",
                        arg.describe()
                    ));
                }
            }
            Ok(())
        }
        Parameters::CodeObject(object) => {
            let t = target::by_name(target_name).expect("target");
            let info = object
                .kernel(kernel)
                .ok_or_else(|| format!("{target_name}: no `{kernel}` in the code object"))?;
            info.check_launch(
                &LaunchDims::linear(1, t.warp_size),
                t.max_shared_bytes_per_block,
                args,
            )
            .map_err(|e| format!("{target_name}: {e}"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptx_parameter_lists_are_read_in_order() {
        let ptx = ".visible .entry k(\n\t.param .u64 .ptr .align 1 k_param_0,\n\t.param .f32 \
                   k_param_1,\n\t.param .u32 k_param_2,\n\t.param .align 8 .b8 k_param_3[184]\n)\n{\n}";
        assert_eq!(
            ptx_parameter_types(ptx, "k").expect("found"),
            [".u64", ".f32", ".u32", ".b8[184]"]
        );
        let record = crate::kernels::verify::device::Args::default();
        assert_eq!(ptx_type_of(&KernelArg::by_value(&record)), ".b8[184]");
        assert!(ptx_parameter_types(ptx, "other").is_none());
        assert_eq!(ptx_type_of(&KernelArg::f32(1.0)), ".f32");
        assert_eq!(ptx_type_of(&KernelArg::u64(1)), ".u64");
        assert_eq!(ptx_type_of(&KernelArg::optional_input::<u8>(None)), ".u64");
    }
}
