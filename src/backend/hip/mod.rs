//! The HIP side: compiling rendered gfx sources with clang (no ROCm needed). Loading and
//! launching the code objects on a Strix Halo device is the HIP backend's work (its own issue).

pub mod clang;
