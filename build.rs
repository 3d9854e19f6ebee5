//! Renders every kernel template for every target of `kernels/targets.toml` into `OUT_DIR` and
//! writes the kernel table (`OUT_DIR/kernel_table.rs`) the crate includes.
//!
//! With the `hip` feature it also
//! - compiles every rendered AMD source to an AMDGPU code object with clang (found as
//!   `src/backend/hip/toolchain.rs` says) and embeds it in the table; without a clang >= 19 it
//!   warns and leaves the table without objects (the crate then compiles them at run time);
//! - generates the HIP runtime bindings (bindgen over `hip/hip_runtime_api.h` of ROCm, or of
//!   Debian's libamdhip64-dev) into `OUT_DIR/hip_runtime_sys.rs`; the library itself is opened
//!   at run time, so a build with bindings still runs where ROCm is absent.
//!
//! Layout: `kernels/templates/<family>.cu` is one kernel family (its kernels, all targets);
//! `kernels/templates/common/` holds the portability layer the families include. A kernel is
//! declared as `FP4_KERNEL void [FP4_LAUNCH_BOUNDS(..)] name(` at the start of a line, which is
//! how its name reaches the table.

#[path = "src/target/facts.rs"]
#[allow(dead_code)]
mod facts;

#[path = "src/backend/hip/toolchain.rs"]
#[allow(dead_code)]
mod hip_toolchain;

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

fn main() {
    if let Err(message) = run() {
        // A build script reports through its exit status; the message names the file at fault.
        eprintln!("fp4spec build.rs: {message}");
        std::process::exit(1);
    }
}

fn run() -> Result<(), String> {
    let manifest = PathBuf::from(env("CARGO_MANIFEST_DIR")?);
    let out_dir = PathBuf::from(env("OUT_DIR")?);
    let templates_dir = manifest.join("kernels/templates");
    let targets_path = manifest.join("kernels/targets.toml");
    println!("cargo:rerun-if-changed={}", targets_path.display());
    println!("cargo:rerun-if-changed={}", templates_dir.display());
    println!("cargo:rerun-if-changed=src/target/facts.rs");
    println!("cargo:rerun-if-changed=src/backend/hip/toolchain.rs");
    let hip = std::env::var_os("CARGO_FEATURE_HIP").is_some();

    let text = std::fs::read_to_string(&targets_path)
        .map_err(|e| format!("{}: {e}", targets_path.display()))?;
    let table = facts::TargetTable::parse(&text)?;

    let mut tera = tera::Tera::default();
    let mut families = Vec::new();
    for path in template_files(&templates_dir)? {
        println!("cargo:rerun-if-changed={}", path.display());
        let name = path
            .strip_prefix(&templates_dir)
            .map_err(|e| e.to_string())?
            .to_string_lossy()
            .replace('\\', "/");
        let body =
            std::fs::read_to_string(&path).map_err(|e| format!("{}: {e}", path.display()))?;
        tera.add_raw_template(&name, &body)
            .map_err(|e| format!("kernels/templates/{name}: {}", tera_error(&e)))?;
        if !name.contains('/') {
            if let Some(family) = name.strip_suffix(".cu") {
                families.push(family.to_string());
            } else {
                return Err(format!(
                    "kernels/templates/{name}: a family template must be named <family>.cu"
                ));
            }
        }
    }
    families.sort();

    let mut rendered = Vec::new();
    for target in &table.target {
        let dir = out_dir.join("kernels").join(&target.name);
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let mut context = tera::Context::new();
        context.insert("target", target);
        for family in &families {
            let template = format!("{family}.cu");
            let source = tera.render(&template, &context).map_err(|e| {
                format!(
                    "kernels/templates/{template} for {}: {}",
                    target.name,
                    tera_error(&e)
                )
            })?;
            let kernels = kernel_names(&source);
            if kernels.is_empty() {
                return Err(format!(
                    "kernels/templates/{template} for {}: no `FP4_KERNEL void name(` declaration",
                    target.name
                ));
            }
            let extension = match target.vendor {
                facts::Vendor::Nvidia => "cu",
                facts::Vendor::Amd => "hip",
            };
            let file_name = format!("{family}.{extension}");
            let path = dir.join(&file_name);
            std::fs::write(&path, &source).map_err(|e| format!("{}: {e}", path.display()))?;
            rendered.push(Rendered {
                target,
                family: family.clone(),
                file_name,
                kernels,
                path,
            });
        }
    }
    let code_objects = if hip {
        code_objects(&rendered)?
    } else {
        vec![None; rendered.len()]
    };
    #[cfg(feature = "hip")]
    hip_bindings::generate(&out_dir)?;

    let mut entries = String::new();
    for (source, object) in rendered.iter().zip(&code_objects) {
        let names: Vec<String> = source.kernels.iter().map(|k| format!("{k:?}")).collect();
        let code_object = match object {
            Some(path) => format!("Some(include_bytes!({:?}))", path.display().to_string()),
            None => "None".to_string(),
        };
        writeln!(
            entries,
            "    RenderedSource {{ target: {target:?}, family: {family:?}, file_name: {file_name:?}, \
             kernels: &[{names}], source: include_str!({path:?}), code_object: {code_object} }},",
            target = source.target.name,
            family = source.family,
            file_name = source.file_name,
            names = names.join(", "),
            path = source.path.display().to_string(),
        )
        .map_err(|e| e.to_string())?;
    }
    let table_rs = format!(
        "// Generated by build.rs from kernels/templates and kernels/targets.toml. Do not edit.\n\
         /// Every rendered kernel source: one entry per (target, family).\n\
         pub static RENDERED_SOURCES: &[RenderedSource] = &[\n{entries}];\n"
    );
    let table_path = out_dir.join("kernel_table.rs");
    std::fs::write(&table_path, table_rs).map_err(|e| format!("{}: {e}", table_path.display()))
}

/// One rendered (target, family) source on disk.
struct Rendered<'a> {
    target: &'a facts::TargetFacts,
    family: String,
    file_name: String,
    kernels: Vec<String>,
    path: PathBuf,
}

/// The `hip` feature's code objects: every AMD source compiled by clang into `<family>.co` beside
/// it, all at once (one clang per family). `None` for NVIDIA sources, and for all of them, with a
/// cargo warning, when no clang >= 19 is found.
///
/// # Errors
/// A source clang rejects (with clang's log): a kernel that does not compile is a defect the
/// build should not hide.
fn code_objects(rendered: &[Rendered<'_>]) -> Result<Vec<Option<PathBuf>>, String> {
    for var in hip_toolchain::COMPILER_ENV {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let mut objects = vec![None; rendered.len()];
    let amd: Vec<usize> = (0..rendered.len())
        .filter(|&i| rendered[i].target.vendor == facts::Vendor::Amd)
        .collect();
    if amd.is_empty() {
        return Ok(objects);
    }
    let clang = match hip_toolchain::find_clang() {
        Ok(clang) => clang,
        Err(why) => {
            println!(
                "cargo:warning=fp4spec: no AMDGPU code objects embedded ({why}); the HIP backend \
                 will compile them with clang at run time"
            );
            return Ok(objects);
        }
    };
    let mut running = Vec::new();
    for &i in &amd {
        let source = &rendered[i];
        let object = source.path.with_extension("co");
        let args =
            hip_toolchain::device_args(&source.target.compiler_arch, "-c", &source.path, &object);
        let child = std::process::Command::new(&clang)
            .args(args)
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .map_err(|e| format!("{}: {e}", clang.display()))?;
        running.push((i, object, child));
    }
    for (i, object, child) in running {
        let source = &rendered[i];
        let output = child
            .wait_with_output()
            .map_err(|e| format!("{}: {e}", clang.display()))?;
        if !output.status.success() {
            return Err(format!(
                "{} could not compile family `{}` for {} into a code object:\n{}",
                clang.display(),
                source.family,
                source.target.name,
                String::from_utf8_lossy(&output.stderr)
            ));
        }
        objects[i] = Some(object);
    }
    Ok(objects)
}

/// The `hip` feature's runtime bindings.
#[cfg(feature = "hip")]
mod hip_bindings {
    use std::path::{Path, PathBuf};

    /// The HIP runtime calls the backend makes; nothing else is bound.
    const FUNCTIONS: &str = "hip(GetDeviceCount|GetDeviceProperties(R0600)?|SetDevice\
        |RuntimeGetVersion|GetErrorName|GetErrorString|Malloc|Free|MemcpyAsync|MemsetAsync\
        |ModuleLoadData|ModuleUnload|ModuleGetFunction|ModuleLaunchKernel|StreamCreate\
        |StreamDestroy|StreamSynchronize|EventCreate|EventRecord|EventSynchronize\
        |EventElapsedTime|EventDestroy)";

    /// The install whose header the bindings come from: `$ROCM_PATH`, `$HIP_PATH`,
    /// `/opt/rocm`, then `/usr` (Debian's libamdhip64-dev), the first with
    /// `include/hip/hip_runtime_api.h`.
    fn header_root() -> Result<PathBuf, String> {
        let mut roots: Vec<PathBuf> = ["ROCM_PATH", "HIP_PATH"]
            .iter()
            .filter_map(std::env::var_os)
            .map(PathBuf::from)
            .collect();
        roots.extend(["/opt/rocm", "/usr"].map(PathBuf::from));
        roots
            .iter()
            .find(|root| root.join("include/hip/hip_runtime_api.h").is_file())
            .cloned()
            .ok_or_else(|| {
                let searched: Vec<String> = roots
                    .iter()
                    .map(|r| {
                        r.join("include/hip/hip_runtime_api.h")
                            .display()
                            .to_string()
                    })
                    .collect();
                format!(
                    "the `hip` feature needs the HIP runtime header to generate its bindings; \
                     searched {} (install ROCm and set ROCM_PATH, or on Debian \
                     `apt-get install libamdhip64-dev`)",
                    searched.join(", ")
                )
            })
    }

    /// Writes `OUT_DIR/hip_runtime_sys.rs`: the bindings, plus the name of the device
    /// properties struct and call of this HIP version (HIP 6 renamed them `...R0600`) and the
    /// install root the runtime library is looked for in first.
    pub fn generate(out_dir: &Path) -> Result<(), String> {
        for var in ["ROCM_PATH", "HIP_PATH", "LIBCLANG_PATH"] {
            println!("cargo:rerun-if-env-changed={var}");
        }
        let root = header_root()?;
        let include = root.join("include");
        println!(
            "cargo:rerun-if-changed={}",
            include.join("hip/hip_runtime_api.h").display()
        );
        // ROCm ships libclang in its llvm/lib; bindgen finds the system's by itself
        let rocm_libclang = root.join("llvm/lib");
        if std::env::var_os("LIBCLANG_PATH").is_none()
            && rocm_libclang.join("libclang.so").is_file()
        {
            // SAFETY: the build script is single-threaded here.
            unsafe { std::env::set_var("LIBCLANG_PATH", &rocm_libclang) };
        }
        let bindings = bindgen::Builder::default()
            .header_contents("fp4spec_hip.h", "#include <hip/hip_runtime_api.h>\n")
            .clang_arg("-D__HIP_PLATFORM_AMD__")
            .clang_arg(format!("-I{}", include.display()))
            .allowlist_function(FUNCTIONS)
            .allowlist_var("HIP_VERSION_(MAJOR|MINOR|PATCH)")
            .default_enum_style(bindgen::EnumVariation::NewType {
                is_bitfield: false,
                is_global: false,
            })
            .dynamic_library_name("HipLibrary")
            .dynamic_link_require_all(true)
            .wrap_unsafe_ops(true)
            .generate_comments(false)
            .rust_edition(bindgen::RustEdition::Edition2024)
            .generate()
            .map_err(|e| {
                format!(
                    "bindgen could not read {}/hip/hip_runtime_api.h: {e} (the `hip` feature needs \
                     libclang: Debian `apt-get install libclang1-19`, or set LIBCLANG_PATH)",
                    include.display()
                )
            })?;
        let mut text = bindings.to_string();
        let suffix = if text.contains("hipGetDevicePropertiesR0600") {
            "R0600"
        } else {
            ""
        };
        text.push_str(&format!(
            "\n/// The install root whose header these bindings come from.\n\
             pub const FP4SPEC_HIP_BUILD_ROOT: &str = {root:?};\n\
             /// The device properties struct of this HIP version.\n\
             pub type DeviceProperties = hipDeviceProp_t{suffix};\n\
             impl HipLibrary {{\n\
             /// `hipGetDeviceProperties{suffix}`: the call that fills [`DeviceProperties`].\n\
             pub unsafe fn get_device_properties(&self, props: *mut DeviceProperties, \
             device: ::std::os::raw::c_int) -> hipError_t {{\n\
             unsafe {{ self.hipGetDeviceProperties{suffix}(props, device) }}\n}}\n}}\n",
            root = root.display().to_string()
        ));
        let path = out_dir.join("hip_runtime_sys.rs");
        std::fs::write(&path, text).map_err(|e| format!("{}: {e}", path.display()))
    }
}

fn env(name: &str) -> Result<String, String> {
    std::env::var(name).map_err(|_| format!("environment variable {name} is not set"))
}

/// Every file below `dir`, sorted, so the table's order is stable.
fn template_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let mut files = Vec::new();
    let mut pending = vec![dir.to_path_buf()];
    while let Some(d) = pending.pop() {
        let entries = std::fs::read_dir(&d).map_err(|e| format!("{}: {e}", d.display()))?;
        for entry in entries {
            let path = entry.map_err(|e| format!("{}: {e}", d.display()))?.path();
            if path.is_dir() {
                pending.push(path);
            } else {
                files.push(path);
            }
        }
    }
    files.sort();
    Ok(files)
}

/// Tera nests the useful message in the error's sources.
fn tera_error(e: &tera::Error) -> String {
    let mut message = e.to_string();
    let mut source = std::error::Error::source(e);
    while let Some(inner) = source {
        message.push_str(": ");
        message.push_str(&inner.to_string());
        source = inner.source();
    }
    message
}

/// Names of the kernels a rendered source declares (`FP4_KERNEL void [FP4_LAUNCH_BOUNDS(..)] name(`).
fn kernel_names(source: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in source.lines() {
        let Some(rest) = line.strip_prefix("FP4_KERNEL void ") else {
            continue;
        };
        let mut rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("FP4_LAUNCH_BOUNDS(") {
            let mut depth = 1;
            let mut end = after.len();
            for (i, c) in after.char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' => {
                        depth -= 1;
                        if depth == 0 {
                            end = i + 1;
                            break;
                        }
                    }
                    _ => {}
                }
            }
            rest = after[end..].trim_start();
        }
        let name: String = rest
            .chars()
            .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
            .collect();
        if !name.is_empty() {
            names.push(name);
        }
    }
    names
}
