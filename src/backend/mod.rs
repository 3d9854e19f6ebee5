//! Backends: where a kernel family's launch API runs.
//!
//! - `cpu`: runs each family's CPU reference (`src/kernels/<family>/reference.rs`).
//! - `cuda`: NVRTC-compiled kernels for the device's own target, through cudarc.
//! - `hip`: the gfx1151 compiler (code objects and resource reports); running them is the HIP
//!   backend issue's work.
//!
//! Kernel families take a [`Backend`] and [`DeviceVec`]s and never look at the target.

pub mod cuda;
pub mod hip;

use crate::error::{Error, Result};
use cudarc::driver::{CudaSlice, DeviceRepr, ValidAsZeroBits};
use std::sync::Arc;

/// Which backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendKind {
    /// CUDA when a driver and a device are present, else the CPU.
    #[default]
    Auto,
    /// The CPU references.
    Cpu,
    /// CUDA device 0; an error when unavailable.
    Cuda,
}

impl std::str::FromStr for BackendKind {
    type Err = Error;
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "cuda" => Ok(Self::Cuda),
            other => Err(Error::invalid(
                "backend",
                format!("`{other}` is not one of auto, cpu, cuda"),
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
}

impl Backend {
    /// Opens the backend `kind` asks for; `Auto` falls back to the CPU when CUDA is unavailable
    /// (use [`Backend::auto`] to learn why).
    ///
    /// # Errors
    /// With `Cuda`: [`Error::CudaUnavailable`] (no driver, no device, no headers, no target for
    /// the device) or [`Error::Cuda`].
    pub fn new(kind: BackendKind) -> Result<Self> {
        match kind {
            BackendKind::Cpu => Ok(Self::Cpu),
            BackendKind::Cuda => Ok(Self::Cuda(Arc::new(cuda::CudaBackend::new(0)?))),
            BackendKind::Auto => Ok(Self::auto().0),
        }
    }

    /// CUDA device 0 when it can be opened, else the CPU together with the reason CUDA was not
    /// used.
    pub fn auto() -> (Self, Option<String>) {
        match cuda::CudaBackend::new(0) {
            Ok(cuda) => (Self::Cuda(Arc::new(cuda)), None),
            Err(e) => (Self::Cpu, Some(e.to_string())),
        }
    }

    /// Short name: `cpu` or `cuda`.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Cpu => "cpu",
            Self::Cuda(_) => "cuda",
        }
    }

    /// A human-readable description (device name and target for CUDA).
    pub fn describe(&self) -> String {
        match self {
            Self::Cpu => "cpu (CPU references)".to_string(),
            Self::Cuda(c) => format!("cuda: {} ({})", c.device_name(), c.target().name),
        }
    }

    /// Copies `data` to the backend.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the allocation or copy fails.
    pub fn upload<T: DeviceRepr + Clone>(&self, data: &[T]) -> Result<DeviceVec<T>> {
        Ok(match self {
            Self::Cpu => DeviceVec::Host(data.to_vec()),
            Self::Cuda(c) => DeviceVec::Cuda(
                c.stream()
                    .clone_htod(data)
                    .map_err(|e| Error::cuda(format!("upload {} elements", data.len()), e))?,
            ),
        })
    }

    /// A zero-filled buffer of `len` elements.
    ///
    /// # Errors
    /// [`Error::Cuda`] when the allocation fails.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits + Clone + Default>(
        &self,
        len: usize,
    ) -> Result<DeviceVec<T>> {
        Ok(match self {
            Self::Cpu => DeviceVec::Host(vec![T::default(); len]),
            Self::Cuda(c) => DeviceVec::Cuda(
                c.stream()
                    .alloc_zeros(len)
                    .map_err(|e| Error::cuda(format!("allocate {len} elements"), e))?,
            ),
        })
    }

    /// Copies a buffer back to the host (waits for the work queued before it).
    ///
    /// # Errors
    /// [`Error::Cuda`] when the copy fails (this is also where an earlier kernel's fault shows),
    /// [`Error::BackendMismatch`] when the buffer is from another backend.
    pub fn download<T: DeviceRepr + Clone + Default>(&self, data: &DeviceVec<T>) -> Result<Vec<T>> {
        match (self, data) {
            (Self::Cpu, DeviceVec::Host(v)) => Ok(v.clone()),
            (Self::Cuda(c), DeviceVec::Cuda(s)) => c
                .stream()
                .clone_dtoh(s)
                .map_err(|e| Error::cuda(format!("download {} elements", s.len()), e)),
            _ => Err(self.mismatch("downloaded buffer", data)),
        }
    }

    /// Waits until all queued work is done.
    ///
    /// # Errors
    /// [`Error::Cuda`] carrying the first asynchronous fault.
    pub fn synchronize(&self) -> Result<()> {
        match self {
            Self::Cpu => Ok(()),
            Self::Cuda(c) => c.synchronize(),
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

/// A buffer on a backend: host memory for the CPU, device memory for CUDA.
pub enum DeviceVec<T> {
    /// CPU backend storage.
    Host(Vec<T>),
    /// CUDA device memory.
    Cuda(CudaSlice<T>),
}

impl<T> DeviceVec<T> {
    /// Number of elements.
    pub fn len(&self) -> usize {
        match self {
            Self::Host(v) => v.len(),
            Self::Cuda(s) => s.len(),
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
