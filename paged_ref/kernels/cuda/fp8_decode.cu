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
//   (swizzled: common.cuh), so each 128-byte line copies as one L2 request and the fragment reads
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
// The cache: e4m3 codes [num_blocks, block_size, Hkv, D] and float32 scales, one per tensor
// or one per token-head [num_blocks, block_size, Hkv] (the _token kernels).
#pragma once

#include "warp.cuh"

// One warp's stage of the shared-memory ring: a 16-token tile of K and V codes (swizzled, no
// padding: every array starts 128-byte aligned) and the token-head scales.
template <int D>
struct Stage {
  static constexpr int ROW = D;  // bytes a row
  uint8_t k[TILE * ROW];
  uint8_t v[TILE * ROW];
  float ks[TILE], vs[TILE];
};
// (plans.py's shared_bytes mirrors this size; the merge of a head's warps reuses the ring)
static_assert(sizeof(Stage<128>) == 2 * TILE * 128 + 2 * TILE * 4, "Stage size");
static_assert(sizeof(Stage<64>) % 128 == 0, "each stage keeps the next one 128-byte aligned");
static_assert(2 * sizeof(Stage<64>) >= MAX_GROUP * (64 + 4) * 4, "merge space per warp");

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
  lc.template tile<FP8_L2_PREFETCH>(st.k, st.v, a, k_head, v_minus_k, table, t0, end, blk);
  if constexpr (TOKEN_SCALE) {
    bool ok;
    const long long s = scale_slot(a, table, head, t0, end, lane, blk, ok);
    const int row = lane % TILE;
    if (lane < TILE) cp_async_4(st.ks + row, a.k_scale + s, ok);
    else cp_async_4(st.vs + row, a.v_scale + s, ok);
  }
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

  // smem (common.cuh): STAGES tiles per warp, then reused by finish_head
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

// extern "C" entry points: fp8_decode_{f16,bf16}_d{64,128,256}[_token] (_token: token-head
// scales). (head_dim 256 holds twice the fragments: one CTA of MAX_WARPS per SM, else it spills)
#define FP8_DECODE(NAME, T, D, TOKEN)                                                      \
  extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, D == 256 ? 1 : MIN_BLOCKS)  \
      NAME(const __grid_constant__ Args a) {                                               \
    allow_dependent_launch();                                                              \
    fp8_decode<T, D, TOKEN>(a);                                                            \
  }
#define FP8_ENTRIES(TN, T, D)                           \
  FP8_DECODE(fp8_decode_##TN##_d##D, T, D, false)       \
  FP8_DECODE(fp8_decode_##TN##_d##D##_token, T, D, true)

EACH_DTYPE_AND_HEAD_DIM(FP8_ENTRIES)
