//! AMDGPU code objects (the ELF files `hipModuleLoadData` loads), read without ROCm: the ELF
//! header (machine, ABI version, the architecture in `e_flags`), the symbol tables (every kernel
//! is a global function plus its `<name>.kd` descriptor), and the `NT_AMDGPU_METADATA` note
//! (MessagePack: target, and per kernel its arguments, LDS, scratch, registers and spills).
//!
//! The HIP backend checks every object with [`check`] before loading it, and every launch
//! against the kernel's metadata ([`KernelInfo::check_launch`]), so a kernel built for another
//! chip, a missing symbol, a wrong argument list or an oversized block is an error value that
//! names the kernel, never a fault on the device.

use super::msgpack::{self, Value};
use crate::backend::{KernelArg, KernelResources, LaunchDims};
use crate::error::{Error, Result};
use crate::kernels::table::RenderedSource;
use crate::target::TargetFacts;

/// `e_machine` of AMDGPU objects.
pub const EM_AMDGPU: u16 = 224;
/// `EI_OSABI` of code objects for the HSA runtime (what HIP loads).
pub const ELFOSABI_AMDGPU_HSA: u8 = 64;
/// The `e_flags` bits that hold the architecture.
pub const EF_AMDGPU_MACH: u32 = 0xff;
/// `n_type` of the MessagePack metadata note.
pub const NT_AMDGPU_METADATA: u32 = 32;

/// `EF_AMDGPU_MACH` values (LLVM's `ELF.h`) of the architectures this crate might meet; the
/// codegen tests compile for each with clang and check the value it writes.
pub const MACHINES: &[(u32, &str)] = &[
    (0x02c, "gfx900"),
    (0x02f, "gfx906"),
    (0x030, "gfx908"),
    (0x03f, "gfx90a"),
    (0x04c, "gfx942"),
    (0x036, "gfx1030"),
    (0x041, "gfx1100"),
    (0x046, "gfx1101"),
    (0x047, "gfx1102"),
    (0x044, "gfx1103"),
    (0x043, "gfx1150"),
    (0x04a, "gfx1151"),
    (0x048, "gfx1200"),
    (0x04e, "gfx1201"),
];

/// The architecture an `EF_AMDGPU_MACH` value stands for, when [`MACHINES`] has it.
pub fn machine_name(mach: u32) -> Option<&'static str> {
    MACHINES.iter().find(|(m, _)| *m == mach).map(|(_, n)| *n)
}

/// What a code object holds, as far as loading and launching need to know.
#[derive(Debug, Clone)]
pub struct CodeObject {
    /// Code object version (3, 4, 5, 6) from the ELF ABI version.
    pub version: u32,
    /// `e_flags & EF_AMDGPU_MACH`.
    pub machine: u32,
    /// The metadata's target id, e.g. `amdgcn-amd-amdhsa--gfx1151`.
    pub target_id: String,
    /// The architecture of the target id without feature suffixes, e.g. `gfx1151`.
    pub arch: String,
    /// Global function symbols (the kernels' entry points).
    pub functions: Vec<String>,
    /// Global data symbols (kernel descriptors are `<kernel>.kd`).
    pub objects: Vec<String>,
    /// Every kernel the metadata describes.
    pub kernels: Vec<KernelInfo>,
}

/// One kernel's metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelInfo {
    /// Kernel name.
    pub name: String,
    /// Its descriptor symbol (`<name>.kd`).
    pub symbol: String,
    /// Every argument, explicit ones first, then the hidden ones the runtime fills.
    pub args: Vec<ArgInfo>,
    /// Bytes of the kernel argument segment.
    pub kernarg_bytes: u32,
    /// Static LDS per block, bytes (`.group_segment_fixed_size`).
    pub lds_bytes: u32,
    /// Scratch per lane, bytes (`.private_segment_fixed_size`).
    pub scratch_bytes: u32,
    /// Whether the kernel needs a stack whose size is unknown at compile time.
    pub dynamic_stack: bool,
    /// Vector registers per lane.
    pub vgprs: u32,
    /// Scalar registers per wave.
    pub sgprs: u32,
    /// Vector registers spilled to scratch.
    pub vgpr_spills: u32,
    /// Scalar registers spilled.
    pub sgpr_spills: u32,
    /// The largest block (work-group) the kernel was compiled for, threads.
    pub max_threads_per_block: u32,
    /// Lanes per wave the kernel was compiled for.
    pub wavefront_size: u32,
}

/// One kernel argument of the metadata.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArgInfo {
    /// Byte offset in the argument segment.
    pub offset: u32,
    /// Bytes.
    pub size: u32,
    /// What it is.
    pub kind: ArgKind,
}

/// The metadata's `.value_kind`, in the classes a launch cares about.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ArgKind {
    /// `global_buffer`: a device pointer the caller passes.
    Pointer,
    /// `by_value`: a scalar or struct the caller passes.
    Value,
    /// `hidden_*`: filled by the runtime (block counts, offsets, ...), not passed.
    Hidden(String),
    /// Another kind (image, sampler, pipe, ...): the launch layer cannot pass it.
    Other(String),
}

impl CodeObject {
    /// Reads an AMDGPU code object.
    ///
    /// # Errors
    /// A sentence naming what is wrong: not a 64-bit little-endian ELF, not `EM_AMDGPU`, not for
    /// the HSA runtime, a table or note outside the file, no metadata note, metadata without a
    /// target or kernels, or a machine value that disagrees with the metadata's target.
    pub fn parse(bytes: &[u8]) -> Result<Self, String> {
        let elf = Elf::parse(bytes)?;
        let metadata = elf.metadata()?;
        let target_id = metadata
            .get("amdhsa.target")
            .and_then(Value::as_str)
            .ok_or("the metadata has no amdhsa.target")?
            .to_string();
        let arch = target_id
            .rsplit('-')
            .next()
            .and_then(|a| a.split(':').next())
            .filter(|a| a.starts_with("gfx"))
            .ok_or_else(|| format!("metadata target `{target_id}` names no gfx architecture"))?
            .to_string();
        let machine = elf.flags & EF_AMDGPU_MACH;
        if let Some(name) = machine_name(machine) {
            if name != arch {
                return Err(format!(
                    "e_flags say {name} (0x{machine:03x}) but the metadata says {target_id}"
                ));
            }
        }
        let kernels = metadata
            .get("amdhsa.kernels")
            .and_then(Value::as_array)
            .ok_or("the metadata has no amdhsa.kernels")?
            .iter()
            .map(KernelInfo::from_metadata)
            .collect::<Result<Vec<_>, _>>()?;
        let (functions, objects) = elf.global_symbols()?;
        Ok(Self {
            version: elf.abi_version + 2,
            machine,
            target_id,
            arch,
            functions,
            objects,
            kernels,
        })
    }

    /// The metadata of kernel `name`.
    pub fn kernel(&self, name: &str) -> Option<&KernelInfo> {
        self.kernels.iter().find(|k| k.name == name)
    }

    /// What is missing for `kernel` to be launchable from this object: its entry symbol, its
    /// descriptor symbol, its metadata. Empty when nothing is.
    pub fn missing_for(&self, kernel: &str) -> Vec<String> {
        let mut missing = Vec::new();
        if !self.functions.iter().any(|f| f == kernel) {
            missing.push(format!("function symbol `{kernel}`"));
        }
        let descriptor = format!("{kernel}.kd");
        if !self.objects.contains(&descriptor) {
            missing.push(format!("kernel descriptor `{descriptor}`"));
        }
        if self.kernel(kernel).is_none() {
            missing.push(format!("metadata for `{kernel}`"));
        }
        missing
    }
}

/// Reads `object` and checks it is for `target` and holds every kernel `source` declares.
///
/// # Errors
/// [`Error::Invalid`] naming the family, the target and what is wrong or missing.
pub fn check(object: &[u8], source: &RenderedSource, target: &TargetFacts) -> Result<CodeObject> {
    let what = format!("{} code object of family `{}`", target.name, source.family);
    let parsed = CodeObject::parse(object).map_err(|reason| Error::invalid(&what, reason))?;
    if parsed.arch != target.compiler_arch {
        return Err(Error::invalid(
            &what,
            format!(
                "built for {} ({}), not {}",
                parsed.arch, parsed.target_id, target.compiler_arch
            ),
        ));
    }
    let missing: Vec<String> = source
        .kernels
        .iter()
        .flat_map(|k| parsed.missing_for(k))
        .collect();
    if !missing.is_empty() {
        return Err(Error::invalid(
            &what,
            format!("lacks {}", missing.join(", ")),
        ));
    }
    Ok(parsed)
}

impl KernelInfo {
    fn from_metadata(kernel: &Value) -> Result<Self, String> {
        let name = kernel
            .get(".name")
            .and_then(Value::as_str)
            .ok_or("a kernel's metadata has no .name")?
            .to_string();
        let number = |key: &str| -> Result<u32, String> {
            kernel
                .get(key)
                .and_then(Value::as_u64)
                .and_then(|n| u32::try_from(n).ok())
                .ok_or_else(|| {
                    format!("kernel `{name}`: metadata field {key} missing or not a u32")
                })
        };
        let args = match kernel.get(".args") {
            None => Vec::new(),
            Some(args) => args
                .as_array()
                .ok_or_else(|| format!("kernel `{name}`: .args is not an array"))?
                .iter()
                .enumerate()
                .map(|(i, arg)| {
                    let field = |key: &str| {
                        arg.get(key)
                            .and_then(Value::as_u64)
                            .and_then(|n| u32::try_from(n).ok())
                            .ok_or_else(|| format!("kernel `{name}` argument {i}: no {key}"))
                    };
                    let kind = arg
                        .get(".value_kind")
                        .and_then(Value::as_str)
                        .ok_or_else(|| format!("kernel `{name}` argument {i}: no .value_kind"))?;
                    Ok(ArgInfo {
                        offset: field(".offset")?,
                        size: field(".size")?,
                        kind: match kind {
                            "global_buffer" => ArgKind::Pointer,
                            "by_value" => ArgKind::Value,
                            hidden if hidden.starts_with("hidden_") => {
                                ArgKind::Hidden(hidden.to_string())
                            }
                            other => ArgKind::Other(other.to_string()),
                        },
                    })
                })
                .collect::<Result<Vec<_>, String>>()?,
        };
        Ok(Self {
            symbol: kernel
                .get(".symbol")
                .and_then(Value::as_str)
                .ok_or_else(|| format!("kernel `{name}`: no .symbol"))?
                .to_string(),
            args,
            kernarg_bytes: number(".kernarg_segment_size")?,
            lds_bytes: number(".group_segment_fixed_size")?,
            scratch_bytes: number(".private_segment_fixed_size")?,
            dynamic_stack: kernel
                .get(".uses_dynamic_stack")
                .and_then(Value::as_bool)
                .unwrap_or(false),
            vgprs: number(".vgpr_count")?,
            sgprs: number(".sgpr_count")?,
            vgpr_spills: number(".vgpr_spill_count")?,
            sgpr_spills: number(".sgpr_spill_count")?,
            max_threads_per_block: number(".max_flat_workgroup_size")?,
            wavefront_size: number(".wavefront_size")?,
            name,
        })
    }

    /// The arguments a caller passes (every one but the hidden ones), in order.
    pub fn explicit_args(&self) -> impl Iterator<Item = &ArgInfo> {
        self.args
            .iter()
            .filter(|a| !matches!(a.kind, ArgKind::Hidden(_)))
    }

    /// The resources in the form `fp4spec kernels --check` prints (spills as 4 bytes per
    /// register, like clang's remarks).
    pub fn resources(&self) -> KernelResources {
        KernelResources {
            kernel: self.name.clone(),
            registers: Some(self.vgprs),
            scalar_registers: Some(self.sgprs),
            spill_bytes: Some(4 * (self.vgpr_spills + self.sgpr_spills)),
            stack_bytes: Some(self.scratch_bytes),
            shared_bytes: Some(self.lds_bytes),
        }
    }

    /// Checks one launch against the metadata: the block fits the kernel and the device
    /// (`max_shared_bytes` of LDS per block, the kernel's static LDS included), the grid is
    /// not empty and its work-items per dimension fit 32 bits (HIP counts them so), and the
    /// arguments match the kernel's explicit arguments in number, kind and size.
    ///
    /// # Errors
    /// A sentence naming the kernel and the first mismatch.
    pub fn check_launch(
        &self,
        dims: &LaunchDims,
        max_shared_bytes: u32,
        args: &[KernelArg<'_>],
    ) -> Result<(), String> {
        let name = &self.name;
        let (grid, block) = (dims.grid, dims.block);
        let threads = u64::from(block.0) * u64::from(block.1) * u64::from(block.2);
        if threads == 0 || grid.0 == 0 || grid.1 == 0 || grid.2 == 0 {
            return Err(format!(
                "kernel `{name}`: empty launch (grid {grid:?}, block {block:?})"
            ));
        }
        if threads > u64::from(self.max_threads_per_block) {
            return Err(format!(
                "kernel `{name}`: block {block:?} has {threads} threads, the kernel was compiled \
                 for at most {}",
                self.max_threads_per_block
            ));
        }
        for (axis, g, b) in [
            ("x", grid.0, block.0),
            ("y", grid.1, block.1),
            ("z", grid.2, block.2),
        ] {
            if u64::from(g) * u64::from(b) > u64::from(u32::MAX) {
                return Err(format!(
                    "kernel `{name}`: grid.{axis} {g} x block.{axis} {b} work-items exceed 2^32"
                ));
            }
        }
        let shared = u64::from(self.lds_bytes) + u64::from(dims.shared_bytes);
        if shared > u64::from(max_shared_bytes) {
            return Err(format!(
                "kernel `{name}`: {} bytes of static LDS + {} dynamic exceed the {max_shared_bytes} \
                 bytes a block may use",
                self.lds_bytes, dims.shared_bytes
            ));
        }
        // no collecting: this runs on every launch, which must not allocate
        let expected = self.explicit_args().count();
        if expected != args.len() {
            return Err(format!(
                "kernel `{name}` takes {expected} arguments, the launch passes {}",
                args.len()
            ));
        }
        for (i, (want, got)) in self.explicit_args().zip(args).enumerate() {
            let fits = match &want.kind {
                ArgKind::Pointer => got.is_pointer() && want.size == 8,
                ArgKind::Value => !got.is_pointer() && want.size as usize == got.size(),
                ArgKind::Hidden(_) => unreachable!("explicit_args skips hidden arguments"),
                ArgKind::Other(kind) => {
                    return Err(format!(
                        "kernel `{name}` argument {i} is a `{kind}`, which launches cannot pass"
                    ));
                }
            };
            if !fits {
                let wanted = match want.kind {
                    ArgKind::Pointer => format!("a {}-byte device pointer", want.size),
                    _ => format!("a {}-byte value", want.size),
                };
                return Err(format!(
                    "kernel `{name}` argument {i}: the kernel takes {wanted}, the launch passes {}",
                    got.describe()
                ));
            }
        }
        Ok(())
    }
}

/// The parts of an ELF64 little-endian file the reader needs.
struct Elf<'a> {
    bytes: &'a [u8],
    flags: u32,
    abi_version: u32,
    sections: Vec<Section>,
}

#[derive(Clone, Copy)]
struct Section {
    kind: u32,
    offset: usize,
    size: usize,
    link: u32,
    entry_size: usize,
}

const SHT_SYMTAB: u32 = 2;
const SHT_NOTE: u32 = 7;
const SHT_DYNSYM: u32 = 11;
const STT_OBJECT: u8 = 1;
const STT_FUNC: u8 = 2;
const STB_GLOBAL: u8 = 1;
const SYMBOL_BYTES: usize = 24;

fn read_u16(bytes: &[u8], at: usize) -> Option<u16> {
    Some(u16::from_le_bytes(bytes.get(at..at + 2)?.try_into().ok()?))
}
fn read_u32(bytes: &[u8], at: usize) -> Option<u32> {
    Some(u32::from_le_bytes(bytes.get(at..at + 4)?.try_into().ok()?))
}
fn read_u64(bytes: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(bytes.get(at..at + 8)?.try_into().ok()?))
}
fn to_usize(n: u64) -> Option<usize> {
    usize::try_from(n).ok()
}

impl<'a> Elf<'a> {
    fn parse(bytes: &'a [u8]) -> Result<Self, String> {
        if bytes.get(..4) != Some(b"\x7fELF".as_slice()) {
            return Err("not an ELF file (no \\x7fELF magic)".into());
        }
        if bytes.get(4) != Some(&2) || bytes.get(5) != Some(&1) {
            return Err("not a 64-bit little-endian ELF".into());
        }
        let truncated = || "ELF header truncated".to_string();
        let machine = read_u16(bytes, 18).ok_or_else(truncated)?;
        if machine != EM_AMDGPU {
            return Err(format!(
                "e_machine {machine}, not EM_AMDGPU ({EM_AMDGPU}): not an AMDGPU code object"
            ));
        }
        let os_abi = bytes[7];
        if os_abi != ELFOSABI_AMDGPU_HSA {
            return Err(format!(
                "OS/ABI {os_abi}, not ELFOSABI_AMDGPU_HSA ({ELFOSABI_AMDGPU_HSA})"
            ));
        }
        let abi_version = u32::from(bytes[8]);
        if abi_version == 0 {
            return Err("code object v2 (ABI version 0): HIP needs v3 or later".into());
        }
        let flags = read_u32(bytes, 48).ok_or_else(truncated)?;
        let table = read_u64(bytes, 40)
            .and_then(to_usize)
            .ok_or_else(truncated)?;
        let entry = usize::from(read_u16(bytes, 58).ok_or_else(truncated)?);
        let count = usize::from(read_u16(bytes, 60).ok_or_else(truncated)?);
        if count > 0 && entry < 64 {
            return Err(format!("section header size {entry}, expected 64"));
        }
        let mut sections = Vec::with_capacity(count);
        for i in 0..count {
            let at = table
                .checked_add(i * entry)
                .filter(|&at| at + 64 <= bytes.len())
                .ok_or_else(|| format!("section header {i} lies outside the file"))?;
            let field = |off: usize| read_u64(bytes, at + off).and_then(to_usize);
            let section = Section {
                kind: read_u32(bytes, at + 4).unwrap_or(0),
                offset: field(24).unwrap_or(usize::MAX),
                size: field(32).unwrap_or(usize::MAX),
                link: read_u32(bytes, at + 40).unwrap_or(0),
                entry_size: field(56).unwrap_or(0),
            };
            if section.kind != 8 /* SHT_NOBITS */
                && section
                    .offset
                    .checked_add(section.size)
                    .is_none_or(|end| end > bytes.len())
            {
                return Err(format!("section {i} lies outside the file"));
            }
            sections.push(section);
        }
        Ok(Self {
            bytes,
            flags,
            abi_version,
            sections,
        })
    }

    fn data(&self, section: &Section) -> &'a [u8] {
        &self.bytes[section.offset..section.offset + section.size]
    }

    /// The decoded `NT_AMDGPU_METADATA` note.
    fn metadata(&self) -> Result<Value, String> {
        for section in self.sections.iter().filter(|s| s.kind == SHT_NOTE) {
            let notes = self.data(section);
            let mut at = 0;
            while at + 12 <= notes.len() {
                let name_size = read_u32(notes, at).unwrap_or(0) as usize;
                let desc_size = read_u32(notes, at + 4).unwrap_or(0) as usize;
                let kind = read_u32(notes, at + 8).unwrap_or(0);
                let name_at = at + 12;
                let desc_at = name_at + name_size.next_multiple_of(4);
                let end = desc_at + desc_size.next_multiple_of(4);
                if desc_at + desc_size > notes.len() {
                    return Err("a note runs past its section".into());
                }
                let name = &notes[name_at..name_at + name_size];
                if kind == NT_AMDGPU_METADATA && name.starts_with(b"AMDGPU") {
                    return msgpack::decode(&notes[desc_at..desc_at + desc_size])
                        .map_err(|e| format!("AMDGPU metadata note: {e}"));
                }
                at = end;
            }
        }
        Err("no NT_AMDGPU_METADATA note (not a code object v3+ for the HSA runtime)".into())
    }

    /// Names of the global functions and global data objects of `.symtab` and `.dynsym`.
    fn global_symbols(&self) -> Result<(Vec<String>, Vec<String>), String> {
        let (mut functions, mut objects) = (Vec::new(), Vec::new());
        for table in self
            .sections
            .iter()
            .filter(|s| s.kind == SHT_SYMTAB || s.kind == SHT_DYNSYM)
        {
            if table.entry_size != SYMBOL_BYTES {
                return Err(format!(
                    "symbol table entries of {} bytes, expected {SYMBOL_BYTES}",
                    table.entry_size
                ));
            }
            let strings = self
                .sections
                .get(table.link as usize)
                .map(|s| self.data(s))
                .ok_or("a symbol table links to no string table")?;
            for symbol in self.data(table).chunks_exact(SYMBOL_BYTES) {
                let info = symbol[4];
                let (bind, kind) = (info >> 4, info & 0xf);
                if bind != STB_GLOBAL || (kind != STT_FUNC && kind != STT_OBJECT) {
                    continue;
                }
                let start = read_u32(symbol, 0).unwrap_or(0) as usize;
                let name = strings
                    .get(start..)
                    .and_then(|s| s.split(|&b| b == 0).next())
                    .ok_or("a symbol name lies outside its string table")?;
                let name = String::from_utf8_lossy(name).into_owned();
                let list = if kind == STT_FUNC {
                    &mut functions
                } else {
                    &mut objects
                };
                if !list.contains(&name) {
                    list.push(name);
                }
            }
        }
        Ok((functions, objects))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kernel(args: Vec<ArgInfo>) -> KernelInfo {
        KernelInfo {
            name: "k".into(),
            symbol: "k.kd".into(),
            args,
            kernarg_bytes: 24,
            lds_bytes: 1024,
            scratch_bytes: 0,
            dynamic_stack: false,
            vgprs: 32,
            sgprs: 16,
            vgpr_spills: 0,
            sgpr_spills: 0,
            max_threads_per_block: 256,
            wavefront_size: 32,
        }
    }

    fn arg(offset: u32, size: u32, kind: ArgKind) -> ArgInfo {
        ArgInfo { offset, size, kind }
    }

    #[test]
    fn launch_checks_name_the_first_mismatch() {
        let k = kernel(vec![
            arg(0, 8, ArgKind::Pointer),
            arg(8, 4, ArgKind::Value),
            arg(16, 8, ArgKind::Value),
            arg(24, 4, ArgKind::Hidden("hidden_block_count_x".into())),
        ]);
        let host = crate::backend::DeviceVec::Host(vec![0u8; 4]);
        let dims = LaunchDims::linear(4, 256);
        let good = [
            KernelArg::input(&host),
            KernelArg::f32(1.0),
            KernelArg::u64(7),
        ];
        assert_eq!(k.check_launch(&dims, 65536, &good), Ok(()));
        let swapped = [
            KernelArg::input(&host),
            KernelArg::u64(7),
            KernelArg::f32(1.0),
        ];
        let e = k.check_launch(&dims, 65536, &swapped).unwrap_err();
        assert!(
            e.contains("argument 1") && e.contains("4-byte value"),
            "{e}"
        );
        let short = [KernelArg::input(&host), KernelArg::f32(1.0)];
        let e = k.check_launch(&dims, 65536, &short).unwrap_err();
        assert!(
            e.contains("takes 3 arguments") && e.contains("passes 2"),
            "{e}"
        );
        let scalar_for_pointer = [KernelArg::u64(0), KernelArg::f32(1.0), KernelArg::u64(7)];
        let e = k
            .check_launch(&dims, 65536, &scalar_for_pointer)
            .unwrap_err();
        assert!(
            e.contains("argument 0") && e.contains("device pointer"),
            "{e}"
        );

        let e = k
            .check_launch(&LaunchDims::linear(4, 512), 65536, &good)
            .unwrap_err();
        assert!(
            e.contains("512 threads") && e.contains("at most 256"),
            "{e}"
        );
        let e = k
            .check_launch(&LaunchDims::linear(0, 256), 65536, &good)
            .unwrap_err();
        assert!(e.contains("empty launch"), "{e}");
        let big = LaunchDims {
            shared_bytes: 65536 - 1024 + 1,
            ..dims
        };
        let e = k.check_launch(&big, 65536, &good).unwrap_err();
        assert!(e.contains("1024 bytes of static LDS"), "{e}");
        let wide = LaunchDims::linear(u32::MAX / 128, 256);
        let e = k.check_launch(&wide, 65536, &good).unwrap_err();
        assert!(e.contains("exceed 2^32"), "{e}");
    }

    #[test]
    fn rejects_files_that_are_not_amdgpu_code_objects() {
        assert!(
            CodeObject::parse(b"not an elf")
                .unwrap_err()
                .contains("magic")
        );
        let mut header = vec![0u8; 64];
        header[..4].copy_from_slice(b"\x7fELF");
        header[4] = 2;
        header[5] = 1;
        header[18] = 62; // EM_X86_64
        assert!(
            CodeObject::parse(&header)
                .unwrap_err()
                .contains("not an AMDGPU code object")
        );
        header[18] = EM_AMDGPU as u8;
        header[7] = ELFOSABI_AMDGPU_HSA;
        header[8] = 3;
        assert!(
            CodeObject::parse(&header)
                .unwrap_err()
                .contains("no NT_AMDGPU_METADATA")
        );
        header[40] = 200; // section table past the end
        header[60] = 1;
        header[58] = 64;
        assert!(
            CodeObject::parse(&header)
                .unwrap_err()
                .contains("outside the file")
        );
    }
}
