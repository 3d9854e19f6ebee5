//! Targets and their facts, read from `kernels/targets.toml` (the same file `build.rs` renders
//! the kernels with).

mod facts;

pub use facts::{
    AttentionTiles, DequantTiles, GDN_STEP_MAX_TOKENS, GdnTiles, GemmTiles, Instructions, MoeTiles,
    NormTiles, STREAM_GROUP_BYTES, TargetFacts, Vendor, VerifyTiles, WGMMA_OPERAND_BYTES,
    wgmma_shared_bytes,
};

use crate::error::{Error, Result};
use std::sync::LazyLock;

static TARGETS_TOML: &str = include_str!("../../kernels/targets.toml");

static TABLE: LazyLock<facts::TargetTable> = LazyLock::new(|| {
    // build.rs parsed and validated this very text; failing here would be a build defect.
    facts::TargetTable::parse(TARGETS_TOML).expect("kernels/targets.toml was validated by build.rs")
});

/// Every target, in the order of `kernels/targets.toml`.
pub fn all() -> &'static [TargetFacts] {
    &TABLE.target
}

/// The target called `name`.
///
/// # Errors
/// [`Error::UnknownTarget`] when `kernels/targets.toml` has no such target.
pub fn by_name(name: &str) -> Result<&'static TargetFacts> {
    all()
        .iter()
        .find(|t| t.name == name)
        .ok_or_else(|| Error::UnknownTarget {
            name: name.to_string(),
            known: known_names(),
        })
}

/// The NVIDIA target for a device of compute capability `major.minor`.
///
/// # Errors
/// [`Error::UnknownTarget`] when no target has that compute capability.
pub fn for_compute_capability(major: u32, minor: u32) -> Result<&'static TargetFacts> {
    all()
        .iter()
        .find(|t| t.compute_capability == Some([major, minor]))
        .ok_or_else(|| Error::UnknownTarget {
            name: format!("compute capability {major}.{minor}"),
            known: known_names(),
        })
}

fn known_names() -> String {
    all()
        .iter()
        .map(|t| t.name.as_str())
        .collect::<Vec<_>>()
        .join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A stream ring, or staged X, that cannot fit in a block's shared memory is refused when the
    /// table is read, naming the target, not at the first launch on a device.
    #[test]
    fn stream_shared_memory_that_does_not_fit_is_refused() {
        for (field, value) in [
            ("stream_stages = 4", "stream_stages = 64"),
            ("stream_max_x_bytes = 69632", "stream_max_x_bytes = 232448"),
            ("stream_chunk_groups = 2", "stream_chunk_groups = 9"),
        ] {
            assert!(TARGETS_TOML.contains(field), "{field}");
            let err = facts::TargetTable::parse(&TARGETS_TOML.replacen(field, value, 1))
                .err()
                .unwrap_or_else(|| panic!("{value} was accepted"));
            assert!(err.contains("sm_90a") && err.contains("stream"), "{err}");
        }
    }

    /// The X-ring GEMM blocks must hold whole tiles: a warp count that the largest warps per
    /// tile does not divide, none, or more than 1024 threads is refused when the table is read.
    #[test]
    fn x_shared_blocks_that_split_a_tile_are_refused() {
        let warps = "mma_x_shared_warps_per_block = 12"; // sm_90a, the first target
        assert!(TARGETS_TOML.contains(warps));
        for w in [0, 5, 40] {
            let value = format!("mma_x_shared_warps_per_block = {w}");
            let err = facts::TargetTable::parse(&TARGETS_TOML.replacen(warps, &value, 1))
                .err()
                .unwrap_or_else(|| panic!("{value} was accepted"));
            assert!(
                err.contains("sm_90a") && err.contains("mma_x_shared"),
                "{err}"
            );
        }
    }

    /// Counts and sizes made of several entries are worked out without wrapping: entries whose
    /// products are multiples of 2^32 (zero in 32 bits) are refused, not accepted after the
    /// overflow (nor a panic of the build script, a debug build).
    #[test]
    fn entries_whose_products_wrap_32_bits_are_refused() {
        for (field, value, table) in [
            // 2^27 warps of 32 threads
            (
                "warps_per_block = 4\nblocks_per_sm = 3",
                "warps_per_block = 134217728\nblocks_per_sm = 3",
                "moe",
            ),
            (
                "combine_warps_per_block = 8",
                "combine_warps_per_block = 134217728",
                "combine_warps_per_block",
            ),
            // 2^21 slots x 2 warps x 9216 bytes = 9 x 2^32
            (
                "mma_x_shared_slots = 3",
                "mma_x_shared_slots = 2097152",
                "mma_x_shared",
            ),
        ] {
            assert!(TARGETS_TOML.contains(field), "{field}");
            let err = facts::TargetTable::parse(&TARGETS_TOML.replacen(field, value, 1))
                .err()
                .unwrap_or_else(|| panic!("{value} was accepted"));
            assert!(err.contains("sm_90a") && err.contains(table), "{err}");
        }
    }
}
