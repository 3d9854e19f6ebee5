//! The HIP runtime (`libamdhip64`), opened at run time with the bindings `build.rs` generated
//! (bindgen, allow-listed) from the `hip/hip_runtime_api.h` of the HIP install found at build
//! time. Opening it checks that the library is the same HIP major version as that header, so
//! the structures and enums the bindings describe are the library's.
//!
//! Each method is one runtime call; a failure is a [`Status`] (code, name, message) that the
//! caller turns into an [`Error::Hip`] naming the operation.

#[allow(
    non_camel_case_types,
    non_snake_case,
    non_upper_case_globals,
    dead_code,
    unsafe_op_in_unsafe_fn,
    clippy::all,
    clippy::pedantic,
    missing_docs
)]
mod sys {
    include!(concat!(env!("OUT_DIR"), "/hip_runtime_sys.rs"));
}

use super::{DeviceProperties, RawEvent, RawFunction, RawModule, RawStream, Status};
use crate::error::{Error, Result};
use std::ffi::{CStr, c_char, c_void};
use std::mem::MaybeUninit;
use std::path::{Path, PathBuf};

/// The HIP version of the header the bindings were generated from, `major.minor.patch`.
pub(crate) fn header_version() -> String {
    format!(
        "{}.{}.{}",
        sys::HIP_VERSION_MAJOR,
        sys::HIP_VERSION_MINOR,
        sys::HIP_VERSION_PATCH
    )
}

/// The loaded library.
pub(crate) struct Runtime {
    lib: sys::HipLibrary,
    path: PathBuf,
    version: i32,
    /// The first failure of a release made in a destructor (hipFree, hipEventDestroy, ...), which
    /// has no caller to return it to: the next checked call returns it (as cudarc records a
    /// CUDA context's), so a fault that surfaces there is not lost.
    released: std::sync::Mutex<Option<Status>>,
}

/// `hipRuntimeGetVersion`'s encoding: major * 10^7 + minor * 10^5 + patch.
fn version_text(version: i32) -> String {
    format!(
        "{}.{}.{}",
        version / 10_000_000,
        version / 100_000 % 100,
        version % 100_000
    )
}

/// Where to look for the library, most specific first: `$FP4SPEC_HIP_LIBRARY`, the `lib`
/// folders of `$ROCM_PATH`, `$HIP_PATH` and of the install whose header the bindings came from,
/// then the loader's search path.
fn library_candidates() -> Vec<PathBuf> {
    let mut candidates: Vec<PathBuf> = Vec::new();
    if let Some(path) = std::env::var_os("FP4SPEC_HIP_LIBRARY") {
        candidates.push(path.into());
    }
    let mut roots: Vec<PathBuf> = ["ROCM_PATH", "HIP_PATH"]
        .iter()
        .filter_map(std::env::var_os)
        .map(PathBuf::from)
        .collect();
    roots.push(PathBuf::from(sys::FP4SPEC_HIP_BUILD_ROOT));
    for root in roots {
        candidates.push(root.join("lib/libamdhip64.so"));
    }
    candidates.push("libamdhip64.so".into());
    candidates.push(format!("libamdhip64.so.{}", sys::HIP_VERSION_MAJOR).into());
    let mut unique = Vec::new();
    for c in candidates {
        if !unique.contains(&c) {
            unique.push(c);
        }
    }
    unique
}

impl Runtime {
    /// Opens the first library of [`library_candidates`] that has every bound symbol and the
    /// HIP major version of the header the bindings came from.
    ///
    /// # Errors
    /// [`Error::HipUnavailable`]: "HIP runtime not found" with every place tried and why (not
    /// there, a symbol missing, another HIP major version).
    pub(crate) fn load() -> Result<Self> {
        let mut tried = Vec::new();
        for path in library_candidates() {
            // SAFETY: opening the library runs its initialisers; libamdhip64's only set up the
            // runtime's own state. Every symbol the bindings name is resolved here or the open
            // fails (dynamic_link_require_all).
            let lib = match unsafe { sys::HipLibrary::new(&path) } {
                Ok(lib) => lib,
                Err(e) => {
                    tried.push(format!("{} ({e})", path.display()));
                    continue;
                }
            };
            let mut version = 0;
            // SAFETY: one valid out-pointer.
            let code = unsafe { lib.hipRuntimeGetVersion(&mut version) };
            let runtime = Self {
                lib,
                path: path.clone(),
                version,
                released: std::sync::Mutex::new(None),
            };
            if let Err(status) = runtime.check(code) {
                tried.push(format!(
                    "{} (hipRuntimeGetVersion: {status})",
                    path.display()
                ));
                continue;
            }
            if i64::from(version / 10_000_000) != i64::from(sys::HIP_VERSION_MAJOR) {
                tried.push(format!(
                    "{} (HIP {}, but the bindings come from the HIP {} header under {}: \
                     rebuild with --features hip against that install, or set \
                     FP4SPEC_HIP_LIBRARY to a HIP {} runtime)",
                    path.display(),
                    version_text(version),
                    header_version(),
                    sys::FP4SPEC_HIP_BUILD_ROOT,
                    sys::HIP_VERSION_MAJOR
                ));
                continue;
            }
            return Ok(runtime);
        }
        Err(Error::HipUnavailable(format!(
            "HIP runtime not found: tried {}. Install ROCm (README, Running on Strix Halo) or set \
             FP4SPEC_HIP_LIBRARY to libamdhip64.so",
            tried.join("; ")
        )))
    }

    /// The library's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    /// The runtime's version, `major.minor.patch`.
    pub(crate) fn version(&self) -> String {
        version_text(self.version)
    }

    /// Keeps `result`'s failure, unless one is kept already, for the next checked call.
    pub(crate) fn record_release(&self, result: Result<(), Status>) {
        if let Err(status) = result {
            let mut slot = self.released.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert(Status {
                message: format!("{} (when releasing a resource earlier)", status.message),
                ..status
            });
        }
    }

    fn check(&self, code: sys::hipError_t) -> Result<(), Status> {
        if code == sys::hipError_t::hipSuccess {
            let released = self
                .released
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .take();
            return released.map_or(Ok(()), Err);
        }
        // SAFETY: both return pointers to static strings (or null for codes they do not know).
        let text = |p: *const c_char| {
            if p.is_null() {
                "unknown".to_string()
            } else {
                unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
            }
        };
        Err(Status {
            code: code.0,
            name: text(unsafe { self.lib.hipGetErrorName(code) }),
            message: text(unsafe { self.lib.hipGetErrorString(code) }),
        })
    }

    /// Devices the runtime sees; 0 when it reports `hipErrorNoDevice`.
    pub(crate) fn device_count(&self) -> Result<i32, Status> {
        let mut count = 0;
        // SAFETY: one valid out-pointer.
        let code = unsafe { self.lib.hipGetDeviceCount(&mut count) };
        if code == sys::hipError_t::hipErrorNoDevice {
            return Ok(0);
        }
        self.check(code).map(|()| count)
    }

    /// Name, architecture and sizes of device `ordinal`.
    pub(crate) fn device_properties(&self, ordinal: i32) -> Result<DeviceProperties, Status> {
        let mut props = MaybeUninit::<sys::DeviceProperties>::zeroed();
        // SAFETY: the struct is the one this header version declares for this call (build.rs
        // picks hipGetDeviceProperties or its HIP 6 successor ...R0600 with its struct).
        let code = unsafe { self.lib.get_device_properties(props.as_mut_ptr(), ordinal) };
        self.check(code)?;
        // SAFETY: zero-initialised plain data, filled by the runtime.
        let props = unsafe { props.assume_init() };
        let text = |chars: &[c_char]| {
            let bytes: Vec<u8> = chars
                .iter()
                .take_while(|&&c| c != 0)
                .map(|&c| c as u8)
                .collect();
            String::from_utf8_lossy(&bytes).into_owned()
        };
        Ok(DeviceProperties {
            name: text(&props.name),
            arch: text(&props.gcnArchName),
            multiprocessors: props.multiProcessorCount.max(0) as u32,
            warp_size: props.warpSize.max(0) as u32,
            shared_bytes_per_block: props.sharedMemPerBlock as u64,
            memory_bytes: props.totalGlobalMem as u64,
        })
    }

    /// Makes `ordinal` the calling thread's device (allocations and module loads go there).
    pub(crate) fn set_device(&self, ordinal: i32) -> Result<(), Status> {
        // SAFETY: plain value argument.
        self.check(unsafe { self.lib.hipSetDevice(ordinal) })
    }

    /// A new stream on the current device.
    pub(crate) fn stream_create(&self) -> Result<RawStream, Status> {
        let mut stream: sys::hipStream_t = std::ptr::null_mut();
        // SAFETY: one valid out-pointer.
        self.check(unsafe { self.lib.hipStreamCreate(&mut stream) })?;
        Ok(stream.cast())
    }

    /// # Safety
    /// `stream` came from [`Self::stream_create`] and is not used afterwards.
    pub(crate) unsafe fn stream_destroy(&self, stream: RawStream) -> Result<(), Status> {
        self.check(unsafe { self.lib.hipStreamDestroy(stream.cast()) })
    }

    /// Waits for everything queued on `stream`.
    pub(crate) fn stream_synchronize(&self, stream: RawStream) -> Result<(), Status> {
        // SAFETY: a stream of this runtime (HipBackend owns it for its lifetime).
        self.check(unsafe { self.lib.hipStreamSynchronize(stream.cast()) })
    }

    /// `bytes` of device memory on the current device (0 bytes: address 0, no call).
    pub(crate) fn malloc(&self, bytes: usize) -> Result<u64, Status> {
        if bytes == 0 {
            return Ok(0);
        }
        let mut address: *mut c_void = std::ptr::null_mut();
        // SAFETY: one valid out-pointer.
        self.check(unsafe { self.lib.hipMalloc(&mut address, bytes) })?;
        Ok(address as u64)
    }

    /// # Safety
    /// `address` came from [`Self::malloc`] (or is 0) and is not used afterwards.
    pub(crate) unsafe fn free(&self, address: u64) -> Result<(), Status> {
        if address == 0 {
            return Ok(());
        }
        self.check(unsafe { self.lib.hipFree(address as *mut c_void) })
    }

    /// Queues a copy of `bytes` from host `src` to device `dst` on `stream`.
    ///
    /// # Safety
    /// `src` is readable for `bytes` until the stream has passed the copy; `dst` is device
    /// memory of at least `bytes`.
    pub(crate) unsafe fn memcpy_htod(
        &self,
        dst: u64,
        src: *const u8,
        bytes: usize,
        stream: RawStream,
    ) -> Result<(), Status> {
        self.check(unsafe {
            self.lib.hipMemcpyAsync(
                dst as *mut c_void,
                src.cast(),
                bytes,
                sys::hipMemcpyKind::hipMemcpyHostToDevice,
                stream.cast(),
            )
        })
    }

    /// Queues a copy of `bytes` from device `src` to host `dst` on `stream`.
    ///
    /// # Safety
    /// `dst` is writable for `bytes` until the stream has passed the copy; `src` is device
    /// memory of at least `bytes`.
    pub(crate) unsafe fn memcpy_dtoh(
        &self,
        dst: *mut u8,
        src: u64,
        bytes: usize,
        stream: RawStream,
    ) -> Result<(), Status> {
        self.check(unsafe {
            self.lib.hipMemcpyAsync(
                dst.cast(),
                src as *const c_void,
                bytes,
                sys::hipMemcpyKind::hipMemcpyDeviceToHost,
                stream.cast(),
            )
        })
    }

    /// Queues a device-to-device copy of `bytes` on `stream`.
    ///
    /// # Safety
    /// Both are device memory of at least `bytes`.
    pub(crate) unsafe fn memcpy_dtod(
        &self,
        dst: u64,
        src: u64,
        bytes: usize,
        stream: RawStream,
    ) -> Result<(), Status> {
        self.check(unsafe {
            self.lib.hipMemcpyAsync(
                dst as *mut c_void,
                src as *const c_void,
                bytes,
                sys::hipMemcpyKind::hipMemcpyDeviceToDevice,
                stream.cast(),
            )
        })
    }

    /// Queues zeroing `bytes` of device memory at `dst` on `stream`.
    ///
    /// # Safety
    /// `dst` is device memory of at least `bytes`.
    pub(crate) unsafe fn memset_zero(
        &self,
        dst: u64,
        bytes: usize,
        stream: RawStream,
    ) -> Result<(), Status> {
        self.check(unsafe {
            self.lib
                .hipMemsetAsync(dst as *mut c_void, 0, bytes, stream.cast())
        })
    }

    /// Loads a code object on the current device. The runtime copies what it needs.
    pub(crate) fn module_load(&self, image: &[u8]) -> Result<RawModule, Status> {
        let mut module: sys::hipModule_t = std::ptr::null_mut();
        // SAFETY: `image` is a complete code object (checked by code_object::check) that lives
        // for the call.
        self.check(unsafe {
            self.lib
                .hipModuleLoadData(&mut module, image.as_ptr().cast())
        })?;
        Ok(module.cast())
    }

    /// # Safety
    /// `module` came from [`Self::module_load`]; neither it nor its functions are used after.
    pub(crate) unsafe fn module_unload(&self, module: RawModule) -> Result<(), Status> {
        self.check(unsafe { self.lib.hipModuleUnload(module.cast()) })
    }

    /// The kernel `name` of `module`.
    pub(crate) fn module_function(
        &self,
        module: RawModule,
        name: &CStr,
    ) -> Result<RawFunction, Status> {
        let mut function: sys::hipFunction_t = std::ptr::null_mut();
        // SAFETY: a live module of this runtime and a NUL-terminated name.
        self.check(unsafe {
            self.lib
                .hipModuleGetFunction(&mut function, module.cast(), name.as_ptr())
        })?;
        Ok(function.cast())
    }

    /// Queues `function` on `stream`.
    ///
    /// # Safety
    /// `params` holds one pointer per explicit kernel argument, each to a value of the
    /// argument's size, valid for the call; the kernel stays within its buffers for this grid.
    pub(crate) unsafe fn launch(
        &self,
        function: RawFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        shared_bytes: u32,
        stream: RawStream,
        params: &mut [*mut c_void],
    ) -> Result<(), Status> {
        self.check(unsafe {
            self.lib.hipModuleLaunchKernel(
                function.cast(),
                grid.0,
                grid.1,
                grid.2,
                block.0,
                block.1,
                block.2,
                shared_bytes,
                stream.cast(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        })
    }

    /// A new timing event.
    pub(crate) fn event_create(&self) -> Result<RawEvent, Status> {
        let mut event: sys::hipEvent_t = std::ptr::null_mut();
        // SAFETY: one valid out-pointer.
        self.check(unsafe { self.lib.hipEventCreate(&mut event) })?;
        Ok(event.cast())
    }

    /// Records `event` at the current end of `stream`.
    pub(crate) fn event_record(&self, event: RawEvent, stream: RawStream) -> Result<(), Status> {
        // SAFETY: a live event and stream of this runtime.
        self.check(unsafe { self.lib.hipEventRecord(event.cast(), stream.cast()) })
    }

    /// Milliseconds between two recorded events, waiting for `end`.
    pub(crate) fn event_elapsed_ms(&self, start: RawEvent, end: RawEvent) -> Result<f32, Status> {
        // SAFETY: live events of this runtime.
        self.check(unsafe { self.lib.hipEventSynchronize(end.cast()) })?;
        let mut ms = 0f32;
        self.check(unsafe {
            self.lib
                .hipEventElapsedTime(&mut ms, start.cast(), end.cast())
        })?;
        Ok(ms)
    }

    /// # Safety
    /// `event` came from [`Self::event_create`] and is not used afterwards.
    pub(crate) unsafe fn event_destroy(&self, event: RawEvent) -> Result<(), Status> {
        self.check(unsafe { self.lib.hipEventDestroy(event.cast()) })
    }
}
