// Paged decode attention over an FP8 (e4m3) KV cache, hand-written for NVIDIA GPUs with
// FP8 conversion instructions (compute capability 8.9+: Ada, Hopper, Blackwell).
//
// Why a CUDA kernel next to the Triton ones? Lesson 10 measured the Triton FP8 kernel at
// ~2/3 of copy bandwidth: per token it issues ~3x the instructions of the bf16 kernel (the
// 8-bit V tile reaches the tensor cores through byte-wide shared-memory loads, because
// ldmatrix.trans moves 16-bit elements only). Here each thread reads from shared memory only
// the bytes its own MMA fragments need, in 16-byte loads:
//
// * one warp owns whole 16-token tiles (warp w of a CTA takes tiles w, w + WARPS, ...), with
//   its own online softmax; the warps of a CTA merge once at the end;
// * each warp copies its next STAGES - 1 tiles global -> shared with cp.async (a ring; no
//   registers held, only __syncwarp between lanes), whole 128-byte token rows per instruction;
// * S = Q K^T and O += P V are mma.sync m16n8k16 (float16 in, float32 accumulate): rows are
//   the query heads of one KV head (GROUP <= 8 of the 16 rows are real);
// * the order of a dot product's terms is free, so each thread's channels are chosen to be
//   contiguous in memory: for K a thread reads 32 bytes of one token (D = 128), for V 16 bytes
//   of each of 4 tokens; Q (loaded once) and the output use the same channel order;
// * V's MMA operand wants two *tokens* of one channel in each 16-bit half: two byte permutes
//   (prmt) build them from two token rows, then one cvt.rn.f16x2.e4m3x2 makes two float16s;
// * P comes out of the S accumulator already in the A-operand layout of the P V MMA.
//
// Cache layout as everywhere in paged_ref: codes [num_blocks, block_size, Hkv, D] (bytes),
// scales float32 (one per tensor, or one per token-head [num_blocks, block_size, Hkv]).
// Long sequences are cut into chunks (blockIdx.y); each chunk writes a normalised partial
// output and its log2-sum-exp, and fp8_merge combines them.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

#ifndef WARPS
#define WARPS 4  // per CTA; they share the chunk's tiles
#endif
#define TILE 16
#define MAX_GROUP 8
#ifndef MIN_BLOCKS
#define MIN_BLOCKS 1  // __launch_bounds__'s CTAs per SM (caps registers when > 1)
#endif
#ifndef L2_PREFETCH
#define L2_PREFETCH 256  // cp.async's L2 prefetch size in bytes (0, 128 or 256)
#endif
#ifndef STAGES
#define STAGES 3  // tiles in a warp's shared-memory ring (STAGES - 1 in flight)
#endif

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

__device__ __forceinline__ void cp_async_16(void* smem, const void* global, bool valid) {
  // 16 bytes global -> shared without passing through registers; zeros when !valid.
  // L2_PREFETCH 128 / 256: L2 fetches the whole 128 / 256-byte line around the address.
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
#if L2_PREFETCH == 256
  asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(dst),
               "l"(global), "r"(valid ? 16 : 0));
#elif L2_PREFETCH == 128
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(dst),
               "l"(global), "r"(valid ? 16 : 0));
#else
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dst), "l"(global),
               "r"(valid ? 16 : 0));
#endif
}
__device__ __forceinline__ void cp_async_4(void* smem, const void* global, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(dst), "l"(global),
               "r"(valid ? 4 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {  // all but the newest N groups have landed
  asm volatile("cp.async.wait_group %0;" ::"n"(N));
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
  long long q_sb, q_sh;       // strides (elements)
  long long o_sb, o_sh;
  long long c_sb, c_st, c_sh; // cache strides (elements = bytes)
  long long s_sb, s_st, s_sh; // token-head scale strides (0 for a per-tensor scale)
  long long table_sb;
  int block_shift;            // log2(block_size): block sizes are powers of two here
  int group, chunk_len, max_chunks;
  float qk_scale_log2;        // softmax scale * log2(e)
};

// One warp's stage of the shared-memory ring: a 16-token tile of K and V codes, rows padded
// by 16 bytes (so the fragment reads below hit 32 different banks), and the token-head scales.
template <int D>
struct Stage {
  static constexpr int ROW = D + 16;
  uint8_t k[TILE * ROW];
  uint8_t v[TILE * ROW];
  float ks[TILE], vs[TILE];
};
// (cuda_fp8.py's shared_bytes mirrors this size; the final merge of the warps reuses the ring)
static_assert(sizeof(Stage<128>) == 2 * TILE * (128 + 16) + 2 * TILE * 4, "Stage size");
static_assert(WARPS * STAGES * sizeof(Stage<64>) >= WARPS * MAX_GROUP * (64 + 2) * 4, "merge");

// Lane `lane` of a warp starts copying tile [t0, t0 + 16) into `st`: each instruction copies
// whole token rows (D / 16 lanes of 16 bytes per row: full 128-byte lines for D = 128, which
// DRAM serves better than the same bytes spread over more rows per instruction); tokens past
// `end` are zero-filled and never read. k_head / v_head: the caches at this KV head.
template <int D, bool TOKEN_SCALE>
__device__ __forceinline__ void copy_tile(Stage<D>& st, const Args& a, const uint8_t* k_head,
                                          const uint8_t* v_head, const int* table, int head,
                                          int t0, int end, int lane) {
  constexpr int PIECES = D / 16, ROWS_PER_STEP = 32 / PIECES;  // per instruction
  const int piece = lane % PIECES, row0 = lane / PIECES;
  const int mask = (1 << a.block_shift) - 1;
  // Blocks of >= 16 tokens: tiles start at multiples of 16, so the whole tile lies in one
  // block: one table entry, rows c_st apart. Smaller blocks: a table entry per row.
  const bool one_block = a.block_shift >= 4;
  const long long tile_base =
      one_block && t0 < end ? table[t0 >> a.block_shift] * a.c_sb + (t0 & mask) * a.c_st : 0;
#pragma unroll
  for (int i = 0; i < TILE / ROWS_PER_STEP; ++i) {
    const int row = row0 + i * ROWS_PER_STEP, tok = t0 + row;
    const bool ok = tok < end;
    long long off = tile_base + row * a.c_st + piece * 16;
    if (!one_block) {
      const long long blk = ok ? table[tok >> a.block_shift] : 0;
      off = blk * a.c_sb + (tok & mask) * a.c_st + piece * 16;
    }
    cp_async_16(st.k + row * Stage<D>::ROW + piece * 16, k_head + off, ok);
    cp_async_16(st.v + row * Stage<D>::ROW + piece * 16, v_head + off, ok);
  }
  if constexpr (TOKEN_SCALE) {
    const int row = lane % TILE, tok = t0 + row;
    const bool ok = tok < end;
    const long long blk = ok ? table[tok >> a.block_shift] : 0;
    const int slot = tok & ((1 << a.block_shift) - 1);
    const long long s = blk * a.s_sb + slot * a.s_st + head * a.s_sh;
    if (lane < TILE) cp_async_4(st.ks + row, a.k_scale + s, ok);
    else cp_async_4(st.vs + row, a.v_scale + s, ok);
  }
}

template <int NWORDS>
__device__ __forceinline__ void read_words(uint32_t (&dst)[NWORDS], const uint8_t* src) {
  // NWORDS 32-bit words of shared memory (16-byte aligned; 8 when NWORDS == 2)
  if constexpr (NWORDS % 4 == 0) {
#pragma unroll
    for (int i = 0; i < NWORDS; i += 4) {
      const uint4 w = reinterpret_cast<const uint4*>(src)[i / 4];
      dst[i] = w.x; dst[i + 1] = w.y; dst[i + 2] = w.z; dst[i + 3] = w.w;
    }
  } else {
    const uint2 w = *reinterpret_cast<const uint2*>(src);
    dst[0] = w.x; dst[1] = w.y;
  }
}

template <typename T, int D, bool TOKEN_SCALE>
__device__ void fp8_decode(const Args& a) {
  constexpr int KSTEPS = D / 16;  // k-steps of S = Q K^T
  constexpr int NTILES = D / 8;   // n-tiles of O = P V (8 channels each)
  // grid (Hkv, chunks, B): the KV heads of one chunk run side by side (their rows interleave
  // in memory)
  const int kv_head = blockIdx.x, chunk = blockIdx.y, b = blockIdx.z;
  const int num_kv_heads = gridDim.x;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const int seq_len = a.seq_lens[b];
  const int start = chunk * a.chunk_len;
  const int end = min(seq_len, start + a.chunk_len);
  const int n_chunks = (seq_len + a.chunk_len - 1) / a.chunk_len;
  if (chunk > 0 && chunk >= n_chunks) return;  // past this sequence's end (chunk 0 writes
                                               // zeros for an empty one)
  const int* table = a.block_tables + b * a.table_sb;
  const uint8_t* k_head = a.k + kv_head * a.c_sh;
  const uint8_t* v_head = a.v + kv_head * a.c_sh;

  extern __shared__ __align__(16) uint8_t smem[];  // STAGES tiles per warp, then reused
  Stage<D>* ring = reinterpret_cast<Stage<D>*>(smem) + warp * STAGES;

  // Q as A fragments (row g = query head kv_head * group + g; rows >= group and 8..15 are 0).
  // k-step s, slots (2t, 2t+1, 2t+8, 2t+9) <-> channels t * D/4 + 4 s + (0, 1, 2, 3).
  uint32_t qa[KSTEPS][4];
  {
    const T* qrow = reinterpret_cast<const T*>(a.q) + b * a.q_sb +
                    (long long)(kv_head * a.group + g) * a.q_sh + t * (D / 4);
    bool real = g < a.group;
#pragma unroll
    for (int s = 0; s < KSTEPS; ++s) {
      float x[4];
#pragma unroll
      for (int i = 0; i < 4; ++i) x[i] = real ? static_cast<float>(qrow[4 * s + i]) : 0.f;
      qa[s][0] = pack_f16x2(x[0], x[1]);
      qa[s][1] = 0;
      qa[s][2] = pack_f16x2(x[2], x[3]);
      qa[s][3] = 0;
    }
  }
  float o[NTILES][4];
#pragma unroll
  for (int j = 0; j < NTILES; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
  float m = -INFINITY, l = 0.f;  // row g's running max (log2 units) and this thread's sum

  const float k_scale = TOKEN_SCALE ? 1.f : __ldg(a.k_scale);
  const float score_scale = a.qk_scale_log2 * k_scale;

  // Warp w takes tiles w, w + WARPS, ... of the chunk: tile i of this warp starts at token
  // first + i * step. The ring keeps STAGES - 1 tiles in flight while one is used.
  const int first = start + warp * TILE, step = WARPS * TILE;
  const int n_tiles = first < end ? (end - first + step - 1) / step : 0;
#pragma unroll
  for (int i = 0; i < STAGES - 1; ++i) {
    if (i < n_tiles) copy_tile<D, TOKEN_SCALE>(ring[i], a, k_head, v_head, table, kv_head, first + i * step, end, lane);
    cp_async_commit();  // (an empty group keeps the counting uniform)
  }
  for (int i = 0; i < n_tiles; ++i) {
    cp_async_wait<STAGES - 2>();  // tile i has landed (this lane's copies) ...
    __syncwarp();                 // ... and every lane's; the stage read last step is free
    const int ahead = i + STAGES - 1;
    if (ahead < n_tiles)
      copy_tile<D, TOKEN_SCALE>(ring[ahead % STAGES], a, k_head, v_head, table, kv_head,
                                first + ahead * step, end, lane);
    cp_async_commit();
    const Stage<D>& st = ring[i % STAGES];
    const int t0 = first + i * step;
    uint32_t kw[2][D / 16], vw[4][D / 32];  // this thread's fragment bytes (see the header)
#pragma unroll
    for (int j = 0; j < 2; ++j) read_words(kw[j], st.k + (8 * j + g) * Stage<D>::ROW + t * (D / 4));
#pragma unroll
    for (int j = 0; j < 4; ++j)
      read_words(vw[j], st.v + (2 * t + (j & 1) + 8 * (j >> 1)) * Stage<D>::ROW + g * (D / 8));

    // S = Q K^T for tokens t0 + 8 j + (2t, 2t+1) (row g: c[j][0..1]; rows 8+: c[j][2..3])
    float c[2][4] = {};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
#pragma unroll
      for (int s = 0; s < KSTEPS; ++s) {
        const uint32_t w = kw[j][s];
        mma_16816(c[j], qa[s], e4m3x2_to_f16x2(w), e4m3x2_hi_to_f16x2(w));
      }
    }
    float x[4];  // scores (log2 units) of tokens 2t, 2t+1, 2t+8, 2t+9
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int tok = t0 + 2 * t + (i & 1) + 8 * (i >> 1);
      float sc = TOKEN_SCALE ? score_scale * st.ks[2 * t + (i & 1) + 8 * (i >> 1)] : score_scale;
      x[i] = tok < end ? c[i >> 1][i & 1] * sc : -INFINITY;
    }
    float mx = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
    mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
    const float m_new = fmaxf(m, mx);  // finite: the tile has a real token
    const float alpha = fast_exp2(m - m_new);
    float p[4];
#pragma unroll
    for (int i = 0; i < 4; ++i) p[i] = fast_exp2(x[i] - m_new);
    l = l * alpha + (p[0] + p[1]) + (p[2] + p[3]);
    m = m_new;
    if (TOKEN_SCALE) {
#pragma unroll
      for (int i = 0; i < 4; ++i) p[i] *= st.vs[2 * t + (i & 1) + 8 * (i >> 1)];
    }
    // P as the A fragment of O += P V: k-slot i <-> token t0 + i
    const uint32_t pa[4] = {pack_f16x2(p[0], p[1]), 0u, pack_f16x2(p[2], p[3]), 0u};
#pragma unroll
    for (int j = 0; j < NTILES; ++j) {
      o[j][0] *= alpha;
      o[j][1] *= alpha;
    }
    // V: n-tile j, column n <-> channel n * D/8 + j. Thread (g, t) holds channels g * D/8 + .
    // of tokens 2t, 2t+1 (v[0], v[1]) and 2t+8, 2t+9 (v[2], v[3]).
#pragma unroll
    for (int w = 0; w < D / 32; ++w) {
      const uint32_t lo01 = prmt(vw[0][w], vw[1][w], 0x5140);  // ch 4w, 4w+1
      const uint32_t hi01 = prmt(vw[0][w], vw[1][w], 0x7362);  // ch 4w+2, 4w+3
      const uint32_t lo23 = prmt(vw[2][w], vw[3][w], 0x5140);
      const uint32_t hi23 = prmt(vw[2][w], vw[3][w], 0x7362);
      mma_16816(o[4 * w + 0], pa, e4m3x2_to_f16x2(lo01), e4m3x2_to_f16x2(lo23));
      mma_16816(o[4 * w + 1], pa, e4m3x2_hi_to_f16x2(lo01), e4m3x2_hi_to_f16x2(lo23));
      mma_16816(o[4 * w + 2], pa, e4m3x2_to_f16x2(hi01), e4m3x2_to_f16x2(hi23));
      mma_16816(o[4 * w + 3], pa, e4m3x2_hi_to_f16x2(hi01), e4m3x2_hi_to_f16x2(hi23));
    }
  }
  cp_async_wait<0>();
  l += __shfl_xor_sync(0xffffffff, l, 1);
  l += __shfl_xor_sync(0xffffffff, l, 2);

  // The four warps' (m, l, O) -> one, in the ring's memory. Thread (g, t) holds row g,
  // channels 2t * D/8 + j (o[j][0]) and (2t + 1) * D/8 + j (o[j][1]).
  __syncthreads();
  float(*sm_o)[MAX_GROUP][D] = reinterpret_cast<float(*)[MAX_GROUP][D]>(smem);
  float(*sm_m)[MAX_GROUP] = reinterpret_cast<float(*)[MAX_GROUP]>(smem + WARPS * MAX_GROUP * D * 4);
  float(*sm_l)[MAX_GROUP] = sm_m + WARPS;
  if (g < a.group) {
    if (t == 0) { sm_m[warp][g] = m; sm_l[warp][g] = l; }
#pragma unroll
    for (int j = 0; j < NTILES; ++j) {
      sm_o[warp][g][2 * t * (D / 8) + j] = o[j][0];
      sm_o[warp][g][(2 * t + 1) * (D / 8) + j] = o[j][1];
    }
  }
  __syncthreads();
  const float v_scale = TOKEN_SCALE ? 1.f : __ldg(a.v_scale);
  for (int idx = threadIdx.x; idx < a.group * D; idx += WARPS * 32) {
    const int row = idx / D, ch = idx % D;
    float mm = -INFINITY;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) mm = fmaxf(mm, sm_m[w][row]);
    float den = 0.f, num = 0.f;
#pragma unroll
    for (int w = 0; w < WARPS; ++w) {
      const float f = sm_m[w][row] == -INFINITY ? 0.f : fast_exp2(sm_m[w][row] - mm);
      den += f * sm_l[w][row];
      num += f * sm_o[w][row][ch];
    }
    const int qh = kv_head * a.group + row;
    const float val = end > start ? num / den * v_scale : 0.f;
    if (n_chunks <= 1) {
      T* out = reinterpret_cast<T*>(a.out) + b * a.o_sb + (long long)qh * a.o_sh + ch;
      *out = T(val);  // (__half / __nv_bfloat16 from float: round to nearest)
    } else if (chunk < n_chunks) {
      const long long r = ((long long)b * num_kv_heads * a.group + qh) * a.max_chunks + chunk;
      a.part_o[r * D + ch] = val;
      if (ch == 0) a.part_lse[r] = mm + __log2f(den);
    }
  }
}

// Combine the chunks of each (sequence, query head): grid (Hq, B), D threads.
template <typename T, int D>
__device__ void fp8_merge(const Args& a) {
  const int qh = blockIdx.x, b = blockIdx.y, ch = threadIdx.x;
  const int n_chunks = (a.seq_lens[b] + a.chunk_len - 1) / a.chunk_len;
  if (n_chunks <= 1) return;  // written by fp8_decode
  const long long r0 = ((long long)b * gridDim.x + qh) * a.max_chunks;
  float mm = -INFINITY;
  for (int c = 0; c < n_chunks; ++c) mm = fmaxf(mm, a.part_lse[r0 + c]);
  float den = 0.f, num = 0.f;
  for (int c = 0; c < n_chunks; ++c) {
    const float f = fast_exp2(a.part_lse[r0 + c] - mm);
    den += f;
    num += f * a.part_o[(r0 + c) * D + ch];
  }
  T* out = reinterpret_cast<T*>(a.out) + b * a.o_sb + (long long)qh * a.o_sh + ch;
  *out = T(num / den);
}

// extern "C" entry points: fp8_decode_{f16,bf16}_d{64,128,256}[_token], fp8_merge_...
#define DECODE(NAME, T, D, TOKEN)                                                        \
  extern "C" __global__ void __launch_bounds__(WARPS * 32, MIN_BLOCKS) NAME(const Args a) {           \
    fp8_decode<T, D, TOKEN>(a);                                                          \
  }
#define MERGE(NAME, T, D) \
  extern "C" __global__ void NAME(const Args a) { fp8_merge<T, D>(a); }
#define ALL(TN, T, D)                                   \
  DECODE(fp8_decode_##TN##_d##D, T, D, false)           \
  DECODE(fp8_decode_##TN##_d##D##_token, T, D, true)    \
  MERGE(fp8_merge_##TN##_d##D, T, D)

ALL(f16, __half, 64)
ALL(f16, __half, 128)
ALL(f16, __half, 256)
ALL(bf16, __nv_bfloat16, 64)
ALL(bf16, __nv_bfloat16, 128)
ALL(bf16, __nv_bfloat16, 256)
