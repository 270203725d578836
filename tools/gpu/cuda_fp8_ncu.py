"""One B64_L4096 FP8 decode with the CUDA kernel, for Nsight Compute to profile:

    ncu --kernel-name regex:fp8_decode --launch-skip 2 --launch-count 1 \\
        --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats \\
        python3 tools/gpu/cuda_fp8_ncu.py [stages] [chunk_len]
"""

import sys

import torch

from paged_ref.course.bench import CASES, SHAPE
from paged_ref.course.testing import make_paged_inputs
from paged_ref.kernels.cuda_fp8 import paged_attention_cuda_fp8

stages = int(sys.argv[1]) if len(sys.argv) > 1 else 4
chunk = int(sys.argv[2]) if len(sys.argv) > 2 else None
inp = make_paged_inputs(CASES["B64_L4096"], device="cuda", seed=0, **SHAPE).quantized("fp8")
for _ in range(4):
    paged_attention_cuda_fp8(*inp.args(), stages=stages, chunk_len=chunk, max_len=4096)
torch.cuda.synchronize()
