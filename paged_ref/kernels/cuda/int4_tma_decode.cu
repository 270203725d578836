// INT4 decode fed by the TMA unit (sm_90+): the common launch, head_dim 128 with one warp per head
// and 8 KV heads a CTA (TMA_HEADS), blocks of >= 16 tokens. In int4_decode every warp spends
// ~40 instructions a tile on its own copies (addresses, 6 cp.async, the table look-ahead's
// shuffle, the ring's bookkeeping), and INT4 is short of issue slots.
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
//   40 in plain order; paged_course/banks.py counts them);
// * slots past the end hold whatever the cache holds there: codes are finite numbers, their
//   scores are masked, and their V pairs are zeroed before they meet a weight of 0.
#pragma once

#include "int4_head.cuh"

#define TMA_HEADS 8  // KV heads a CTA (plans.py's TMA_HEADS)
// At step i, the stage of tile i - TMA_LAG is refilled (with tile i - TMA_LAG + STAGES): the
// slack the slowest warp has before its turn's warp waits. With 4 or 5 stages (the plans'
// choices here), 2: two or three tiles ahead; with 2 or 3 (asked for), 1.
#define TMA_LAG (STAGES >= 4 ? 2 : 1)

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

  // The ring at the first 1024-byte boundary (plans.py allows the slack), then its
  // barriers: full[s] (1 arrival + the tile's bytes) and empty[s] (one arrival per warp).
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

// extern "C" entry points: int4_decode_tma_{f16,bf16}_d128 (the TMA unit: sm_90+ only)
#if !defined(__CUDA_ARCH__) || __CUDA_ARCH__ >= 900
#define INT4_TMA_DECODE(NAME, T)                                                           \
  extern "C" __global__ void __launch_bounds__(MAX_WARPS * 32, MIN_BLOCKS)                 \
      NAME(const __grid_constant__ Args a) {                                               \
    allow_dependent_launch();                                                              \
    int4_decode_tma<T>(a);                                                                 \
  }
INT4_TMA_DECODE(int4_decode_tma_f16_d128, __half)
INT4_TMA_DECODE(int4_decode_tma_bf16_d128, __nv_bfloat16)
#endif
