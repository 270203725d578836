// How fast can a GPU read a paged INT4 cache through a block table, with no attention at all?
// The bench's INT4 rows read ~300 MB (B64_L4096 and the other batches) or ~150 MB (B1_L131072)
// and reach 3.4-3.6 TB/s; FP8's, 540 MB, 4.0 TB/s. Is that the bytes' size, their layout, or
// the kernel? Every kernel here only moves the cache into shared memory (or registers),
// touches what arrived, and writes a checksum per CTA. Layout as paged_ref's "int4" format
// with blocks of 16 tokens: codes [num_blocks, 16, Hkv, D/2] bytes (8 KB a block of K for
// Hkv 8, D 128), and four float16 (scale, zero) tensors [num_blocks, 16, Hkv, 2] (512 bytes a
// block each). tools/gpu/int4_read_probe.py builds the bench's inputs and times these.
//
// * probe_int4_bulk_s{3,4,6}: one CTA per (sequence, chunk) with all the KV heads, 8 consumer
//   warps and a producer warp; a ring of 3, 4 or 6 stages, each `blocks_per_stage` blocks of
//   the chunk; for each block the producer issues one 1-D TMA bulk copy (cp.async.bulk) of
//   its K codes, one of its V codes and (pair_bytes > 0) one of each of its four pair
//   tensors' pieces: what the INT4 kernel's tensor-map boxes fetch, without the map;
// * probe_flat: one contiguous buffer streamed with grid-stride 16-byte loads (the ceiling of
//   any read of that many bytes).

#include <stdint.h>

#define FULL 0xffffffffu
#define TILE 16       // tokens a block
#define CONSUMERS 8   // consumer warps a CTA
#define MAX_PIECES 6  // K, V and four pair pieces a block

struct P {
  const uint8_t* k;         // codes, block_bytes a block
  const uint8_t* v;
  const uint8_t* pairs[4];  // k_scale, k_zero, v_scale, v_zero: pair_bytes a block
  const int* tables;        // [B, table_sb]
  const int* seq_lens;      // [B]
  unsigned* out;            // one checksum per CTA
  unsigned* sm_of_cta;      // (if not null) the SM each CTA ran on
  long long flat_bytes;     // probe_flat: bytes of k to stream
  int table_sb, chunk_len, block_bytes, pair_bytes, blocks_per_stage;
};

__device__ __forceinline__ unsigned cta_id() {
  return blockIdx.x + gridDim.x * (blockIdx.y + gridDim.y * blockIdx.z);
}
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
__device__ __forceinline__ void bulk_copy(void* dst, const void* src, unsigned bytes,
                                          uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];"
      ::"r"(smem_addr(dst)), "l"(src), "r"(bytes), "r"(smem_addr(bar)) : "memory");
}

template <int RING>
__device__ void bulk(const P& p) {
  const int block_share = 2 * p.block_bytes + 4 * p.pair_bytes;  // shared bytes a block
  const int stage_bytes = p.blocks_per_stage * block_share;
  extern __shared__ __align__(128) uint8_t smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem + RING * stage_bytes);
  uint64_t* empty = full + RING;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (p.sm_of_cta && threadIdx.x == 0) {
    unsigned sm;
    asm volatile("mov.u32 %0, %%smid;" : "=r"(sm));
    p.sm_of_cta[cta_id()] = sm;
  }
  const int b = blockIdx.y, start = blockIdx.x * p.chunk_len;
  const int end = min(p.seq_lens[b], start + p.chunk_len);
  if (start >= end) return;  // (a short sequence of a ragged batch)
  const int first = start / TILE, n_blocks = (end + TILE - 1) / TILE - first;
  const int steps = (n_blocks + p.blocks_per_stage - 1) / p.blocks_per_stage;
  const int* table = p.tables + (long long)b * p.table_sb;
  if (threadIdx.x == 0) {
    for (int s = 0; s < RING; ++s) { mbar_init(full + s, 1); mbar_init(empty + s, CONSUMERS); }
    asm volatile("fence.mbarrier_init.release.cluster;");
  }
  __syncthreads();
  unsigned acc = 0;
  const int pieces = p.pair_bytes ? 6 : 2;
  if (warp == CONSUMERS) {  // the producer
    for (int i = 0; i < steps; ++i) {
      const int s = i % RING;
      if (i >= RING) mbar_wait(empty + s, (i / RING - 1) & 1);
      const int b0 = i * p.blocks_per_stage, here = min(p.blocks_per_stage, n_blocks - b0);
      uint8_t* st = smem + s * stage_bytes;
      if (lane == 0) mbar_expect_tx(full + s, here * block_share);
      __syncwarp();
      for (int j = lane; j < here * pieces; j += 32) {
        const int n = j / pieces, piece = j % pieces;
        const long long blk = table[first + b0 + n];
        uint8_t* dst = st + n * block_share;
        if (piece < 2)
          bulk_copy(dst + piece * p.block_bytes, (piece ? p.v : p.k) + blk * p.block_bytes,
                    p.block_bytes, full + s);
        else
          bulk_copy(dst + 2 * p.block_bytes + (piece - 2) * p.pair_bytes,
                    p.pairs[piece - 2] + blk * p.pair_bytes, p.pair_bytes, full + s);
      }
    }
  } else {  // a consumer: touch 16 bytes of K and of V of each block that arrived
    for (int i = 0; i < steps; ++i) {
      const int s = i % RING;
      mbar_wait(full + s, (i / RING) & 1);
      const uint8_t* st = smem + s * stage_bytes + warp * 16 * 32 % p.block_bytes;
      const uint4 a = *reinterpret_cast<const uint4*>(st + lane * 16 % p.block_bytes);
      const uint4 c = *reinterpret_cast<const uint4*>(st + p.block_bytes + lane * 16 % p.block_bytes);
      acc ^= a.x ^ a.w ^ c.y ^ c.z;
      __syncwarp();
      if (lane == 0) mbar_arrive(empty + s);
    }
  }
  acc = __reduce_xor_sync(FULL, acc);
  if (lane == 0) atomicXor(p.out + cta_id(), acc);
}

extern "C" __global__ void __launch_bounds__(288) probe_int4_bulk_s3(const P p) { bulk<3>(p); }
extern "C" __global__ void __launch_bounds__(288) probe_int4_bulk_s4(const P p) { bulk<4>(p); }
extern "C" __global__ void __launch_bounds__(288) probe_int4_bulk_s6(const P p) { bulk<6>(p); }

__device__ __forceinline__ uint4 ldg_stream(const void* ptr) {
  uint4 r;
  asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(r.x), "=r"(r.y), "=r"(r.z), "=r"(r.w) : "l"(ptr));
  return r;
}

extern "C" __global__ void __launch_bounds__(256) probe_flat(const P p) {
  unsigned acc = 0;
  const long long n = p.flat_bytes / 16, stride = (long long)gridDim.x * blockDim.x;
  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += 2 * stride) {
    const uint4 x = ldg_stream(p.k + 16 * i);
    const uint4 y = i + stride < n ? ldg_stream(p.k + 16 * (i + stride)) : make_uint4(0, 0, 0, 0);
    acc ^= x.x ^ x.w ^ y.y ^ y.z;
  }
  acc = __reduce_xor_sync(FULL, acc);
  if (threadIdx.x % 32 == 0) atomicXor(p.out + blockIdx.x, acc);
}
