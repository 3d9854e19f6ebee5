//! What the emulated-kernel tests (tests/gdn_emulated.rs, tests/moe_emulated.rs,
//! tests/gemm_emulated.rs, tests/attention_emulated.rs) share: cutting sections out of an
//! emulator file, splicing them over the vendor layers of a rendered kernel source, compiling the
//! result for the host, and reading back the buffers it dumped. Each test file includes it with `mod emulation;`.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, OnceLock};

/// The text of section `name` (from its `//@@ name` line to the next) of an emulator file.
pub fn section<'a>(file: &'a str, name: &str) -> &'a str {
    let marker = format!("//@@ {name}\n");
    let start = file
        .find(&marker)
        .unwrap_or_else(|| panic!("emulator section {name}"))
        + marker.len();
    let end = file[start..]
        .find("//@@ ")
        .map_or(file.len(), |e| start + e);
    &file[start..end]
}

/// Replaces the lines from the one starting with `begin` to the one containing `end`
/// (inclusive) with `with`.
///
/// # Panics
/// If the source has no `begin` or no `end` after it.
pub fn splice(source: &str, begin: &str, end: &str, with: &str) -> String {
    assert!(
        source.contains(begin),
        "no `{begin}` in the rendered source"
    );
    splice_if_present(source, begin, end, with)
}

/// [`splice`] for a layer only some targets render (mma.sync, cp.async, WMMA): a source without
/// `begin` is returned as it is.
pub fn splice_if_present(source: &str, begin: &str, end: &str, with: &str) -> String {
    let Some(a) = source.find(begin) else {
        return source.to_string();
    };
    let b = a + source[a..]
        .find(end)
        .unwrap_or_else(|| panic!("no `{end}` after `{begin}`"));
    let b = b + source[b..].find('\n').map_or(source.len() - b, |n| n + 1);
    format!("{}{}{}", &source[..a], with, &source[b..])
}

/// `$CXX`, else the first of `candidates` that runs.
fn compiler(candidates: &[&str], family: &str) -> String {
    if let Ok(cxx) = std::env::var("CXX") {
        return cxx;
    }
    for candidate in candidates {
        if Command::new(candidate)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
        {
            return candidate.to_string();
        }
    }
    panic!(
        "no C++ compiler of {candidates:?} (set CXX, or install clang++-19): the {family} \
         emulation needs one"
    );
}

/// Compiles `source()` (a family's rendered kernels with the emulator spliced in, and its
/// driver) for the host with the first of `compilers` found, in a temporary folder of this
/// process; returns the executable. Once per (family, target) and process: a test file's tests
/// run in parallel threads, and a second build over the executable another test is running
/// fails to start it.
///
/// # Panics
/// If no compiler is found or the source does not compile (the message holds the source's path
/// and the compiler's errors).
pub fn build_host(
    family: &str,
    target_name: &str,
    compilers: &[&str],
    source: impl FnOnce() -> String,
) -> PathBuf {
    static BUILT: OnceLock<Mutex<HashMap<(String, String), PathBuf>>> = OnceLock::new();
    let mut built = BUILT
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    let key = (family.to_string(), target_name.to_string());
    if let Some(exe) = built.get(&key) {
        return exe.clone();
    }
    let exe = compile_host(family, target_name, &source(), compilers);
    built.insert(key, exe.clone());
    exe
}

fn compile_host(family: &str, target_name: &str, source: &str, compilers: &[&str]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "fp4spec-{family}-emulator-{}-{target_name}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).expect("temp dir");
    let (cpp, exe) = (
        dir.join(format!("{family}_host.cpp")),
        dir.join(format!("{family}_host")),
    );
    std::fs::write(&cpp, source).expect("write host source");
    let output = Command::new(compiler(compilers, family))
        .args([
            "-std=c++20",
            "-O1",
            "-fno-strict-aliasing",
            "-pthread",
            "-w",
            "-o",
        ])
        .arg(&exe)
        .arg(&cpp)
        .output()
        .expect("run the C++ compiler");
    assert!(
        output.status.success(),
        "the {target_name} {family} source does not compile for the host ({}):\n{}",
        cpp.display(),
        String::from_utf8_lossy(&output.stderr)
    );
    exe
}

/// The buffers an emulator dumped to `path`, in dump order with their ids: records of (u32 id,
/// u64 bytes, bytes), the format the emulators' drivers write.
pub fn read_dumps(path: &Path) -> Vec<(u32, Vec<u8>)> {
    let data = std::fs::read(path).expect("read dumps");
    let mut dumps = Vec::new();
    let mut at = 0;
    while at < data.len() {
        let id = u32::from_le_bytes(data[at..at + 4].try_into().expect("id"));
        let n = u64::from_le_bytes(data[at + 4..at + 12].try_into().expect("len")) as usize;
        dumps.push((id, data[at + 12..at + 12 + n].to_vec()));
        at += 12 + n;
    }
    dumps
}
