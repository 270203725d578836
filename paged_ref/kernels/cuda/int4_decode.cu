// INT4 decode through each warp's own cp.async ring (every GPU; on sm_90+ the common launch,
// head_dim 128 with one warp per head and 8 KV heads a CTA, runs int4_tma_decode.cu's kernel
// instead). The warps, the ring, the table look-ahead and the softmax are fp8_decode's; the
// copies (Int4Copier) and the fragment reads (FragmentOffsets) are worked out once per lane;
// Int4Head (int4_head.cuh) turns the codes into MMA operands.
#pragma once

#include "int4_head.cuh"

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

// One warp per (KV head, part of a chunk), its own ring of STAGES Int4Stage tiles: as fp8_decode,
// with Int4Head doing the arithmetic.
template <typename T, int D>
__device__ void int4_decode(const Args& a) {
  constexpr int KW = D / 32, VW = D / 64;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int g = lane / 4, t = lane % 4;
  const WarpWork w(a);
  if (w.idle()) return;
  const int end = w.end;

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

// extern "C" entry points: int4_decode_{f16,bf16}_d{64,128,256}
// (head_dim 256 holds twice the fragments: one CTA of MAX_WARPS per SM, else it spills)
#define INT4_DECODE(NAME, T, D)                                                            \
  extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, D == 256 ? 1 : MIN_BLOCKS)  \
      NAME(const __grid_constant__ Args a) {                                               \
    allow_dependent_launch();                                                              \
    int4_decode<T, D>(a);                                                                  \
  }
#define INT4_ENTRIES(TN, T, D) INT4_DECODE(int4_decode_##TN##_d##D, T, D)

EACH_DTYPE_AND_HEAD_DIM(INT4_ENTRIES)
