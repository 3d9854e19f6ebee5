// Host emulation of the `attention` decode kernels for tests/attention_emulated.rs: the source
// rendered for an mma.sync target is compiled for the CPU with tests/gdn_emulator.cpp's
// portability layer, ldmatrix / mma.sync emulation and driver (one OS thread per GPU thread of a
// block, blocks one after another), tests/gemm_emulator.cpp's cp.async (copies at once), and the
// section below for the built-ins attention.cu uses that the gdn kernels do not. Sections start
// at `//@@ name` lines.

//@@ attention
// the driver runs grids of (x, y) blocks: the test launches one row (block z = 0) at a time
FP4_DEVICE u32 block_z() { return 0; }
FP4_DEVICE void block_barrier() { emu::block->arrive_and_wait(); }
FP4_DEVICE float exp2_f32(float v) { return std::exp2(v); }
