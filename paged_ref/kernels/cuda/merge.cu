// The second kernel of a chunked launch, for every decode kernel (FP8 or INT4: they all write
// the same float32 partials): each chunk's normalised output and log2-sum-exp -> the answer.
// plans.py launches it on Hopper+ as a programmatic dependent of the decode kernel, so it
// starts without a launch gap.
#pragma once

#include "common.cuh"

// Combine the chunks of each (sequence, query head): grid (Hq, B), blockDim.x / 32 warps
// (<= MAX_MERGE_WARPS). Warp w folds chunks w, w + warps, ... (each lane D/32 channels), then
// the warps fold together: many chunks (one long sequence) are read by many warps at once.
#define MAX_MERGE_WARPS 16
template <typename T, int D>
__device__ void merge_chunks(const Args& a) {
  constexpr int PER_LANE = D / 32;
  // Launched as a programmatic dependent of the decode kernel (Hopper+, plans.py): this
  // CTA may start while the decode kernel still runs; wait here until it has finished and
  // its partials are visible. (A plain launch passes straight through.)
  dependent_launch_wait();
  const int qh = blockIdx.x, b = blockIdx.y, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int warps = blockDim.x / 32;
  const int n_chunks = (min(a.seq_lens[b], a.max_len) + a.chunk_len - 1) / a.chunk_len;
  if (n_chunks <= 1) return;  // written by the decode kernel
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

// extern "C" entry points: merge_chunks_{f16,bf16}_d{64,128,256}
#define MERGE_CHUNKS(NAME, T, D)                                        \
  extern "C" __global__ void __launch_bounds__(MAX_MERGE_WARPS * 32)    \
      NAME(const __grid_constant__ Args a) {                            \
    merge_chunks<T, D>(a);                                              \
  }
#define MERGE_ENTRIES(TN, T, D) MERGE_CHUNKS(merge_chunks_##TN##_d##D, T, D)

EACH_DTYPE_AND_HEAD_DIM(MERGE_ENTRIES)
