"""The kernels over the paged cache: :mod:`.triton` (every backend's kernels, compiled on a
GPU or run in Triton's interpreter on a CPU) and :mod:`.cuda` (the hand-written CUDA decode
kernels for FP8 and INT4 caches: a GPU with nvcc).

Import the modules directly (``from paged_ref.kernels.triton import decode``): they import
triton, so ``paged_ref`` itself loads them only when a kernel backend runs.
"""
