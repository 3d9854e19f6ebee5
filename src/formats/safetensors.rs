//! Safetensors checkpoints: a single file or a sharded folder (`model.safetensors.index.json`),
//! memory-mapped, every shard's header validated at open, every tensor checked for dtype and
//! shape against what the caller expects. Shard names in an index must stay inside the folder.

use crate::error::{Error, Result};
use memmap2::Mmap;
use safetensors::Dtype;
use safetensors::tensor::{Metadata, SafeTensors};
use std::collections::HashMap;
use std::fs::File;
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

    /// The elements as f32, from F32, BF16 or F16 storage.
    ///
    /// # Errors
    /// [`Error::Dtype`] for any other dtype.
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        self.expect_dtype(&[Dtype::F32, Dtype::BF16, Dtype::F16])?;
        Ok(match self.dtype {
            Dtype::F32 => self
                .data
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect(),
            Dtype::BF16 => self
                .data
                .chunks_exact(2)
                .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
            _ => self
                .data
                .chunks_exact(2)
                .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
                .collect(),
        })
    }

    fn shape_error(&self, expected: &str) -> Error {
        Error::Shape {
            tensor: self.name.to_string(),
            file: self.file.to_path_buf(),
            expected: expected.to_string(),
            found: self.shape.to_vec(),
        }
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
                file: path.clone(),
                reason: describe_safetensors_error(&e, map.len()),
            })?;
        Ok(Self {
            path,
            map,
            header_len,
            metadata,
        })
    }
}

fn describe_safetensors_error(e: &safetensors::SafeTensorError, file_len: usize) -> String {
    use safetensors::SafeTensorError as E;
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
        other => other.to_string(),
    }
}

/// `root/name` when `name` is a plain relative path that stays inside `root` (also after
/// following symbolic links), else why not.
fn contained_shard_path(root: &Path, name: &str) -> std::result::Result<PathBuf, String> {
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
