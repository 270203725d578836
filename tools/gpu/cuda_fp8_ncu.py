"""One B64_L4096 decode for Nsight Compute to profile: the CUDA FP8 or INT4 kernel
(``fp8|int4 [stages] [chunk_len] [warps_per_head]``) or, for comparison, the Triton kernel
``paged_attention`` runs on the bf16 cache (``bf16``). Three warm-up calls, then the profiled one:

    ncu --kernel-name regex:fp8_decode --launch-skip 3 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python3 tools/gpu/cuda_fp8_ncu.py fp8 3 2048
    ncu --kernel-name regex:paged_decode_kernel --launch-skip 3 --launch-count 1 ... bf16
"""

import sys

import torch

from paged_bench.decode import CASES, SHAPE
from paged_course.testing import make_paged_inputs

mode = sys.argv[1] if len(sys.argv) > 1 else "fp8"
inp = make_paged_inputs(CASES["B64_L4096"], device="cuda", seed=0, **SHAPE)
if mode == "bf16":
    from paged_ref import paged_attention

    def run():
        paged_attention(*inp.args())
else:  # fp8 or int4
    from paged_ref.kernels.cuda import paged_attention_cuda

    stages = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    chunk = int(sys.argv[3]) if len(sys.argv) > 3 else None
    warps = int(sys.argv[4]) if len(sys.argv) > 4 else None
    inp = inp.quantized(mode)

    def run():
        paged_attention_cuda(*inp.args(), stages=stages, chunk_len=chunk, max_len=4096,
                             warps_per_head=warps)
for _ in range(4):
    run()
torch.cuda.synchronize()
