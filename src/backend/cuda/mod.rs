//! The CUDA backend: one context and stream on a device (and a second stream that graph
//! captures record on), the device's target from `kernels/targets.toml`, and a lazily filled
//! module cache (one module per kernel family, compiled by NVRTC for the device's own
//! architecture, CUBINs cached on disk). Launches come through the vendor-neutral
//! [`Backend::launch`](crate::backend::Backend::launch) (raw `cuLaunchKernel`).

pub mod cublas;
pub mod nvrtc;

use crate::backend::{
    KernelArg, LaunchDims, LaunchFilter, MAX_KERNEL_ARGS, SplitKCell, check_arg_backends,
    check_arg_sizes,
};
use crate::error::{Error, Result};
use crate::kernels::table;
use crate::target::{self, TargetFacts};
use cudarc::driver::sys::{CUfunction_attribute_enum, CUresult, cudaError_enum};
use cudarc::driver::{CudaContext, CudaFunction, CudaModule, CudaStream};
use std::cell::Cell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};

/// The first driver with `cuFuncGetParamInfo` (12.4), as `cuDriverGetVersion` encodes it.
const PARAM_INFO_DRIVER: i32 = 12040;

/// A CUDA device ready to run this crate's kernels.
pub struct CudaBackend {
    context: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// The stream [`CudaBackend::capture`] records on, for its own thread only: other threads'
    /// launches, copies and frees keep running on `stream` meanwhile instead of landing in the
    /// graph (one shared capturing stream would record them, and replay them later against
    /// buffers their owners may have freed).
    capture_stream: Arc<CudaStream>,
    /// Held for the whole of a capture: one capture at a time on `capture_stream`.
    capture_lock: Mutex<()>,
    target: &'static TargetFacts,
    device_name: String,
    include_dir: PathBuf,
    multiprocessors: u32,
    modules: Mutex<HashMap<&'static str, Arc<CudaModule>>>,
    launch_targets: Mutex<HashMap<(&'static str, &'static str), Arc<LaunchTarget>>>,
    driver_version: i32,
    split_k: SplitKCell,
    launch_filter: LaunchFilter,
}

thread_local! {
    /// The backend (its address) whose capture this thread is inside, or 0.
    static CAPTURING: Cell<usize> = const { Cell::new(0) };
}

/// Marks the current thread as capturing for a backend until dropped (also on a panic inside
/// the recording).
struct CaptureScope {
    before: usize,
}

impl CaptureScope {
    fn enter(backend: usize) -> Self {
        Self {
            before: CAPTURING.with(|c| c.replace(backend)),
        }
    }
}

impl Drop for CaptureScope {
    fn drop(&mut self) {
        CAPTURING.with(|c| c.set(self.before));
    }
}

/// A capture begun on a backend's capture stream: [`OpenCapture::end`] ends it, and dropping it
/// unended (a panic in the recording) ends it too and destroys what it recorded. It ends through
/// the driver directly: cudarc's `end_capture` first returns any error another thread's drop
/// recorded in the context, and then leaves the stream capturing, so every later capture failed.
struct OpenCapture<'a> {
    backend: &'a CudaBackend,
}

impl OpenCapture<'_> {
    /// Ends the capture: the graph recorded (null when nothing was queued).
    fn end(self) -> std::result::Result<cudarc::driver::sys::CUgraph, cudarc::driver::DriverError> {
        let ended = self.end_capture();
        std::mem::forget(self);
        ended
    }

    fn end_capture(
        &self,
    ) -> std::result::Result<cudarc::driver::sys::CUgraph, cudarc::driver::DriverError> {
        make_current(&self.backend.context)?;
        // SAFETY: the backend's capture stream, capturing since this value was made.
        unsafe {
            cudarc::driver::result::stream::end_capture(self.backend.capture_stream.cu_stream())
        }
    }
}

impl Drop for OpenCapture<'_> {
    fn drop(&mut self) {
        match self.end_capture() {
            Ok(graph) if graph.is_null() => {}
            Ok(graph) => {
                // SAFETY: the graph just ended, owned by nobody else.
                let destroyed = unsafe { cudarc::driver::result::graph::destroy(graph) };
                self.backend.context.record_err(destroyed);
            }
            // an invalidated capture has ended all the same
            Err(e) if e.0 == cudaError_enum::CUDA_ERROR_STREAM_CAPTURE_INVALIDATED => {}
            // e.g. the context could not be made current: the next checked call reports it
            Err(e) => self.backend.context.record_err::<()>(Err(e)),
        }
    }
}

/// A graph [`CudaBackend::capture`] recorded, instantiated: both destroyed on drop. Neither
/// `Send` nor `Sync` (raw driver handles), as cudarc's own graph: the driver forbids using one
/// executable from two threads at once, so `Sync` would be unsound; `Send` alone would be sound.
pub struct CapturedGraph {
    context: Arc<CudaContext>,
    graph: cudarc::driver::sys::CUgraph,
    exec: cudarc::driver::sys::CUgraphExec,
}

impl Drop for CapturedGraph {
    fn drop(&mut self) {
        let destroyed = make_current(&self.context).and_then(|()| {
            // SAFETY: the executable and graph are this context's (current now) and owned here
            // (null: never made).
            unsafe {
                if !self.exec.is_null() {
                    cudarc::driver::result::graph::exec_destroy(self.exec)?;
                }
                if !self.graph.is_null() {
                    cudarc::driver::result::graph::destroy(self.graph)?;
                }
            }
            Ok(())
        });
        // as cudarc's own resources do: a failure is returned by the context's next checked call
        self.context.record_err(destroyed);
    }
}

/// Makes `context` current on this thread without first collecting the errors other threads'
/// resource drops recorded in it (cudarc's `bind_to_thread` returns those and binds nothing):
/// for the calls that must run whatever happened elsewhere and report only their own results,
/// such as ending a capture, destroying a graph, and launches (a launch inside a capture that
/// failed for another thread's drop ended the capture's recording with a stale error). A
/// recorded error stays for the context's next cudarc call, which reports it (an allocation, a
/// copy, a synchronisation, or a family's first launch, whose module cudarc loads).
fn make_current(context: &CudaContext) -> std::result::Result<(), cudarc::driver::DriverError> {
    // SAFETY: a live context (the caller holds it).
    unsafe { cudarc::driver::result::ctx::set_current(context.cu_ctx()) }
}

/// A kernel as [`CudaBackend::launch`] needs it: the function and, where the driver can say,
/// the byte size of each parameter.
struct LaunchTarget {
    function: CudaFunction,
    param_sizes: Option<Vec<usize>>,
    /// Dynamic shared memory the kernel was allowed so far (bytes): raised once per size, so
    /// repeated launches set no attribute and stay capturable.
    dynamic_shared_allowed: AtomicU32,
    /// Held while the attribute is raised, so it only ever grows: two threads raising it at
    /// once (GPU tests in parallel) left the smaller size set after the larger was recorded,
    /// and a launch of the larger then failed with an invalid value (thirty-first session).
    raising_shared: Mutex<()>,
    /// The driver's answers to [`CudaBackend::max_active_clusters`] and
    /// [`CudaBackend::max_active_blocks`], by question and launch shape.
    occupancy: Mutex<HashMap<OccupancyShape, u32>>,
}

/// What the occupancy queries ask the driver.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Occupancy {
    /// Clusters of the launch's shape resident at once on the device.
    Clusters,
    /// Blocks resident at once on the device (per multiprocessor, times the multiprocessors).
    Blocks,
}

/// What decides an occupancy answer: the question, threads per block, dynamic shared memory
/// (bytes) and blocks per cluster in x, y, z.
type OccupancyShape = (Occupancy, u32, u32, (u32, u32, u32));

/// The launch attribute of `dims`' cluster shape.
fn cluster_attribute(dims: &LaunchDims) -> cudarc::driver::sys::CUlaunchAttribute {
    use cudarc::driver::sys;
    sys::CUlaunchAttribute {
        id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION,
        pad: [0; 4],
        value: sys::CUlaunchAttributeValue {
            clusterDim: sys::CUlaunchAttributeValue_union__bindgen_ty_1 {
                x: dims.cluster.0,
                y: dims.cluster.1,
                z: dims.cluster.2,
            },
        },
    }
}

/// The launch configuration of `dims` on `stream` with `attributes` (which must outlive its
/// use).
fn launch_config(
    dims: &LaunchDims,
    stream: cudarc::driver::sys::CUstream,
    attributes: &mut [cudarc::driver::sys::CUlaunchAttribute],
) -> cudarc::driver::sys::CUlaunchConfig {
    cudarc::driver::sys::CUlaunchConfig {
        gridDimX: dims.grid.0,
        gridDimY: dims.grid.1,
        gridDimZ: dims.grid.2,
        blockDimX: dims.block.0,
        blockDimY: dims.block.1,
        blockDimZ: dims.block.2,
        sharedMemBytes: dims.shared_bytes,
        hStream: stream,
        attrs: if attributes.is_empty() {
            std::ptr::null_mut()
        } else {
            attributes.as_mut_ptr()
        },
        numAttrs: attributes.len() as u32,
    }
}

/// Lets `target`'s kernel use `bytes` of dynamic shared memory: more than 48 KiB only once
/// allowed to. The attribute is raised under the lock, each time above every earlier setting,
/// and recorded after it is set, so a launch that finds its size recorded finds it set.
fn allow_dynamic_shared(
    target: &LaunchTarget,
    family: &'static str,
    kernel: &'static str,
    bytes: u32,
) -> Result<()> {
    if bytes <= target.dynamic_shared_allowed.load(Ordering::Acquire) {
        return Ok(());
    }
    let _raising = target
        .raising_shared
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    if bytes > target.dynamic_shared_allowed.load(Ordering::Relaxed) {
        target
            .function
            .set_attribute(
                CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
            .map_err(|e| {
                Error::cuda(
                    format!("allow {bytes} bytes of shared memory for {kernel} ({family})"),
                    e,
                )
            })?;
        target
            .dynamic_shared_allowed
            .store(bytes, Ordering::Release);
    }
    Ok(())
}

/// How many CUDA devices the driver reports: 0 when there is no driver library or `cuInit`
/// fails (no usable NVIDIA GPU). Tells "no GPU here" apart from a GPU that
/// [`CudaBackend::new`] cannot open (no target for it, no NVRTC or headers, a driver error).
pub fn device_count() -> usize {
    // SAFETY: only probes whether the driver library can be opened.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    if cudarc::driver::result::init().is_err() {
        return 0;
    }
    cudarc::driver::result::device::get_count().map_or(0, |count| count.max(0) as usize)
}

impl CudaBackend {
    /// Opens device `ordinal`.
    ///
    /// # Errors
    /// [`Error::CudaUnavailable`] when the driver library is missing, there is no such device,
    /// the device's compute capability has no target in `kernels/targets.toml`, or NVRTC or the
    /// CUDA headers are missing; [`Error::Cuda`] when the driver refuses.
    pub fn new(ordinal: usize) -> Result<Self> {
        // SAFETY: only probes whether the driver library can be opened.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::CudaUnavailable("the CUDA driver library (libcuda.so.1) is not on the loader path: no NVIDIA driver on this machine".into()));
        }
        cudarc::driver::result::init().map_err(|e| {
            Error::CudaUnavailable(format!("cuInit failed ({e}): no usable NVIDIA GPU"))
        })?;
        let count = cudarc::driver::result::device::get_count()
            .map_err(|e| Error::cuda("count devices", e))?;
        let mut driver_version = 0;
        // SAFETY: one valid out-pointer.
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver_version) }
            .result()
            .map_err(|e| Error::cuda("read the driver version", e))?;
        if ordinal as i32 >= count {
            return Err(Error::CudaUnavailable(format!(
                "device {ordinal} requested, {count} CUDA device(s) present"
            )));
        }
        let context = CudaContext::new(ordinal)
            .map_err(|e| Error::cuda(format!("create a context on device {ordinal}"), e))?;
        let (major, minor) = context
            .compute_capability()
            .map_err(|e| Error::cuda("read the compute capability", e))?;
        let device_name = context
            .name()
            .map_err(|e| Error::cuda("read the device name", e))?;
        let target = target::for_compute_capability(major as u32, minor as u32).map_err(|e| {
            Error::CudaUnavailable(format!(
                "{device_name} (compute capability {major}.{minor}) has no kernel target: {e}"
            ))
        })?;
        nvrtc::version()?;
        let include_dir = nvrtc::cuda_include_dir()?;
        let multiprocessors = context
            .attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            )
            .map_err(|e| Error::cuda("read the multiprocessor count", e))?
            as u32;
        // Every launch and copy of the backend goes to one stream of its own: the legacy default
        // stream cannot be captured into a CUDA graph. With a single stream, cudarc's per-buffer
        // event tracking (for ordering across streams) is pure launch overhead.
        // SAFETY: this backend never uses a second stream of this context.
        unsafe { context.disable_event_tracking() };
        let stream = context
            .new_stream()
            .map_err(|e| Error::cuda("create a stream", e))?;
        let capture_stream = context
            .new_stream()
            .map_err(|e| Error::cuda("create the graph capture stream", e))?;
        Ok(Self {
            context,
            stream,
            capture_stream,
            capture_lock: Mutex::new(()),
            target,
            device_name,
            include_dir,
            multiprocessors,
            modules: Mutex::new(HashMap::new()),
            launch_targets: Mutex::new(HashMap::new()),
            driver_version,
            split_k: SplitKCell::default(),
            launch_filter: LaunchFilter::default(),
        })
    }

    /// The target the device runs (its kernels are rendered for it).
    pub fn target(&self) -> &'static TargetFacts {
        self.target
    }

    /// The device's name as the driver reports it.
    pub fn device_name(&self) -> &str {
        &self.device_name
    }

    /// Streaming multiprocessors of the device (as the driver reports, not the target table).
    pub fn multiprocessors(&self) -> u32 {
        self.multiprocessors
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

    /// The stream this thread's launches and copies go to: the backend's one stream, or, on the
    /// thread inside [`CudaBackend::capture`], the stream being captured.
    pub fn stream(&self) -> &Arc<CudaStream> {
        if CAPTURING.with(Cell::get) == self.identity() {
            &self.capture_stream
        } else {
            &self.stream
        }
    }

    /// What [`CAPTURING`] holds while this backend captures on the current thread.
    fn identity(&self) -> usize {
        self as *const Self as usize
    }

    /// Records what `record` queues from this thread into a graph, instantiated and uploaded,
    /// to replay with [`CudaBackend::launch_graph`]. Only this thread's
    /// work is recorded (on a stream of its own); other threads keep using the backend's stream
    /// meanwhile; a second capture waits for the first. The capture is ended whatever happens
    /// in `record` (an error, a panic), so the capture stream never stays capturing.
    ///
    /// # Errors
    /// The error `record` returns (the capture is ended and dropped first); [`Error::Cuda`]
    /// when the capture, instantiation or upload fails (e.g. `record` allocated or
    /// synchronised); [`Error::Invalid`] when `record` queued nothing.
    pub fn capture(&self, record: impl FnOnce() -> Result<()>) -> Result<CapturedGraph> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        let _one_capture = self
            .capture_lock
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        make_current(&self.context)
            .map_err(|e| Error::cuda("bind the context to begin a graph capture", e))?;
        // SAFETY: this backend's capture stream, alive while `self` is.
        unsafe {
            cudarc::driver::result::stream::begin_capture(
                self.capture_stream.cu_stream(),
                CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(|e| Error::cuda("begin a graph capture", e))?;
        let open = OpenCapture { backend: self };
        let recorded = {
            let _capturing = CaptureScope::enter(self.identity());
            record()
        };
        let ended = open.end();
        // owned from here, so every early return below destroys it
        let mut captured = CapturedGraph {
            context: Arc::clone(&self.context),
            graph: ended.as_ref().map_or(std::ptr::null_mut(), |graph| *graph),
            exec: std::ptr::null_mut(),
        };
        recorded?;
        ended.map_err(|e| Error::cuda("end the graph capture", e))?;
        if captured.graph.is_null() {
            return Err(Error::invalid(
                "graph capture",
                "nothing was queued while capturing",
            ));
        }
        // SAFETY: a graph of this context, just captured and owned by `captured` (the context is
        // current: `open.end` bound it).
        captured.exec = unsafe {
            cudarc::driver::result::graph::instantiate(captured.graph, CUgraphInstantiate_flags(0))
        }
        .map_err(|e| Error::cuda("instantiate the captured graph", e))?;
        // SAFETY: the executable just instantiated, and this backend's stream.
        unsafe { cudarc::driver::result::graph::upload(captured.exec, self.stream.cu_stream()) }
            .map_err(|e| Error::cuda("upload the captured graph", e))?;
        Ok(captured)
    }

    /// Queues one replay of `graph` (from [`CudaBackend::capture`]) where this thread's launches
    /// go ([`CudaBackend::stream`]): the backend's stream, or, inside a capture, into the graph
    /// being recorded, like any other launch.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a graph captured on another backend; [`Error::Cuda`] when the
    /// launch fails.
    pub fn launch_graph(&self, graph: &CapturedGraph) -> Result<()> {
        if !Arc::ptr_eq(&graph.context, &self.context) {
            return Err(Error::invalid(
                "captured graph",
                "it was captured on another CUDA backend (context) than the one asked to launch it",
            ));
        }
        make_current(&self.context)
            .map_err(|e| Error::cuda("make the context current to launch a graph", e))?;
        // SAFETY: a live instantiated graph of this context, and this backend's stream.
        unsafe { cudarc::driver::result::graph::launch(graph.exec, self.stream().cu_stream()) }
            .map_err(|e| Error::cuda("launch a captured graph", e))
    }

    /// The context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.context
    }

    /// Waits for the stream.
    ///
    /// # Errors
    /// [`Error::Cuda`] carrying the first asynchronous fault of queued work.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(|e| Error::cuda("synchronize the stream", e))
    }

    /// The kernel `kernel` of family `family`, compiling and loading the family's module on
    /// first use.
    ///
    /// # Errors
    /// [`Error::Compile`] when the source does not compile, [`Error::Cuda`] when loading fails,
    /// [`Error::Invalid`] when the kernel table has no such family or kernel for this target.
    pub fn function(&self, family: &'static str, kernel: &str) -> Result<CudaFunction> {
        let module = self.module(family)?;
        module.load_function(kernel).map_err(|e| {
            Error::cuda(
                format!(
                    "find kernel `{kernel}` in family `{family}` for {}",
                    self.target.name
                ),
                e,
            )
        })
    }

    /// The function and parameter sizes of `kernel`, looked up once.
    fn launch_target(
        &self,
        family: &'static str,
        kernel: &'static str,
    ) -> Result<Arc<LaunchTarget>> {
        let mut targets = self
            .launch_targets
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(target) = targets.get(&(family, kernel)) {
            return Ok(target.clone());
        }
        let function = self.function(family, kernel)?;
        let param_sizes =
            if self.driver_version >= PARAM_INFO_DRIVER {
                Some(param_sizes(&function).map_err(|e| {
                    Error::cuda(format!("read the parameters of kernel `{kernel}`"), e)
                })?)
            } else {
                None
            };
        let target = Arc::new(LaunchTarget {
            function,
            param_sizes,
            dynamic_shared_allowed: AtomicU32::new(0),
            raising_shared: Mutex::new(()),
            occupancy: Mutex::new(HashMap::new()),
        });
        targets.insert((family, kernel), target.clone());
        Ok(target)
    }

    /// Queues `kernel` of `family` on the stream with `cuLaunchKernel` (see
    /// [`Backend::launch`](crate::backend::Backend::launch)); the arguments are checked against
    /// the kernel's parameter sizes when the driver reports them (12.4+).
    ///
    /// # Safety
    /// The kernel must stay within the buffers passed for this grid and these scalars.
    ///
    /// # Errors
    /// [`Error::Invalid`] for arguments that do not fit the kernel,
    /// [`Error::BackendMismatch`] for buffers of another backend, [`Error::Compile`] /
    /// [`Error::Cuda`] when compiling, loading or launching fails.
    pub unsafe fn launch(
        &self,
        family: &'static str,
        kernel: &'static str,
        dims: &LaunchDims,
        args: &[KernelArg<'_>],
    ) -> Result<()> {
        let target = self.launch_target(family, kernel)?;
        if let Some(sizes) = &target.param_sizes {
            check_arg_sizes(kernel, sizes, args).map_err(|reason| {
                Error::invalid(
                    format!("launch of `{kernel}` ({family}, {})", self.target.name),
                    reason,
                )
            })?;
        }
        check_arg_backends("cuda", kernel, args)?;
        let mut params = [std::ptr::null_mut(); MAX_KERNEL_ARGS];
        for (slot, arg) in params.iter_mut().zip(args) {
            *slot = arg.value_ptr();
        }
        let op = || {
            format!(
                "launch {kernel} ({family}) grid {:?} block {:?} cluster {:?} shared {} bytes",
                dims.grid, dims.block, dims.cluster, dims.shared_bytes
            )
        };
        make_current(&self.context).map_err(|e| Error::cuda(op(), e))?;
        allow_dynamic_shared(&target, family, kernel, dims.shared_bytes)?;
        use cudarc::driver::sys;
        // Programmatic stream serialization where the target's kernels chain themselves
        // (chain_after_previous_grid() in common/prelude.cuh): the kernel's blocks may start
        // while the previous kernel finishes and wait for it on the device.
        let serialization = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            value: sys::CUlaunchAttributeValue {
                programmaticStreamSerializationAllowed: 1,
            },
        };
        let chained = self.target.instructions.grid_dependency_control;
        // The cluster shape where the launch asks for one (checked by Backend::launch).
        let cluster = cluster_attribute(dims);
        let mut attributes = [serialization, cluster];
        let attributes: &mut [sys::CUlaunchAttribute] = match (chained, dims.cluster != (1, 1, 1)) {
            (true, true) => &mut attributes[..],
            (true, false) => &mut attributes[..1],
            (false, true) => &mut attributes[1..],
            (false, false) => &mut [],
        };
        let config = launch_config(dims, self.stream().cu_stream(), attributes);
        // SAFETY: one pointer per parameter, each to a value of the parameter's size (checked
        // above where the driver reports sizes) living in `args` for the call; the config and
        // its attribute outlive the call; the caller vouches for the indexing.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                target.function.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(|e| Error::cuda(op(), e))
    }

    /// How many clusters of `dims`' shape (threads per block, dynamic shared memory, cluster
    /// shape; the grid only has to be a multiple of the cluster) of `kernel` the device holds at
    /// once (`cuOccupancyMaxActiveClusters`), asked once per shape. A launch of more clusters
    /// runs them in more than one wave.
    ///
    /// # Errors
    /// As [`CudaBackend::launch`] for an unknown kernel or a module that does not load;
    /// [`Error::Cuda`] when the driver cannot answer (a cluster shape the kernel cannot run).
    pub fn max_active_clusters(
        &self,
        family: &'static str,
        kernel: &'static str,
        dims: &LaunchDims,
    ) -> Result<u32> {
        self.occupancy(family, kernel, dims, Occupancy::Clusters)
    }

    /// How many blocks of `dims`' shape (threads per block, dynamic shared memory) of `kernel`
    /// the device holds at once: `cuOccupancyMaxActiveBlocksPerMultiprocessor` times the
    /// multiprocessors, asked once per shape. A launch of more blocks runs in more than one wave.
    ///
    /// # Errors
    /// As [`CudaBackend::launch`] for an unknown kernel or a module that does not load;
    /// [`Error::Cuda`] when the driver cannot answer.
    pub fn max_active_blocks(
        &self,
        family: &'static str,
        kernel: &'static str,
        dims: &LaunchDims,
    ) -> Result<u32> {
        self.occupancy(family, kernel, dims, Occupancy::Blocks)
    }

    /// The driver's answer to `question` for `kernel` launched as `dims`, remembered per shape.
    fn occupancy(
        &self,
        family: &'static str,
        kernel: &'static str,
        dims: &LaunchDims,
        question: Occupancy,
    ) -> Result<u32> {
        let target = self.launch_target(family, kernel)?;
        let threads = dims.block.0 * dims.block.1 * dims.block.2;
        // the driver answers blocks per multiprocessor, clusters per device
        let (cluster, per_answer) = match question {
            Occupancy::Clusters => (dims.cluster, 1),
            Occupancy::Blocks => ((1, 1, 1), self.multiprocessors),
        };
        let key = (question, threads, dims.shared_bytes, cluster);
        let mut known = target
            .occupancy
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Some(&answer) = known.get(&key) {
            return Ok(answer);
        }
        let op = || {
            let unit = match question {
                Occupancy::Clusters => format!("clusters of {:?} blocks", dims.cluster),
                Occupancy::Blocks => "blocks".to_string(),
            };
            format!(
                "{unit} of {:?} threads and {} bytes of shared memory resident at once for \
                 {kernel} ({family})",
                dims.block, dims.shared_bytes
            )
        };
        make_current(&self.context).map_err(|e| Error::cuda(op(), e))?;
        allow_dynamic_shared(&target, family, kernel, dims.shared_bytes)?;
        let function = target.function.cu_function();
        let mut answer: std::ffi::c_int = 0;
        let result = match question {
            Occupancy::Clusters => {
                let mut attributes = [cluster_attribute(dims)];
                let config = launch_config(dims, self.stream().cu_stream(), &mut attributes);
                // SAFETY: the config and its attribute outlive the call; `answer` is written once.
                unsafe {
                    cudarc::driver::sys::cuOccupancyMaxActiveClusters(
                        &mut answer,
                        function,
                        &config,
                    )
                }
            }
            // SAFETY: `answer` is written once; the function belongs to a loaded module.
            Occupancy::Blocks => unsafe {
                cudarc::driver::sys::cuOccupancyMaxActiveBlocksPerMultiprocessor(
                    &mut answer,
                    function,
                    threads as std::ffi::c_int,
                    dims.shared_bytes as usize,
                )
            },
        };
        result.result().map_err(|e| Error::cuda(op(), e))?;
        let answer = answer.max(0) as u32 * per_answer;
        known.insert(key, answer);
        Ok(answer)
    }

    fn module(&self, family: &'static str) -> Result<Arc<CudaModule>> {
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
        let cubin = nvrtc::cached_cubin(source, self.target, &self.include_dir)?;
        let module = self
            .context
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(|e| {
                Error::cuda(
                    format!("load the `{family}` module for {}", self.target.name),
                    e,
                )
            })?;
        modules.insert(family, module.clone());
        Ok(module)
    }
}

/// The byte size of each parameter of `function`, from `cuFuncGetParamInfo` (which answers
/// `CUDA_ERROR_INVALID_VALUE` past the last one).
fn param_sizes(
    function: &CudaFunction,
) -> std::result::Result<Vec<usize>, cudarc::driver::DriverError> {
    let mut sizes = Vec::new();
    for index in 0..=MAX_KERNEL_ARGS {
        let (mut offset, mut size) = (0usize, 0usize);
        // SAFETY: a loaded function and two valid out-pointers.
        let result: CUresult = unsafe {
            cudarc::driver::sys::cuFuncGetParamInfo(
                function.cu_function(),
                index,
                &mut offset,
                &mut size,
            )
        };
        if result == cudaError_enum::CUDA_ERROR_INVALID_VALUE {
            break;
        }
        result.result()?;
        sizes.push(size);
    }
    Ok(sizes)
}
