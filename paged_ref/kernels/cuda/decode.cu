// The CUDA decode kernels as one translation unit, so that each build (build.py: one per
// STAGES, WARPS_PER_HEAD and SMALL_BLOCKS a plan asks for) is one cubin holding every entry
// point: fp8_decode_*, int4_decode_*, int4_decode_tma_* (sm_90+) and merge_chunks_*.
#include "fp8_decode.cu"
#include "int4_decode.cu"
#include "int4_tma_decode.cu"
#include "merge.cu"
