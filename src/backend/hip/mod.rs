//! The HIP backend (AMD, gfx1151 Strix Halo): one device and stream, device memory, copies,
//! code objects loaded from the kernel table (embedded at build time, or compiled by clang at
//! run time when the table has none), launches checked against each kernel's metadata, and
//! events for timing.
//!
//! - [`clang`] / `toolchain`: compiling rendered sources for amdgcn (no ROCm needed).
//! - [`code_object`] / [`msgpack`]: reading code objects (ELF, symbols, metadata) without ROCm.
//! - `runtime`: the HIP runtime library, opened at run time through bindgen bindings generated
//!   at build time (`hip` feature). Without the feature the backend reports that it was not
//!   built in; without the library, device or a gfx1151 it says which is missing.
//!
//! Nothing here has run on a gfx1151 yet (there is none where this was written); everything
//! short of the device is checked by `tests/hip.rs`.

pub mod clang;
pub mod code_object;
pub mod msgpack;
mod toolchain;

#[cfg(feature = "hip")]
mod runtime;
#[cfg(not(feature = "hip"))]
#[path = "runtime_absent.rs"]
mod runtime;

use crate::backend::{
    KernelArg, LaunchDims, LaunchFilter, MAX_KERNEL_ARGS, SplitKCell, check_arg_backends,
};
use crate::error::{Error, Result};
use crate::kernels::table;
use crate::target::{self, TargetFacts, Vendor};
use code_object::{CodeObject, KernelInfo};
use cudarc::driver::{DeviceRepr, ValidAsZeroBits};
use runtime::Runtime;
use std::borrow::Cow;
use std::collections::HashMap;
use std::ffi::{CString, c_void};
use std::fmt;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex};

/// Runtime handles, as the runtime returns them.
pub(crate) type RawStream = *mut c_void;
pub(crate) type RawModule = *mut c_void;
pub(crate) type RawFunction = *mut c_void;
pub(crate) type RawEvent = *mut c_void;

/// A failed runtime call.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "hip"), allow(dead_code))] // only the real runtime makes one
pub(crate) struct Status {
    code: u32,
    name: String,
    message: String,
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} ({}): {}", self.name, self.code, self.message)
    }
}

/// [`Error::Hip`] for the operation `op`.
fn hip_error(op: impl Into<String>, status: Status) -> Error {
    Error::Hip {
        op: op.into(),
        code: status.code,
        name: status.name,
        message: status.message,
    }
}

/// What the runtime says about a device.
#[derive(Debug, Clone)]
#[cfg_attr(not(feature = "hip"), allow(dead_code))] // only the real runtime makes one
pub(crate) struct DeviceProperties {
    name: String,
    /// `gcnArchName`, e.g. `gfx1151` (feature suffixes like `:xnack-` possible).
    arch: String,
    multiprocessors: u32,
    warp_size: u32,
    shared_bytes_per_block: u64,
    memory_bytes: u64,
}

/// Whether this build has HIP runtime bindings (`--features hip`).
pub const BINDINGS: bool = cfg!(feature = "hip");

/// The HIP version of the header the bindings were generated from (or a sentence saying there
/// are none).
pub fn bindings_header_version() -> String {
    runtime::header_version()
}

/// A HIP device ready to run this crate's kernels.
pub struct HipBackend {
    runtime: Arc<Runtime>,
    ordinal: i32,
    stream: RawStream,
    target: &'static TargetFacts,
    properties: DeviceProperties,
    modules: Mutex<HashMap<&'static str, Arc<LoadedModule>>>,
    functions: Mutex<HashMap<(&'static str, &'static str), LoadedFunction>>,
    split_k: SplitKCell,
    launch_filter: LaunchFilter,
}

// SAFETY: the HIP runtime's handles may be used from any host thread (its API is thread-safe);
// the backend's mutable state is behind mutexes.
unsafe impl Send for HipBackend {}
// SAFETY: as for Send.
unsafe impl Sync for HipBackend {}

struct LoadedModule {
    handle: RawModule,
    object: CodeObject,
}

// SAFETY: a module handle may be used from any host thread; the module is never mutated.
unsafe impl Send for LoadedModule {}
// SAFETY: as for Send.
unsafe impl Sync for LoadedModule {}

#[derive(Clone)]
struct LoadedFunction {
    handle: RawFunction,
    info: Arc<KernelInfo>,
}

/// How many HIP devices the runtime sees: 0 in a build without the `hip` feature, without a
/// HIP runtime library, or when the runtime reports none. Tells "no GPU here" apart from a GPU
/// that [`HipBackend::new`] cannot open.
pub fn device_count() -> usize {
    Runtime::load()
        .ok()
        .and_then(|runtime| runtime.device_count().ok())
        .map_or(0, |count| count.max(0) as usize)
}

impl HipBackend {
    /// Opens HIP device `ordinal`.
    ///
    /// # Errors
    /// [`Error::HipUnavailable`] for a build without the `hip` feature, no HIP runtime library
    /// ("HIP runtime not found", with every place tried), no device, no such ordinal, or a
    /// device whose architecture has no target in `kernels/targets.toml` ("no gfx1151
    /// device"); [`Error::Hip`] when the runtime refuses a call.
    pub fn new(ordinal: usize) -> Result<Self> {
        let runtime = Arc::new(Runtime::load()?);
        let place = format!(
            "HIP runtime {} ({})",
            runtime.version(),
            runtime.path().display()
        );
        let count = runtime
            .device_count()
            .map_err(|s| Error::HipUnavailable(format!("{place}: hipGetDeviceCount: {s}")))?;
        if count <= 0 {
            return Err(Error::HipUnavailable(format!(
                "no HIP device: the {place} sees none (no AMD GPU, or no access to /dev/kfd and \
                 /dev/dri: add the user to the `render` and `video` groups)"
            )));
        }
        let ordinal = i32::try_from(ordinal)
            .ok()
            .filter(|&o| o < count)
            .ok_or_else(|| {
                Error::HipUnavailable(format!(
                    "device {ordinal} requested, {count} HIP device(s) present"
                ))
            })?;
        runtime
            .set_device(ordinal)
            .map_err(|s| hip_error(format!("select device {ordinal}"), s))?;
        let properties = runtime
            .device_properties(ordinal)
            .map_err(|s| hip_error(format!("read the properties of device {ordinal}"), s))?;
        let target = target_for_arch(&properties.arch).map_err(|known| {
            Error::HipUnavailable(format!(
                "no {known} device: device {ordinal} ({}) is {}, and kernels/targets.toml has \
                 HIP kernels for {known} only",
                properties.name, properties.arch
            ))
        })?;
        if properties.warp_size != target.warp_size {
            return Err(Error::HipUnavailable(format!(
                "device {ordinal} ({}) runs {}-lane waves; the {} kernels are compiled for {}",
                properties.name, properties.warp_size, target.name, target.warp_size
            )));
        }
        let stream = runtime
            .stream_create()
            .map_err(|s| hip_error("create a stream", s))?;
        Ok(Self {
            runtime,
            ordinal,
            stream,
            target,
            properties,
            modules: Mutex::new(HashMap::new()),
            functions: Mutex::new(HashMap::new()),
            split_k: SplitKCell::default(),
            launch_filter: LaunchFilter::default(),
        })
    }

    /// The target the device runs.
    pub fn target(&self) -> &'static TargetFacts {
        self.target
    }

    /// The device's name as the runtime reports it.
    pub fn device_name(&self) -> &str {
        &self.properties.name
    }

    /// The device's architecture as the runtime reports it (`gfx1151`, possibly with feature
    /// suffixes).
    pub fn arch_name(&self) -> &str {
        &self.properties.arch
    }

    /// Compute units, as the runtime reports them.
    pub fn multiprocessors(&self) -> u32 {
        self.properties.multiprocessors
    }

    /// Device memory, bytes, as the runtime reports it.
    pub fn memory_bytes(&self) -> u64 {
        self.properties.memory_bytes
    }

    /// The runtime library's version and path, e.g. `6.4.1 (/opt/rocm/lib/libamdhip64.so)`.
    pub fn runtime_description(&self) -> String {
        format!(
            "{} ({})",
            self.runtime.version(),
            self.runtime.path().display()
        )
    }

    /// Which launches are noted and which left out (`Backend::leave_out`).
    pub(crate) fn launch_filter(&self) -> &LaunchFilter {
        &self.launch_filter
    }

    /// The device's split-K scratch (grown by
    /// [`Backend::split_k_scratch`](crate::backend::Backend::split_k_scratch)).
    pub(crate) fn split_k_scratch(&self) -> &SplitKCell {
        &self.split_k
    }

    /// LDS a block may use: the smaller of the target's table and the device's report.
    fn max_shared_bytes(&self) -> u32 {
        let reported = u32::try_from(self.properties.shared_bytes_per_block).unwrap_or(u32::MAX);
        self.target.max_shared_bytes_per_block.min(reported)
    }

    /// Waits for the stream.
    ///
    /// # Errors
    /// [`Error::Hip`] carrying the first asynchronous fault of queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.runtime
            .stream_synchronize(self.stream)
            .map_err(|s| hip_error("synchronize the stream", s))
    }

    fn alloc<T>(&self, len: usize, what: &str) -> Result<HipSlice<T>> {
        let bytes = len.checked_mul(size_of::<T>()).ok_or_else(|| {
            Error::invalid(what, format!("{len} elements overflow the address space"))
        })?;
        self.runtime
            .set_device(self.ordinal)
            .map_err(|s| hip_error(format!("select device {}", self.ordinal), s))?;
        let address = self
            .runtime
            .malloc(bytes)
            .map_err(|s| hip_error(format!("allocate {bytes} bytes for {what}"), s))?;
        Ok(HipSlice {
            address,
            len,
            runtime: self.runtime.clone(),
            element: PhantomData,
        })
    }

    /// Copies `data` to new device memory (returns once the copy is done, so `data` may be
    /// dropped).
    ///
    /// # Errors
    /// [`Error::Hip`] when the allocation or copy fails.
    pub fn upload<T: DeviceRepr>(&self, data: &[T]) -> Result<HipSlice<T>> {
        let mut slice = self.alloc::<T>(data.len(), &format!("upload {} elements", data.len()))?;
        self.write(&mut slice, 0, data)?;
        Ok(slice)
    }

    /// Copies `values` into `slice` from element `at` on (returns once the copy is done, so
    /// `values` may be dropped).
    ///
    /// # Errors
    /// [`Error::Invalid`] when the elements are not within `slice`, [`Error::Hip`] when the
    /// copy fails.
    pub fn write<T: DeviceRepr>(
        &self,
        slice: &mut HipSlice<T>,
        at: usize,
        values: &[T],
    ) -> Result<()> {
        let what = format!("copy {} elements to the device", values.len());
        let address = slice.element_address(at, values.len(), &what)?;
        let bytes = size_of_val(values);
        if bytes > 0 {
            // SAFETY: `values` is `bytes` long and outlives the synchronisation below; the
            // slice holds `bytes` from `address` (checked above).
            unsafe {
                self.runtime
                    .memcpy_htod(address, values.as_ptr().cast(), bytes, self.stream)
            }
            .map_err(|s| hip_error(&what, s))?;
            self.runtime
                .stream_synchronize(self.stream)
                .map_err(|s| hip_error(&what, s))?;
        }
        Ok(())
    }

    /// `len` zeroed elements of device memory (the zeroing is queued on the stream).
    ///
    /// # Errors
    /// [`Error::Hip`] when the allocation or the memset fails.
    pub fn zeros<T: ValidAsZeroBits>(&self, len: usize) -> Result<HipSlice<T>> {
        let mut slice = self.alloc::<T>(len, &format!("allocate {len} zeroed elements"))?;
        self.fill_zeros(&mut slice)?;
        Ok(slice)
    }

    /// Queues zeroing every element of `slice`.
    ///
    /// # Errors
    /// [`Error::Hip`] when the memset fails.
    pub fn fill_zeros<T: ValidAsZeroBits>(&self, slice: &mut HipSlice<T>) -> Result<()> {
        let bytes = slice.len * size_of::<T>();
        if bytes > 0 {
            // SAFETY: the slice was allocated with `bytes`.
            unsafe { self.runtime.memset_zero(slice.address, bytes, self.stream) }
                .map_err(|s| hip_error(format!("zero {} elements", slice.len), s))?;
        }
        Ok(())
    }

    /// Copies the elements `range` of `slice` back to the host after the work queued before it.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `range` is not within `slice`, [`Error::Hip`] when the copy fails
    /// (this is also where an earlier kernel's fault shows).
    pub fn read<T: DeviceRepr + Clone + Default>(
        &self,
        slice: &HipSlice<T>,
        range: std::ops::Range<usize>,
    ) -> Result<Vec<T>> {
        let len = range.end.saturating_sub(range.start);
        let what = format!("download {len} elements");
        let address = slice.element_address(range.start, len, &what)?;
        let mut host = vec![T::default(); len];
        let bytes = size_of_val(host.as_slice());
        if bytes > 0 {
            // SAFETY: `host` is `bytes` long and outlives the synchronisation below; the device
            // memory from `address` holds `len` values written as `T` (checked above).
            unsafe {
                self.runtime
                    .memcpy_dtoh(host.as_mut_ptr().cast(), address, bytes, self.stream)
            }
            .map_err(|s| hip_error(&what, s))?;
        }
        self.runtime
            .stream_synchronize(self.stream)
            .map_err(|s| hip_error(&what, s))?;
        Ok(host)
    }

    /// Queues a device-to-device copy of `src` into `dst` (same lengths).
    ///
    /// # Errors
    /// [`Error::Invalid`] for different lengths, [`Error::Hip`] when the copy fails.
    pub fn copy<T>(&self, src: &HipSlice<T>, dst: &mut HipSlice<T>) -> Result<()> {
        if src.len != dst.len {
            return Err(Error::invalid(
                "device copy",
                format!("source has {} elements, destination {}", src.len, dst.len),
            ));
        }
        let bytes = src.len * size_of::<T>();
        if bytes == 0 {
            return Ok(());
        }
        // SAFETY: both slices hold `bytes`.
        unsafe {
            self.runtime
                .memcpy_dtod(dst.address, src.address, bytes, self.stream)
        }
        .map_err(|s| hip_error(format!("copy {bytes} bytes device to device"), s))
    }

    /// Records an event at the current end of the stream (for timing).
    ///
    /// # Errors
    /// [`Error::Hip`] when the event cannot be created or recorded.
    pub fn record_event(&self) -> Result<HipEvent> {
        let event = self
            .runtime
            .event_create()
            .map_err(|s| hip_error("create an event", s))?;
        let event = HipEvent {
            event,
            runtime: self.runtime.clone(),
        };
        self.runtime
            .event_record(event.event, self.stream)
            .map_err(|s| hip_error("record an event", s))?;
        Ok(event)
    }

    /// The code object of `family`, loaded on first use: the table's embedded one, else the
    /// source compiled by clang now; checked (architecture, every kernel's symbols and
    /// metadata) before the runtime sees it.
    fn module(&self, family: &'static str) -> Result<Arc<LoadedModule>> {
        let mut modules = self
            .modules
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(module) = modules.get(family) {
            return Ok(module.clone());
        }
        let source = table::rendered(&self.target.name, family).ok_or_else(|| {
            Error::invalid(
                format!("kernel family `{family}`"),
                format!("not rendered for {}", self.target.name),
            )
        })?;
        let (image, origin): (Cow<'static, [u8]>, &str) = match source.code_object {
            Some(object) => (Cow::Borrowed(object), "embedded at build time"),
            None => {
                let clang = clang::find()?;
                let compiled = clang::compile(&clang, source, self.target)?;
                (Cow::Owned(compiled.object), "compiled by clang at run time")
            }
        };
        let object = code_object::check(&image, source, self.target)?;
        self.runtime
            .set_device(self.ordinal)
            .map_err(|s| hip_error(format!("select device {}", self.ordinal), s))?;
        let handle = self.runtime.module_load(&image).map_err(|s| {
            hip_error(
                format!(
                    "load the `{family}` code object for {} ({origin})",
                    self.target.name
                ),
                s,
            )
        })?;
        let module = Arc::new(LoadedModule { handle, object });
        modules.insert(family, module.clone());
        Ok(module)
    }

    fn function(&self, family: &'static str, kernel: &'static str) -> Result<LoadedFunction> {
        let mut functions = self
            .functions
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(function) = functions.get(&(family, kernel)) {
            return Ok(function.clone());
        }
        let module = self.module(family)?;
        let info = module.object.kernel(kernel).cloned().ok_or_else(|| {
            let known: Vec<&str> = module
                .object
                .kernels
                .iter()
                .map(|k| k.name.as_str())
                .collect();
            Error::invalid(
                format!("kernel `{kernel}`"),
                format!(
                    "not in the `{family}` code object for {} (it has {})",
                    self.target.name,
                    known.join(", ")
                ),
            )
        })?;
        let name = CString::new(kernel)
            .map_err(|_| Error::invalid(format!("kernel `{kernel}`"), "name contains a NUL"))?;
        let handle = self
            .runtime
            .module_function(module.handle, &name)
            .map_err(|s| hip_error(format!("find kernel `{kernel}` in family `{family}`"), s))?;
        let function = LoadedFunction {
            handle,
            info: Arc::new(info),
        };
        functions.insert((family, kernel), function.clone());
        Ok(function)
    }

    /// The metadata of `kernel` in `family` (arguments, LDS, registers), loading the family's
    /// code object on first use.
    ///
    /// # Errors
    /// As [`HipBackend::launch`] before the launch itself.
    pub fn kernel_info(&self, family: &'static str, kernel: &'static str) -> Result<KernelInfo> {
        Ok(self.function(family, kernel)?.info.as_ref().clone())
    }

    /// Queues `kernel` of `family` on the stream, after checking the launch against the
    /// kernel's metadata ([`KernelInfo::check_launch`]).
    ///
    /// # Safety
    /// The kernel must stay within the buffers passed for this grid and these scalars (the
    /// checks cover the argument list's shape, not what the kernel indexes).
    ///
    /// # Errors
    /// [`Error::Invalid`] for an unknown kernel or a launch that does not fit it,
    /// [`Error::BackendMismatch`] for a buffer of another backend, [`Error::Compile`] when the
    /// run-time compile fails, [`Error::Hip`] when loading or launching fails.
    pub unsafe fn launch(
        &self,
        family: &'static str,
        kernel: &'static str,
        dims: &LaunchDims,
        args: &[KernelArg<'_>],
    ) -> Result<()> {
        let function = self.function(family, kernel)?;
        function
            .info
            .check_launch(dims, self.max_shared_bytes(), args)
            .map_err(|reason| {
                Error::invalid(
                    format!("launch of `{kernel}` ({family}, {})", self.target.name),
                    reason,
                )
            })?;
        check_arg_backends("hip", kernel, args)?;
        let mut params = [std::ptr::null_mut(); MAX_KERNEL_ARGS];
        for (slot, arg) in params.iter_mut().zip(args) {
            *slot = arg.value_ptr();
        }
        // SAFETY: one pointer per explicit argument, each to a value of the size the metadata
        // asks for (checked above) living in `args` for the call; the caller vouches for the
        // indexing.
        unsafe {
            self.runtime.launch(
                function.handle,
                dims.grid,
                dims.block,
                dims.shared_bytes,
                self.stream,
                &mut params[..args.len()],
            )
        }
        .map_err(|s| {
            hip_error(
                format!(
                    "launch {kernel} ({family}) grid {:?} block {:?} shared {} bytes",
                    dims.grid, dims.block, dims.shared_bytes
                ),
                s,
            )
        })
    }
}

impl Drop for HipBackend {
    fn drop(&mut self) {
        // failures are kept for the runtime's next checked call (its slices may outlive this)
        self.runtime
            .record_release(self.runtime.stream_synchronize(self.stream));
        let modules = self
            .modules
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        for (_, module) in modules.drain() {
            // SAFETY: the functions of the module are dropped with the backend and never used
            // again.
            self.runtime
                .record_release(unsafe { self.runtime.module_unload(module.handle) });
        }
        // SAFETY: the backend owns the stream; nothing uses it after this.
        self.runtime
            .record_release(unsafe { self.runtime.stream_destroy(self.stream) });
    }
}

/// The AMD target whose compiler arch is `arch` (feature suffixes ignored).
///
/// # Errors
/// The AMD targets' names, for the message.
fn target_for_arch(arch: &str) -> std::result::Result<&'static TargetFacts, String> {
    let base = arch.split(':').next().unwrap_or(arch);
    let amd: Vec<&'static TargetFacts> = target::all()
        .iter()
        .filter(|t| t.vendor == Vendor::Amd)
        .collect();
    amd.iter()
        .find(|t| t.compiler_arch == base)
        .copied()
        .ok_or_else(|| {
            amd.iter()
                .map(|t| t.compiler_arch.as_str())
                .collect::<Vec<_>>()
                .join(" / ")
        })
}

/// Device memory of `len` elements of `T` on a HIP device; freed on drop.
pub struct HipSlice<T> {
    address: u64,
    len: usize,
    runtime: Arc<Runtime>,
    element: PhantomData<T>,
}

impl<T> HipSlice<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it has no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address of the first element (0 for an empty slice).
    pub fn device_address(&self) -> u64 {
        self.address
    }

    /// The device address of element `at`, when `len` elements from it are within the slice.
    fn element_address(&self, at: usize, len: usize, what: &str) -> Result<u64> {
        if at.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(Error::invalid(
                what,
                format!(
                    "elements {at}..{} are not within a buffer of {}",
                    at.saturating_add(len),
                    self.len
                ),
            ));
        }
        Ok(self.address + (at * size_of::<T>()) as u64)
    }
}

impl<T> Drop for HipSlice<T> {
    fn drop(&mut self) {
        // SAFETY: allocated by this runtime, dropped once. hipFree waits for queued work that
        // may still use it (and may return an earlier kernel's fault): the runtime's next checked
        // call returns a failure.
        self.runtime
            .record_release(unsafe { self.runtime.free(self.address) });
    }
}

/// A recorded point in a HIP stream, for timing.
pub struct HipEvent {
    event: RawEvent,
    runtime: Arc<Runtime>,
}

// SAFETY: HIP events may be used from any host thread.
unsafe impl Send for HipEvent {}
// SAFETY: as for Send.
unsafe impl Sync for HipEvent {}

impl HipEvent {
    /// Milliseconds from `self` to `end`, waiting for `end` to pass.
    ///
    /// # Errors
    /// [`Error::Hip`] when the runtime cannot time the pair.
    pub fn elapsed_ms(&self, end: &HipEvent) -> Result<f32> {
        self.runtime
            .event_elapsed_ms(self.event, end.event)
            .map_err(|s| hip_error("time two events", s))
    }
}

impl Drop for HipEvent {
    fn drop(&mut self) {
        // SAFETY: created by this runtime, dropped once.
        self.runtime
            .record_release(unsafe { self.runtime.event_destroy(self.event) });
    }
}

/// The path of the runtime library this process would open, or why none can be (for
/// diagnostics: `fp4spec` and the tests print it).
///
/// # Errors
/// As [`HipBackend::new`]'s loading step.
pub fn runtime_library() -> Result<String> {
    let runtime = Runtime::load()?;
    Ok(format!(
        "{} ({})",
        runtime.version(),
        runtime.path().display()
    ))
}
