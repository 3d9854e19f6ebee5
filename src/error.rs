//! The crate's error type. Every variant names what was wrong: the tensor, file, field, shape,
//! kernel or target.

use std::path::PathBuf;

/// Everything that can go wrong in fp4spec.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// A file could not be opened, read, mapped or written.
    #[error("{path}: {source}")]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// What the operating system said.
        source: std::io::Error,
    },

    /// A safetensors file is malformed (header, offsets, truncation).
    #[error("{file}: not a valid safetensors file: {reason}")]
    Safetensors {
        /// The shard.
        file: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A checkpoint folder or its shard index is malformed (missing files, escaping paths).
    #[error("{path}: {reason}")]
    Checkpoint {
        /// The folder or index file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },

    /// A tensor the caller needs is not in the checkpoint.
    #[error("tensor `{tensor}` is missing from {checkpoint}")]
    MissingTensor {
        /// Tensor name.
        tensor: String,
        /// The checkpoint (file or folder).
        checkpoint: PathBuf,
    },

    /// A tensor has another dtype than the caller expects.
    #[error("tensor `{tensor}` in {file}: dtype {found}, expected {expected}")]
    Dtype {
        /// Tensor name.
        tensor: String,
        /// Shard holding it.
        file: PathBuf,
        /// What the caller accepts.
        expected: String,
        /// What the file says.
        found: String,
    },

    /// A tensor has another shape than the caller expects.
    #[error("tensor `{tensor}` in {file}: shape {found:?}, expected {expected}")]
    Shape {
        /// Tensor name.
        tensor: String,
        /// Shard holding it.
        file: PathBuf,
        /// What the caller accepts.
        expected: String,
        /// What the file says.
        found: Vec<usize>,
    },

    /// A value is out of its domain: NaN or Inf in a weight, a NaN scale, a K that is not a
    /// multiple of 16, a buffer of the wrong length handed to a kernel.
    #[error("{what}: {reason}")]
    Invalid {
        /// The tensor, argument or field.
        what: String,
        /// Why it is rejected.
        reason: String,
    },

    /// The CUDA backend cannot start: no driver library, no device, no CUDA headers, or a
    /// device this crate has no target for.
    #[error("CUDA backend unavailable: {0}")]
    CudaUnavailable(String),

    /// A CUDA driver call failed.
    #[error("CUDA: {op}: {source}")]
    Cuda {
        /// The operation, naming the kernel or buffer involved.
        op: String,
        /// The driver's error.
        source: cudarc::driver::DriverError,
    },

    /// The HIP backend cannot start: a build without the `hip` feature, no HIP runtime library,
    /// a runtime of another HIP version than the bindings, no device, or a device this crate
    /// has no target for.
    #[error("HIP backend unavailable: {0}")]
    HipUnavailable(String),

    /// A HIP runtime call failed.
    #[error("HIP: {op}: {name} ({code}): {message}")]
    Hip {
        /// The operation, naming the kernel or buffer involved.
        op: String,
        /// The `hipError_t` value.
        code: u32,
        /// Its name (`hipErrorOutOfMemory`, ...).
        name: String,
        /// The runtime's description of it.
        message: String,
    },

    /// A cuBLAS call failed.
    #[error("cuBLAS: {op}: {source}")]
    Cublas {
        /// The operation and its shape.
        op: String,
        /// cuBLAS' error.
        source: cudarc::cublas::result::CublasError,
    },

    /// A kernel source did not compile.
    #[error("{compiler} could not compile family `{family}` for {target}:\n{log}")]
    Compile {
        /// NVRTC or clang.
        compiler: String,
        /// Target name.
        target: String,
        /// Kernel family.
        family: String,
        /// The compiler's log.
        log: String,
    },

    /// A target name, or a device, that `kernels/targets.toml` does not describe.
    #[error("unknown target `{name}` (known: {known})")]
    UnknownTarget {
        /// What was asked for.
        name: String,
        /// The targets of kernels/targets.toml.
        known: String,
    },

    /// Buffers from one backend handed to another.
    #[error("{what} lives on the {found} backend, but the call runs on {expected}")]
    BackendMismatch {
        /// The buffer.
        what: String,
        /// The backend running the call.
        expected: &'static str,
        /// Where the buffer lives.
        found: &'static str,
    },
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;

impl Error {
    /// The same error with `context` (what the caller was doing: the buffer, the kernel) put in
    /// front of the failed operation of a device call; other errors already name their subject.
    pub(crate) fn during(mut self, context: &str) -> Self {
        if let Error::Cuda { op, .. } | Error::Hip { op, .. } = &mut self {
            *op = format!("{context}: {op}");
        }
        self
    }

    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io {
            path: path.into(),
            source,
        }
    }

    pub(crate) fn invalid(what: impl Into<String>, reason: impl Into<String>) -> Self {
        Error::Invalid {
            what: what.into(),
            reason: reason.into(),
        }
    }

    pub(crate) fn cuda(op: impl Into<String>, source: cudarc::driver::DriverError) -> Self {
        Error::Cuda {
            op: op.into(),
            source,
        }
    }
}
