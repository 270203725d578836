// What a decode warp does the same for FP8 (fp8_decode.cu) and INT4 (int4_decode.cu,
// int4_tma_decode.cu): which tiles it takes (WarpWork), the block-table entries looked up
// ahead (TableAhead), a per-warp ring's copies (LaneCopies, scale_slot), fragment reads from
// the swizzled tiles (read_words), the online softmax's step (softmax_step), P^T into an MMA
// operand (transpose8x8) and the end of a chunk (finish_head).
#pragma once

#include "common.cuh"

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
    const int c_sb = (int)a.c_sb, c_st = (int)a.c_st;  // (plans.py checks they fit an int)
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
