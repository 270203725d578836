// How fast can a GPU read a paged FP8 cache through a block table, by each way of copying?
// No attention here: every kernel only reads K and V of its (sequence, chunk) into shared
// memory or registers, touches what arrived, and writes a checksum per CTA. Cache layout as
// everywhere in paged_ref, fixed at B64_L4096's shape: [num_blocks, 16, 8, 128] bytes
// (block 16, 8 KV heads, head_dim 128: a head's token row is 128 B, a token row 1 KiB, a
// block 16 KiB). tools/gpu/read_probe.py builds the inputs, times each kernel and profiles.
//
// * probe_cpasync_{pf256,pf0}: the CUDA FP8 kernel's copies (cuda_fp8_decode.cu): warp w of
//   a CTA takes head w % hpc, tiles part, part + wph, ... (part = w / hpc), a per-warp ring of
//   3 stages filled by cp.async.cg 16 B a lane (4 rows of 128 B per instruction), with or
//   without the L2::256B prefetch hint; probe_cpasync_swz_*: the same into 128-byte rows
//   whose 16-byte chunks are permuted (no padding: every row 128-byte aligned);
// * probe_ldg: the same tiles straight into registers (ld.global.nc.L1::no_allocate.v4);
// * probe_bulk_rows: one CTA per (sequence, chunk) with all 8 heads; a producer warp copies
//   each token row (1 KiB, 8 heads) with a 1-D TMA bulk copy (cp.async.bulk) into a padded
//   row of a 3- or 6-stage ring (2 or 1 CTAs per SM), mbarriers for full / empty stages;
//   8 consumer warps (one a head);
// * probe_bulk_tile: the same, one bulk copy per 16 KiB block of K and one of V;
// * probe_flat: the K and V buffers as one contiguous stream (grid-stride 16-byte loads).

#include <stdint.h>

#define FULL 0xffffffffu
#define TILE 16
#define HEADS 8
#define D 128
#define TOKEN_ROW (HEADS * D)       // 1024 bytes
#define BLOCK_BYTES (TILE * TOKEN_ROW)  // 16384 bytes

struct P {
  const uint8_t* k;
  const uint8_t* v;
  const int* tables;  // [B, table_sb]
  unsigned* out;      // one checksum per CTA
  long long flat_bytes;
  int table_sb, chunk_len, seq_len, hpc, wph;
};

__device__ __forceinline__ void cp_async_16(void* smem, const void* global, int pf) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if (pf)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16;" ::"r"(dst), "l"(global));
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(global));
}

// (volatile loads keep their order; this volatile no-op after all of them makes the compiler
// issue every load before the first use, so they are in flight together)
__device__ __forceinline__ void after_loads(uint4& r) {
  asm volatile("" : "+r"(r.x), "+r"(r.y), "+r"(r.z), "+r"(r.w));
}

__device__ __forceinline__ unsigned cta_id() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}

template <int PF, bool SWIZZLE>
__device__ void cpasync_warp(const P& p) {
  // rows padded by 16 bytes (as in cuda_fp8_decode.cu), or 128-byte rows with their 16-byte
  // chunks permuted (chunk c of row r at c ^ (r % 8)): every row stays 128-byte aligned
  constexpr int RING = 3, ROW = SWIZZLE ? D : D + 16;
  extern __shared__ __align__(16) uint8_t smem[];
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head = blockIdx.x * p.hpc + warp % p.hpc, part = warp / p.hpc;
  const int b = blockIdx.z, start = blockIdx.y * p.chunk_len;
  const int end = min(p.seq_len, start + p.chunk_len);
  const int first = start / TILE + part, n_tiles = max(0, (end / TILE - first + p.wph - 1) / p.wph);
  uint8_t* ring = smem + warp * RING * 2 * TILE * ROW;
  const int* table = p.tables + b * p.table_sb;
  const int piece = lane % 8, row0 = lane / 8;
  auto copy = [&](int i) {
    const int blk = table[first + i * p.wph];
    uint8_t* st = ring + (i % RING) * 2 * TILE * ROW;
    const uint8_t* src = p.k + (long long)blk * BLOCK_BYTES + row0 * TOKEN_ROW + head * D + piece * 16;
#pragma unroll
    for (int r = 0; r < TILE / 4; ++r) {
      const int row = row0 + 4 * r, at = (SWIZZLE ? piece ^ (row % 8) : piece) * 16;
      cp_async_16(st + row * ROW + at, src + 4 * r * TOKEN_ROW, PF);
      cp_async_16(st + (TILE + row) * ROW + at, src + 4 * r * TOKEN_ROW + (p.v - p.k), PF);
    }
  };
  unsigned acc = 0;
  for (int i = 0; i < RING - 1; ++i) {
    if (i < n_tiles) copy(i);
    asm volatile("cp.async.commit_group;");
  }
  for (int i = 0; i < n_tiles; ++i) {
    asm volatile("cp.async.wait_group 1;");
    __syncwarp();
    if (i + RING - 1 < n_tiles) copy(i + RING - 1);
    asm volatile("cp.async.commit_group;");
    const uint8_t* st = ring + (i % RING) * 2 * TILE * ROW;
    const uint4 a = *reinterpret_cast<const uint4*>(st + (lane % 16) * ROW + (lane / 16) * 64);
    const uint4 c = *reinterpret_cast<const uint4*>(st + (TILE + lane % 16) * ROW + (lane / 16) * 64);
    acc ^= a.x ^ a.w ^ c.y ^ c.z;
    __syncwarp();
  }
  asm volatile("cp.async.wait_group 0;");
  acc = __reduce_xor_sync(FULL, acc);
  if (lane == 0) atomicXor(p.out + cta_id(), acc);
}

extern "C" __global__ void __launch_bounds__(256) probe_cpasync_pf256(const P p) { cpasync_warp<1, false>(p); }
extern "C" __global__ void __launch_bounds__(256) probe_cpasync_pf0(const P p) { cpasync_warp<0, false>(p); }
extern "C" __global__ void __launch_bounds__(256) probe_cpasync_swz_pf256(const P p) { cpasync_warp<1, true>(p); }
extern "C" __global__ void __launch_bounds__(256) probe_cpasync_swz_pf0(const P p) { cpasync_warp<0, true>(p); }

__device__ __forceinline__ uint4 ldg_stream(const uint8_t* src) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(src));
  return r;
}

extern "C" __global__ void __launch_bounds__(256) probe_ldg(const P p) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int head = blockIdx.x * p.hpc + warp % p.hpc, part = warp / p.hpc;
  const int b = blockIdx.z, start = blockIdx.y * p.chunk_len;
  const int end = min(p.seq_len, start + p.chunk_len);
  const int first = start / TILE + part, n_tiles = max(0, (end / TILE - first + p.wph - 1) / p.wph);
  const int* table = p.tables + b * p.table_sb;
  const int piece = lane % 8, row0 = lane / 8;
  unsigned acc = 0;
  int i = 0;
  for (; i + 1 < n_tiles; i += 2) {  // two tiles (256 bytes a lane) in flight
    uint4 r[2][8];
#pragma unroll
    for (int u = 0; u < 2; ++u) {
      const int blk = table[first + (i + u) * p.wph];
      const uint8_t* src = p.k + (long long)blk * BLOCK_BYTES + row0 * TOKEN_ROW + head * D + piece * 16;
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        r[u][q] = ldg_stream(src + 4 * q * TOKEN_ROW);
        r[u][4 + q] = ldg_stream(src + 4 * q * TOKEN_ROW + (p.v - p.k));
      }
    }
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int q = 0; q < 8; ++q) after_loads(r[u][q]);
#pragma unroll
    for (int u = 0; u < 2; ++u)
#pragma unroll
      for (int q = 0; q < 8; ++q) acc ^= r[u][q].x ^ r[u][q].y ^ r[u][q].z ^ r[u][q].w;
  }
  for (; i < n_tiles; ++i) {
    const int blk = table[first + i * p.wph];
    const uint8_t* src = p.k + (long long)blk * BLOCK_BYTES + row0 * TOKEN_ROW + head * D + piece * 16;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const uint4 x = ldg_stream(src + 4 * q * TOKEN_ROW), y = ldg_stream(src + 4 * q * TOKEN_ROW + (p.v - p.k));
      acc ^= x.x ^ x.w ^ y.y ^ y.z;
    }
  }
  acc = __reduce_xor_sync(FULL, acc);
  if (lane == 0) atomicXor(p.out + cta_id(), acc);
}

// ---- TMA bulk copies with mbarriers (sm_90+) -------------------------------------------
__device__ __forceinline__ unsigned smem_addr(const void* ptr) {
  return static_cast<unsigned>(__cvta_generic_to_shared(ptr));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, unsigned count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(bar)), "r"(count));
}
__device__ __forceinline__ void mbar_expect_tx(uint64_t* bar, unsigned bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_addr(bar)),
               "r"(bytes));
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_addr(bar)));
}
__device__ __forceinline__ void mbar_wait(uint64_t* bar, unsigned parity) {
  asm volatile(
      "{\n\t.reg .pred done;\n"
      "WAIT_%=:\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 done, [%0], %1;\n\t"
      "@!done bra WAIT_%=;\n}" ::"r"(smem_addr(bar)), "r"(parity));
}
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

template <bool ROWS, int RING>
__device__ void bulk(const P& p) {
  constexpr int ROW = ROWS ? TOKEN_ROW + 16 : TOKEN_ROW;
  constexpr int STAGE_BYTES = 2 * TILE * ROW;
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + RING * STAGE_BYTES);
  uint64_t* empty = full + RING;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int b = blockIdx.y, start = blockIdx.x * p.chunk_len;
  const int end = min(p.seq_len, start + p.chunk_len);
  const int first = start / TILE, n_tiles = max(0, end / TILE - first);
  const int* table = p.tables + b * p.table_sb;
  if (threadIdx.x == 0) {
    for (int s = 0; s < RING; ++s) { mbar_init(full + s, 1); mbar_init(empty + s, HEADS); }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  unsigned acc = 0;
  if (warp == HEADS) {  // the producer
    for (int i = 0; i < n_tiles; ++i) {
      const int s = i % RING;
      if (i >= RING) mbar_wait(empty + s, (i / RING - 1) & 1);
      const long long blk = table[first + i];
      uint8_t* st = smem + s * STAGE_BYTES;
      if (lane == 0) mbar_expect_tx(full + s, 2 * BLOCK_BYTES);
      __syncwarp();
      if (ROWS) {
        const int row = lane % TILE;
        const uint8_t* src = (lane < TILE ? p.k : p.v) + blk * BLOCK_BYTES + row * TOKEN_ROW;
        bulk_copy(st + (lane / TILE) * TILE * ROW + row * ROW, src, TOKEN_ROW, full + s);
      } else if (lane < 2) {
        bulk_copy(st + lane * TILE * ROW, (lane ? p.v : p.k) + blk * BLOCK_BYTES, BLOCK_BYTES,
                  full + s);
      }
    }
  } else {  // consumer warp = head
    for (int i = 0; i < n_tiles; ++i) {
      const int s = i % RING;
      mbar_wait(full + s, (i / RING) & 1);
      const uint8_t* st = smem + s * STAGE_BYTES + warp * D;
      const uint4 a = *reinterpret_cast<const uint4*>(st + (lane % 16) * ROW + (lane / 16) * 64);
      const uint4 c = *reinterpret_cast<const uint4*>(st + (TILE + lane % 16) * ROW + (lane / 16) * 64);
      acc ^= a.x ^ a.w ^ c.y ^ c.z;
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + s);
    }
  }
  acc = __reduce_xor_sync(FULL, acc);
  if (lane == 0) atomicXor(p.out + cta_id(), acc);
}

extern "C" __global__ void __launch_bounds__(288) probe_bulk_rows_s3(const P p) { bulk<true, 3>(p); }
extern "C" __global__ void __launch_bounds__(288) probe_bulk_rows_s6(const P p) { bulk<true, 6>(p); }
extern "C" __global__ void __launch_bounds__(288) probe_bulk_tile_s3(const P p) { bulk<false, 3>(p); }
extern "C" __global__ void __launch_bounds__(288) probe_bulk_tile_s6(const P p) { bulk<false, 6>(p); }

extern "C" __global__ void __launch_bounds__(256) probe_flat(const P p) {
  unsigned acc = 0;
  const long long n = p.flat_bytes / 16, stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += 2 * stride) {
    const uint4 x = ldg_stream(p.k + 16 * i);
    const uint4 y = ldg_stream(p.v + 16 * i);
    uint4 x2 = make_uint4(0, 0, 0, 0), y2 = x2;
    if (i + stride < n) { x2 = ldg_stream(p.k + 16 * (i + stride)); y2 = ldg_stream(p.v + 16 * (i + stride)); }
    acc ^= x.x ^ x.w ^ y.y ^ y.z ^ x2.x ^ y2.w;
  }
  acc = __reduce_xor_sync(FULL, acc);
  if (threadIdx.x % 32 == 0) atomicXor(p.out + blockIdx.x, acc);
}
