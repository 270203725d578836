// INT4 caches (paged_ref's "int4" format: two codes a byte, byte i holding channel i in its
// low nibble and channel i + D/2 in its high nibble; a float16 (scale, zero) per token-head
// for each of the two halves: x = zero + scale * code): how a warp turns a tile's codes into
// MMA operands and its scores and output (Int4Head), whichever ring the tile came from
// (int4_decode.cu's per-warp one, int4_tma_decode.cu's per-CTA one).
#pragma once

#include "warp.cuh"

// The low nibbles of x's two bytes 0 and 2 -> float16x2 (n0, n1) * 2^-24 (subnormals), and
// their high nibbles -> (n0, n1) * 2^-20.
__device__ __forceinline__ uint32_t low_nibbles(uint32_t x) { return x & 0x000f000fu; }
__device__ __forceinline__ uint32_t high_nibbles(uint32_t x) { return x & 0x00f000f0u; }
// x >> 8 (bytes 1 and 3 to where the masks take them), as the high word of x * 2^24: an
// integer multiply-add runs on the FMA pipe, a shift on the integer ALU, INT4's busiest
// (measured on the H200: 16 of a tile's ~190 ALU instructions move)
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
