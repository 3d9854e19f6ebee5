//! Safetensors checkpoints: a single file or a sharded folder (`model.safetensors.index.json`),
//! memory-mapped, every shard's header validated at open, every tensor checked for dtype and
//! shape against what the caller expects. Shard names in an index must stay inside the folder.
//!
//! Beside the reader: [`TensorHeaders`] (tensors known by their headers alone, from an opened
//! [`Checkpoint`] or a [`HeaderCatalog`] built by hand), [`read_shard_header`] (one shard's header
//! without its data, with every structural problem listed rather than the first refused), and
//! [`ShardWriter`] (a shard written tensor by tensor, in pieces, with a header the safetensors
//! crate validated).

use crate::error::{Error, Result};
use memmap2::Mmap;
use safetensors::Dtype;
use safetensors::tensor::TensorInfo;
use safetensors::tensor::{Metadata, SafeTensors};
use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::ops::Range;
use std::path::{Component, Path, PathBuf};

/// Name of the shard index in a sharded checkpoint folder.
pub const INDEX_FILE: &str = "model.safetensors.index.json";
/// Name of the single file in an unsharded checkpoint folder.
pub const SINGLE_FILE: &str = "model.safetensors";

struct Shard {
    path: PathBuf,
    map: Mmap,
    header_len: usize,
    metadata: Metadata,
}

/// An opened checkpoint: shards mapped, headers parsed and checked, tensor -> shard resolved.
pub struct Checkpoint {
    location: PathBuf,
    shards: Vec<Shard>,
    tensor_shard: HashMap<String, usize>,
    sharded: bool,
}

/// One tensor of a checkpoint, borrowed from the mapped shard.
#[derive(Debug, Clone, Copy)]
pub struct TensorRef<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Shard holding it.
    pub file: &'a Path,
    /// Element type as stored.
    pub dtype: Dtype,
    /// Shape as stored.
    pub shape: &'a [usize],
    /// The raw little-endian bytes (not necessarily aligned).
    pub data: &'a [u8],
}

impl Checkpoint {
    /// Opens `path`: a `.safetensors` file, or a folder holding `model.safetensors.index.json`
    /// (sharded) or `model.safetensors`.
    ///
    /// # Errors
    /// [`Error::Io`] for unreadable files, [`Error::Safetensors`] for a malformed or truncated
    /// shard, [`Error::Checkpoint`] for a folder with neither file, a malformed index, a shard
    /// name that escapes the folder, or an index entry whose tensor is not in its shard.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let meta = std::fs::metadata(path).map_err(|e| Error::io(path, e))?;
        if meta.is_file() {
            let shard = Shard::open(path.to_path_buf())?;
            let tensor_shard = shard
                .metadata
                .tensors()
                .into_keys()
                .map(|name| (name, 0))
                .collect();
            return Ok(Self {
                location: path.to_path_buf(),
                shards: vec![shard],
                tensor_shard,
                sharded: false,
            });
        }
        let index = path.join(INDEX_FILE);
        if index.is_file() {
            return Self::open_sharded(path, &index);
        }
        let single = path.join(SINGLE_FILE);
        if single.is_file() {
            let mut checkpoint = Self::open(&single)?;
            checkpoint.location = path.to_path_buf();
            return Ok(checkpoint);
        }
        Err(Error::Checkpoint {
            path: path.to_path_buf(),
            reason: format!("neither {INDEX_FILE} nor {SINGLE_FILE} is in this folder"),
        })
    }

    fn open_sharded(dir: &Path, index: &Path) -> Result<Self> {
        let bad = |reason: String| Error::Checkpoint {
            path: index.to_path_buf(),
            reason,
        };
        let text = std::fs::read_to_string(index).map_err(|e| Error::io(index, e))?;
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not valid JSON: {e}")))?;
        let weight_map = json
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| bad("has no `weight_map` object".into()))?;
        let root = dir.canonicalize().map_err(|e| Error::io(dir, e))?;
        let mut shard_ids: HashMap<String, usize> = HashMap::new();
        let mut shards = Vec::new();
        let mut tensor_shard = HashMap::new();
        let mut names: Vec<&String> = weight_map.keys().collect();
        names.sort(); // stable error messages and shard order
        for tensor in names {
            let shard_name = weight_map[tensor]
                .as_str()
                .ok_or_else(|| bad(format!("weight_map[`{tensor}`] is not a string")))?;
            let id = match shard_ids.get(shard_name) {
                Some(&id) => id,
                None => {
                    let shard_path = contained_shard_path(&root, shard_name).map_err(|reason| {
                        bad(format!(
                            "shard `{shard_name}` of tensor `{tensor}`: {reason}"
                        ))
                    })?;
                    shards.push(Shard::open(shard_path)?);
                    shard_ids.insert(shard_name.to_string(), shards.len() - 1);
                    shards.len() - 1
                }
            };
            if shards[id].metadata.info(tensor).is_none() {
                return Err(bad(format!(
                    "lists tensor `{tensor}` in {}, which does not contain it",
                    shards[id].path.display()
                )));
            }
            tensor_shard.insert(tensor.clone(), id);
        }
        Ok(Self {
            location: dir.to_path_buf(),
            shards,
            tensor_shard,
            sharded: true,
        })
    }

    /// The file or folder this checkpoint was opened from.
    pub fn location(&self) -> &Path {
        &self.location
    }

    /// Whether the checkpoint has a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.tensor_shard.contains_key(name)
    }

    /// Whether the checkpoint was opened from a shard index (else from a single file).
    pub fn is_sharded(&self) -> bool {
        self.sharded
    }

    /// Every shard in index order (sorted tensor names decide it), with the tensors the
    /// checkpoint resolves to it in the order of their data in the file. A tensor a shard holds
    /// but the index does not list is not included.
    pub fn shards(&self) -> Vec<(&Path, Vec<&str>)> {
        self.shards
            .iter()
            .enumerate()
            .map(|(id, shard)| {
                let mut names: Vec<(&str, usize)> = self
                    .tensor_shard
                    .iter()
                    .filter(|&(_, &s)| s == id)
                    .filter_map(|(name, _)| {
                        let info = shard.metadata.info(name)?;
                        Some((name.as_str(), info.data_offsets.0))
                    })
                    .collect();
                names.sort_by_key(|&(name, start)| (start, name));
                (
                    shard.path.as_path(),
                    names.into_iter().map(|(name, _)| name).collect(),
                )
            })
            .collect()
    }

    /// Every tensor name, sorted.
    pub fn tensor_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.tensor_shard.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    /// The tensor called `name`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when there is none.
    pub fn tensor(&self, name: &str) -> Result<TensorRef<'_>> {
        let (stored_name, &id) =
            self.tensor_shard
                .get_key_value(name)
                .ok_or_else(|| Error::MissingTensor {
                    tensor: name.to_string(),
                    checkpoint: self.location.clone(),
                })?;
        let shard = &self.shards[id];
        // `tensor_shard` only holds names present in their shard's header (checked at open).
        let info = shard
            .metadata
            .info(name)
            .ok_or_else(|| Error::MissingTensor {
                tensor: name.to_string(),
                checkpoint: shard.path.clone(),
            })?;
        let start = 8 + shard.header_len + info.data_offsets.0;
        let end = 8 + shard.header_len + info.data_offsets.1;
        Ok(TensorRef {
            name: stored_name,
            file: &shard.path,
            dtype: info.dtype,
            shape: &info.shape,
            data: &shard.map[start..end],
        })
    }

    /// The tensor `name` after checking it has one of `dtypes` and exactly `shape`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::Dtype`], [`Error::Shape`].
    pub fn expect(&self, name: &str, dtypes: &[Dtype], shape: &[usize]) -> Result<TensorRef<'_>> {
        let tensor = self.tensor(name)?;
        tensor.expect_dtype(dtypes)?;
        tensor.expect_shape(shape)?;
        Ok(tensor)
    }

    /// A scalar F32 tensor (shape `[]` or `[1]`), as ModelOpt stores global scales.
    ///
    /// # Errors
    /// [`Error::MissingTensor`], [`Error::Dtype`], [`Error::Shape`].
    pub fn scalar_f32(&self, name: &str) -> Result<f32> {
        let tensor = self.tensor(name)?;
        tensor.expect_dtype(&[Dtype::F32])?;
        if tensor.shape.iter().product::<usize>() != 1 || tensor.shape.len() > 1 {
            return Err(tensor.shape_error("a scalar ([] or [1])"));
        }
        let bytes: [u8; 4] = tensor
            .data
            .try_into()
            .map_err(|_| tensor.shape_error("4 bytes of f32"))?;
        Ok(f32::from_le_bytes(bytes))
    }
}

impl<'a> TensorRef<'a> {
    /// The header part of this tensor (name, file, dtype, shape).
    pub fn header(&self) -> TensorHeader<'a> {
        TensorHeader {
            name: self.name,
            file: self.file,
            dtype: self.dtype,
            shape: self.shape,
        }
    }

    /// Checks the dtype is one of `dtypes`.
    ///
    /// # Errors
    /// [`Error::Dtype`] naming the tensor and file.
    pub fn expect_dtype(&self, dtypes: &[Dtype]) -> Result<()> {
        self.header().expect_dtype(dtypes)
    }

    /// Checks the shape is exactly `shape`.
    ///
    /// # Errors
    /// [`Error::Shape`] naming the tensor and file.
    pub fn expect_shape(&self, shape: &[usize]) -> Result<()> {
        self.header().expect_shape(shape)
    }

    /// Checks the tensor has rank `R` and returns its dimensions.
    ///
    /// # Errors
    /// [`Error::Shape`] naming the tensor and file.
    pub fn expect_rank<const R: usize>(&self) -> Result<[usize; R]> {
        self.header().expect_rank::<R>()
    }

    /// Number of elements (the product of the shape; 1 for a scalar).
    pub fn elements(&self) -> usize {
        self.shape.iter().product()
    }

    /// The elements as f32, from F32, BF16 or F16 storage.
    ///
    /// # Errors
    /// [`Error::Dtype`] for any other dtype.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        self.to_f32_range(0..self.elements())
    }

    /// Elements `range` (row-major element indices) as f32, from F32, BF16 or F16 storage:
    /// how a tensor larger than memory should be read, a piece at a time.
    ///
    /// # Errors
    /// [`Error::Dtype`] for any other dtype, [`Error::Invalid`] for a range past the end.
    pub fn to_f32_range(&self, range: Range<usize>) -> Result<Vec<f32>> {
        self.expect_dtype(&[Dtype::F32, Dtype::BF16, Dtype::F16])?;
        let width = self.dtype.bitsize() / 8;
        if range.start > range.end || range.end * width > self.data.len() {
            return Err(Error::invalid(
                format!("tensor `{}` in {}", self.name, self.file.display()),
                format!(
                    "elements {range:?} asked for, it has {}",
                    self.data.len() / width
                ),
            ));
        }
        let bytes = &self.data[range.start * width..range.end * width];
        Ok(match self.dtype {
            Dtype::F32 => bytes
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => bytes
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        })
    }

    fn shape_error(&self, expected: &str) -> Error {
        self.header().shape_error(expected)
    }
}

impl Shard {
    fn open(path: PathBuf) -> Result<Self> {
        let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
        // SAFETY: the map is read-only; a checkpoint modified while mapped is outside our contract
        // (as for every engine that maps weights).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(&path, e))?;
        let (header_len, metadata) =
            SafeTensors::read_metadata(&map).map_err(|e| Error::Safetensors {
                reason: describe_safetensors_error(&e, map.len(), &path),
                file: path.clone(),
            })?;
        Ok(Self {
            path,
            map,
            header_len,
            metadata,
        })
    }
}

/// What the safetensors crate refused in the shard at `path`, in words: its own text names no
/// tensor, so for the other errors the shard's header is read again ([`read_shard_header`]) and
/// its first problem, which names the tensor, is reported beside it.
fn describe_safetensors_error(
    e: &safetensors::SafeTensorError,
    file_len: usize,
    path: &Path,
) -> String {
    use safetensors::SafeTensorError as E;
    let first_problem = || {
        read_shard_header(path)
            .ok()
            .and_then(|h| h.problems.into_iter().next())
            .map(|p| match p.tensor {
                Some(tensor) => format!("tensor `{tensor}`: {}", p.message),
                None => p.message,
            })
    };
    match e {
        E::HeaderTooSmall => format!("{file_len} bytes, shorter than the 8-byte header length"),
        E::InvalidHeaderLength => {
            format!(
                "the header length runs past the end of the file ({file_len} bytes): truncated?"
            )
        }
        E::MetadataIncompleteBuffer => format!(
            "the tensors' data offsets do not end at the end of the file ({file_len} bytes): truncated or padded"
        ),
        other => match first_problem() {
            Some(problem) => format!("{other}: {problem}"),
            None => other.to_string(),
        },
    }
}

/// `root/name` when `name` is a plain relative path that stays inside `root` (also after
/// following symbolic links), else why not.
pub(crate) fn contained_shard_path(
    root: &Path,
    name: &str,
) -> std::result::Result<PathBuf, String> {
    let relative = Path::new(name);
    if name.is_empty()
        || !relative
            .components()
            .all(|c| matches!(c, Component::Normal(_)))
    {
        return Err("shard names must be plain file names inside the checkpoint folder (no `..`, no absolute paths)".into());
    }
    let joined = root.join(relative);
    let resolved = joined
        .canonicalize()
        .map_err(|e| format!("{}: {e}", joined.display()))?;
    if !resolved.starts_with(root) {
        return Err(format!(
            "resolves to {}, outside the checkpoint folder",
            resolved.display()
        ));
    }
    Ok(resolved)
}

// ---- Tensors known by their headers alone ----

/// What a shard header says about one tensor: no data.
#[derive(Debug, Clone, Copy)]
pub struct TensorHeader<'a> {
    /// Tensor name.
    pub name: &'a str,
    /// Shard holding it.
    pub file: &'a Path,
    /// Element type as stored.
    pub dtype: Dtype,
    /// Shape as stored.
    pub shape: &'a [usize],
}

impl TensorHeader<'_> {
    /// Checks the dtype is one of `dtypes`.
    ///
    /// # Errors
    /// [`Error::Dtype`] naming the tensor and file.
    pub fn expect_dtype(&self, dtypes: &[Dtype]) -> Result<()> {
        if dtypes.contains(&self.dtype) {
            return Ok(());
        }
        Err(Error::Dtype {
            tensor: self.name.to_string(),
            file: self.file.to_path_buf(),
            expected: dtypes
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(" or "),
            found: self.dtype.to_string(),
        })
    }

    /// Checks the shape is exactly `shape`.
    ///
    /// # Errors
    /// [`Error::Shape`] naming the tensor and file.
    pub fn expect_shape(&self, shape: &[usize]) -> Result<()> {
        if self.shape == shape {
            return Ok(());
        }
        Err(self.shape_error(&format!("{shape:?}")))
    }

    /// Checks the tensor has rank `R` and returns its dimensions.
    ///
    /// # Errors
    /// [`Error::Shape`] naming the tensor and file.
    pub fn expect_rank<const R: usize>(&self) -> Result<[usize; R]> {
        self.shape
            .try_into()
            .map_err(|_| self.shape_error(&format!("rank {R}")))
    }

    /// Checks the tensor is an F32 scalar, shape `[]` or `[1]`, as NVFP4 global scales are
    /// stored.
    ///
    /// # Errors
    /// [`Error::Dtype`] or [`Error::Shape`] naming the tensor and file.
    pub fn expect_f32_scalar(&self) -> Result<()> {
        self.expect_dtype(&[Dtype::F32])?;
        if self.shape.len() > 1 || self.shape.iter().product::<usize>() != 1 {
            return Err(self.shape_error("a scalar ([] or [1])"));
        }
        Ok(())
    }

    /// Bytes of data the header implies (elements x dtype width); `u64::MAX` where that product
    /// overflows (possible only in a header read without the safetensors checks, which
    /// `fp4spec doctor` reports as such).
    pub fn bytes(&self) -> u64 {
        self.shape
            .iter()
            .try_fold(self.dtype.bitsize() as u64, |bits, &d| {
                bits.checked_mul(d as u64)
            })
            .map_or(u64::MAX, |bits| bits / 8)
    }

    /// An [`Error::Shape`] for this tensor.
    pub fn shape_error(&self, expected: &str) -> Error {
        Error::Shape {
            tensor: self.name.to_string(),
            file: self.file.to_path_buf(),
            expected: expected.to_string(),
            found: self.shape.to_vec(),
        }
    }
}

/// Tensors known by name from their headers: an opened [`Checkpoint`], or a [`HeaderCatalog`]
/// (what `doctor` read from shard headers it could parse). The tensor check of
/// `model::weights` reads only this.
pub trait TensorHeaders {
    /// The checkpoint folder or file, for messages.
    fn location(&self) -> &Path;

    /// The header of tensor `name`, if there is one.
    fn header(&self, name: &str) -> Option<TensorHeader<'_>>;

    /// Every tensor name, sorted.
    fn names(&self) -> Vec<&str>;

    /// Whether there is a tensor called `name`.
    fn contains(&self, name: &str) -> bool {
        self.header(name).is_some()
    }

    /// The header of tensor `name`.
    ///
    /// # Errors
    /// [`Error::MissingTensor`] when there is none.
    fn expect_header(&self, name: &str) -> Result<TensorHeader<'_>> {
        self.header(name).ok_or_else(|| Error::MissingTensor {
            tensor: name.to_string(),
            checkpoint: self.location().to_path_buf(),
        })
    }
}

impl TensorHeaders for Checkpoint {
    fn location(&self) -> &Path {
        &self.location
    }

    fn header(&self, name: &str) -> Option<TensorHeader<'_>> {
        let (stored_name, &id) = self.tensor_shard.get_key_value(name)?;
        let shard = &self.shards[id];
        let info = shard.metadata.info(name)?;
        Some(TensorHeader {
            name: stored_name,
            file: &shard.path,
            dtype: info.dtype,
            shape: &info.shape,
        })
    }

    fn names(&self) -> Vec<&str> {
        self.tensor_names()
    }
}

/// Tensor headers gathered by hand: from shards read with [`read_shard_header`], or one
/// checkpoint's tensors with another's added (what a graft would produce).
#[derive(Debug, Clone, Default)]
pub struct HeaderCatalog {
    location: PathBuf,
    files: Vec<PathBuf>,
    tensors: BTreeMap<String, (usize, Dtype, Vec<usize>)>,
}

impl HeaderCatalog {
    /// An empty catalogue; `location` names it in messages.
    pub fn new(location: impl Into<PathBuf>) -> Self {
        Self {
            location: location.into(),
            ..Self::default()
        }
    }

    /// Every tensor of `source`.
    pub fn from_headers(source: &dyn TensorHeaders) -> Self {
        let mut catalog = Self::new(source.location());
        for name in source.names() {
            if let Some(h) = source.header(name) {
                catalog.insert(name, h.file, h.dtype, h.shape.to_vec());
            }
        }
        catalog
    }

    /// Adds (or replaces) tensor `name`, stored in `file`.
    pub fn insert(&mut self, name: &str, file: &Path, dtype: Dtype, shape: Vec<usize>) {
        let id = match self.files.iter().position(|f| f == file) {
            Some(id) => id,
            None => {
                self.files.push(file.to_path_buf());
                self.files.len() - 1
            }
        };
        self.tensors.insert(name.to_string(), (id, dtype, shape));
    }

    /// Number of tensors.
    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    /// Whether there are no tensors.
    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }
}

impl TensorHeaders for HeaderCatalog {
    fn location(&self) -> &Path {
        &self.location
    }

    fn header(&self, name: &str) -> Option<TensorHeader<'_>> {
        let (stored_name, (id, dtype, shape)) = self.tensors.get_key_value(name)?;
        Some(TensorHeader {
            name: stored_name,
            file: &self.files[*id],
            dtype: *dtype,
            shape,
        })
    }

    fn names(&self) -> Vec<&str> {
        self.tensors.keys().map(String::as_str).collect()
    }
}

// ---- One shard's header, read without its data, every problem listed ----

/// Largest header the safetensors crate accepts (100 MB).
const MAX_HEADER_BYTES: u64 = 100_000_000;

/// What is structurally wrong with a shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HeaderProblemKind {
    /// The file is shorter than 8 bytes, or the header length runs past its end.
    HeaderPastEnd,
    /// The header is not UTF-8 JSON of the safetensors form, or an entry is malformed.
    HeaderInvalid,
    /// A tensor's data offsets are reversed or run past the end of the file.
    OutOfBounds,
    /// Two tensors' data overlap.
    Overlap,
    /// Bytes between two tensors (or before the first) that belong to none.
    Gap,
    /// A tensor's byte span disagrees with its dtype and shape.
    SizeMismatch,
    /// Bytes after the last tensor.
    TrailingBytes,
}

impl HeaderProblemKind {
    /// Stable code, as `fp4spec doctor` prints it.
    pub fn code(self) -> &'static str {
        match self {
            Self::HeaderPastEnd => "shard-header-past-end",
            Self::HeaderInvalid => "shard-header-invalid",
            Self::OutOfBounds => "shard-offsets-out-of-bounds",
            Self::Overlap => "shard-offsets-overlap",
            Self::Gap => "shard-offsets-gap",
            Self::SizeMismatch => "shard-tensor-size",
            Self::TrailingBytes => "shard-trailing-bytes",
        }
    }
}

/// One structural problem of a shard.
#[derive(Debug, Clone, PartialEq)]
pub struct HeaderProblem {
    /// What kind.
    pub kind: HeaderProblemKind,
    /// The tensor it concerns, if one.
    pub tensor: Option<String>,
    /// What is wrong, with the numbers.
    pub message: String,
}

/// A shard's header as read from the file (the data is not read).
#[derive(Debug, Clone)]
pub struct ShardHeader {
    /// The shard.
    pub path: PathBuf,
    /// File size, bytes.
    pub file_len: u64,
    /// The header's JSON length, bytes (the 8-byte length prefix excluded).
    pub header_len: u64,
    /// Every tensor entry that parsed, sorted by data offsets.
    pub tensors: Vec<(String, TensorInfo)>,
    /// Everything structurally wrong: empty for a shard [`Checkpoint::open`] accepts.
    pub problems: Vec<HeaderProblem>,
}

/// Reads the header of the shard at `path` (not its data) and lists every structural problem:
/// a header length past the end of the file, malformed JSON or entries, offsets reversed, out of
/// bounds, overlapping, with gaps or trailing bytes, spans that disagree with dtype x shape.
///
/// # Errors
/// [`Error::Io`] only: the file cannot be opened or read. Problems of its content are in
/// [`ShardHeader::problems`].
pub fn read_shard_header(path: &Path) -> Result<ShardHeader> {
    let mut file = File::open(path).map_err(|e| Error::io(path, e))?;
    let file_len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut header = ShardHeader {
        path: path.to_path_buf(),
        file_len,
        header_len: 0,
        tensors: Vec::new(),
        problems: Vec::new(),
    };
    let problem = |kind, tensor: Option<&str>, message: String| HeaderProblem {
        kind,
        tensor: tensor.map(str::to_string),
        message,
    };
    if file_len < 8 {
        header.problems.push(problem(
            HeaderProblemKind::HeaderPastEnd,
            None,
            format!("{file_len} bytes, shorter than the 8-byte header length"),
        ));
        return Ok(header);
    }
    let mut prefix = [0u8; 8];
    file.read_exact(&mut prefix)
        .map_err(|e| Error::io(path, e))?;
    let n = u64::from_le_bytes(prefix);
    header.header_len = n;
    if n > file_len - 8 {
        header.problems.push(problem(
            HeaderProblemKind::HeaderPastEnd,
            None,
            format!(
                "the header length {n} runs past the end of the file ({file_len} bytes): truncated?"
            ),
        ));
        return Ok(header);
    }
    if n > MAX_HEADER_BYTES {
        header.problems.push(problem(
            HeaderProblemKind::HeaderInvalid,
            None,
            format!("a header of {n} bytes is over the safetensors limit of {MAX_HEADER_BYTES}"),
        ));
        return Ok(header);
    }
    let mut text = vec![0u8; n as usize];
    file.read_exact(&mut text).map_err(|e| Error::io(path, e))?;
    let entries: serde_json::Map<String, serde_json::Value> = match std::str::from_utf8(&text)
        .map_err(|e| e.to_string())
        .and_then(|t| serde_json::from_str(t).map_err(|e| e.to_string()))
    {
        Ok(entries) => entries,
        Err(e) => {
            header.problems.push(problem(
                HeaderProblemKind::HeaderInvalid,
                None,
                format!("the header is not a JSON object of tensor entries: {e}"),
            ));
            return Ok(header);
        }
    };
    for (name, value) in entries {
        if name == "__metadata__" {
            let strings = value
                .as_object()
                .is_some_and(|m| m.values().all(serde_json::Value::is_string));
            if !strings {
                header.problems.push(problem(
                    HeaderProblemKind::HeaderInvalid,
                    None,
                    "`__metadata__` must map strings to strings".into(),
                ));
            }
            continue;
        }
        match serde_json::from_value::<TensorInfo>(value) {
            Ok(info) => header.tensors.push((name, info)),
            Err(e) => header.problems.push(problem(
                HeaderProblemKind::HeaderInvalid,
                Some(&name),
                format!("entry is not {{dtype, shape, data_offsets}}: {e}"),
            )),
        }
    }
    header
        .tensors
        .sort_by(|a, b| (a.1.data_offsets, &a.0).cmp(&(b.1.data_offsets, &b.0)));
    let data_len = file_len - 8 - n;
    let mut cursor: u64 = 0;
    let mut previous: Option<&str> = None;
    for (name, info) in &header.tensors {
        let (start, end) = (info.data_offsets.0 as u64, info.data_offsets.1 as u64);
        if end < start {
            header.problems.push(problem(
                HeaderProblemKind::OutOfBounds,
                Some(name),
                format!("data_offsets [{start}, {end}] end before they start"),
            ));
            continue;
        }
        if end > data_len {
            header.problems.push(problem(
                HeaderProblemKind::OutOfBounds,
                Some(name),
                format!(
                    "data_offsets [{start}, {end}] run past the end of the data section ({data_len} bytes)"
                ),
            ));
        }
        let needed = info
            .shape
            .iter()
            .try_fold(info.dtype.bitsize() as u64, |acc, &d| {
                acc.checked_mul(d as u64)
            })
            .map(|bits| (bits / 8, bits % 8 == 0));
        match needed {
            Some((bytes, true)) if bytes == end - start => {}
            Some((bytes, _)) => header.problems.push(problem(
                HeaderProblemKind::SizeMismatch,
                Some(name),
                format!(
                    "data_offsets span {} bytes, but {} {:?} needs {bytes}",
                    end - start,
                    info.dtype,
                    info.shape
                ),
            )),
            None => header.problems.push(problem(
                HeaderProblemKind::SizeMismatch,
                Some(name),
                format!("shape {:?} overflows a byte count", info.shape),
            )),
        }
        if start < cursor {
            header.problems.push(problem(
                HeaderProblemKind::Overlap,
                Some(name),
                format!(
                    "data [{start}, {end}) overlaps `{}` (which ends at {cursor})",
                    previous.unwrap_or("?")
                ),
            ));
        } else if start > cursor {
            header.problems.push(problem(
                HeaderProblemKind::Gap,
                Some(name),
                format!(
                    "data starts at {start}, {} bytes after the previous tensor ends",
                    start - cursor
                ),
            ));
        }
        if end >= cursor {
            cursor = end;
            previous = Some(name);
        }
    }
    if cursor < data_len {
        header.problems.push(problem(
            HeaderProblemKind::TrailingBytes,
            None,
            format!(
                "{} bytes after the last tensor's data (data section {data_len} bytes)",
                data_len - cursor
            ),
        ));
    }
    Ok(header)
}

// ---- Writing a shard ----

/// One tensor of a shard about to be written: its bytes follow in plan order.
#[derive(Debug, Clone, PartialEq)]
pub struct PlannedTensor {
    /// Tensor name.
    pub name: String,
    /// Element type.
    pub dtype: Dtype,
    /// Shape.
    pub shape: Vec<usize>,
}

impl PlannedTensor {
    /// A planned tensor.
    pub fn new(name: impl Into<String>, dtype: Dtype, shape: Vec<usize>) -> Self {
        Self {
            name: name.into(),
            dtype,
            shape,
        }
    }

    /// Bytes of its data.
    ///
    /// # Errors
    /// [`Error::Invalid`] when the shape overflows or the bits are not whole bytes.
    pub fn bytes(&self) -> Result<usize> {
        let bits = self
            .shape
            .iter()
            .try_fold(self.dtype.bitsize(), |acc, &d| acc.checked_mul(d));
        match bits {
            Some(bits) if bits % 8 == 0 => Ok(bits / 8),
            _ => Err(Error::invalid(
                format!("tensor `{}`", self.name),
                format!(
                    "{} {:?} is not a whole number of bytes",
                    self.dtype, self.shape
                ),
            )),
        }
    }
}

/// A safetensors shard written in one pass: the header (built and validated by the safetensors
/// crate from the plan) first, then each tensor's bytes in plan order, in as many pieces as the
/// caller likes, so a tensor never has to be in memory whole. [`ShardWriter::finish`] checks
/// that every byte was written and syncs the file. The file must not exist beforehand.
pub struct ShardWriter {
    path: PathBuf,
    out: BufWriter<File>,
    tensors: Vec<(String, usize)>,
    current: usize,
    written: usize,
    total: u64,
}

impl ShardWriter {
    /// Creates `path` and writes the header for `tensors` (in that order) with optional
    /// `__metadata__`.
    ///
    /// # Errors
    /// [`Error::Invalid`] for a duplicate name or a shape that is not whole bytes,
    /// [`Error::Safetensors`] when the crate rejects the header, [`Error::Io`] when the file
    /// exists or cannot be written.
    pub fn create(
        path: impl Into<PathBuf>,
        tensors: &[PlannedTensor],
        metadata: Option<HashMap<String, String>>,
    ) -> Result<Self> {
        let path = path.into();
        let mut seen = std::collections::HashSet::new();
        let mut infos = Vec::with_capacity(tensors.len());
        let mut sizes = Vec::with_capacity(tensors.len());
        let mut offset = 0usize;
        for t in tensors {
            if !seen.insert(t.name.as_str()) {
                return Err(Error::invalid(
                    format!("shard {}", path.display()),
                    format!("tensor `{}` is planned twice", t.name),
                ));
            }
            let bytes = t.bytes()?;
            infos.push((
                t.name.clone(),
                TensorInfo {
                    dtype: t.dtype,
                    shape: t.shape.clone(),
                    data_offsets: (offset, offset + bytes),
                },
            ));
            sizes.push((t.name.clone(), bytes));
            offset += bytes;
        }
        let header = Metadata::new(metadata, infos).map_err(|e| Error::Safetensors {
            file: path.clone(),
            reason: e.to_string(),
        })?;
        let mut json = serde_json::to_vec(&header).map_err(|e| Error::Safetensors {
            file: path.clone(),
            reason: e.to_string(),
        })?;
        // the data starts 8-byte aligned, as the safetensors crate writes it
        json.resize(json.len().next_multiple_of(8), b' ');
        let file = File::create_new(&path).map_err(|e| Error::io(&path, e))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        out.write_all(&(json.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&json))
            .map_err(|e| Error::io(&path, e))?;
        Ok(Self {
            total: 8 + json.len() as u64 + offset as u64,
            path,
            out,
            tensors: sizes,
            current: 0,
            written: 0,
        })
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Appends `bytes` to tensor `name`: the tensor being written, or the next one in the plan
    /// once the current one is complete.
    ///
    /// # Errors
    /// [`Error::Invalid`] when `name` is out of plan order or `bytes` overruns it, [`Error::Io`].
    pub fn write(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        while self
            .tensors
            .get(self.current)
            .is_some_and(|(_, size)| self.written == *size && name != self.tensors[self.current].0)
        {
            self.current += 1;
            self.written = 0;
        }
        let Some((expected, size)) = self.tensors.get(self.current) else {
            return Err(Error::invalid(
                format!("shard {}", self.path.display()),
                format!("tensor `{name}` written after the planned tensors are complete"),
            ));
        };
        if expected != name {
            return Err(Error::invalid(
                format!("shard {}", self.path.display()),
                format!(
                    "tensor `{name}` written while `{expected}` has {} of {size} bytes",
                    self.written
                ),
            ));
        }
        if self.written + bytes.len() > *size {
            return Err(Error::invalid(
                format!("shard {}", self.path.display()),
                format!(
                    "tensor `{name}`: {} more bytes would overrun its {size}",
                    bytes.len()
                ),
            ));
        }
        self.out
            .write_all(bytes)
            .map_err(|e| Error::io(&self.path, e))?;
        self.written += bytes.len();
        Ok(())
    }

    /// Checks every planned byte was written, flushes and syncs the file; returns its size.
    ///
    /// # Errors
    /// [`Error::Invalid`] naming the first incomplete tensor, [`Error::Io`].
    pub fn finish(mut self) -> Result<u64> {
        while self
            .tensors
            .get(self.current)
            .is_some_and(|(_, size)| self.written == *size)
        {
            self.current += 1;
            self.written = 0;
        }
        if let Some((name, size)) = self.tensors.get(self.current) {
            return Err(Error::invalid(
                format!("shard {}", self.path.display()),
                format!(
                    "tensor `{name}` has {} of its {size} bytes at finish",
                    self.written
                ),
            ));
        }
        let file = self
            .out
            .into_inner()
            .map_err(|e| Error::io(&self.path, e.into_error()))?;
        file.sync_all().map_err(|e| Error::io(&self.path, e))?;
        Ok(self.total)
    }
}
