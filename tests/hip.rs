//! The HIP backend up to the hardware (there is no AMD GPU where these run): the gfx1151 code
//! objects (embedded at build time with `--features hip`, else compiled here with clang) are
//! valid AMDGPU ELF files for gfx1151 holding every kernel the table lists (read by the crate's
//! reader and, independently, by llvm-readelf); the WMMA kernels' machine code has `v_wmma`
//! (llvm-objdump); no kernel spills, uses scratch or more than 64 KiB of LDS; launches are
//! checked against the real metadata; and a missing runtime or device is an error value.
//!
//! Needs clang-19 / llvm-19 (`bash tools/toolchains.sh cargo test --release --test hip`).

use fp4spec::Error;
use fp4spec::backend::hip::{self, clang, code_object};
use fp4spec::backend::{Backend, BackendKind, DeviceVec, KernelArg, LaunchDims};
use fp4spec::kernels::table::{self, RenderedSource};
use fp4spec::kernels::{check, dequant};
use fp4spec::target::{self, TargetFacts, Vendor};
use std::path::{Path, PathBuf};
use std::process::Command;

fn amd_targets() -> Vec<&'static TargetFacts> {
    let amd: Vec<&'static TargetFacts> = target::all()
        .iter()
        .filter(|t| t.vendor == Vendor::Amd)
        .collect();
    assert!(
        amd.iter().any(|t| t.name == "gfx1151"),
        "kernels/targets.toml has no gfx1151"
    );
    amd
}

fn clang_path() -> PathBuf {
    clang::find().expect("clang-19: run as `bash tools/toolchains.sh cargo test --release`")
}

/// The code object of `source`: the embedded one when the build has it, else compiled now.
/// With the `hip` feature and a clang present, the build must have embedded it.
fn code_object_of(source: &RenderedSource, target: &TargetFacts) -> (Vec<u8>, &'static str) {
    if let Some(object) = source.code_object {
        return (object.to_vec(), "embedded");
    }
    let clang = clang_path();
    if cfg!(feature = "hip") {
        panic!(
            "{} {}: a `hip` build with {} present embedded no code object",
            target.name,
            source.family,
            clang.display()
        );
    }
    let compiled = clang::compile(&clang, source, target).expect("compiles for gfx");
    (compiled.object, "compiled by the test")
}

/// An LLVM 19+ tool: `<name>-19` .. `-22` on PATH, else `<name>` beside the clang in use.
fn llvm_tool(name: &str) -> PathBuf {
    let mut candidates: Vec<PathBuf> = (19..=22).map(|v| format!("{name}-{v}").into()).collect();
    if let Some(dir) = clang_path().parent().filter(|d| !d.as_os_str().is_empty()) {
        candidates.push(dir.join(name));
    }
    candidates.push(name.into());
    candidates
        .into_iter()
        .find(|tool| {
            Command::new(tool)
                .arg("--version")
                .output()
                .is_ok_and(|o| o.status.success())
        })
        .unwrap_or_else(|| panic!("no {name} (llvm-19): run `bash tools/toolchains.sh`"))
}

fn run_tool(tool: &Path, args: &[&str], object: &Path) -> String {
    let output = Command::new(tool)
        .args(args)
        .arg(object)
        .output()
        .unwrap_or_else(|e| panic!("{}: {e}", tool.display()));
    assert!(
        output.status.success(),
        "{} {args:?} {}: {}",
        tool.display(),
        object.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn write_object(dir: &Path, source: &RenderedSource, bytes: &[u8]) -> PathBuf {
    let path = dir.join(format!("{}-{}.co", source.target, source.family));
    std::fs::write(&path, bytes).expect("write the code object");
    path
}

#[test]
fn every_code_object_is_a_gfx1151_elf_with_every_kernel_of_the_table() {
    let readelf = llvm_tool("llvm-readelf");
    let dir = tempfile::tempdir().expect("temp dir");
    for target in amd_targets() {
        let sources: Vec<&RenderedSource> = table::rendered_for_target(&target.name).collect();
        assert!(!sources.is_empty(), "{}: no rendered sources", target.name);
        for source in sources {
            let (bytes, origin) = code_object_of(source, target);
            let object = code_object::check(&bytes, source, target)
                .unwrap_or_else(|e| panic!("{} {} ({origin}): {e}", target.name, source.family));
            assert_eq!(object.arch, target.compiler_arch);
            assert_eq!(
                object.target_id,
                format!("amdgcn-amd-amdhsa--{}", target.compiler_arch)
            );
            assert!(
                object.version >= 4,
                "{} {}: code object v{} (ROCm 6 loads v4-v6)",
                target.name,
                source.family,
                object.version
            );

            // the same facts, read by LLVM's own tool
            let path = write_object(dir.path(), source, &bytes);
            let text = run_tool(&readelf, &["--file-header", "--symbols"], &path);
            assert!(
                text.contains("EM_AMDGPU") && text.contains("AMDGPU - HSA"),
                "{}: llvm-readelf does not see an AMDGPU HSA object:\n{text}",
                path.display()
            );
            let flags = text
                .lines()
                .find(|l| l.trim_start().starts_with("Flags:"))
                .unwrap_or_default();
            assert!(
                flags.ends_with(&format!(", {}", target.compiler_arch)),
                "{}: llvm-readelf flags `{flags}`",
                path.display()
            );
            for kernel in source.kernels {
                let symbol = |kind: &str, name: &str| {
                    text.lines().any(|l| {
                        let fields: Vec<&str> = l.split_whitespace().collect();
                        fields.len() >= 8
                            && fields[3] == kind
                            && fields[4] == "GLOBAL"
                            && fields[7] == name
                    })
                };
                assert!(
                    symbol("FUNC", kernel) && symbol("OBJECT", &format!("{kernel}.kd")),
                    "{} {} ({origin}): llvm-readelf finds no global FUNC `{kernel}` and OBJECT \
                     `{kernel}.kd`",
                    target.name,
                    source.family
                );
            }
            println!(
                "{} {:<10} {origin}: v{} code object, {} bytes, kernels {}",
                target.name,
                source.family,
                object.version,
                bytes.len(),
                source.kernels.join(", ")
            );
        }
    }
}

/// The kernels named `*_wmma_*` (gemm now; moe when it lands) run on the WMMA units: their
/// machine code, disassembled from the code object, has `v_wmma_*` instructions.
#[test]
fn the_wmma_kernels_machine_code_has_v_wmma() {
    let objdump = llvm_tool("llvm-objdump");
    let dir = tempfile::tempdir().expect("temp dir");
    for target in amd_targets() {
        let gemm = table::rendered(&target.name, "gemm").expect("gemm rendered");
        assert!(
            gemm.kernels.iter().any(|k| k.contains("_wmma_")),
            "{}: gemm has no WMMA kernel: {:?}",
            target.name,
            gemm.kernels
        );
        for source in table::rendered_for_target(&target.name) {
            let wmma: Vec<&str> = source
                .kernels
                .iter()
                .copied()
                .filter(|k| k.contains("_wmma_"))
                .collect();
            if wmma.is_empty() {
                continue;
            }
            let (bytes, _) = code_object_of(source, target);
            let path = write_object(dir.path(), source, &bytes);
            let arch = format!("--mcpu={}", target.compiler_arch);
            let listing = run_tool(&objdump, &["-d", &arch], &path);
            for kernel in wmma {
                let header = format!("<{kernel}>:");
                let body: Vec<&str> = listing
                    .lines()
                    .skip_while(|l| !l.ends_with(&header))
                    .skip(1)
                    .take_while(|l| !l.ends_with(">:"))
                    .collect();
                assert!(
                    !body.is_empty(),
                    "{kernel}: not in the disassembly of {}",
                    path.display()
                );
                let body = body.join("\n");
                let count = body.matches("v_wmma_").count();
                assert!(
                    count > 0,
                    "{} {kernel}: no v_wmma instruction in its machine code",
                    target.name
                );
                println!("{} {kernel}: {count} v_wmma instructions", target.name);
            }
        }
    }
}

/// Every AMD kernel fits the device without spilling: no VGPR/SGPR spills, no scratch, no
/// dynamic stack, LDS within the target's (and 64 KiB), waves of the target's width. Read from
/// the code object's metadata, and cross-checked with clang's remarks (the numbers
/// `fp4spec kernels --check` prints).
#[test]
fn no_amd_kernel_spills_uses_scratch_or_more_than_64_kib_of_lds() {
    let mut problems = Vec::new();
    let rows = check::check(&amd_targets().into_iter().cloned().collect::<Vec<_>>());
    for target in amd_targets() {
        let limit = target.max_shared_bytes_per_block.min(64 * 1024);
        for source in table::rendered_for_target(&target.name) {
            let (bytes, _) = code_object_of(source, target);
            let object = code_object::CodeObject::parse(&bytes).expect("parses");
            for kernel in source.kernels {
                let info = object.kernel(kernel).expect("metadata");
                println!(
                    "{} {:<28} vgprs {:>3} sgprs {:>3} lds {:>6} scratch {:>4} spills {}/{} \
                     max block {}",
                    target.name,
                    kernel,
                    info.vgprs,
                    info.sgprs,
                    info.lds_bytes,
                    info.scratch_bytes,
                    info.vgpr_spills,
                    info.sgpr_spills,
                    info.max_threads_per_block
                );
                let at = format!("{} {kernel}", target.name);
                // gfx1151 verify_topk: clang 19 spills up to 15 SGPRs into VGPR lanes, no scratch
                // (its uniform state: the arguments, the sequence, the row's weights); not run on
                // a gfx1151 yet (tests/codegen.rs accepts it too)
                let accepted = target.name == "gfx1151"
                    && *kernel == "verify_topk"
                    && info.vgpr_spills == 0
                    && info.scratch_bytes == 0;
                if info.vgpr_spills + info.sgpr_spills > 0 && !accepted {
                    problems.push(format!(
                        "{at}: spills {} VGPRs and {} SGPRs",
                        info.vgpr_spills, info.sgpr_spills
                    ));
                }
                if info.scratch_bytes > 0 || info.dynamic_stack {
                    problems.push(format!(
                        "{at}: {} bytes of scratch per lane{}",
                        info.scratch_bytes,
                        if info.dynamic_stack {
                            " and a dynamic stack"
                        } else {
                            ""
                        }
                    ));
                }
                if info.lds_bytes > limit {
                    problems.push(format!(
                        "{at}: {} bytes of LDS, more than {limit}",
                        info.lds_bytes
                    ));
                }
                if info.wavefront_size != target.warp_size {
                    problems.push(format!(
                        "{at}: compiled for {}-lane waves, the target has {}",
                        info.wavefront_size, target.warp_size
                    ));
                }
                let remarks = rows
                    .iter()
                    .find(|r| r.target == target.name && r.kernel == *kernel)
                    .and_then(|r| r.resources.clone())
                    .unwrap_or_else(|| panic!("{at}: `kernels --check` has no resources"));
                assert_eq!(
                    (remarks.registers, remarks.shared_bytes, remarks.stack_bytes),
                    (
                        Some(info.vgprs),
                        Some(info.lds_bytes),
                        Some(info.scratch_bytes)
                    ),
                    "{at}: clang's remarks (VGPRs, LDS, scratch) disagree with the metadata"
                );
            }
        }
    }
    assert!(problems.is_empty(), "{}", problems.join("\n"));
}

/// `fp4spec kernels --check --target gfx1151` prints every kernel with VGPRs, SGPRs, spills,
/// scratch and LDS.
#[test]
fn kernels_check_prints_the_gfx1151_resources() {
    let output = Command::new(env!("CARGO_BIN_EXE_fp4spec"))
        .args(["kernels", "--check", "--target", "gfx1151"])
        .output()
        .expect("run fp4spec");
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{text}\n{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let header: Vec<&str> = text
        .lines()
        .next()
        .unwrap_or_default()
        .split_whitespace()
        .collect();
    assert_eq!(
        header,
        [
            "target", "family", "kernel", "status", "regs", "sregs", "spill", "stack", "lds",
            "detail"
        ]
    );
    for source in table::rendered_for_target("gfx1151") {
        for kernel in source.kernels {
            let row = text
                .lines()
                .find(|l| l.split_whitespace().nth(2) == Some(kernel))
                .unwrap_or_else(|| panic!("no row for {kernel}:\n{text}"));
            let fields: Vec<&str> = row.split_whitespace().collect();
            assert_eq!(fields[3], "ok", "{row}");
            assert!(
                fields[4..9].iter().all(|f| f.parse::<u32>().is_ok()),
                "{kernel}: a resource is missing: {row}"
            );
        }
    }
}

/// The `EF_AMDGPU_MACH` table the reader names architectures with is what clang writes.
#[test]
fn the_machine_table_matches_what_clang_writes() {
    let clang = clang_path();
    let gfx1151 = target::by_name("gfx1151").expect("gfx1151");
    for &(mach, arch) in code_object::MACHINES {
        let mut facts = gfx1151.clone();
        facts.compiler_arch = arch.to_string();
        let probe = RenderedSource {
            target: "probe",
            family: "probe",
            file_name: "probe.hip",
            kernels: &["probe"],
            source: "extern \"C\" __attribute__((global)) void probe(int* p) { *p = 1; }\n",
            code_object: None,
        };
        let out = clang::compile(&clang, &probe, &facts)
            .unwrap_or_else(|e| panic!("clang cannot compile for {arch}: {e}"));
        let object =
            code_object::CodeObject::parse(&out.object).unwrap_or_else(|e| panic!("{arch}: {e}"));
        assert_eq!(
            (object.machine, object.arch.as_str()),
            (mach, arch),
            "{arch}: clang wrote EF_AMDGPU_MACH 0x{:03x}",
            object.machine
        );
        assert_eq!(object.missing_for("probe"), Vec::<String>::new());
        assert!(!object.missing_for("absent").is_empty());
    }
}

/// A code object for another chip, or without a kernel the table lists, is refused before the
/// runtime would see it.
#[test]
fn a_code_object_for_another_chip_or_without_a_kernel_is_refused() {
    let t = target::by_name("gfx1151").expect("gfx1151");
    let source = table::rendered("gfx1151", dequant::FAMILY).expect("dequant");
    let mut other = t.clone();
    other.compiler_arch = "gfx1100".into();
    let wrong_chip = clang::compile(&clang_path(), source, &other).expect("compiles for gfx1100");
    let e = code_object::check(&wrong_chip.object, source, t).unwrap_err();
    assert!(
        e.to_string().contains("built for gfx1100") && e.to_string().contains("dequant"),
        "{e}"
    );
    let (bytes, _) = code_object_of(source, t);
    let pretend = RenderedSource {
        kernels: &["dequant_nvfp4_bf16", "not_in_the_object"],
        ..*source
    };
    let e = code_object::check(&bytes, &pretend, t).unwrap_err();
    assert!(
        e.to_string()
            .contains("function symbol `not_in_the_object`"),
        "{e}"
    );
    let e = code_object::check(&bytes[..bytes.len() / 2], source, t).unwrap_err();
    assert!(e.to_string().contains("outside the file"), "{e}");
}

/// The HIP launch check on the real dequant metadata: the family's argument list passes; a u32
/// where the kernel takes a u64, a missing argument, or a block above the kernel's launch
/// bounds are refused with the kernel and argument named.
#[test]
fn launches_are_checked_against_the_real_dequant_metadata() {
    let t = target::by_name("gfx1151").expect("gfx1151");
    let source = table::rendered("gfx1151", dequant::FAMILY).expect("dequant");
    let (bytes, _) = code_object_of(source, t);
    let object = code_object::check(&bytes, source, t).expect("valid");
    let info = object
        .kernel(dequant::KERNEL_DEQUANT_NVFP4_BF16)
        .expect("dequant kernel metadata");
    let packed = DeviceVec::Host(vec![0u8; 8]);
    let scales = DeviceVec::Host(vec![0u8; 1]);
    let mut out = DeviceVec::Host(vec![half::bf16::ZERO; 16]);
    let threads = t.dequant.threads_per_block;
    let dims = LaunchDims::linear(1, threads);
    let max_lds = t.max_shared_bytes_per_block;
    {
        let good = [
            KernelArg::input(&packed),
            KernelArg::input(&scales),
            KernelArg::f32(1.0),
            KernelArg::output(&mut out),
            KernelArg::u64(1),
        ];
        assert_eq!(info.check_launch(&dims, max_lds, &good), Ok(()));
        let e = info
            .check_launch(&LaunchDims::linear(1, 2 * threads), max_lds, &good)
            .unwrap_err();
        assert!(
            e.contains("dequant_nvfp4_bf16") && e.contains("threads"),
            "{e}"
        );
        assert!(info.check_launch(&dims, max_lds, &good[..4]).is_err());
    }
    let narrow = [
        KernelArg::input(&packed),
        KernelArg::input(&scales),
        KernelArg::f32(1.0),
        KernelArg::output(&mut out),
        KernelArg::u32(1),
    ];
    let e = info.check_launch(&dims, max_lds, &narrow).unwrap_err();
    assert!(
        e.contains("argument 4") && e.contains("8-byte value") && e.contains("u32"),
        "{e}"
    );
}

/// Without a HIP runtime, a device or the `hip` feature, `--backend hip` is an error value
/// saying which; `auto` falls back to the CPU and says why neither device backend was used.
#[test]
fn the_hip_backend_reports_a_missing_runtime_or_device_as_an_error_value() {
    match Backend::new(BackendKind::Hip) {
        Ok(backend) => println!(
            "a HIP device is present: {} (run the GPU tests)",
            backend.describe()
        ),
        Err(Error::HipUnavailable(why)) => {
            let expected: &[&str] = if hip::BINDINGS {
                &[
                    "HIP runtime not found",
                    "no HIP device",
                    "no gfx1151 device",
                ]
            } else {
                &["--features hip"]
            };
            assert!(
                expected.iter().any(|e| why.contains(e)),
                "`{why}` says none of {expected:?}"
            );
            println!("hip backend: {why}");
        }
        Err(other) => panic!("expected HipUnavailable, got {other}"),
    }
    assert!(
        "hip"
            .parse::<BackendKind>()
            .is_ok_and(|k| k == BackendKind::Hip)
    );
    let (backend, why) = Backend::auto();
    if backend.name() == "cpu" {
        let why = why.expect("a reason for the CPU");
        assert!(why.contains("CUDA") && why.contains("HIP"), "{why}");
    }
}

/// With the `hip` feature the bindings compiled and the runtime library was looked for; in CI
/// (Debian's libamdhip64 5.2 installed, no GPU) it is found and reports no device.
#[test]
fn the_runtime_bindings_load_the_library_or_say_where_they_looked() {
    println!(
        "bindings: {}; header {}",
        hip::BINDINGS,
        hip::bindings_header_version()
    );
    match hip::runtime_library() {
        Ok(library) => println!("HIP runtime library: {library}"),
        Err(Error::HipUnavailable(why)) => {
            if hip::BINDINGS {
                assert!(
                    why.contains("HIP runtime not found") || why.contains("rebuild"),
                    "{why}"
                );
            }
            println!("no HIP runtime library: {why}");
        }
        Err(other) => panic!("expected HipUnavailable, got {other}"),
    }
}
