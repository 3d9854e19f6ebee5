//! The MessagePack subset AMDGPU code-object metadata uses (the `NT_AMDGPU_METADATA` note of
//! code object v3 and later): maps, arrays, strings, integers, floats, booleans and nil. Binary
//! blobs and extension types are read and kept as bytes so a newer compiler's additions do not
//! stop the reader.

use std::fmt;

/// One decoded value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// `nil`.
    Nil,
    /// `true` / `false`.
    Bool(bool),
    /// Any integer that fits an `i128` (every MessagePack integer does).
    Int(i128),
    /// `float 32` or `float 64`.
    Float(f64),
    /// A UTF-8 string (invalid UTF-8 is replaced, metadata strings are ASCII).
    Str(String),
    /// `bin` or `ext` payload.
    Bytes(Vec<u8>),
    /// An array.
    Array(Vec<Value>),
    /// A map, in the order written.
    Map(Vec<(Value, Value)>),
}

/// Why a buffer is not MessagePack.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DecodeError {
    /// Byte offset where decoding stopped.
    pub offset: usize,
    /// What was wrong there.
    pub reason: &'static str,
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "MessagePack at byte {}: {}", self.offset, self.reason)
    }
}

/// Nesting deeper than this is rejected (the metadata nests four levels).
const MAX_DEPTH: usize = 64;

/// Decodes one value from the start of `bytes`; trailing bytes are an error.
///
/// # Errors
/// [`DecodeError`] on truncation, an unused marker byte (0xc1), nesting deeper than 64 levels,
/// or bytes left over.
pub fn decode(bytes: &[u8]) -> Result<Value, DecodeError> {
    let mut reader = Reader { bytes, at: 0 };
    let value = reader.value(0)?;
    if reader.at != bytes.len() {
        return Err(reader.error("bytes after the value"));
    }
    Ok(value)
}

impl Value {
    /// The value under string key `key`, when `self` is a map that has it.
    pub fn get(&self, key: &str) -> Option<&Value> {
        match self {
            Value::Map(entries) => entries
                .iter()
                .find(|(k, _)| matches!(k, Value::Str(s) if s == key))
                .map(|(_, v)| v),
            _ => None,
        }
    }

    /// The string, when `self` is one.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::Str(s) => Some(s),
            _ => None,
        }
    }

    /// The integer as a `u64`, when `self` is a non-negative integer that fits.
    pub fn as_u64(&self) -> Option<u64> {
        match self {
            Value::Int(n) => u64::try_from(*n).ok(),
            _ => None,
        }
    }

    /// The elements, when `self` is an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(items) => Some(items),
            _ => None,
        }
    }

    /// The boolean, when `self` is one.
    pub fn as_bool(&self) -> Option<bool> {
        match self {
            Value::Bool(b) => Some(*b),
            _ => None,
        }
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn error(&self, reason: &'static str) -> DecodeError {
        DecodeError {
            offset: self.at,
            reason,
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|&end| end <= self.bytes.len())
            .ok_or_else(|| self.error("truncated"))?;
        let out = &self.bytes[self.at..end];
        self.at = end;
        Ok(out)
    }

    fn uint(&mut self, n: usize) -> Result<u64, DecodeError> {
        Ok(self
            .take(n)?
            .iter()
            .fold(0u64, |acc, &b| (acc << 8) | u64::from(b)))
    }

    fn sint(&mut self, n: usize) -> Result<i64, DecodeError> {
        let raw = self.uint(n)?;
        let shift = 64 - 8 * n as u32;
        Ok(((raw << shift) as i64) >> shift)
    }

    fn len(&mut self, n: usize) -> Result<usize, DecodeError> {
        let len = self.uint(n)?;
        usize::try_from(len).map_err(|_| self.error("length exceeds the address space"))
    }

    fn string(&mut self, len: usize) -> Result<Value, DecodeError> {
        Ok(Value::Str(
            String::from_utf8_lossy(self.take(len)?).into_owned(),
        ))
    }

    fn bytes_value(&mut self, len: usize) -> Result<Value, DecodeError> {
        Ok(Value::Bytes(self.take(len)?.to_vec()))
    }

    fn ext(&mut self, len: usize) -> Result<Value, DecodeError> {
        self.take(1)?; // the extension type
        self.bytes_value(len)
    }

    fn array(&mut self, len: usize, depth: usize) -> Result<Value, DecodeError> {
        // each element takes at least one byte: a length beyond the buffer is a lie
        if len > self.bytes.len() - self.at {
            return Err(self.error("array longer than the buffer"));
        }
        let mut items = Vec::with_capacity(len);
        for _ in 0..len {
            items.push(self.value(depth + 1)?);
        }
        Ok(Value::Array(items))
    }

    fn map(&mut self, len: usize, depth: usize) -> Result<Value, DecodeError> {
        if len > (self.bytes.len() - self.at) / 2 {
            return Err(self.error("map longer than the buffer"));
        }
        let mut entries = Vec::with_capacity(len);
        for _ in 0..len {
            let key = self.value(depth + 1)?;
            let value = self.value(depth + 1)?;
            entries.push((key, value));
        }
        Ok(Value::Map(entries))
    }

    fn value(&mut self, depth: usize) -> Result<Value, DecodeError> {
        if depth > MAX_DEPTH {
            return Err(self.error("nested too deeply"));
        }
        let marker = self.take(1)?[0];
        match marker {
            0x00..=0x7f => Ok(Value::Int(i128::from(marker))),
            0x80..=0x8f => self.map(usize::from(marker & 0x0f), depth),
            0x90..=0x9f => self.array(usize::from(marker & 0x0f), depth),
            0xa0..=0xbf => self.string(usize::from(marker & 0x1f)),
            0xc0 => Ok(Value::Nil),
            0xc1 => Err(DecodeError {
                offset: self.at - 1,
                reason: "marker 0xc1 is never used",
            }),
            0xc2 => Ok(Value::Bool(false)),
            0xc3 => Ok(Value::Bool(true)),
            0xc4..=0xc6 => {
                let len = self.len(1 << (marker - 0xc4))?;
                self.bytes_value(len)
            }
            0xc7..=0xc9 => {
                let len = self.len(1 << (marker - 0xc7))?;
                self.ext(len)
            }
            0xca => Ok(Value::Float(f64::from(
                f32::from_bits(self.uint(4)? as u32),
            ))),
            0xcb => Ok(Value::Float(f64::from_bits(self.uint(8)?))),
            0xcc..=0xcf => Ok(Value::Int(i128::from(self.uint(1 << (marker - 0xcc))?))),
            0xd0..=0xd3 => Ok(Value::Int(i128::from(self.sint(1 << (marker - 0xd0))?))),
            0xd4..=0xd8 => self.ext(1 << (marker - 0xd4)),
            0xd9..=0xdb => {
                let len = self.len(1 << (marker - 0xd9))?;
                self.string(len)
            }
            0xdc | 0xdd => {
                let len = self.len(2 << (marker - 0xdc))?;
                self.array(len, depth)
            }
            0xde | 0xdf => {
                let len = self.len(2 << (marker - 0xde))?;
                self.map(len, depth)
            }
            0xe0..=0xff => Ok(Value::Int(i128::from(marker as i8))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn decodes_every_marker_family() {
        // {"a": [1, -1, 300, -300, 70000, true, nil, 1.5], "b": "xyz", "c": bin[2]}
        let bytes = [
            0x83, 0xa1, b'a', 0x98, 0x01, 0xff, 0xcd, 0x01, 0x2c, 0xd1, 0xfe, 0xd4, 0xce, 0x00,
            0x01, 0x11, 0x70, 0xc3, 0xc0, 0xcb, 0x3f, 0xf8, 0, 0, 0, 0, 0, 0, 0xa1, b'b', 0xd9,
            0x03, b'x', b'y', b'z', 0xa1, b'c', 0xc4, 0x02, 0xde, 0xad,
        ];
        let v = decode(&bytes).expect("valid");
        let a = v.get("a").and_then(Value::as_array).expect("array a");
        assert_eq!(
            a,
            [
                Value::Int(1),
                Value::Int(-1),
                Value::Int(300),
                Value::Int(-300),
                Value::Int(70000),
                Value::Bool(true),
                Value::Nil,
                Value::Float(1.5),
            ]
        );
        assert_eq!(v.get("b").and_then(Value::as_str), Some("xyz"));
        assert_eq!(v.get("c"), Some(&Value::Bytes(vec![0xde, 0xad])));
        assert_eq!(v.get("d"), None);
    }

    #[test]
    fn rejects_truncation_lies_and_leftovers() {
        assert_eq!(decode(&[0xa3, b'x']).unwrap_err().reason, "truncated");
        assert_eq!(
            decode(&[0xdd, 0xff, 0xff, 0xff, 0xff]).unwrap_err().reason,
            "array longer than the buffer"
        );
        assert_eq!(decode(&[0xc1]).unwrap_err().offset, 0);
        assert_eq!(
            decode(&[0x01, 0x02]).unwrap_err().reason,
            "bytes after the value"
        );
        let deep = vec![0x91; MAX_DEPTH + 2];
        assert_eq!(decode(&deep).unwrap_err().reason, "nested too deeply");
    }
}
