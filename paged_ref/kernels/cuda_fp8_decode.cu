// Paged decode attention over an FP8 (e4m3) KV cache, hand-written for NVIDIA GPUs with
// FP8 conversion instructions (compute capability 8.9+: Ada, Hopper, Blackwell).
//
// Why a CUDA kernel next to the Triton ones? Lesson 10 measured the Triton FP8 kernel at
// ~2/3 of copy bandwidth: per token it issues ~3x the instructions of the bf16 kernel (the
// 8-bit V tile reaches the tensor cores through byte-wide shared-memory loads, because
// ldmatrix.trans moves 16-bit elements only). Here each thread reads from shared memory only
// the bytes its own MMA fragments need, in 16-byte loads:
//
// * a CTA holds several KV heads of one sequence side by side (their 128-byte rows are
//   neighbours in memory, so together they read whole token rows), and WARPS_PER_HEAD warps
//   per head; a warp owns whole 16-token tiles (warp part p of a head takes tiles p,
//   p + WARPS_PER_HEAD, ...) with its own online softmax; a head's warps merge at the end;
// * each warp copies its next STAGES - 1 tiles global -> shared with cp.async (a ring; no
//   registers held, only __syncwarp between lanes), whole 128-byte token rows per instruction,
//   with the block-table entries looked up 32 tiles ahead (one load per lane), so no copy
//   waits on a table read; the tiles are stored unpadded with their 16-byte chunks permuted
//   (swizzled, below), so each 128-byte line copies as one L2 request and the fragment reads
//   still spread over the banks;
// * the MMAs are mma.sync m16n8k16 (float16 in, float32 accumulate), with the 16-row A
//   operand always full: S^T = K Q^T has the tile's 16 tokens as rows and the query heads of
//   one KV head as the 8 columns (GROUP <= 8 real), so a tile takes D/16 MMAs, half of what
//   S = Q K^T with 16 query rows (12 of them padding for GROUP 4) would; O^T += V^T P^T has
//   the channels as rows. P^T's B operand is the S^T accumulator transposed in registers
//   (movmatrix, one instruction per 8 tokens);
// * the order of a dot product's terms is free, so each thread's channels are chosen to be
//   contiguous in memory: for K a thread reads 32 bytes of each of 2 tokens (D = 128), for V
//   16 bytes of each of 4 tokens; Q (loaded once) and the output use the same channel order;
// * V's MMA operand wants two *tokens* of one channel in each 16-bit half: two byte permutes
//   (prmt) build them from two token rows, then one cvt.rn.f16x2.e4m3x2 makes two float16s;
// * a thread holds 2 tokens of 2 queries; a query's reference max is shared by the 8 lanes
//   that hold its tokens, and moves (3 shuffles, then a thread rescales its own O columns) only
//   when a score passes it by more than 2^8 in weight: after the first tile, rarely;
// * blocks of >= 16 tokens (SMALL_BLOCKS 0) hold whole tiles; smaller ones get their own build.
//
// Cache layout as everywhere in paged_ref: codes [num_blocks, block_size, Hkv, D] (bytes),
// scales float32 (one per tensor, or one per token-head [num_blocks, block_size, Hkv]).
// Long sequences are cut into chunks (blockIdx.y); each chunk writes a normalised partial
// output and its log2-sum-exp, and fp8_merge combines them (launched on Hopper as a
// programmatic dependent, so it starts without a launch gap).

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stddef.h>
#include <stdint.h>

#ifndef WARPS_PER_HEAD
#define WARPS_PER_HEAD 1  // warps sharing one KV head's tiles of a chunk (merged at the end)
#endif
#ifndef MAX_WARPS
#define MAX_WARPS 8  // per CTA: heads_per_cta * WARPS_PER_HEAD (a launch argument) <= this
#endif
#define TILE 16
#define MAX_GROUP 8
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 2  // __launch_bounds__'s CTAs (of MAX_WARPS warps) per SM: <= 128 registers
#endif
#ifndef L2_PREFETCH
#define L2_PREFETCH 0  // cp.async's L2 prefetch size in bytes (0, 128 or 256): 256 costs
                       // ~4 % on the H200 (results/h200/cuda_kernels_study.json)
#endif
#ifndef INT4_L2_PREFETCH
#define INT4_L2_PREFETCH 128  // the INT4 kernel's: a head's row is half a 128-byte line, the
                              // other half its neighbour's; fetching the line whole is ~3 %
                              // faster (cuda_fp8_probe.json)
#endif
#ifndef STAGES
#define STAGES 3  // tiles in a warp's shared-memory ring (STAGES - 1 in flight)
#endif
#ifndef SMALL_BLOCKS
#define SMALL_BLOCKS 0  // 0: blocks of >= 16 tokens, so a 16-token tile lies in one block (one
                        // table entry a tile, looked up ahead); 1: smaller blocks, a table entry
                        // per token row. cuda_fp8.py compiles the one the cache's block size needs
#endif
#define FULL 0xffffffffu

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
  // PREFETCH 128 / 256: L2 fetches the whole 128 / 256-byte line around the address.
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (PREFETCH == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst),
                 "l"(global), "r"(valid ? 16 : 0));
  else if constexpr (PREFETCH == 128)
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

// A CUtensorMap (cuda.h): 128 opaque bytes, 64-byte aligned, that the driver's
// cuTensorMapEncodeTiled fills on the host and the TMA unit reads (int4_decode_tma).
struct alignas(64) TensorMap {
  unsigned long long opaque[16];
};

// Shared-memory barriers that count bytes, and the TMA unit's copies (sm_90+: only
// int4_decode_tma uses them). A barrier's phase completes when its expected arrivals have
// arrived and the bytes it was told to expect have landed; waiters name the phase by parity.
__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void barrier_init(uint32_t bar, int arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(arrivals));
}
__device__ __forceinline__ void barrier_init_fence() {  // the inits, visible to the TMA unit
#if __CUDA_ARCH__ >= 900
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
#endif
}
__device__ __forceinline__ void barrier_arrive(uint32_t bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
// One arrival, and `bytes` more to land before the phase completes
__device__ __forceinline__ void barrier_arrive_expect(uint32_t bar, int bytes) {
#if __CUDA_ARCH__ >= 900
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes)
               : "memory");
#endif
}
__device__ __forceinline__ void barrier_wait(uint32_t bar, uint32_t parity) {
#if __CUDA_ARCH__ >= 900
  uint32_t done;
  do {
    asm volatile(
        "{\n\t.reg .pred p;\n\tmbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
        "selp.u32 %0, 1, 0, p;\n\t}" : "=r"(done) : "r"(bar), "r"(parity) : "memory");
  } while (!done);
#endif
}
// Loads from shared addresses (the TMA ring's, worked out once)
__device__ __forceinline__ void load_shared_16(uint32_t (&x)[4], uint32_t at) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(x[0]), "=r"(x[1]), "=r"(x[2]), "=r"(x[3]) : "r"(at));
}
__device__ __forceinline__ void load_shared_8(uint32_t (&x)[2], uint32_t at) {
  asm volatile("ld.shared.v2.u32 {%0, %1}, [%2];" : "=r"(x[0]), "=r"(x[1]) : "r"(at));
}
__device__ __forceinline__ uint32_t load_shared_4(uint32_t at) {
  uint32_t x;
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(x) : "r"(at));
  return x;
}
// The TMA unit copies the box at coordinates (x0, x1, x2, x3) of `map` (innermost first) to
// shared address `dst`, counting its bytes on barrier `bar` (one thread issues it)
__device__ __forceinline__ void tma_load_4d(uint32_t dst, const TensorMap* map, int x0, int x1,
                                            int x2, int x3, uint32_t bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4, %5}], [%6];"
      ::"r"(dst), "l"(map), "r"(x0), "r"(x1), "r"(x2), "r"(x3), "r"(bar) : "memory");
#endif
}
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TensorMap* map, int x0, int x1,
                                            int x2, uint32_t bar) {
#if __CUDA_ARCH__ >= 900
  asm volatile(
      "cp.async.bulk.tensor.3d.shared::cluster.global.tile.mbarrier::complete_tx::bytes"
      " [%0], [%1, {%2, %3, %4}], [%5];"
      ::"r"(dst), "l"(map), "r"(x0), "r"(x1), "r"(x2), "r"(bar) : "memory");
#endif
}

struct Args {
  const void* q;              // [B, Hq, D] float16 / bfloat16
  const uint8_t* k;           // e4m3 codes [num_blocks, block_size, Hkv, D]
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
  char _pad[44];              // (to byte 256: cuda_fp8.py's _Args spells it out too)
  // int4_decode_tma only (cuda_fp8.py encodes them): the K and V codes and the four
  // (scale, zero) tensors as the TMA unit's tensors (see int4_decode_tma)
  TensorMap k_map, v_map, pair_maps[4];  // pair_maps: k_scale, k_zero, v_scale, v_zero
};
static_assert(offsetof(Args, k_map) == 256 && sizeof(Args) == 1024, "cuda_fp8.py's _Args");

// Where logical byte `at` of a tile (rows of ROW bytes, one after another) lives in shared
// memory: the 16-byte chunks of each 128-byte line are permuted, chunk c of line n at
// c ^ (n % 8) for rows of 128 bytes or more, c ^ 2 (n % 4) for shorter ones. Two reasons
// (results/h200/cuda_kernels_study.json, part copy_paths, measured on the H200):
// * every 128-byte line of the cache lands in one 128-byte line of shared memory. Rows padded
//   to D + 16 bytes (the usual way to spread rows over the banks) split each line's copy in
//   two: the L2 then served ~2.7 requests per line instead of 1, and the same reads ran at
//   89 % of copy bandwidth instead of 94 %;
// * the fragment reads below hit different banks (tests/kernels/test_cuda_fp8_host.py counts
//   the bank conflicts of every format and D: none for rows of 32, 64 or 128 bytes). For rows
//   of 64 bytes the pattern also depends only on bits 1-2 of the row, so a thread's reads of
//   rows r and r + 8 lie 8 * 64 bytes apart, and of rows 2t and 2t + 1, 64 bytes apart the
//   other way of bit 6 (int4_decode reads them from one offset: FragmentOffsets).
template <int ROW>
__device__ __forceinline__ int swizzled(int at) {
  if constexpr (ROW < 128) return at ^ (((at >> 7) & 3) << 5);
  return at ^ (((at >> 7) & 7) << 4);
}

// One warp's stage of the shared-memory ring: a 16-token tile of K and V codes (swizzled, no
// padding: every array starts 128-byte aligned) and the token-head scales.
template <int D>
struct Stage {
  static constexpr int ROW = D;  // bytes a row
  uint8_t k[TILE * ROW];
  uint8_t v[TILE * ROW];
  float ks[TILE], vs[TILE];
};
// (cuda_fp8.py's shared_bytes mirrors this size; the merge of a head's warps reuses the ring)
static_assert(sizeof(Stage<128>) == 2 * TILE * 128 + 2 * TILE * 4, "Stage size");
static_assert(sizeof(Stage<64>) % 128 == 0, "each stage keeps the next one 128-byte aligned");
static_assert(2 * sizeof(Stage<64>) >= MAX_GROUP * (64 + 4) * 4, "merge space per warp");

// 16 bytes of both K and V, from global memory to byte `to` of the stage tiles (zeros when !ok).
template <int PREFETCH>
__device__ __forceinline__ void copy_kv_16(uint8_t* k_tile, uint8_t* v_tile, int to,
                                           const uint8_t* k_src, long long v_minus_k, bool ok) {
  cp_async_16<PREFETCH>(k_tile + to, k_src, ok);
  cp_async_16<PREFETCH>(v_tile + to, k_src + v_minus_k, ok);
}

// What one lane copies of every tile (rows of ROW bytes, ROW / 16 lanes a row, whole rows per
// instruction): rows row0 + i * STEP_ROWS, 16 bytes at `piece`. Its offsets within a block of
// the cache (`src`) and within a stage tile (`dst`, swizzled) are the same for every tile, so
// they are computed once; a tile then costs one base address and the copies.
template <int ROW>
struct LaneCopies {
  static constexpr int PIECES = ROW / 16, STEP_ROWS = 32 / PIECES, N = TILE / STEP_ROWS;
  int row0, piece, src[N], dst[N];
  __device__ LaneCopies(const Args& a, int lane) : row0(lane / PIECES), piece(lane % PIECES) {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      const int row = row0 + i * STEP_ROWS;
      src[i] = row * (int)a.c_st + piece * 16;  // (a block's bytes fit an int)
      dst[i] = swizzled<ROW>(row * ROW + piece * 16);
    }
  }
  // Tile [t0, t0 + 16) of head `k_head` (blocks of >= 16 tokens: all in block `blk`; smaller
  // ones: a table entry per row) into k_tile / v_tile; rows past `end` zero-filled.
  template <int PREFETCH>
  __device__ __forceinline__ void tile(uint8_t* k_tile, uint8_t* v_tile, const Args& a,
                                       const uint8_t* k_head, long long v_minus_k,
                                       const int* table, int t0, int end, int blk) const {
    const int mask = (1 << a.block_shift) - 1;
    const int c_sb = (int)a.c_sb, c_st = (int)a.c_st;  // (cuda_fp8.py checks they fit an int)
    if constexpr (!SMALL_BLOCKS) {  // the whole tile in block blk
      const uint8_t* base = k_head + mul_wide(blk, c_sb) + (t0 & mask) * c_st;
#pragma unroll
      for (int i = 0; i < N; ++i)
        copy_kv_16<PREFETCH>(k_tile, v_tile, dst[i], base + src[i], v_minus_k,
                             t0 + row0 + i * STEP_ROWS < end);
    } else {
#pragma unroll
      for (int i = 0; i < N; ++i) {
        const int tok = t0 + row0 + i * STEP_ROWS;
        const bool ok = tok < end;
        const int b = ok ? table[tok >> a.block_shift] : 0;
        copy_kv_16<PREFETCH>(k_tile, v_tile, dst[i],
                             k_head + mul_wide(b, c_sb) + (tok & mask) * c_st + piece * 16,
                             v_minus_k, ok);
      }
    }
  }
};

// Where token t0 + lane % 16's token-head scale lives (elements of the scale tensors; 0 past
// `end`), and whether it is a real token.
__device__ __forceinline__ long long scale_slot(const Args& a, const int* table, int head, int t0,
                                                int end, int lane, int blk, bool& ok) {
  const int tok = t0 + lane % TILE, mask = (1 << a.block_shift) - 1;
  ok = tok < end;
  const int b = !SMALL_BLOCKS ? blk : ok ? table[tok >> a.block_shift] : 0;
  return mul_wide(b, (int)a.s_sb) + (tok & mask) * (int)a.s_st + head * (int)a.s_sh;
}

// Lane `lane` of a warp starts copying tile [t0, t0 + 16) into `st` (its K and V rows through
// `lc`: whole token rows per instruction, full 128-byte lines for D = 128, which DRAM serves
// better than the same bytes spread over more rows per instruction), and with token-head
// scales one scale per lane; tokens past `end` are zero-filled and never read. k_head: the K
// cache at this KV head. Blocks of >= 16 tokens: tiles start at multiples of 16, so the whole
// tile lies in one block, whose table entry `blk` the caller looked up ahead of time. Smaller
// blocks: an entry per row.
template <int D, bool TOKEN_SCALE>
__device__ __forceinline__ void copy_tile(Stage<D>& st, const LaneCopies<D>& lc, const Args& a,
                                          const uint8_t* k_head, long long v_minus_k,
                                          const int* table, int head, int t0, int end, int lane,
                                          int blk) {
  lc.template tile<L2_PREFETCH>(st.k, st.v, a, k_head, v_minus_k, table, t0, end, blk);
  if constexpr (TOKEN_SCALE) {
    bool ok;
    const long long s = scale_slot(a, table, head, t0, end, lane, blk, ok);
    const int row = lane % TILE;
    if (lane < TILE) cp_async_4(st.ks + row, a.k_scale + s, ok);
    else cp_async_4(st.vs + row, a.v_scale + s, ok);
  }
}

template <int ROW, int NWORDS>
__device__ __forceinline__ void read_words(uint32_t (&dst)[NWORDS], const uint8_t* tile, int at) {
  // NWORDS 32-bit words from logical byte `at` of a swizzled tile (`at` 16-byte aligned; 8
  // when NWORDS == 2, 4 when 1): 16 bytes at a time, each chunk from where swizzled puts it
  if constexpr (NWORDS % 4 == 0) {
#pragma unroll
    for (int i = 0; i < NWORDS; i += 4) {
      const uint4 w = *reinterpret_cast<const uint4*>(tile + swizzled<ROW>(at + 4 * i));
      dst[i] = w.x; dst[i + 1] = w.y; dst[i + 2] = w.z; dst[i + 3] = w.w;
    }
  } else if constexpr (NWORDS == 2) {
    const uint2 w = *reinterpret_cast<const uint2*>(tile + swizzled<ROW>(at));
    dst[0] = w.x; dst[1] = w.y;
  } else {
    static_assert(NWORDS == 1, "1, 2 or a multiple of 4 words");
    dst[0] = *reinterpret_cast<const uint32_t*>(tile + swizzled<ROW>(at));
  }
}

// Store 4 consecutive channels of one output row (float32 partials or q's dtype).
template <typename T>
__device__ __forceinline__ void store4(T* dst, float x0, float x1, float x2, float x3) {
  if constexpr (sizeof(T) == 4) {
    *reinterpret_cast<float4*>(dst) = make_float4(x0, x1, x2, x3);
  } else {
    T v[4] = {T(x0), T(x1), T(x2), T(x3)};  // (__half / __nv_bfloat16 from float: nearest)
    *reinterpret_cast<uint2*>(dst) = *reinterpret_cast<const uint2*>(v);
  }
}

// Four consecutive elements of q (8-byte aligned: the launcher guarantees it) as floats; zeros
// for a padding row (no load).
template <typename T>
__device__ __forceinline__ void load_q4(float (&x)[4], const T* src, bool real) {
  x[0] = x[1] = x[2] = x[3] = 0.f;
  if (real) {
    const uint2 w = *reinterpret_cast<const uint2*>(src);
    const T* v = reinterpret_cast<const T*>(&w);
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = static_cast<float>(v[i]);
  }
}

// The end of a warp's chunk, for both formats: this thread's unnormalised outputs ov[u][.]
// for queries 2t + u (groups of 4 channels from base[n]), their running max mq[u] (log2
// units) and sum lq[u] -> q's dtype in `out` (one chunk) or a float32 partial and its
// log2-sum-exp (several); out_scale multiplies every value. With WARPS_PER_HEAD > 1 the
// warps of a head first merge through shared memory (the ring's, after a __syncthreads).
template <typename T, int D>
__device__ __forceinline__ void finish_head(const Args& a, uint8_t* smem, const float (&ov)[2][D / 8],
                                            const int (&base)[D / 32], const float (&mq)[2],
                                            const float (&lq)[2], float out_scale, int kv_head,
                                            int start, int end, int n_chunks) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, t = lane % 4;
  const int chunk = blockIdx.y, b = blockIdx.z;
  const bool split = n_chunks > 1;
  const int num_q_heads = gridDim.x * a.heads_per_cta * a.group;
  if constexpr (WARPS_PER_HEAD == 1) {
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int q = 2 * t + u;
      if (q >= a.group) continue;
      const int qh = kv_head * a.group + q;
      const float f = end > start ? out_scale / lq[u] : 0.f;
      const long long r = ((long long)b * num_q_heads + qh) * a.max_chunks + chunk;
#pragma unroll
      for (int n = 0; n < D / 32; ++n) {
        const float x0 = ov[u][4 * n] * f, x1 = ov[u][4 * n + 1] * f;
        const float x2 = ov[u][4 * n + 2] * f, x3 = ov[u][4 * n + 3] * f;
        if (!split)
          store4(reinterpret_cast<T*>(a.out) + b * a.o_sb + (long long)qh * a.o_sh + base[n],
                 x0, x1, x2, x3);
        else
          store4(a.part_o + r * D + base[n], x0, x1, x2, x3);
      }
      if (split && g == 0) a.part_lse[r] = mq[u] + __log2f(lq[u]);
    }
  } else {
    // The WARPS_PER_HEAD warps of each head: (m, l, O) -> one, in the ring's memory.
    __syncthreads();
    constexpr int ROWF = D + 4;  // a query's D values, then its max and sum (16-byte rows)
    float* mine = reinterpret_cast<float*>(smem) + warp * MAX_GROUP * ROWF;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int q = 2 * t + u;
      if (q >= a.group) continue;
      float* row = mine + q * ROWF;
      if (g == 0) { row[D] = mq[u]; row[D + 1] = lq[u]; }
#pragma unroll
      for (int n = 0; n < D / 32; ++n)
        store4(row + base[n], ov[u][4 * n], ov[u][4 * n + 1], ov[u][4 * n + 2], ov[u][4 * n + 3]);
    }
    __syncthreads();
    const int heads = a.heads_per_cta;
    for (int idx = threadIdx.x; idx < heads * a.group * D; idx += blockDim.x) {
      const int h = idx / (a.group * D), q = idx / D % a.group, ch = idx % D;
      float mm = -INFINITY;
#pragma unroll
      for (int w = 0; w < WARPS_PER_HEAD; ++w) {
        const float* row = reinterpret_cast<float*>(smem) + ((w * heads + h) * MAX_GROUP + q) * ROWF;
        mm = fmaxf(mm, row[D]);
      }
      float den = 0.f, num = 0.f;
#pragma unroll
      for (int w = 0; w < WARPS_PER_HEAD; ++w) {
        const float* row = reinterpret_cast<float*>(smem) + ((w * heads + h) * MAX_GROUP + q) * ROWF;
        const float f = row[D] == -INFINITY ? 0.f : fast_exp2(row[D] - mm);
        den += f * row[D + 1];
        num += f * row[ch];
      }
      const int qh = (blockIdx.x * heads + h) * a.group + q;
      const float val = end > start ? num / den * out_scale : 0.f;
      if (!split) {
        reinterpret_cast<T*>(a.out)[b * a.o_sb + (long long)qh * a.o_sh + ch] = T(val);
      } else {
        const long long r = ((long long)b * num_q_heads + qh) * a.max_chunks + chunk;
        a.part_o[r * D + ch] = val;
        if (ch == 0) a.part_lse[r] = mm + __log2f(den);
      }
    }
  }
}

// What one warp works on, for both formats. grid (Hkv / heads_per_cta, chunks, B): the KV
// heads of one CTA read the same tokens at the same time (their rows interleave in memory).
// Warp w: head w % heads_per_cta of the CTA, part w / heads_per_cta of that head's tiles of
// the chunk: tiles part, part + WARPS_PER_HEAD, ...; tile i starts at token first + i * step.
struct WarpWork {
  int kv_head, b, start, end, n_chunks, first, step, n_tiles;
  const int* table;        // this sequence's block-table row
  const uint8_t* k_head;   // the K cache at this KV head
  long long v_minus_k;     // same layout: V's byte = K's byte + this
  __device__ explicit WarpWork(const Args& a) {
    const int warp = threadIdx.x / 32, part = warp / a.heads_per_cta;
    kv_head = blockIdx.x * a.heads_per_cta + warp % a.heads_per_cta;
    b = blockIdx.z;
    const int seq_len = min(a.seq_lens[b], a.max_len);
    start = blockIdx.y * a.chunk_len;
    end = min(seq_len, start + a.chunk_len);
    n_chunks = (seq_len + a.chunk_len - 1) / a.chunk_len;
    first = start + part * TILE;
    step = WARPS_PER_HEAD * TILE;
    n_tiles = first < end ? (end - first + step - 1) / step : 0;
    table = a.block_tables + b * a.table_sb;
    k_head = a.k + kv_head * a.c_sh;
    v_minus_k = a.v - a.k;
  }
  // past this sequence's end (chunk 0 writes zeros for an empty one): the CTA returns
  __device__ bool idle() const { return blockIdx.y > 0 && (int)blockIdx.y >= n_chunks; }
};

// Block-table entries looked up ahead (blocks of >= 16 tokens hold whole tiles): lane j holds
// tile 32 n + j's entry in `now` and tile 32 (n + 1) + j's in `next`, so a tile's copy never
// waits on a table read. at(i) is tile i's entry, for i = 0, 1, 2, ... in turn (every lane).
struct TableAhead {
  int now, next;
  __device__ int load(const Args& a, const WarpWork& w, int i) const {
    return !SMALL_BLOCKS && i < w.n_tiles ? w.table[(w.first + i * w.step) >> a.block_shift] : 0;
  }
  __device__ TableAhead(const Args& a, const WarpWork& w, int lane)
      : now(load(a, w, lane)), next(load(a, w, 32 + lane)) {}
  __device__ int at(const Args& a, const WarpWork& w, int i, int lane) {
    if ((unsigned)i % 32u == 0 && i > 0) {
      now = next;
      next = load(a, w, i + 32 + lane);
    }
    return __shfl_sync(FULL, now, (unsigned)i % 32u);
  }
};

// One tile's step of the online softmax. This thread's scores x[i] (log2 units, -inf past the
// end) are of token g + 8 (i >> 1) for query 2t + (i & 1) (the S^T accumulator's layout); the
// 16 tokens of query 2t + u are in the 8 lanes of this t. Per query u: the running reference
// max m[u] (the same in those 8 lanes), the weights p = exp2(x - m), alpha[u] = exp2(m_old -
// m_new) and this thread's running sum l[u]. True when one of this thread's maxes grew (then
// its O needs rescaling).
// m need not be the exact running max, only close enough that no weight overflows: it moves
// only when some score of the warp passes its query's m by more than RESCALE_SLACK (weights up
// to 2^8, exact in float16 and float32), and then to the tile's max. Most tiles after the
// first skip the 3-shuffle max of each query and the rescale (FlashAttention-4's conditional
// rescaling); the answer is the same, because l and O are both relative to the same m.
#define RESCALE_SLACK 8.f
__device__ __forceinline__ bool softmax_step(const float (&x)[4], float (&m)[2], float (&l)[2],
                                             float (&p)[4], float (&alpha)[2]) {
  const bool over = x[0] > m[0] + RESCALE_SLACK || x[1] > m[1] + RESCALE_SLACK ||
                    x[2] > m[0] + RESCALE_SLACK || x[3] > m[1] + RESCALE_SLACK;
  bool grew = false;
  alpha[0] = alpha[1] = 1.f;
  if (__any_sync(FULL, over)) {  // (the same branch in every lane: m stays uniform)
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      float mx = fmaxf(x[u], x[2 + u]);
#pragma unroll
      for (int d = 4; d < 32; d *= 2) mx = fmaxf(mx, __shfl_xor_sync(FULL, mx, d));
      const float m_new = fmaxf(m[u], mx);  // finite: the tile has a real token
      grew |= m_new > m[u];
      alpha[u] = fast_exp2(m[u] - m_new);
      m[u] = m_new;
    }
  }
#pragma unroll
  for (int u = 0; u < 2; ++u) {
    p[u] = fast_exp2(x[u] - m[u]);
    p[2 + u] = fast_exp2(x[2 + u] - m[u]);
    l[u] = l[u] * alpha[u] + (p[u] + p[2 + u]);
  }
  return grew;
}

// The 8x8 matrix of 16-bit values whose row r, columns 2c and 2c + 1 are in lane 4r + c (one
// 8-row half of an MMA accumulator, packed), transposed: lane 4r + c then holds row r,
// columns 2c, 2c + 1 of the transpose. Turns P^T's rows (tokens) into the B operand of
// O^T += V^T P^T (a query's tokens).
__device__ __forceinline__ uint32_t transpose8x8(uint32_t x) {
  uint32_t r;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
  return r;
}

template <typename T, int D, bool TOKEN_SCALE>
__device__ void fp8_decode(const Args& a) {
  constexpr int KSTEPS = D / 16;  // k-steps of S^T = K Q^T
  constexpr int VWORDS = D / 32;  // 32-bit words of each V row a thread reads (its D/8 channels)
  constexpr int OTILES = D / 16;  // m-tiles of O^T = V^T P^T (16 channels each)
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const WarpWork w(a);
  if (w.idle()) return;
  const int kv_head = w.kv_head, b = w.b, start = w.start, end = w.end;

  extern __shared__ __align__(128) uint8_t smem[];  // STAGES tiles per warp, then reused
  Stage<D>* ring = reinterpret_cast<Stage<D>*>(smem) + warp * STAGES;

  // Q^T as B fragments (column g = query head kv_head * group + g; zeros for g >= group).
  // k-step s, slots (2t, 2t+1 | 2t+8, 2t+9) <-> channels t * D/4 + 4 s + (0, 1 | 2, 3).
  uint32_t qb[KSTEPS][2];
  {
    const T* qrow = reinterpret_cast<const T*>(a.q) + b * a.q_sb +
                    (long long)(kv_head * a.group + g) * a.q_sh + t * (D / 4);
    const bool real = g < a.group;
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      float x[4];
      load_q4(x, qrow + 4 * s, real);
      qb[s][0] = pack_f16x2(x[0], x[1]);
      qb[s][1] = pack_f16x2(x[2], x[3]);
    }
  }
  // O^T accumulators: m-tile j, thread (g, t) holds queries 2t, 2t+1 of channels
  // g * D/8 + 2j (o[j][0], o[j][1]) and g * D/8 + 2j + 1 (o[j][2], o[j][3]).
  float o[OTILES][4];
#pragma unroll
  for (int j = 0; j < OTILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};  // queries 2t, 2t+1 (softmax_step)

  const float k_scale = TOKEN_SCALE ? 1.f : __ldg(a.k_scale);
  const float score_scale = a.qk_scale_log2 * k_scale;

  TableAhead entries(a, w, lane);
  const LaneCopies<D> lanes(a, lane);
  int copied = 0, copy_stage = 0;  // tiles copied so far; the next one's stage
  auto copy = [&]() {  // the next tile into its stage (the same in every lane); the ring keeps
                       // STAGES - 1 tiles in flight while one is used
    copy_tile<D, TOKEN_SCALE>(ring[copy_stage], lanes, a, w.k_head, w.v_minus_k, w.table,
                              kv_head, w.first + copied * w.step, end, lane,
                              entries.at(a, w, copied, lane));
    ++copied;
    copy_stage = copy_stage == STAGES - 1 ? 0 : copy_stage + 1;
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < w.n_tiles) copy();
    cp_async_commit();  // (an empty group keeps the counting uniform)
  }
  int stage = 0;
  for (int i = 0, t0 = w.first; i < w.n_tiles; ++i, t0 += w.step) {
    cp_async_wait<STAGES - 2>();  // tile i has landed (this lane's copies) ...
    __syncwarp();                 // ... and every lane's; the stage read last step is free
    if (i + STAGES - 1 < w.n_tiles) copy();
    cp_async_commit();
    const Stage<D>& st = ring[stage];
    stage = stage == STAGES - 1 ? 0 : stage + 1;
    uint32_t kw[2][D / 16], vw[4][VWORDS];  // this thread's fragment bytes (see the header)
#pragma unroll
    for (int j = 0; j < 2; ++j) read_words<D>(kw[j], st.k, (8 * j + g) * Stage<D>::ROW + t * (D / 4));
#pragma unroll
    for (int j = 0; j < 4; ++j)
      read_words<D>(vw[j], st.v, (2 * t + (j & 1) + 8 * (j >> 1)) * Stage<D>::ROW + g * (D / 8));

    // S^T = K Q^T: K is the A operand (row g <-> token t0 + g, row g + 8 <-> t0 + g + 8), so
    // all 16 of its rows are real; even and odd k-steps in two chains. c[.][i]: token
    // g + 8 (i >> 1), query 2t + (i & 1).
    float c[2][4] = {};
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      const uint32_t k0 = kw[0][s], k1 = kw[1][s];
      const uint32_t ka[4] = {e4m3x2_to_f16x2(k0), e4m3x2_to_f16x2(k1), e4m3x2_hi_to_f16x2(k0),
                              e4m3x2_hi_to_f16x2(k1)};
      mma_16816(c[s & 1], ka, qb[s][0], qb[s][1]);
    }
    float x[4];  // scores (log2 units): token g + 8 (i >> 1), query 2t + (i & 1)
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tk = g + 8 * (i >> 1);
      const float sc = TOKEN_SCALE ? score_scale * st.ks[tk] : score_scale;
      x[i] = t0 + tk < end ? (c[0][i] + c[1][i]) * sc : -INFINITY;
    }
    float p[4], alpha[2];
    const bool grew = softmax_step(x, m, l, p, alpha);
    if (TOKEN_SCALE) {
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] *= st.vs[g + 8 * (i >> 1)];
    }
    // Rescale O only where a max grew (alpha is 1 otherwise: skipping is exact). O^T's
    // columns are queries 2t, 2t+1: this thread's own alphas.
    if (grew) {
#pragma unroll
      for (int j = 0; j < OTILES; ++j) {
        o[j][0] *= alpha[0]; o[j][1] *= alpha[1]; o[j][2] *= alpha[0]; o[j][3] *= alpha[1];
      }
    }
    // O^T += V^T P^T: P^T is the B operand (k-slot i <-> token t0 + i, column g <-> query g):
    // the transposes of the two 8-token halves of P^T as it stands. V^T is the A operand:
    // m-tile 2w + h, row g <-> channel g * D/8 + 4w + 2h, row g + 8 <-> the next channel; its
    // 16-bit halves want two *tokens* of one channel, which prmt gathers from the token rows
    // (bytes 0, 4, 1, 5 / 2, 6, 3, 7).
    const uint32_t pb0 = transpose8x8(pack_f16x2(p[0], p[1]));
    const uint32_t pb1 = transpose8x8(pack_f16x2(p[2], p[3]));
#pragma unroll
    for (int w = 0; w < VWORDS; ++w) {
      const uint32_t lo01 = prmt(vw[0][w], vw[1][w], 0x5140);  // ch 4w | 4w+1, tokens 2t, 2t+1
      const uint32_t hi01 = prmt(vw[0][w], vw[1][w], 0x7362);  // ch 4w+2 | 4w+3
      const uint32_t lo23 = prmt(vw[2][w], vw[3][w], 0x5140);  // tokens 2t+8, 2t+9
      const uint32_t hi23 = prmt(vw[2][w], vw[3][w], 0x7362);
      const uint32_t va[4] = {e4m3x2_to_f16x2(lo01), e4m3x2_hi_to_f16x2(lo01),
                              e4m3x2_to_f16x2(lo23), e4m3x2_hi_to_f16x2(lo23)};
      mma_16816(o[2 * w], va, pb0, pb1);
      const uint32_t vb[4] = {e4m3x2_to_f16x2(hi01), e4m3x2_hi_to_f16x2(hi01),
                              e4m3x2_to_f16x2(hi23), e4m3x2_hi_to_f16x2(hi23)};
      mma_16816(o[2 * w + 1], vb, pb0, pb1);
    }
  }
  cp_async_wait<0>();
  // This thread's output queries 2t + u: their max is m[u]; their sum, the 8 lanes' l[u].
#pragma unroll
  for (int d = 4; d < 32; d *= 2) {
    l[0] += __shfl_xor_sync(FULL, l[0], d);
    l[1] += __shfl_xor_sync(FULL, l[1], d);
  }
  // This thread's outputs: queries 2t + u, channels chan + 4w + (0..3) are o[2w][u],
  // o[2w][2 + u], o[2w + 1][u], o[2w + 1][2 + u].
  float ov[2][D / 8];
  int base[D / 32];
#pragma unroll
  for (int w = 0; w < VWORDS; ++w) {
    base[w] = g * (D / 8) + 4 * w;
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      ov[u][4 * w] = o[2 * w][u];
      ov[u][4 * w + 1] = o[2 * w][2 + u];
      ov[u][4 * w + 2] = o[2 * w + 1][u];
      ov[u][4 * w + 3] = o[2 * w + 1][2 + u];
    }
  }
  const float v_scale = TOKEN_SCALE ? 1.f : __ldg(a.v_scale);
  finish_head<T, D>(a, smem, ov, base, m, l, v_scale, kv_head, start, end, w.n_chunks);
}

// ---------------------------------------------------------------------------------------
// INT4 caches (paged_ref's "int4" format: two codes a byte, byte i holding channel i in its
// low nibble and channel i + D/2 in its high nibble; a float16 (scale, zero) per token-head
// for each of the two halves: x = zero + scale * code). The warps, the ring, the table
// look-ahead and the softmax are fp8_decode's; the copies (Int4Copier) and the fragment reads
// (FragmentOffsets) are worked out once per lane; Int4Head turns the codes into MMA operands.
// On sm_90+ the common launch (head_dim 128, one warp per head, 8 KV heads a CTA) runs
// int4_decode_tma instead: one ring per CTA, filled by the TMA unit.

template <int D>
struct Int4Stage {
  static constexpr int ROW = D / 2;  // bytes a row (swizzled as Stage's)
  uint8_t k[TILE * ROW];
  uint8_t v[TILE * ROW];
  uint32_t ks[TILE], kz[TILE], vs[TILE], vz[TILE];  // float16 pairs: (low half, high half)
};
static_assert(sizeof(Int4Stage<64>) % 128 == 0, "each stage keeps the next one 128-byte aligned");
static_assert(2 * sizeof(Int4Stage<128>) >= MAX_GROUP * (128 + 4) * 4 &&
                  2 * sizeof(Int4Stage<256>) >= MAX_GROUP * (256 + 4) * 4, "merge space per warp");

// As copy_tile, for D / 2 bytes a row and the four (scale, zero) pairs of each token (blocks of
// fewer than 16 tokens; larger ones: Int4Copier).
template <int D>
__device__ __forceinline__ void copy_int4_tile(Int4Stage<D>& st, const LaneCopies<D / 2>& lc,
                                               const Args& a, const uint8_t* k_head,
                                               long long v_minus_k, const int* table, int head,
                                               int t0, int end, int lane, int blk) {
  lc.template tile<INT4_L2_PREFETCH>(st.k, st.v, a, k_head, v_minus_k, table, t0, end, blk);
  bool ok;
  const long long s = scale_slot(a, table, head, t0, end, lane, blk, ok);  // float16s
  const int row = lane % TILE;
  if (lane < TILE) {
    cp_async_4(st.ks + row, reinterpret_cast<const __half*>(a.k_scale) + s, ok);
    cp_async_4(st.kz + row, reinterpret_cast<const __half*>(a.k_zero) + s, ok);
  } else {
    cp_async_4(st.vs + row, reinterpret_cast<const __half*>(a.v_scale) + s, ok);
    cp_async_4(st.vz + row, reinterpret_cast<const __half*>(a.v_zero) + s, ok);
  }
}

// What one lane copies of every INT4 tile (blocks of >= 16 tokens), worked out once: its
// rows of codes as in LaneCopies, and one token's (scale, zero) pair of K (lanes < 16) or V
// (the others). A tile then costs its block's offset and the copies. The codes are copied
// unmasked: the whole tile lies in one block, so rows past the end are still cache memory,
// and their codes (whatever they hold: every code is a finite number) meet a weight of exactly
// 0. The scales are masked (zero past the end, never a NaN from an unused slot: 0 * NaN is
// NaN).
template <int D>
struct Int4Copier {
  static constexpr int ROW = D / 2, PIECES = ROW / 16, STEP_ROWS = 32 / PIECES,
                       N = TILE / STEP_ROWS;
  const uint8_t* src;        // this lane's first code byte at block 0, token row0
  const __half* scale;       // its scale at block 0, token lane % 16 (its zero: + zero_off)
  long long zero_off, v_minus_k;
  int row_step;              // bytes between its rows (STEP_ROWS tokens)
  uint32_t dst[N];           // shared addresses of its K pieces in stage 0 (V's: + TILE * ROW)
  uint32_t scale_dst;        // ... of its scale in stage 0 (its zero: + 4 * TILE)
  __device__ Int4Copier(const Args& a, const WarpWork& w, const void* stage0, int lane) {
    static_assert(ROW != 64 || STEP_ROWS == 8, "rows of 64 bytes: 8 a copy instruction");
    const int row0 = lane / PIECES, piece = lane % PIECES, r = lane % TILE;
    src = w.k_head + row0 * a.c_st + piece * 16;
    v_minus_k = w.v_minus_k;
    row_step = STEP_ROWS * (int)a.c_st;
    const uint32_t base = static_cast<uint32_t>(__cvta_generic_to_shared(stage0));
#pragma unroll
    for (int i = 0; i < N; ++i)  // (rows of 64 bytes: row0 + 8 lies at row0's + 512)
      dst[i] = ROW == 64 && i > 0 ? dst[0] + i * STEP_ROWS * ROW
                                  : base + swizzled<ROW>((row0 + i * STEP_ROWS) * ROW + piece * 16);
    const bool k_side = lane < TILE;
    const __half* s = reinterpret_cast<const __half*>(k_side ? a.k_scale : a.v_scale);
    const __half* z = reinterpret_cast<const __half*>(k_side ? a.k_zero : a.v_zero);
    scale = s + r * a.s_st + w.kv_head * a.s_sh;
    zero_off = z - s;
    scale_dst = base + 2 * TILE * ROW + (k_side ? 0 : 8 * TILE) + 4 * r;  // ks or vs [r]
  }
  // Tile [t0, t0 + 16) of block blk into the stage `stage_off` bytes past stage 0.
  __device__ __forceinline__ void tile(const Args& a, uint32_t stage_off, int blk, int t0,
                                       int end, int lane) const {
    const int in_block = t0 & ((1 << a.block_shift) - 1);
    const uint8_t* k = src + mul_wide(blk, (int)a.c_sb) + in_block * (int)a.c_st;
#pragma unroll
    for (int i = 0; i < N; ++i) {
      cp_async_16_to(dst[i] + stage_off, k + i * row_step);
      cp_async_16_to(dst[i] + stage_off + TILE * ROW, k + i * row_step + v_minus_k);
    }
    const __half* sc = scale + mul_wide(blk, (int)a.s_sb) + in_block * (int)a.s_st;
    const bool ok = t0 + lane % TILE < end;
    cp_async_4_to(scale_dst + stage_off, sc, ok);
    cp_async_4_to(scale_dst + stage_off + 4 * TILE, sc + zero_off, ok);
  }
};

// Where this thread's fragment reads lie in an Int4Stage's K and V tiles (byte offsets from
// each): K rows 8j + g at t * D/8, V rows 2t + (j & 1) + 8 (j >> 1) at g * D/16 (logical;
// then swizzled). For rows of 64 bytes (D = 128) the swizzle keeps row r + 8 at r's + 512 and
// puts row 2t + 1 at 2t's ^ 64 (swizzled's comment), so one offset each serves every read:
// the loop computes no swizzle.
template <int D>
struct FragmentOffsets {
  static constexpr int ROW = D / 2;
  static constexpr bool ONE_OFFSET = ROW == 64;
  int k[2], v[4];
  __device__ FragmentOffsets(int g, int t) {
#pragma unroll
    for (int j = 0; j < 2; ++j) k[j] = (8 * j + g) * ROW + t * (D / 8);  // logical
#pragma unroll
    for (int j = 0; j < 4; ++j) v[j] = (2 * t + (j & 1) + 8 * (j >> 1)) * ROW + g * (D / 16);
    if constexpr (ONE_OFFSET) {
      k[0] = swizzled<ROW>(k[0]);
      v[0] = swizzled<ROW>(v[0]);
    }
  }
  template <int KW, int VW>
  __device__ __forceinline__ void read(uint32_t (&kw)[2][KW], uint32_t (&vw)[4][VW],
                                       const Int4Stage<D>& st) const {
    if constexpr (ONE_OFFSET) {
      static_assert(KW == 4 && VW == 2, "D = 128: 16 bytes of each K row, 8 of each V row");
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const uint4 x = *reinterpret_cast<const uint4*>(st.k + k[0] + 8 * ROW * j);
        kw[j][0] = x.x; kw[j][1] = x.y; kw[j][2] = x.z; kw[j][3] = x.w;
      }
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const int at = ((j & 1) ? v[0] ^ 64 : v[0]) + 8 * ROW * (j >> 1);
        const uint2 x = *reinterpret_cast<const uint2*>(st.v + at);
        vw[j][0] = x.x; vw[j][1] = x.y;
      }
    } else {
#pragma unroll
      for (int j = 0; j < 2; ++j) read_words<ROW>(kw[j], st.k, k[j]);
#pragma unroll
      for (int j = 0; j < 4; ++j) read_words<ROW>(vw[j], st.v, v[j]);
    }
  }
};

// The low nibbles of x's two bytes 0 and 2 -> float16x2 (n0, n1) * 2^-24 (subnormals), and
// their high nibbles -> (n0, n1) * 2^-20.
__device__ __forceinline__ uint32_t low_nibbles(uint32_t x) { return x & 0x000f000fu; }
__device__ __forceinline__ uint32_t high_nibbles(uint32_t x) { return x & 0x00f000f0u; }
// x >> 8 (bytes 1 and 3 to where the masks take them), as the high word of x * 2^24: an
// integer multiply-add runs on the FMA pipe, a shift on the integer ALU, INT4's busiest
// (docs/lab_notes.md: 16 of a tile's ~190 ALU instructions move)
__device__ __forceinline__ uint32_t byte_shift(uint32_t x) {
  uint32_t r;
  asm("mul.hi.u32 %0, %1, %2;" : "=r"(r) : "r"(x), "r"(1u << 24));
  return r;
}
#define LOW_UNIT 16777216.f  // 2^24: a low nibble's float16 is its code / LOW_UNIT
#define HIGH_UNIT 1048576.f  // 2^20: a high nibble's

__device__ __forceinline__ float2 f16x2_to_float2(uint32_t x) {
  return __half22float2(*reinterpret_cast<const __half2*>(&x));
}

// What one tile of int4_decode needs besides its codes, for this thread's two token rows r
// (the MMA's rows g and g + 8): each token's (scale, zero) pairs as float16x2 words (low half,
// high half), and whether it is a real token (before the end). The V pair of a token that is
// not must be zeros: its weight 0 times an unused slot's NaN would be NaN.
struct Int4TileScales {
  uint32_t ks[2], kz[2], vs[2], vz[2];
  bool real[2];
};

// One warp's KV head in int4_decode (either ring): its queries as MMA operands, its running
// softmax and output, a tile's step and the end. The codes become operands thus:
// * a nibble n, alone in the low bits of a 16-bit half, *is* a float16: the subnormal
//   n * 2^-24, exactly (and in bits 4..7, 16 n * 2^-24); the tensor cores multiply subnormals
//   exactly, so one and (x & 0x000f000f, or 0x00f000f0 for the high nibbles) makes two
//   operands, and the 2^24 (2^20) comes out once, with the scales. (The usual trick, or-ing n
//   into 1024.0's mantissa, leaves 1024 + n, and taking 1024 * sum(p) back out of a float32
//   sum over thousands of tokens loses the digits a small average needs.)
// * every MMA's 16 channels lie in one half, so one (scale, zero) per token applies:
//   S_t = sum_h scale_h(t) * (q_h . codes_h(t)) + zero_h(t) * sum(q_h), two accumulators;
//   O = sum_t (p_t scale_h(t)) codes_h(t) + sum_t p_t zero_h(t), p_t scale_h(t) (float16,
//   multiplied before the transpose, so each thread scales its own 2 tokens) as the B operand.
// * the tile's 16 tokens may reach the MMA rows in any order, as long as K's rows, the
//   scales and V's columns (P's k-slots) follow the same one: "token g" below is the token of
//   MMA row g (the TMA ring reads them permuted, to spread its reads over the banks).
template <typename T, int D>
struct Int4Head {
  static constexpr int KW = D / 32;  // words of K a thread reads per token row (D/8 bytes)
  static constexpr int VW = D / 64;  // words of V a thread reads per token row (D/16 bytes)
  static constexpr int OT = D / 32;  // m-tiles of O^T per half (16 channels each)
  // Q^T as B fragments (column g <-> query g). K-step (h, w), h = 0 for the low nibbles
  // (channels < D/2), 1 for the high: slots (2t, 2t+1) <-> channels c, c+2 and (2t+8, 2t+9)
  // <-> c+1, c+3, with c = h * D/2 + t * D/8 + 4w (the order a word's nibbles unpack in).
  // qz[h][u]: the sum of query 2t + u's float16 q over half h, times the softmax scale (the
  // zero points' term of its scores).
  uint32_t qb[2][KW][2];
  float qz[2][2];
  float low_qk, high_qk;
  // O^T accumulators per half h, m-tile j: thread (g, t) holds queries 2t, 2t+1 of the
  // channels h * D/2 + g * D/16 + 2j (o[h][j][0..1]) and the next one (o[h][j][2..3]); they
  // hold sum_t p_t scale_h(t) code / 2^24 (2^20 for h = 1), and zs[h][u] this thread's
  // tokens' sum_t p_t zero_h(t) for query 2t + u.
  float o[2][OT][4];
  float m[2], l[2], zs[2][2];

  __device__ __forceinline__ Int4Head(const Args& a, const WarpWork& w, int g, int t) {
    const T* qrow = reinterpret_cast<const T*>(a.q) + w.b * a.q_sb +
                    (long long)(w.kv_head * a.group + g) * a.q_sh + t * (D / 8);
    const bool real = g < a.group;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float qsum = 0.f;  // query g's, over half h (this thread's channels, then its row's 4)
#pragma unroll
      for (int w = 0; w < KW; ++w) {
        float x[4];
        load_q4(x, qrow + h * (D / 2) + 4 * w, real);
        qb[h][w][0] = pack_f16x2(x[0], x[2]);
        qb[h][w][1] = pack_f16x2(x[1], x[3]);
        const float2 s0 = f16x2_to_float2(qb[h][w][0]), s1 = f16x2_to_float2(qb[h][w][1]);
        qsum += (s0.x + s0.y) + (s1.x + s1.y);
      }
      qsum += __shfl_xor_sync(FULL, qsum, 1);
      qsum += __shfl_xor_sync(FULL, qsum, 2);
#pragma unroll
      for (int u = 0; u < 2; ++u)
        qz[h][u] = __shfl_sync(FULL, qsum, 4 * (2 * t + u)) * a.qk_scale_log2;
    }
    low_qk = LOW_UNIT * a.qk_scale_log2;
    high_qk = HIGH_UNIT * a.qk_scale_log2;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int j = 0; j < OT; ++j) o[h][j][0] = o[h][j][1] = o[h][j][2] = o[h][j][3] = 0.f;
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
    zs[0][0] = zs[0][1] = zs[1][0] = zs[1][1] = 0.f;
  }

  // One tile: kw, K rows g, g + 8 (16 K-step words each); vw, V rows 2t + (j & 1) + 8 (j >> 1)
  // (this thread's D/16 bytes of each); sc, rows g and g + 8's scales.
  __device__ __forceinline__ void tile(const uint32_t (&kw)[2][KW], const uint32_t (&vw)[4][VW],
                                       const Int4TileScales& sc) {
    // S^T = K Q^T per half (K the A operand: rows g, g+8 <-> tokens t0 + g, t0 + g + 8), in
    // units of 2^-24 (2^-20). c[h][i]: token g + 8 (i >> 1), query 2t + (i & 1).
    float c[2][4] = {};
  #pragma unroll
    for (int w = 0; w < KW; ++w) {
      const uint32_t x = kw[0][w], y = kw[1][w], x8 = byte_shift(x), y8 = byte_shift(y);
      const uint32_t lo[4] = {low_nibbles(x), low_nibbles(y), low_nibbles(x8), low_nibbles(y8)};
      mma_16816(c[0], lo, qb[0][w][0], qb[0][w][1]);
      const uint32_t hi[4] = {high_nibbles(x), high_nibbles(y), high_nibbles(x8),
                              high_nibbles(y8)};
      mma_16816(c[1], hi, qb[1][w][0], qb[1][w][1]);
    }
    float x[4];  // scores (log2 units): token g + 8 (i >> 1), query 2t + (i & 1)
  #pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float2 ks = f16x2_to_float2(sc.ks[r]), kz = f16x2_to_float2(sc.kz[r]);
      const float k0 = low_qk * ks.x, k1 = high_qk * ks.y;
      const bool real = sc.real[r];
  #pragma unroll
      for (int u = 0; u < 2; ++u) {
        const int i = 2 * r + u;
        x[i] = real ? k0 * c[0][i] + k1 * c[1][i] + (kz.x * qz[0][u] + kz.y * qz[1][u])
                    : -INFINITY;
      }
    }
    float p[4], alpha[2];
    const bool grew = softmax_step(x, m, l, p, alpha);
    if (grew) {
  #pragma unroll
      for (int h = 0; h < 2; ++h)
  #pragma unroll
        for (int j = 0; j < OT; ++j) {
          o[h][j][0] *= alpha[0]; o[h][j][1] *= alpha[1];
          o[h][j][2] *= alpha[0]; o[h][j][3] *= alpha[1];
        }
    }
    // P'^T per half: p_t scale_h(t) in float16, this thread's rows (tokens g, g+8) times their
    // scale, transposed into the B operand (k-slot i <-> token t0 + i, column g <-> query g);
    // and the zero points' sums.
    const uint32_t pg = pack_f16x2(p[0], p[1]), pg8 = pack_f16x2(p[2], p[3]);
    const __half2 vs_g = *reinterpret_cast<const __half2*>(&sc.vs[0]);
    const __half2 vs_g8 = *reinterpret_cast<const __half2*>(&sc.vs[1]);
    const float2 vz_g = f16x2_to_float2(sc.vz[0]), vz_g8 = f16x2_to_float2(sc.vz[1]);
    uint32_t pb[2][2];
  #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const __half2 s_g = h ? __high2half2(vs_g) : __low2half2(vs_g);
      const __half2 s_g8 = h ? __high2half2(vs_g8) : __low2half2(vs_g8);
      const __half2 r0 = __hmul2(*reinterpret_cast<const __half2*>(&pg), s_g);
      const __half2 r1 = __hmul2(*reinterpret_cast<const __half2*>(&pg8), s_g8);
      pb[h][0] = transpose8x8(*reinterpret_cast<const uint32_t*>(&r0));
      pb[h][1] = transpose8x8(*reinterpret_cast<const uint32_t*>(&r1));
      const float z0 = h ? vz_g.y : vz_g.x, z1 = h ? vz_g8.y : vz_g8.x;
  #pragma unroll
      for (int u = 0; u < 2; ++u) zs[h][u] = zs[h][u] * alpha[u] + (p[u] * z0 + p[2 + u] * z1);
    }
    // O^T += V^T P'^T: word k of a token row holds bytes 4k..4k+3 of this thread's D/16;
    // prmt pairs tokens (2t, 2t+1) and (2t+8, 2t+9) byte by byte (bytes 0, 1 | 2, 3), and the
    // nibble of each byte pair lands in the two halves of one float16x2.
  #pragma unroll
    for (int k = 0; k < VW; ++k) {
  #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const uint32_t sel = e ? 0x7632 : 0x5410;
        const uint32_t r01 = prmt(vw[0][k], vw[1][k], sel), r23 = prmt(vw[2][k], vw[3][k], sel);
        const uint32_t s01 = byte_shift(r01), s23 = byte_shift(r23);  // each pair's 2nd byte
        const uint32_t lo[4] = {low_nibbles(r01), low_nibbles(s01), low_nibbles(r23),
                                low_nibbles(s23)};
        mma_16816(o[0][2 * k + e], lo, pb[0][0], pb[0][1]);
        const uint32_t hi[4] = {high_nibbles(r01), high_nibbles(s01), high_nibbles(r23),
                                high_nibbles(s23)};
        mma_16816(o[1][2 * k + e], hi, pb[1][0], pb[1][1]);
      }
    }
  }

  // The end of the chunk: queries 2t + u's sums and zero-point corrections over the 8 lanes,
  // the two units out, and finish_head's write.
  __device__ __forceinline__ void finish(const Args& a, uint8_t* smem, const WarpWork& w, int g) {
#pragma unroll
    for (int d = 4; d < 32; d *= 2) {
#pragma unroll
      for (int u = 0; u < 2; ++u) {
        l[u] += __shfl_xor_sync(FULL, l[u], d);
        zs[0][u] += __shfl_xor_sync(FULL, zs[0][u], d);
        zs[1][u] += __shfl_xor_sync(FULL, zs[1][u], d);
      }
    }
    float ov[2][D / 8];
    int base[D / 32];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float shift = zs[h][u], unit = h ? HIGH_UNIT : LOW_UNIT;
#pragma unroll
        for (int k = 0; k < VW; ++k) {  // channels h * D/2 + g * D/16 + 4k + (0..3)
          const int n = h * VW + k;
          base[n] = h * (D / 2) + g * (D / 16) + 4 * k;
          ov[u][4 * n] = unit * o[h][2 * k][u] + shift;
          ov[u][4 * n + 1] = unit * o[h][2 * k][2 + u] + shift;
          ov[u][4 * n + 2] = unit * o[h][2 * k + 1][u] + shift;
          ov[u][4 * n + 3] = unit * o[h][2 * k + 1][2 + u] + shift;
        }
      }
    }
    finish_head<T, D>(a, smem, ov, base, m, l, 1.f, w.kv_head, w.start, w.end, w.n_chunks);
  }
};

// INT4 decode through each warp's own cp.async ring (every GPU; int4_decode_tma below feeds
// the common launch on sm_90+ instead).
template <typename T, int D>
__device__ void int4_decode(const Args& a) {
  constexpr int KW = D / 32, VW = D / 64;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const WarpWork w(a);
  if (w.idle()) return;
  const int end = w.end;

  extern __shared__ __align__(128) uint8_t smem[];
  Int4Stage<D>* ring = reinterpret_cast<Int4Stage<D>*>(smem) + warp * STAGES;
  Int4Head<T, D> head(a, w, g, t);

  TableAhead entries(a, w, lane);
  const LaneCopies<D / 2> lanes(a, lane);   // (blocks of < 16 tokens)
  const Int4Copier<D> copier(a, w, ring, lane);  // (the others)
  const FragmentOffsets<D> frag(g, t);
  int copied = 0, copy_stage = 0;
  auto copy = [&]() {
    const int t0 = w.first + copied * w.step, blk = entries.at(a, w, copied, lane);
    if constexpr (SMALL_BLOCKS)
      copy_int4_tile<D>(ring[copy_stage], lanes, a, w.k_head, w.v_minus_k, w.table, w.kv_head,
                        t0, end, lane, blk);
    else
      copier.tile(a, copy_stage * sizeof(Int4Stage<D>), blk, t0, end, lane);
    ++copied;
    copy_stage = copy_stage == STAGES - 1 ? 0 : copy_stage + 1;
  };
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < w.n_tiles) copy();
    cp_async_commit();
  }
  int stage = 0;
  for (int i = 0, t0 = w.first; i < w.n_tiles; ++i, t0 += w.step) {
    cp_async_wait<STAGES - 2>();
    __syncwarp();
    if (i + STAGES - 1 < w.n_tiles) copy();
    cp_async_commit();
    const Int4Stage<D>& st = ring[stage];
    stage = stage == STAGES - 1 ? 0 : stage + 1;
    uint32_t kw[2][KW], vw[4][VW];
    frag.read(kw, vw, st);
    Int4TileScales sc;  // (zeros past the end: the copies' mask)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int tk = g + 8 * r;
      sc.ks[r] = st.ks[tk]; sc.kz[r] = st.kz[tk]; sc.vs[r] = st.vs[tk]; sc.vz[r] = st.vz[tk];
      sc.real[r] = t0 + tk < end;
    }
    head.tile(kw, vw, sc);
  }
  cp_async_wait<0>();
  head.finish(a, smem, w, g);
}

// ---------------------------------------------------------------------------------------
// INT4 fed by the TMA unit (sm_90+): the common launch, head_dim 128 with one warp per head
// and 8 KV heads a CTA (TMA_HEADS), blocks of >= 16 tokens. In int4_decode every warp spends
// ~40 instructions a tile on its own copies (addresses, 6 cp.async, the table look-ahead's
// shuffle, the ring's bookkeeping), and INT4 is short of issue slots (docs/lab_notes.md).
// Here the CTA's 8 warps share one ring of STAGES tiles, each tile all 8 heads' 16 tokens:
// * one thread asks the TMA unit for a whole tile: the K and V codes as two boxes of
//   16 tokens x 4 head pairs x 128 bytes (8 KB each, one DRAM stream of whole token rows), and
//   each of the 4 (scale, zero) tensors as a box of 16 tokens x 8 heads (512 bytes); the
//   tile's `full` barrier completes when all their bytes have landed;
// * the warps take turns at that: at step i, warp i % 8 refills the stage tile i - TMA_LAG
//   used, with tile i - TMA_LAG + STAGES, once all 8 warps have arrived on that stage's
//   `empty` barrier (they do after their last read of it);
// * the unit writes the codes 128-byte swizzled (16-byte chunk c of 128-byte row r at
//   c ^ (r % 8)); row r = 4 token + pair, so a token's swizzle depends on its parity only,
//   and a warp's head is half of each row: tokens of one parity meet on the same 16 banks.
//   The MMA rows take the tokens permuted (row_token: bit 0 flipped where bit 1 is set), so
//   that each group of lanes served together reads tokens of both parities: K's reads are
//   conflict-free, V's take 2 wavefronts where 1 would do (24 a tile against 16 ideal and
//   40 in plain order; paged_ref/course/banks.py counts them);
// * slots past the end hold whatever the cache holds there: codes are finite numbers, their
//   scores are masked, and their V pairs are zeroed before they meet a weight of 0.
#ifndef INT4_TMA
#define INT4_TMA 1  // 0: no int4_decode_tma entry points (cuda_fp8.py then runs int4_decode)
#endif
#define TMA_HEADS 8
#ifndef TMA_LAG  // at step i, the stage of tile i - TMA_LAG is refilled (with tile i - TMA_LAG
                 // + STAGES): the slack the slowest warp has before its turn's warp waits. With
                 // 4 stages (the plans' default here), 2: two tiles ahead, as with 3 and 1
#define TMA_LAG (STAGES >= 4 ? 2 : 1)
#endif
struct Int4TmaStage {  // one tile of the CTA's 8 heads, as the TMA unit writes it
  uint8_t k[TILE * TMA_HEADS * 64];  // [token][head pair][128 bytes], swizzled
  uint8_t v[TILE * TMA_HEADS * 64];
  uint32_t pairs[4][TILE * TMA_HEADS];  // k_scale, k_zero, v_scale, v_zero: [token][head]
};
static_assert(sizeof(Int4TmaStage) % 1024 == 0, "stages keep the swizzle's 1024-byte alignment");

// The token of MMA row r of a tile (r < 16): bit 0 flipped where bit 1 is set (see above)
__device__ __forceinline__ int row_token(int r) { return r ^ ((r >> 1) & 1); }

template <typename T>
__device__ void int4_decode_tma(const Args& a) {
  constexpr int D = 128, KW = D / 32, VW = D / 64;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int warps = blockDim.x / 32;  // = TMA_HEADS
  constexpr int AHEAD = STAGES - TMA_LAG;  // tiles in flight (or landed) ahead of the one used
  static_assert(AHEAD >= 1, "TMA_LAG < STAGES");
  const WarpWork w(a);
  if (w.idle()) return;
  const int end = w.end;

  // The ring at the first 1024-byte boundary (cuda_fp8.py allows the slack), then its
  // barriers: full[s] (1 arrival + the tile's bytes) and empty[s] (one arrival per warp).
  extern __shared__ __align__(1024) uint8_t smem[];
  const uint32_t base = (shared_address(smem) + 1023) & ~1023u;
  const uint32_t full = base + STAGES * sizeof(Int4TmaStage), empty = full + 8 * STAGES;
  if (threadIdx.x == 0) {
    for (int s = 0; s < STAGES; ++s) {
      barrier_init(full + 8 * s, 1);
      barrier_init(empty + 8 * s, warps);
    }
    barrier_init_fence();
  }
  __syncthreads();

  // Tile p (tokens first + 16 p of the chunk, all in one block) into stage p % STAGES.
  const int head0 = blockIdx.x * TMA_HEADS, in_block = (1 << a.block_shift) - 1;
  auto issue = [&](int p, int blk) {
    const uint32_t dst = base + (p % STAGES) * sizeof(Int4TmaStage), bar = full + 8 * (p % STAGES);
    const int row0 = (w.first + p * TILE) & in_block;
    barrier_arrive_expect(bar, sizeof(Int4TmaStage));
    tma_load_4d(dst, &a.k_map, 0, head0 / 2, row0, blk, bar);
    tma_load_4d(dst + offsetof(Int4TmaStage, v), &a.v_map, 0, head0 / 2, row0, blk, bar);
#pragma unroll
    for (int n = 0; n < 4; ++n)
      tma_load_3d(dst + offsetof(Int4TmaStage, pairs) + n * 4 * TILE * TMA_HEADS,
                  &a.pair_maps[n], head0, row0, blk, bar);
  };
  auto entry = [&](int p) {
    return p < w.n_tiles ? w.table[(w.first + p * TILE) >> a.block_shift] : 0;
  };
  if (threadIdx.x == 0) {
#pragma unroll
    for (int p = 0; p < AHEAD; ++p)
      if (p < w.n_tiles) issue(p, entry(p));
  }
  // This warp issues tiles warp + AHEAD, then every 8th; lane 0 reads each one's table entry
  // 8 tiles ahead.
  int turn = warp, turn_blk = lane == 0 ? entry(warp + AHEAD) : 0;

  // Where this thread's fragments lie in stage 0 (shared addresses; see Int4Head::tile for
  // which rows): K rows g, g + 8 (tokens row_token(g) + 0, 8) at k_at, + 4096; V rows
  // 2t + e + 8 (j >> 1), e = j & 1 (tokens row_token(2t + e) + 8 (j >> 1)) at v_at[e] +
  // 4096 (j >> 1) (a token's swizzle is its parity's: tokens 8 apart share it); and K rows
  // g, g + 8's (scale, zero) pairs at pair_at + 4 * 16 * 8 n, + 8 * 32.
  // (Each passes through an identity shuffle: ptxas, short of registers, would otherwise
  // work them out again from threadIdx in every tile, ~30 instructions.)
  const int pair = warp / 2, side = warp % 2;  // this head's pair, and its half of the row
  const int k_token = row_token(g);
  const uint32_t k_at = __shfl_sync(FULL, base + (4 * k_token + pair) * 128 +
                                    ((4 * side + t) ^ (4 * (k_token & 1) + pair)) * 16, lane);
  uint32_t v_at[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    const int v_token = row_token(2 * t + e);
    v_at[e] = __shfl_sync(FULL, base + offsetof(Int4TmaStage, v) + (4 * v_token + pair) * 128 +
                                    ((4 * side + g / 2) ^ (4 * (v_token & 1) + pair)) * 16 +
                                    (g % 2) * 8, lane);
  }
  const uint32_t pair_at = __shfl_sync(FULL, base + offsetof(Int4TmaStage, pairs) +
                                       4 * (k_token * TMA_HEADS + warp), lane);
  const int k_end = __shfl_sync(FULL, end - k_token, lane);  // row g is real while t0 < this
  Int4Head<T, D> head(a, w, g, t);

  int stage = 0;
  uint32_t phase = 0;  // parity of the ring's pass (flips when stage wraps to 0)
  for (int i = 0, t0 = w.first; i < w.n_tiles; ++i, t0 += TILE) {
    barrier_wait(full + 8 * stage, phase);  // tile i has landed
    if (i == turn) {  // this warp's turn: tile i + AHEAD into the stage tile i - TMA_LAG used
      turn += warps;
      if (lane == 0 && i + AHEAD < w.n_tiles) {
        const int used = i - TMA_LAG;
        if (used >= 0) barrier_wait(empty + 8 * (used % STAGES), (used / STAGES) & 1);
        issue(i + AHEAD, turn_blk);
        turn_blk = entry(turn + AHEAD);
      }
    }
    const uint32_t at = stage * (uint32_t)sizeof(Int4TmaStage);
    uint32_t kw[2][KW], vw[4][VW];
#pragma unroll
    for (int j = 0; j < 2; ++j) load_shared_16(kw[j], k_at + at + 4096 * j);
#pragma unroll
    for (int j = 0; j < 4; ++j) load_shared_8(vw[j], v_at[j & 1] + at + 4096 * (j >> 1));
    Int4TileScales sc;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const uint32_t pa = pair_at + at + 8 * 32 * r;
      const bool real = t0 + 8 * r < k_end;
      sc.ks[r] = load_shared_4(pa);
      sc.kz[r] = load_shared_4(pa + 4 * TILE * TMA_HEADS);
      sc.vs[r] = real ? load_shared_4(pa + 8 * TILE * TMA_HEADS) : 0u;
      sc.vz[r] = real ? load_shared_4(pa + 12 * TILE * TMA_HEADS) : 0u;
      sc.real[r] = real;
    }
    head.tile(kw, vw, sc);
    __syncwarp();  // every lane's reads of the stage are done:
    if (lane == 0) barrier_arrive(empty + 8 * stage);  // (it may be refilled)
    if (++stage == STAGES) {
      stage = 0;
      phase ^= 1;
    }
  }
  head.finish(a, smem, w, g);
}

// Combine the chunks of each (sequence, query head): grid (Hq, B), blockDim.x / 32 warps
// (<= MAX_MERGE_WARPS). Warp w folds chunks w, w + warps, ... (each lane D/32 channels), then
// the warps fold together: many chunks (one long sequence) are read by many warps at once.
#define MAX_MERGE_WARPS 16
template <typename T, int D>
__device__ void fp8_merge(const Args& a) {
  constexpr int PER_LANE = D / 32;
  // Launched as a programmatic dependent of the decode kernel (Hopper+, cuda_fp8.py): this
  // CTA may start while the decode kernel still runs; wait here until it has finished and
  // its partials are visible. (A plain launch passes straight through.)
  dependent_launch_wait();
  const int qh = blockIdx.x, b = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  const int n_chunks = (min(a.seq_lens[b], a.max_len) + a.chunk_len - 1) / a.chunk_len;
  if (n_chunks <= 1) return;  // written by fp8_decode
  const long long r0 = ((long long)b * gridDim.x + qh) * a.max_chunks;
  float m = -INFINITY, den = 0.f, num[PER_LANE] = {};
#pragma unroll 4
  for (int c = warp; c < n_chunks; c += warps) {
    const float lse = a.part_lse[r0 + c];
    float val[PER_LANE];
#pragma unroll
    for (int i = 0; i < PER_LANE; i += 2) {
      const float2 v2 = *reinterpret_cast<const float2*>(a.part_o + (r0 + c) * D + lane * PER_LANE + i);
      val[i] = v2.x; val[i + 1] = v2.y;
    }
    const float m_new = fmaxf(m, lse);  // finite: every chunk below n_chunks has a token
    const float alpha = fast_exp2(m - m_new), f = fast_exp2(lse - m_new);
    den = den * alpha + f;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) num[i] = num[i] * alpha + f * val[i];
    m = m_new;
  }
  __shared__ float sm_m[MAX_MERGE_WARPS], sm_den[MAX_MERGE_WARPS], sm_num[MAX_MERGE_WARPS][D];
  if (lane == 0) { sm_m[warp] = m; sm_den[warp] = den; }
#pragma unroll
  for (int i = 0; i < PER_LANE; ++i) sm_num[warp][lane * PER_LANE + i] = num[i];
  __syncthreads();
  float mm = -INFINITY;
  for (int w = 0; w < warps; ++w) mm = fmaxf(mm, sm_m[w]);
  for (int ch = threadIdx.x; ch < D; ch += blockDim.x) {
    float d = 0.f, n = 0.f;
    for (int w = 0; w < warps; ++w) {
      const float f = sm_m[w] == -INFINITY ? 0.f : fast_exp2(sm_m[w] - mm);
      d += f * sm_den[w];
      n += f * sm_num[w][ch];
    }
    reinterpret_cast<T*>(a.out)[b * a.o_sb + (long long)qh * a.o_sh + ch] = T(n / d);
  }
}

// extern "C" entry points: fp8_decode_{f16,bf16}_d{64,128,256}[_token], int4_decode_...,
// fp8_merge_... (the merge is the same for both formats)
// (head_dim 256 holds twice the fragments: one CTA of MAX_WARPS per SM, else it spills)
#define DECODE(NAME, T, D, TOKEN)                                                        \
  extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, D == 256 ? 1 : MIN_BLOCKS)  \
      NAME(const __grid_constant__ Args a) {                                                                 \
    allow_dependent_launch();                                                              \
    fp8_decode<T, D, TOKEN>(a);                                                          \
  }
#define MERGE(NAME, T, D) \
  extern "C" __global__ void __launch_bounds__(MAX_MERGE_WARPS * 32) NAME(const __grid_constant__ Args a) { fp8_merge<T, D>(a); }
#define INT4(NAME, T, D)                                                                 \
  extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, D == 256 ? 1 : MIN_BLOCKS)  \
      NAME(const __grid_constant__ Args a) {                                                                 \
    allow_dependent_launch();                                                              \
    int4_decode<T, D>(a);                                                                  \
  }
#if INT4_TMA && (!defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900)  // (the TMA unit: sm_90+)
#define INT4_TMA_ENTRY(NAME, T)                                                           \
  extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, MIN_BLOCKS)                 \
      NAME(const __grid_constant__ Args a) {                                               \
    allow_dependent_launch();                                                              \
    int4_decode_tma<T>(a);                                                                 \
  }
INT4_TMA_ENTRY(int4_decode_tma_f16_d128, __half)
INT4_TMA_ENTRY(int4_decode_tma_bf16_d128, __nv_bfloat16)
#endif
#define ALL(TN, T, D)                                   \
  DECODE(fp8_decode_##TN##_d##D, T, D, false)           \
  DECODE(fp8_decode_##TN##_d##D##_token, T, D, true)    \
  INT4(int4_decode_##TN##_d##D, T, D)                   \
  MERGE(fp8_merge_##TN##_d##D, T, D)

ALL(f16, __half, 64)
ALL(f16, __half, 128)
ALL(f16, __half, 256)
ALL(bf16, __nv_bfloat16, 64)
ALL(bf16, __nv_bfloat16, 128)
ALL(bf16, __nv_bfloat16, 256)
