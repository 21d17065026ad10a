// Default values of the compile-time knobs every drafter-attention kernel family takes (NVRTC
// -D options override them; kernels/cupy_backend.py's variant_defines lists them).
#pragma once
#ifndef HEAD_DIM
#define HEAD_DIM 128
#endif
#ifndef PAGE_SIZE
#define PAGE_SIZE 0  // 0: the arena layout
#endif
#ifndef TILE_N
#define TILE_N 64
#endif
#ifndef NUM_WARPS
#define NUM_WARPS 4
#endif
#ifndef STAGES
#define STAGES 3
#endif
#ifndef Q_SMEM
#define Q_SMEM 0
#endif
#ifndef WGMMA
#define WGMMA 0
#endif
#ifndef MIN_CTAS
#define MIN_CTAS 1  // __launch_bounds__ occupancy hint: >1 caps registers to fit that many CTAs
#endif
#ifndef OVERLAP
#define OVERLAP 0  // drafter_attention.cu, wgmma path: 1 or 2 pipelines the tiles
#endif
#ifndef TMA_LOADS
#define TMA_LOADS 0  // drafter_attention.cu, pipelined wgmma path: context tiles by bulk tensor
// copies (TMA; not `TMA`: CuTe has a namespace of that name)
#endif
#ifndef TRACE
#define TRACE 0  // the ws attention and the combine record when each CTA reaches its steps (trace.cuh)
#endif
