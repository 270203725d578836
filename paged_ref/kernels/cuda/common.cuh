// What every CUDA decode kernel of paged_ref shares: the build's three settings, the PTX
// helpers (FP8 conversions, mma.sync, cp.async, programmatic dependent launch), the launch
// argument struct Args (driver.py's _Args mirrors it field for field) and the swizzle of the
// shared-memory tiles. The kernels: fp8_decode.cu, int4_decode.cu, int4_tma_decode.cu and
// merge.cu, compiled as one translation unit (decode.cu) into one cubin per setting.
//
// Cache layout as everywhere in paged_ref: codes [num_blocks, block_size, Hkv, D] (bytes: one
// e4m3 code, or two INT4 codes), their scales (and INT4's zero points) per tensor or per
// token-head. Grid (Hkv / heads_per_cta, chunks, B): long sequences are cut into chunks
// (blockIdx.y); each chunk writes a normalised partial output and its log2-sum-exp, and
// merge.cu combines them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <stdint.h>

// The build's settings: build.py passes the ones a plan asks for (plans.py: why each).
#ifndef STAGES
#define STAGES 3  // tiles in a warp's shared-memory ring (STAGES - 1 in flight)
#endif
#ifndef WARPS_PER_HEAD
#define WARPS_PER_HEAD 1  // warps sharing one KV head's tiles of a chunk (merged at the end)
#endif
#ifndef SMALL_BLOCKS
#define SMALL_BLOCKS 0  // 0: blocks of >= 16 tokens, so a 16-token tile lies in one block (one
                        // table entry a tile, looked up ahead); 1: smaller blocks, a table entry
                        // per token row. plans.py compiles the one the cache's block size needs
#endif

// Fixed choices (measured on the H200; the probes that chose them live in commit 9ae93fd,
// tools/gpu/read_probe.py and cuda_fp8_probe.py):
#define MAX_WARPS 8   // per CTA: heads_per_cta * WARPS_PER_HEAD (a launch argument) <= this
#define MIN_BLOCKS 2  // __launch_bounds__'s CTAs (of MAX_WARPS warps) per SM: <= 128 registers
#define TILE 16
#define MAX_GROUP 8
#define FP8_L2_PREFETCH 0     // FP8's cp.async fetch no more than they copy: the L2 fetching
                              // whole 256-byte lines cost ~4 %
#define INT4_L2_PREFETCH 128  // INT4's: a head's row is half a 128-byte line, the other half its
                              // neighbour's; fetching the line whole is ~3 % faster
#define FULL 0xffffffffu
// Every (q dtype, head_dim) the entry points come in: X(name, type, head_dim) for each
#define EACH_DTYPE_AND_HEAD_DIM(X)                                    \
  X(f16, __half, 64) X(f16, __half, 128) X(f16, __half, 256)          \
  X(bf16, __nv_bfloat16, 64) X(bf16, __nv_bfloat16, 128) X(bf16, __nv_bfloat16, 256)

__device__ __forceinline__ uint32_t e4m3x2_to_f16x2(uint32_t two_codes) {
  // low byte -> low float16, next byte -> high float16 (of the word's low 16 bits)
  uint32_t r;
  asm("{.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, lo;}"
      : "=r"(r) : "r"(two_codes));
  return r;
}
__device__ __forceinline__ uint32_t e4m3x2_hi_to_f16x2(uint32_t two_codes) {
  // the same for the word's high 16 bits
  uint32_t r;
  asm("{.reg .b16 lo, hi;\n\tmov.b32 {lo, hi}, %1;\n\tcvt.rn.f16x2.e4m3x2 %0, hi;}"
      : "=r"(r) : "r"(two_codes));
  return r;
}

// a * b as a 64-bit product (one multiply; byte offsets past 2^31 in a large cache)
__device__ __forceinline__ long long mul_wide(int a, int b) {
  long long r;
  asm("mul.wide.s32 %0, %1, %2;" : "=l"(r) : "r"(a), "r"(b));
  return r;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel) {
  uint32_t r;
  asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
  return r;
}

__device__ __forceinline__ float fast_exp2(float x) {
  float r;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
  return r;
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&h);
}

// c += a (16x16, row) * b (16x8, col); float16 inputs, float32 accumulators.
__device__ __forceinline__ void mma_16816(float c[4], const uint32_t a[4], uint32_t b0,
                                          uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

template <int PREFETCH>
__device__ __forceinline__ void cp_async_16(void* smem, const void* global, bool valid) {
  // 16 bytes global -> shared without passing through registers; zeros when !valid.
  // PREFETCH 128: L2 fetches the whole 128-byte line around the address.
  static_assert(PREFETCH == 0 || PREFETCH == 128, "FP8_L2_PREFETCH, INT4_L2_PREFETCH");
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (PREFETCH == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst),
                 "l"(global), "r"(valid ? 16 : 0));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(global),
                 "r"(valid ? 16 : 0));
}
// The same to a shared-memory address worked out beforehand (INT4's Int4Copier): 16 bytes
// unmasked (the L2 fetching the whole 128-byte line), or 4 bytes (zeros when !valid).
__device__ __forceinline__ void cp_async_16_to(uint32_t dst, const void* global) {
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16;" ::"r"(dst), "l"(global));
}
__device__ __forceinline__ void cp_async_4_to(uint32_t dst, const void* global, bool valid) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(global),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_4(void* smem, const void* global, bool valid) {
  cp_async_4_to(static_cast<uint32_t>(__cvta_generic_to_shared(smem)), global, valid);
}
// Programmatic dependent launch (sm_90+; no-ops before): the decode kernel lets the merge
// kernel's launch begin as soon as all its CTAs are running; the merge waits for its data.
__device__ __forceinline__ void allow_dependent_launch() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;");
#endif
}
__device__ __forceinline__ void dependent_launch_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {  // all but the newest N groups have landed
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
}

// The dynamic shared memory a decode kernel's ring lives in: one symbol for the module,
// 1024-byte aligned for int4_decode_tma (the TMA unit's swizzle works in 1024-byte blocks; the
// per-warp rings need 128). (The merge has none: its __shared__ arrays are static.)
extern __shared__ __align__(1024) uint8_t smem[];

// A CUtensorMap (cuda.h): 128 opaque bytes, 64-byte aligned, that the driver's
// cuTensorMapEncodeTiled fills on the host and the TMA unit reads (int4_decode_tma).
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

struct Args {
  const void* q;              // [B, Hq, D] float16 / bfloat16
  const uint8_t* k;           // codes [num_blocks, block_size, Hkv, D] (e4m3, or INT4 D / 2)
  const uint8_t* v;
  const float* k_scale;       // [] or [num_blocks, block_size, Hkv]
  const float* v_scale;
  const int* block_tables;    // [B, max_blocks] int32
  const int* seq_lens;        // [B] int32
  void* out;                  // [B, Hq, D], q's dtype (one chunk)
  float* part_o;              // [B, Hq, max_chunks, D] float32 (several chunks)
  float* part_lse;            // [B, Hq, max_chunks]: log2 of the chunk's sum of exp2
  const void* k_zero;         // int4: float16 [num_blocks, block_size, Hkv, 2] (k_scale too)
  const void* v_zero;
  long long q_sb, q_sh;       // strides (elements)
  long long o_sb, o_sh;
  long long c_sb, c_st, c_sh; // cache strides (elements = bytes)
  long long s_sb, s_st, s_sh; // token-head scale strides (0 for a per-tensor scale)
  long long table_sb;
  int block_shift;            // log2(block_size): block sizes are powers of two here
  int group, chunk_len, max_chunks;
  int max_len;                // lengths are clamped to this (what the launch was planned for)
  int heads_per_cta;          // KV heads side by side in one CTA (blockDim = 32 * this * WARPS_PER_HEAD)
  float qk_scale_log2;        // softmax scale * log2(e)
  char _pad[44];              // (to byte 256: driver.py's _Args spells it out too)
  // int4_decode_tma only (driver.py encodes them): the K and V codes and the four
  // (scale, zero) tensors as the TMA unit's tensors (see int4_decode_tma)
  TensorMap k_map, v_map, pair_maps[4];  // pair_maps: k_scale, k_zero, v_scale, v_zero
};
static_assert(offsetof(Args, k_map) == 256 && sizeof(Args) == 1024, "driver.py's _Args");

// Where logical byte `at` of a tile (rows of ROW bytes, one after another) lives in shared
// memory: the 16-byte chunks of each 128-byte line are permuted, chunk c of line n at
// c ^ (n % 8) for rows of 128 bytes or more, c ^ 2 (n % 4) for shorter ones. Two reasons
// (measured on the H200 by read_probe, commit 9ae93fd):
// * every 128-byte line of the cache lands in one 128-byte line of shared memory. Rows padded
//   to D + 16 bytes (the usual way to spread rows over the banks) split each line's copy in
//   two: the L2 then served ~2.7 requests per line instead of 1, and the same reads ran at
//   89 % of copy bandwidth instead of 94 %;
// * the kernels' fragment reads hit different banks (tests/kernels/cuda/test_banks.py counts
//   the bank conflicts of every format and D: none for rows of 32, 64 or 128 bytes). For rows
//   of 64 bytes the pattern also depends only on bits 1-2 of the row, so a thread's reads of
//   rows r and r + 8 lie 8 * 64 bytes apart, and of rows 2t and 2t + 1, 64 bytes apart the
//   other way of bit 6 (int4_decode reads them from one offset: FragmentOffsets).
template <int ROW>
__device__ __forceinline__ int swizzled(int at) {
  if constexpr (ROW < 128) return at ^ (((at >> 7) & 3) << 5);
  return at ^ (((at >> 7) & 7) << 4);
}
