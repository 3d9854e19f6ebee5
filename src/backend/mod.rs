//! Backends: where a kernel family's launch API runs.
//!
//! - `cpu`: runs each family's CPU reference (`src/kernels/<family>/reference.rs`).
//! - `cuda`: NVRTC-compiled kernels for the device's own target, through cudarc.
//! - `hip`: gfx1151 code objects (embedded at build time or compiled by clang) on the HIP
//!   runtime, opened at run time (`hip` feature).
//!
//! Kernel families take a [`Backend`] and [`DeviceVec`]s and never look at the vendor: a device
//! launch is [`Backend::launch`] with the family's kernel name, [`LaunchDims`] from the target's
//! tile table ([`Backend::target`]) and [`KernelArg`]s (buffers and scalars); CUDA runs it with
//! `cuLaunchKernel`, HIP with `hipModuleLaunchKernel`.

pub mod cuda;
pub mod hip;

use crate::error::{Error, Result};
use crate::target::TargetFacts;
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, ValidAsZeroBits};
use std::ffi::c_void;
use std::marker::PhantomData;
use std::ops::Range;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// CUDA when a driver and a device are present, else HIP when a runtime and a gfx1151 are,
    /// else the CPU.
    #[default]
    Auto,
    /// The CPU references.
    Cpu,
    /// CUDA device 0; an error when unavailable.
    Cuda,
    /// HIP device 0; an error when unavailable (or built without the `hip` feature).
    Hip,
}

impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda),
            "hip" => Ok(Self::Hip),
            other => Err(Error::invalid(
                "backend",
                format!("`{other}` is not one of auto, cpu, cuda, hip"),
            )),
        }
    }
}

/// A live backend.
#[derive(Clone)]
pub enum Backend {
    /// The CPU references.
    Cpu,
    /// A CUDA device.
    Cuda(Arc<cuda::CudaBackend>),
    /// A HIP device.
    Hip(Arc<hip::HipBackend>),
}

impl Backend {
    /// Opens the backend `kind` asks for; `Auto` falls back to the CPU when neither CUDA nor
    /// HIP is available (use [`Backend::auto`] to learn why).
    ///
    /// # Errors
    /// With `Cuda`: [`Error::CudaUnavailable`] (no driver, no device, no headers, no target for
    /// the device) or [`Error::Cuda`]. With `Hip`: [`Error::HipUnavailable`] (built without the
    /// `hip` feature, no runtime library, no device, not a gfx1151) or [`Error::Hip`].
    pub fn new(kind: BackendKind) -> Result<Self> {
        match kind {
            BackendKind::Cpu => Ok(Self::Cpu),
            BackendKind::Cuda => Ok(Self::Cuda(Arc::new(cuda::CudaBackend::new(0)?))),
            BackendKind::Hip => Ok(Self::Hip(Arc::new(hip::HipBackend::new(0)?))),
            BackendKind::Auto => Ok(Self::auto().0),
        }
    }

    /// CUDA device 0 when it can be opened, else HIP device 0, else the CPU together with the
    /// reasons neither device backend was used.
    pub fn auto() -> (Self, Option<String>) {
        let why_not_cuda = match cuda::CudaBackend::new(0) {
            Ok(cuda) => return (Self::Cuda(Arc::new(cuda)), None),
            Err(e) => e.to_string(),
        };
        match hip::HipBackend::new(0) {
            Ok(hip) => (Self::Hip(Arc::new(hip)), None),
            Err(e) => (Self::Cpu, Some(format!("{why_not_cuda}; {e}"))),
        }
    }

    /// Short name: `cpu`, `cuda` or `hip`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda(_) => "cuda",
            Self::Hip(_) => "hip",
        }
    }

    /// A human-readable description (device name and target for a device).
    pub fn describe(&self) -> String {
        match self {
            Self::Cpu => "cpu (CPU references)".to_string(),
            Self::Cuda(c) => format!("cuda: {} ({})", c.device_name(), c.target().name),
            Self::Hip(h) => format!(
                "hip: {} ({}, HIP runtime {})",
                h.device_name(),
                h.target().name,
                h.runtime_description()
            ),
        }
    }

    /// The target a device backend runs (its kernels and tile table); `None` on the CPU.
    pub fn target(&self) -> Option<&'static TargetFacts> {
        match self {
            Self::Cpu => None,
            Self::Cuda(c) => Some(c.target()),
            Self::Hip(h) => Some(h.target()),
        }
    }

    /// Multiprocessors (SMs / CUs) the device reports; `None` on the CPU.
    pub fn multiprocessors(&self) -> Option<u32> {
        match self {
            Self::Cpu => None,
            Self::Cuda(c) => Some(c.multiprocessors()),
            Self::Hip(h) => Some(h.multiprocessors()),
        }
    }

    /// Queues `kernel` of `family` on the device with `dims` and `args` (in the kernel's
    /// parameter order), without knowing the vendor: `cuLaunchKernel` on CUDA,
    /// `hipModuleLaunchKernel` on HIP. Before launching, the arguments are checked against the
    /// kernel's parameters (count and sizes from the driver on CUDA 12.4+; count, kind, size
    /// and the block shape from the code object's metadata on HIP), and every buffer against
    /// the backend. The first launch of a kernel loads its family's module; later ones never
    /// allocate or synchronise, so they can be captured into a graph. While
    /// [`Backend::leave_out`] names this launch, it returns `Ok` without running.
    ///
    /// # Safety
    /// The kernel must stay within the buffers passed for this grid and these scalars: the
    /// checks cover the shape of the argument list, not what the kernel indexes.
    ///
    /// # Errors
    /// [`Error::Invalid`] on the CPU backend (it runs references, not kernels), for an unknown
    /// kernel, arguments that do not fit it, or a grid or cluster shape no launch can take
    /// ([`LaunchDims::MAX_GRID_X`], [`LaunchDims::MAX_GRID_YZ`]); [`Error::BackendMismatch`] for a buffer of
    /// another backend; [`Error::Compile`] when the family does not compile; [`Error::Cuda`] /
    /// [`Error::Hip`] when loading or launching fails.
    pub unsafe fn launch(
        &self,
        family: &'static str,
        kernel: &'static str,
        dims: &LaunchDims,
        args: &[KernelArg<'_>],
    ) -> Result<()> {
        if args.len() > MAX_KERNEL_ARGS {
            return Err(Error::invalid(
                format!("launch of `{kernel}` ({family})"),
                format!(
                    "{} arguments; launches pass at most {MAX_KERNEL_ARGS}",
                    args.len()
                ),
            ));
        }
        if let Some(filter) = self.launch_filter() {
            if !filter.admits(kernel, dims) {
                return Ok(());
            }
        }
        if let Some(target) = self.target() {
            check_grid(dims)
                .and_then(|()| check_clusters(dims, target))
                .map_err(|reason| {
                    Error::invalid(
                        format!("launch of `{kernel}` ({family}, {})", target.name),
                        reason,
                    )
                })?;
        }
        match self {
            Self::Cpu => Err(Error::invalid(
                format!("launch of `{kernel}` ({family})"),
                "the CPU backend runs the families' references, not device kernels",
            )),
            // SAFETY: forwarded from the caller.
            Self::Cuda(c) => unsafe { c.launch(family, kernel, dims, args) },
            // SAFETY: forwarded from the caller.
            Self::Hip(h) => unsafe { h.launch(family, kernel, dims, args) },
        }
    }

    /// How many clusters of `dims`' shape (threads per block, dynamic shared memory, cluster
    /// shape) of `kernel` the device holds at once; `None` where the backend has no clusters
    /// (the CPU, HIP).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the kernel's module does not load or the driver cannot answer for
    /// this shape.
    pub fn max_active_clusters(
        &self,
        family: &'static str,
        kernel: &'static str,
        dims: &LaunchDims,
    ) -> Result<Option<u32>> {
        match self {
            Self::Cuda(c) => c.max_active_clusters(family, kernel, dims).map(Some),
            Self::Cpu | Self::Hip(_) => Ok(None),
        }
    }

    /// How many blocks of `dims`' shape (threads per block, dynamic shared memory) of `kernel`
    /// the device holds at once; `None` where the backend has no occupancy query here (the CPU,
    /// HIP).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the kernel's module does not load or the driver cannot answer for
    /// this shape.
    pub fn max_active_blocks(
        &self,
        family: &'static str,
        kernel: &'static str,
        dims: &LaunchDims,
    ) -> Result<Option<u32>> {
        match self {
            Self::Cuda(c) => c.max_active_blocks(family, kernel, dims).map(Some),
            Self::Cpu | Self::Hip(_) => Ok(None),
        }
    }

    /// The device backend's launch filter (none on the CPU).
    fn launch_filter(&self) -> Option<&LaunchFilter> {
        match self {
            Self::Cpu => None,
            Self::Cuda(c) => Some(c.launch_filter()),
            Self::Hip(h) => Some(h.launch_filter()),
        }
    }

    /// Starts (`true`: forgetting what was seen) or stops noting the kind of every launch and
    /// counting them, for [`Backend::recorded_launches`]. Nothing on the CPU backend.
    pub fn record_launches(&self, on: bool) {
        if let Some(filter) = self.launch_filter() {
            filter.update(|state| {
                state.record = on;
                if on {
                    state.seen.clear();
                }
            });
        }
    }

    /// Launches queued (or left out) while [`Backend::record_launches`] was on (0 on the CPU
    /// backend).
    pub fn recorded_launch_count(&self) -> usize {
        self.recorded_launches().iter().map(|t| t.launches).sum()
    }

    /// The kinds of launch noted since [`Backend::record_launches`] was turned on, in order of
    /// first appearance, each with its number of launches (empty on the CPU backend).
    pub fn recorded_launches(&self) -> Vec<LaunchTally> {
        self.launch_filter()
            .map(|filter| filter.state().seen.clone())
            .unwrap_or_default()
    }

    /// Leaves every launch of `class` out from now on (they return `Ok` without running), or
    /// none with `None`: a step captured without one kernel tells what that kernel costs it
    /// (`fp4spec bench decode --kernel-costs`). Results that depend on the kernel are wrong
    /// while it is left out. Nothing on the CPU backend.
    pub fn leave_out(&self, class: Option<LaunchClass>) {
        if let Some(filter) = self.launch_filter() {
            filter.update(|state| state.skip = class);
        }
    }

    /// Records the current end of the backend's queue, for timing with
    /// [`DeviceEvent::elapsed_ms`] (the CPU backend records the wall clock).
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the event cannot be created or recorded.
    pub fn record_event(&self) -> Result<DeviceEvent> {
        Ok(match self {
            Self::Cpu => DeviceEvent::Host(Instant::now()),
            Self::Cuda(c) => DeviceEvent::Cuda(
                c.stream()
                    .record_event(Some(cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT))
                    .map_err(|e| Error::cuda("record an event", e))?,
            ),
            Self::Hip(h) => DeviceEvent::Hip(h.record_event()?),
        })
    }

    /// Records the launches and copies `record` queues into a graph instead of running them,
    /// and returns it ready to replay ([`Graph::launch`]): one submission for the whole sequence,
    /// so per-launch costs are paid once at capture. What `record` queues must not allocate,
    /// synchronise or copy from the host (the families' launches do not, after a first call
    /// outside the capture has loaded their modules and grown their scratch). Only the calling
    /// thread's work is recorded: other threads sharing the backend keep running theirs
    /// meanwhile, and a second capture waits for the first.
    ///
    /// # Errors
    /// [`Error::Invalid`] on the CPU and HIP backends (only CUDA captures graphs here), or when
    /// `record` queued nothing; the error `record` returns (the capture is ended and dropped
    /// first); [`Error::Cuda`] when the capture or the instantiation fails, e.g. because
    /// `record` did something a capture cannot hold.
    pub fn capture(&self, record: impl FnOnce() -> Result<()>) -> Result<Graph> {
        let Self::Cuda(c) = self else {
            return Err(Error::invalid(
                "graph capture",
                format!("the {} backend captures no graphs (CUDA only)", self.name()),
            ));
        };
        Ok(Graph {
            graph: c.capture(record)?,
            backend: Arc::clone(c),
        })
    }

    /// Queues a copy of `src` into `dst` (same backend, same length): the device-to-device
    /// copy every bandwidth ceiling is measured with.
    ///
    /// # Errors
    /// [`Error::Invalid`] for different lengths, [`Error::BackendMismatch`] for buffers of
    /// another backend, [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn copy<T: DeviceRepr + Clone>(
        &self,
        src: &DeviceVec<T>,
        dst: &mut DeviceVec<T>,
    ) -> Result<()> {
        if src.len() != dst.len() {
            return Err(Error::invalid(
                "device copy",
                format!(
                    "source has {} elements, destination {}",
                    src.len(),
                    dst.len()
                ),
            ));
        }
        match (self, src, dst) {
            (Self::Cpu, DeviceVec::Host(s), DeviceVec::Host(d)) => {
                d.clone_from_slice(s);
                Ok(())
            }
            (Self::Cuda(c), DeviceVec::Cuda(s), DeviceVec::Cuda(d)) => c
                .stream()
                .memcpy_dtod(s, d)
                .map_err(|e| Error::cuda(format!("copy {} elements device to device", s.len()), e)),
            (Self::Hip(h), DeviceVec::Hip(s), DeviceVec::Hip(d)) => h.copy(s, d),
            (_, src, _) => Err(self.mismatch("copied buffer", src)),
        }
    }

    /// A second buffer on the backend holding a copy of `data` (device to device on a device).
    ///
    /// # Errors
    /// [`Error::BackendMismatch`] for a buffer of another backend, [`Error::Cuda`] /
    /// [`Error::Hip`] when the allocation or the copy fails.
    pub fn duplicate<T: DeviceRepr + ValidAsZeroBits + Clone + Default>(
        &self,
        data: &DeviceVec<T>,
    ) -> Result<DeviceVec<T>> {
        let mut copied = self.zeros(data.len())?;
        self.copy(data, &mut copied)?;
        Ok(copied)
    }

    /// Device-to-device copy bandwidth in bytes per second (bytes read plus bytes written): the
    /// median of `repeats` copies of a `bytes`-byte buffer timed between events, after one
    /// untimed copy. The ceiling decode figures are reported against.
    ///
    /// # Errors
    /// [`Error::Invalid`] for zero bytes or repeats; [`Error::Cuda`] / [`Error::Hip`] when an
    /// allocation, a copy or the timing fails.
    pub fn copy_bandwidth(&self, bytes: usize, repeats: usize) -> Result<f64> {
        if bytes == 0 || repeats == 0 {
            return Err(Error::invalid(
                "copy bandwidth",
                format!("{bytes} bytes, {repeats} repeats: both must be positive"),
            ));
        }
        let src = self.zeros::<u8>(bytes)?;
        let mut dst = self.zeros::<u8>(bytes)?;
        self.copy(&src, &mut dst)?;
        let mut seconds = Vec::with_capacity(repeats);
        for _ in 0..repeats {
            let start = self.record_event()?;
            self.copy(&src, &mut dst)?;
            let end = self.record_event()?;
            self.synchronize()?;
            seconds.push(f64::from(start.elapsed_ms(&end)?) / 1e3);
        }
        seconds.sort_by(f64::total_cmp);
        Ok(2.0 * bytes as f64 / seconds[repeats / 2].max(f64::MIN_POSITIVE))
    }

    /// The split-K scratch of the device, grown to at least `partials` floats and `counters`
    /// counters (a growth allocates zeroed memory, at least twice the old size; later calls of
    /// the same or smaller sizes do not allocate, so launches using it stay capturable). Hold
    /// the guard across the launch that uses it: one launch at a time owns the scratch. A
    /// buffer a growth replaces stays allocated as long as the backend: a graph captured with it
    /// (a decoder of another batch size, a test on another thread) still names its address.
    ///
    /// # Errors
    /// [`Error::Invalid`] on the CPU backend (it has no device scratch), [`Error::Cuda`] /
    /// [`Error::Hip`] when an allocation fails.
    pub fn split_k_scratch(
        &self,
        partials: usize,
        counters: usize,
    ) -> Result<MutexGuard<'_, SplitKScratch>> {
        let cell = match self {
            Self::Cpu => {
                return Err(Error::invalid(
                    "split-K scratch",
                    "the CPU backend has no device scratch",
                ));
            }
            Self::Cuda(c) => c.split_k_scratch(),
            Self::Hip(h) => h.split_k_scratch(),
        };
        let mut scratch = cell.lock().unwrap_or_else(|poisoned| poisoned.into_inner());
        let SplitKScratch {
            partials: partials_buffer,
            counters: counters_buffer,
            retired_partials,
            retired_counters,
        } = &mut *scratch;
        self.grow_zeroed(partials_buffer, retired_partials, partials)?;
        self.grow_zeroed(counters_buffer, retired_counters, counters)?;
        Ok(scratch)
    }

    /// Replaces `buffer` by a zeroed one of at least `len` elements (and twice its old length)
    /// when it is shorter, keeping the replaced one in `retired`; nothing when it is long enough.
    fn grow_zeroed<T: DeviceRepr + ValidAsZeroBits + Clone + Default>(
        &self,
        buffer: &mut Option<DeviceVec<T>>,
        retired: &mut Vec<DeviceVec<T>>,
        len: usize,
    ) -> Result<()> {
        let old = buffer.as_ref().map_or(0, DeviceVec::len);
        if old < len {
            if let Some(replaced) = buffer.replace(self.zeros(len.max(2 * old).max(1))?) {
                retired.push(replaced);
            }
        }
        Ok(())
    }

    /// Copies `data` to the backend.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the allocation or copy fails.
    pub fn upload<T: DeviceRepr + Clone>(&self, data: &[T]) -> Result<DeviceVec<T>> {
        Ok(match self {
            Self::Cpu => DeviceVec::Host(data.to_vec()),
            Self::Cuda(c) => DeviceVec::Cuda(
                c.stream()
                    .clone_htod(data)
                    .map_err(|e| Error::cuda(format!("upload {} elements", data.len()), e))?,
            ),
            Self::Hip(h) => DeviceVec::Hip(h.upload(data)?),
        })
    }

    /// A zero-filled buffer of `len` elements.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the allocation fails; [`Error::Invalid`] when a
    /// host buffer (the CPU backend) cannot be allocated.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits + Clone + Default>(
        &self,
        len: usize,
    ) -> Result<DeviceVec<T>> {
        Ok(match self {
            Self::Cpu => {
                // an allocation the host cannot make is an error here, not an abort
                let mut host = Vec::new();
                host.try_reserve_exact(len).map_err(|e| {
                    Error::invalid(format!("a host buffer of {len} elements"), e.to_string())
                })?;
                host.resize(len, T::default());
                DeviceVec::Host(host)
            }
            Self::Cuda(c) => DeviceVec::Cuda(
                c.stream()
                    .alloc_zeros(len)
                    .map_err(|e| Error::cuda(format!("allocate {len} elements"), e))?,
            ),
            Self::Hip(h) => DeviceVec::Hip(h.zeros(len)?),
        })
    }

    /// Copies a buffer back to the host (waits for the work queued before it).
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] when the copy fails (this is also where an earlier
    /// kernel's fault shows), [`Error::BackendMismatch`] when the buffer is from another backend.
    pub fn download<T: DeviceRepr + Clone + Default>(&self, data: &DeviceVec<T>) -> Result<Vec<T>> {
        self.read(data, 0..data.len())
    }

    /// Copies `values` into `dst` from element `at` on, queued after the work before it; it
    /// returns once `values` may be dropped (not for use inside a captured graph).
    ///
    /// # Errors
    /// [`Error::Invalid`] when `at + values.len()` is past the end of `dst`,
    /// [`Error::BackendMismatch`] for a buffer of another backend, [`Error::Cuda`] /
    /// [`Error::Hip`] when the copy fails.
    pub fn write<T: DeviceRepr + Clone>(
        &self,
        dst: &mut DeviceVec<T>,
        at: usize,
        values: &[T],
    ) -> Result<()> {
        let range = at..at.saturating_add(values.len());
        check_range(dst, &range)?;
        match (self, dst) {
            (Self::Cpu, DeviceVec::Host(d)) => {
                d[range].clone_from_slice(values);
                Ok(())
            }
            (Self::Cuda(c), DeviceVec::Cuda(d)) => c
                .stream()
                .memcpy_htod(values, &mut d.slice_mut(range))
                .map_err(|e| {
                    Error::cuda(format!("copy {} elements to the device", values.len()), e)
                }),
            (Self::Hip(h), DeviceVec::Hip(d)) => h.write(d, at, values),
            (_, dst) => Err(self.mismatch("written buffer", dst)),
        }
    }

    /// Copies the elements `range` of `src` back to the host (waits for the work queued before
    /// it).
    ///
    /// # Errors
    /// [`Error::Invalid`] when `range` is not within `src`, [`Error::BackendMismatch`] for a
    /// buffer of another backend, [`Error::Cuda`] / [`Error::Hip`] when the copy fails.
    pub fn read<T: DeviceRepr + Clone + Default>(
        &self,
        src: &DeviceVec<T>,
        range: Range<usize>,
    ) -> Result<Vec<T>> {
        check_range(src, &range)?;
        match (self, src) {
            (Self::Cpu, DeviceVec::Host(s)) => Ok(s[range].to_vec()),
            (Self::Cuda(c), DeviceVec::Cuda(s)) => c
                .stream()
                .clone_dtoh(&s.slice(range.clone()))
                .map_err(|e| Error::cuda(format!("download {} elements", range.len()), e)),
            (Self::Hip(h), DeviceVec::Hip(s)) => h.read(s, range),
            _ => Err(self.mismatch("downloaded buffer", src)),
        }
    }

    /// Queues zeroing every element of `buffer`.
    ///
    /// # Errors
    /// [`Error::BackendMismatch`] for a buffer of another backend, [`Error::Cuda`] /
    /// [`Error::Hip`] when the memset fails.
    pub fn fill_zeros<T: DeviceRepr + ValidAsZeroBits + Clone + Default>(
        &self,
        buffer: &mut DeviceVec<T>,
    ) -> Result<()> {
        match (self, buffer) {
            (Self::Cpu, DeviceVec::Host(b)) => {
                b.fill(T::default());
                Ok(())
            }
            (Self::Cuda(c), DeviceVec::Cuda(b)) => c
                .stream()
                .memset_zeros(b)
                .map_err(|e| Error::cuda(format!("zero {} elements", b.len()), e)),
            (Self::Hip(h), DeviceVec::Hip(b)) => h.fill_zeros(b),
            (_, buffer) => Err(self.mismatch("zeroed buffer", buffer)),
        }
    }

    /// Waits until all queued work is done.
    ///
    /// # Errors
    /// [`Error::Cuda`] / [`Error::Hip`] carrying the first asynchronous fault.
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Self::Cpu => Ok(()),
            Self::Cuda(c) => c.synchronize(),
            Self::Hip(h) => h.synchronize(),
        }
    }

    pub(crate) fn mismatch<T>(&self, what: &str, data: &DeviceVec<T>) -> Error {
        Error::BackendMismatch {
            what: what.to_string(),
            expected: self.name(),
            found: data.backend_name(),
        }
    }
}

/// Launches captured by [`Backend::capture`], replayed together.
pub struct Graph {
    backend: Arc<cuda::CudaBackend>,
    graph: cuda::CapturedGraph,
}

impl Graph {
    /// Queues one replay of everything captured, on the backend's stream.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the launch fails.
    pub fn launch(&self) -> Result<()> {
        self.backend.launch_graph(&self.graph)
    }
}

/// A buffer on a backend: host memory for the CPU, device memory for CUDA and HIP.
pub enum DeviceVec<T> {
    /// CPU backend storage.
    Host(Vec<T>),
    /// CUDA device memory.
    Cuda(CudaSlice<T>),
    /// HIP device memory.
    Hip(hip::HipSlice<T>),
}

impl<T> DeviceVec<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(v) => v.len(),
            Self::Cuda(s) => s.len(),
            Self::Hip(s) => s.len(),
        }
    }

    /// The device address of the first element (what a kernel receives); `None` for host
    /// memory.
    pub fn device_address(&self) -> Option<u64> {
        match self {
            Self::Host(_) => None,
            // The stream only orders cudarc's event tracking, which the backend turns off.
            Self::Cuda(s) => Some(s.device_ptr(s.stream()).0),
            Self::Hip(s) => Some(s.device_address()),
        }
    }

    /// Whether the buffer has no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Name of the backend holding it.
    pub fn backend_name(&self) -> &'static str {
        match self {
            Self::Host(_) => "cpu",
            Self::Cuda(_) => "cuda",
            Self::Hip(_) => "hip",
        }
    }

    /// The address a kernel argument carries: the device address, or the host address of CPU
    /// storage (which a launch rejects).
    fn argument_address(&self) -> u64 {
        match self {
            Self::Host(v) => v.as_ptr() as u64,
            _ => self.device_address().unwrap_or(0),
        }
    }
}

/// Device scratch for split-K reductions, one per device backend ([`Backend::split_k_scratch`]):
/// fp32 partial sums and one arrival counter per output tile. Counters are zero between launches
/// (the last arriving warp of a tile resets its own).
#[derive(Default)]
pub struct SplitKScratch {
    /// Partial sums, at least as many as the largest launch so far asked for.
    pub partials: Option<DeviceVec<f32>>,
    /// Arrival counters, zero-initialised.
    pub counters: Option<DeviceVec<u32>>,
    /// The buffers earlier growths replaced, kept for the graphs captured with them (freed,
    /// their replays would read and write memory the device may have given to others).
    retired_partials: Vec<DeviceVec<f32>>,
    retired_counters: Vec<DeviceVec<u32>>,
}

/// A device backend's split-K scratch, empty until the first launch that splits K.
pub(crate) type SplitKCell = Mutex<SplitKScratch>;

/// One kind of launch: a kernel at one grid size (the same GEMM kernel serves several layers'
/// shapes, told apart by their blocks).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LaunchClass {
    /// The kernel's name.
    pub kernel: &'static str,
    /// Blocks in the grid (x * y * z).
    pub blocks: u32,
}

/// A kind of launch noted while recording ([`Backend::recorded_launches`]) and how many times it
/// was launched.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchTally {
    /// The kernel and its grid.
    pub class: LaunchClass,
    /// Launches of it while recording.
    pub launches: usize,
}

impl std::fmt::Display for LaunchClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.kernel, self.blocks)
    }
}

/// What a device backend notes about launches and which it leaves out
/// ([`Backend::record_launches`], [`Backend::leave_out`]); idle (one relaxed load per launch)
/// unless asked.
#[derive(Default)]
pub(crate) struct LaunchFilter {
    active: std::sync::atomic::AtomicBool,
    state: Mutex<LaunchFilterState>,
}

#[derive(Default)]
pub(crate) struct LaunchFilterState {
    record: bool,
    seen: Vec<LaunchTally>,
    skip: Option<LaunchClass>,
}

impl LaunchFilter {
    fn state(&self) -> MutexGuard<'_, LaunchFilterState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn update(&self, change: impl FnOnce(&mut LaunchFilterState)) {
        let mut state = self.state();
        change(&mut state);
        let active = state.record || state.skip.is_some();
        self.active
            .store(active, std::sync::atomic::Ordering::Relaxed);
    }

    /// Whether a launch of `kernel` on `dims` runs (noting it when recording).
    fn admits(&self, kernel: &'static str, dims: &LaunchDims) -> bool {
        if !self.active.load(std::sync::atomic::Ordering::Relaxed) {
            return true;
        }
        let (x, y, z) = dims.grid;
        let class = LaunchClass {
            kernel,
            blocks: x.saturating_mul(y).saturating_mul(z),
        };
        let mut state = self.state();
        if state.record {
            match state.seen.iter_mut().find(|t| t.class == class) {
                Some(tally) => tally.launches += 1,
                None => state.seen.push(LaunchTally {
                    class: class.clone(),
                    launches: 1,
                }),
            }
        }
        state.skip.as_ref() != Some(&class)
    }
}

/// The most arguments one launch passes (the longest list, `gdn_step_*`'s, has 33).
pub const MAX_KERNEL_ARGS: usize = 40;

/// Grid and block of one launch, and its dynamic shared memory (LDS) in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchDims {
    /// Blocks in x, y, z.
    pub grid: (u32, u32, u32),
    /// Threads per block in x, y, z.
    pub block: (u32, u32, u32),
    /// Dynamic shared memory per block, bytes (on top of the kernel's static use).
    pub shared_bytes: u32,
    /// Blocks per thread block cluster in x, y, z (`(1, 1, 1)`: no clusters). Each grid
    /// dimension must be a multiple of its cluster dimension, on targets with
    /// `instructions.clusters` only; a launch the device cannot place fails with the driver's
    /// error.
    pub cluster: (u32, u32, u32),
}

impl LaunchDims {
    /// Most blocks along x of one launch (CUDA and HIP alike).
    pub const MAX_GRID_X: u32 = i32::MAX as u32;
    /// Most blocks along y and along z of one launch (CUDA and HIP alike).
    pub const MAX_GRID_YZ: u32 = 65535;
}

/// Why `dims`' grid cannot be launched: a dimension past the launch limits
/// ([`LaunchDims::MAX_GRID_X`], [`LaunchDims::MAX_GRID_YZ`]). The families check their own
/// shapes first, naming them; this is what no launch gets past.
fn check_grid(dims: &LaunchDims) -> std::result::Result<(), String> {
    let (gx, gy, gz) = dims.grid;
    if gx > LaunchDims::MAX_GRID_X || gy > LaunchDims::MAX_GRID_YZ || gz > LaunchDims::MAX_GRID_YZ {
        return Err(format!(
            "a grid of {:?} blocks: at most {} along x and {} along y and z",
            dims.grid,
            LaunchDims::MAX_GRID_X,
            LaunchDims::MAX_GRID_YZ
        ));
    }
    Ok(())
}

/// Why `dims`' clusters cannot run on `target`: clusters on a target without them, a cluster
/// dimension of zero or one that does not divide the grid, or more than 8 blocks in a cluster
/// (the portable size).
fn check_clusters(dims: &LaunchDims, target: &TargetFacts) -> std::result::Result<(), String> {
    let (cx, cy, cz) = dims.cluster;
    if (cx, cy, cz) == (1, 1, 1) {
        return Ok(());
    }
    if !target.instructions.clusters {
        return Err(format!(
            "clusters of {:?} blocks: {} has no thread block clusters",
            dims.cluster, target.name
        ));
    }
    let (gx, gy, gz) = dims.grid;
    if cx == 0 || cy == 0 || cz == 0 || gx % cx != 0 || gy % cy != 0 || gz % cz != 0 {
        return Err(format!(
            "clusters of {:?} blocks do not tile the grid {:?}",
            dims.cluster, dims.grid
        ));
    }
    if u64::from(cx) * u64::from(cy) * u64::from(cz) > 8 {
        return Err(format!(
            "clusters of {:?} blocks: more than 8 blocks in a cluster",
            dims.cluster
        ));
    }
    Ok(())
}

impl LaunchDims {
    /// `blocks` blocks of `threads` threads in x, no dynamic shared memory.
    pub fn linear(blocks: u32, threads: u32) -> Self {
        Self {
            grid: (blocks, 1, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
            cluster: (1, 1, 1),
        }
    }
}

/// One kernel argument: a buffer's address (from a [`DeviceVec`], borrowed for as long as the
/// argument lives, mutably for outputs) or a scalar. The scalar's type must be the kernel
/// parameter's: a launch checks sizes (and on HIP pointer vs value), not types.
#[derive(Debug, Clone, Copy)]
pub struct KernelArg<'a> {
    value: ArgValue,
    borrow: PhantomData<&'a ()>,
}

#[derive(Debug, Clone, Copy)]
enum ArgValue {
    /// An address and the backend its memory belongs to (`None`: the null pointer, valid
    /// everywhere).
    Pointer {
        address: u64,
        backend: Option<&'static str>,
    },
    U32(u32),
    I32(i32),
    U64(u64),
    F32(f32),
    /// A plain struct passed by value: where its bytes are (borrowed for the argument's
    /// lifetime) and how many.
    Struct {
        data: *const c_void,
        size: usize,
    },
}

impl<'a> KernelArg<'a> {
    fn pointer<T>(buffer: &DeviceVec<T>, element_offset: usize) -> Self {
        let address = buffer.argument_address() + (element_offset * size_of::<T>()) as u64;
        Self::from_value(ArgValue::Pointer {
            address,
            backend: Some(buffer.backend_name()),
        })
    }

    fn from_value(value: ArgValue) -> Self {
        Self {
            value,
            borrow: PhantomData,
        }
    }

    /// A buffer the kernel reads.
    pub fn input<T>(buffer: &'a DeviceVec<T>) -> Self {
        Self::pointer(buffer, 0)
    }

    /// A buffer the kernel writes (borrowed mutably, so no other argument of the launch can
    /// be the same buffer).
    pub fn output<T>(buffer: &'a mut DeviceVec<T>) -> Self {
        Self::pointer(buffer, 0)
    }

    /// The elements `range` of a buffer the kernel reads (the address of `range.start`).
    ///
    /// # Errors
    /// [`Error::Invalid`] when `range` is not within the buffer.
    pub fn input_range<T>(buffer: &'a DeviceVec<T>, range: Range<usize>) -> Result<Self> {
        check_range(buffer, &range)?;
        Ok(Self::pointer(buffer, range.start))
    }

    /// The elements `range` of a buffer the kernel writes.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `range` is not within the buffer.
    pub fn output_range<T>(buffer: &'a mut DeviceVec<T>, range: Range<usize>) -> Result<Self> {
        check_range(buffer, &range)?;
        Ok(Self::pointer(buffer, range.start))
    }

    /// A buffer the kernel reads when present, the null pointer when not.
    pub fn optional_input<T>(buffer: Option<&'a DeviceVec<T>>) -> Self {
        match buffer {
            Some(buffer) => Self::input(buffer),
            None => Self::from_value(ArgValue::Pointer {
                address: 0,
                backend: None,
            }),
        }
    }

    /// A buffer the kernel writes when present, the null pointer when not.
    pub fn optional_output<T>(buffer: Option<&'a mut DeviceVec<T>>) -> Self {
        match buffer {
            Some(buffer) => Self::output(buffer),
            None => Self::from_value(ArgValue::Pointer {
                address: 0,
                backend: None,
            }),
        }
    }

    /// A `uint32_t` / `unsigned` parameter.
    pub fn u32(value: u32) -> Self {
        Self::from_value(ArgValue::U32(value))
    }

    /// An `int32_t` / `int` parameter.
    pub fn i32(value: i32) -> Self {
        Self::from_value(ArgValue::I32(value))
    }

    /// A `uint64_t` / `unsigned long long` parameter.
    pub fn u64(value: u64) -> Self {
        Self::from_value(ArgValue::U64(value))
    }

    /// A `float` parameter.
    pub fn f32(value: f32) -> Self {
        Self::from_value(ArgValue::F32(value))
    }

    /// A struct parameter passed by value (`value` laid out as the kernel declares the struct:
    /// `#[repr(C)]`, same fields and padding); the launch copies its bytes.
    pub fn by_value<T: DeviceRepr>(value: &'a T) -> Self {
        Self::from_value(ArgValue::Struct {
            data: std::ptr::from_ref(value).cast(),
            size: size_of::<T>(),
        })
    }

    /// Bytes the kernel parameter occupies.
    pub fn size(&self) -> usize {
        match self.value {
            ArgValue::Pointer { .. } | ArgValue::U64(_) => 8,
            ArgValue::U32(_) | ArgValue::I32(_) | ArgValue::F32(_) => 4,
            ArgValue::Struct { size, .. } => size,
        }
    }

    /// Whether it is a buffer address (or the null pointer).
    pub fn is_pointer(&self) -> bool {
        matches!(self.value, ArgValue::Pointer { .. })
    }

    /// What it is, for messages: `a device pointer (cuda)`, `a u32 (7)`, ...
    pub fn describe(&self) -> String {
        match self.value {
            ArgValue::Pointer { backend: None, .. } => "a null pointer".into(),
            ArgValue::Pointer {
                backend: Some(b), ..
            } => format!("a pointer to {b} memory"),
            ArgValue::U32(v) => format!("a u32 ({v})"),
            ArgValue::I32(v) => format!("an i32 ({v})"),
            ArgValue::U64(v) => format!("a u64 ({v})"),
            ArgValue::F32(v) => format!("an f32 ({v})"),
            ArgValue::Struct { size, .. } => format!("a {size}-byte struct"),
        }
    }

    /// Where the parameter's value lives, for the launch's parameter array (valid while
    /// `self` is).
    pub(crate) fn value_ptr(&self) -> *mut c_void {
        match &self.value {
            ArgValue::Pointer { address, .. } => std::ptr::from_ref(address).cast_mut().cast(),
            ArgValue::U32(v) => std::ptr::from_ref(v).cast_mut().cast(),
            ArgValue::I32(v) => std::ptr::from_ref(v).cast_mut().cast(),
            ArgValue::U64(v) => std::ptr::from_ref(v).cast_mut().cast(),
            ArgValue::F32(v) => std::ptr::from_ref(v).cast_mut().cast(),
            ArgValue::Struct { data, .. } => data.cast_mut(),
        }
    }
}

fn check_range<T>(buffer: &DeviceVec<T>, range: &Range<usize>) -> Result<()> {
    if range.start > range.end || range.end > buffer.len() {
        return Err(Error::invalid(
            "kernel argument range",
            format!(
                "{}..{} is not within a buffer of {} elements",
                range.start,
                range.end,
                buffer.len()
            ),
        ));
    }
    Ok(())
}

/// Every buffer argument belongs to `backend` (or is null).
///
/// # Errors
/// [`Error::BackendMismatch`] naming the first argument that does not.
pub(crate) fn check_arg_backends(
    backend: &'static str,
    kernel: &str,
    args: &[KernelArg<'_>],
) -> Result<()> {
    for (i, arg) in args.iter().enumerate() {
        if let ArgValue::Pointer {
            backend: Some(found),
            ..
        } = arg.value
        {
            if found != backend {
                return Err(Error::BackendMismatch {
                    what: format!("argument {i} of kernel `{kernel}`"),
                    expected: backend,
                    found,
                });
            }
        }
    }
    Ok(())
}

/// Checks `args` against a kernel's parameter sizes in bytes (as CUDA's driver reports them).
///
/// # Errors
/// A sentence naming the kernel and the first mismatch.
pub(crate) fn check_arg_sizes(
    kernel: &str,
    sizes: &[usize],
    args: &[KernelArg<'_>],
) -> std::result::Result<(), String> {
    if sizes.len() != args.len() {
        return Err(format!(
            "kernel `{kernel}` takes {} arguments, the launch passes {}",
            sizes.len(),
            args.len()
        ));
    }
    for (i, (&size, arg)) in sizes.iter().zip(args).enumerate() {
        if size != arg.size() {
            return Err(format!(
                "kernel `{kernel}` argument {i}: the kernel takes {size} bytes, the launch passes \
                 {} ({} bytes)",
                arg.describe(),
                arg.size()
            ));
        }
    }
    Ok(())
}

/// A recorded point in a backend's queue, for timing.
pub enum DeviceEvent {
    /// The CPU backend's wall clock.
    Host(Instant),
    /// A CUDA event.
    Cuda(cudarc::driver::CudaEvent),
    /// A HIP event.
    Hip(hip::HipEvent),
}

impl DeviceEvent {
    /// Milliseconds from `self` to `end` (waits for `end` to pass).
    ///
    /// # Errors
    /// [`Error::Invalid`] for events of two backends, [`Error::Cuda`] / [`Error::Hip`] when
    /// the device cannot time them.
    pub fn elapsed_ms(&self, end: &DeviceEvent) -> Result<f32> {
        match (self, end) {
            (Self::Host(start), Self::Host(end)) => {
                Ok(end.saturating_duration_since(*start).as_secs_f32() * 1e3)
            }
            (Self::Cuda(start), Self::Cuda(end)) => start
                .elapsed_ms(end)
                .map_err(|e| Error::cuda("time two events", e)),
            (Self::Hip(start), Self::Hip(end)) => start.elapsed_ms(end),
            _ => Err(Error::invalid(
                "timing events",
                "the two events belong to different backends",
            )),
        }
    }
}

/// Resources one compiled kernel uses, as the compiler reported them.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KernelResources {
    /// Kernel (entry point) name.
    pub kernel: String,
    /// Registers per thread (NVIDIA) or VGPRs (AMD).
    pub registers: Option<u32>,
    /// Scalar registers (AMD SGPRs).
    pub scalar_registers: Option<u32>,
    /// Bytes spilled to local memory / scratch (stores on NVIDIA; VGPR+SGPR spills on AMD count
    /// registers, reported here as bytes at 4 bytes each).
    pub spill_bytes: Option<u32>,
    /// Stack frame (NVIDIA) or scratch per lane (AMD), bytes.
    pub stack_bytes: Option<u32>,
    /// Static shared memory (LDS), bytes.
    pub shared_bytes: Option<u32>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The filter admits everything until asked; recording notes each kind once in order of
    /// first appearance; a left-out kind (kernel and blocks) is refused, others of the same
    /// kernel are not.
    #[test]
    fn the_launch_filter_notes_kinds_and_leaves_out_only_the_one_asked() {
        let filter = LaunchFilter::default();
        let dims = |x: u32, y: u32| LaunchDims {
            grid: (x, y, 1),
            block: (32, 1, 1),
            shared_bytes: 0,
            cluster: (1, 1, 1),
        };
        assert!(filter.admits("gemm", &dims(386, 1)));
        assert!(filter.state().seen.is_empty(), "noted while idle");
        filter.update(|s| s.record = true);
        for (kernel, x, y) in [
            ("gemm", 386, 1),
            ("norm", 1, 1),
            ("gemm", 128, 3),
            ("gemm", 386, 1),
        ] {
            assert!(filter.admits(kernel, &dims(x, y)));
        }
        let seen: Vec<(String, usize)> = filter
            .state()
            .seen
            .iter()
            .map(|t| (t.class.to_string(), t.launches))
            .collect();
        let want = [("gemm@386", 2), ("norm@1", 1), ("gemm@384", 1)];
        assert_eq!(seen, want.map(|(k, n)| (k.to_string(), n)));
        filter.update(|s| {
            s.record = false;
            s.skip = Some(LaunchClass {
                kernel: "gemm",
                blocks: 384,
            });
        });
        assert!(!filter.admits("gemm", &dims(128, 3)));
        assert!(filter.admits("gemm", &dims(386, 1)));
        assert!(filter.admits("norm", &dims(1, 1)));
        filter.update(|s| s.skip = None);
        assert!(filter.admits("gemm", &dims(128, 3)));
        let launches: usize = filter.state().seen.iter().map(|t| t.launches).sum();
        assert_eq!(launches, 4, "nothing counted while not recording");
    }

    #[test]
    fn each_argument_points_at_its_own_value_of_its_own_size() {
        let buffer = DeviceVec::Host(vec![1.0f32, 2.0, 3.0]);
        let args = [
            KernelArg::u32(7),
            KernelArg::i32(-5),
            KernelArg::u64(1 << 40),
            KernelArg::f32(0.5),
            KernelArg::input(&buffer),
            KernelArg::input_range(&buffer, 2..3).expect("in range"),
            KernelArg::optional_input::<f32>(None),
            KernelArg::optional_output::<f32>(None),
        ];
        let sizes: Vec<usize> = args.iter().map(KernelArg::size).collect();
        assert_eq!(sizes, [4, 4, 8, 4, 8, 8, 8, 8]);
        // SAFETY: each pointer is read as the type its constructor stored, while `args` lives.
        unsafe {
            assert_eq!(*args[0].value_ptr().cast::<u32>(), 7);
            assert_eq!(*args[1].value_ptr().cast::<i32>(), -5);
            assert_eq!(*args[2].value_ptr().cast::<u64>(), 1 << 40);
            assert_eq!(*args[3].value_ptr().cast::<f32>(), 0.5);
            let base = *args[4].value_ptr().cast::<u64>();
            let DeviceVec::Host(values) = &buffer else {
                unreachable!()
            };
            assert_eq!(base, values.as_ptr() as u64);
            assert_eq!(*args[5].value_ptr().cast::<u64>(), base + 8);
            assert_eq!(*args[6].value_ptr().cast::<u64>(), 0);
            assert_eq!(*args[7].value_ptr().cast::<u64>(), 0);
        }
        assert!(args[4].is_pointer() && args[6].is_pointer() && !args[2].is_pointer());
        let mut written = DeviceVec::Host(vec![0.0f32; 2]);
        let address = written.argument_address();
        let out = KernelArg::optional_output(Some(&mut written));
        // SAFETY: a pointer argument stores a u64 address.
        assert_eq!(unsafe { *out.value_ptr().cast::<u64>() }, address);

        let record = 0x0123_4567_89ab_cdefu64;
        let by_value = KernelArg::by_value(&record);
        assert_eq!(by_value.size(), 8);
        assert!(!by_value.is_pointer());
        assert_eq!(by_value.describe(), "a 8-byte struct");
        assert_eq!(
            by_value.value_ptr().cast_const(),
            std::ptr::from_ref(&record).cast()
        );
    }

    #[test]
    fn ranges_buffers_and_sizes_are_checked_with_names() {
        let mut buffer = DeviceVec::Host(vec![0u8; 4]);
        assert!(KernelArg::input_range(&buffer, 4..4).is_ok());
        let e = KernelArg::input_range(&buffer, 2..5).unwrap_err();
        assert!(
            e.to_string().contains("2..5") && e.to_string().contains("4 elements"),
            "{e}"
        );
        let reversed = Range { start: 3, end: 2 };
        assert!(KernelArg::output_range(&mut buffer, reversed).is_err());

        let args = [KernelArg::u32(1), KernelArg::input(&buffer)];
        match check_arg_backends("cuda", "k", &args) {
            Err(Error::BackendMismatch {
                what,
                expected: "cuda",
                found: "cpu",
            }) => assert!(what.contains("argument 1 of kernel `k`"), "{what}"),
            other => panic!("expected a mismatch, got {other:?}"),
        }
        let null = [KernelArg::optional_input::<u8>(None)];
        assert!(check_arg_backends("hip", "k", &null).is_ok());

        assert_eq!(check_arg_sizes("k", &[4, 8], &args), Ok(()));
        let e = check_arg_sizes("k", &[8, 8], &args).unwrap_err();
        assert!(e.contains("argument 0") && e.contains("u32"), "{e}");
        let e = check_arg_sizes("k", &[4], &args).unwrap_err();
        assert!(e.contains("takes 1 arguments, the launch passes 2"), "{e}");
    }

    #[test]
    fn the_cpu_backend_launches_nothing_copies_and_times() {
        let dims = LaunchDims::linear(1, 32);
        // SAFETY: refused before anything runs.
        let e = unsafe { Backend::Cpu.launch("dequant", "dequant_nvfp4_bf16", &dims, &[]) }
            .unwrap_err();
        assert!(e.to_string().contains("CPU backend"), "{e}");
        let too_many = vec![KernelArg::u32(0); MAX_KERNEL_ARGS + 1];
        // SAFETY: refused before anything runs.
        let e = unsafe { Backend::Cpu.launch("f", "k", &dims, &too_many) }.unwrap_err();
        assert!(
            e.to_string()
                .contains(&format!("at most {MAX_KERNEL_ARGS}")),
            "{e}"
        );

        let backend = Backend::Cpu;
        assert!(backend.target().is_none() && backend.multiprocessors().is_none());
        let src = backend.upload(&[1u16, 2, 3]).expect("upload");
        let mut dst = backend.zeros::<u16>(3).expect("zeros");
        let start = backend.record_event().expect("event");
        backend.copy(&src, &mut dst).expect("copy");
        let end = backend.record_event().expect("event");
        assert_eq!(backend.download(&dst).expect("download"), [1, 2, 3]);
        assert!(start.elapsed_ms(&end).expect("elapsed") >= 0.0);
        let mut short = backend.zeros::<u16>(2).expect("zeros");
        assert!(backend.copy(&src, &mut short).is_err());
        backend.write(&mut dst, 1, &[7, 8]).expect("write");
        assert_eq!(backend.read(&dst, 1..3).expect("read"), [7, 8]);
        let e = backend.write(&mut dst, 2, &[7, 8]).unwrap_err();
        assert!(e.to_string().contains("2..4"), "{e}");
        assert!(backend.read(&dst, 0..4).is_err());
        backend.fill_zeros(&mut dst).expect("zero");
        assert_eq!(backend.download(&dst).expect("download"), [0, 0, 0]);
        assert_eq!(src.device_address(), None);
    }
}
