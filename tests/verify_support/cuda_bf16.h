// Stand-in for the CUDA header the rendered sources include: the emulation (cuda_emu.h,
// force-included before it) defines everything they use.
#pragma once
