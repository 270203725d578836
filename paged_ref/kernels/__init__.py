"""Triton kernels over the paged cache: one-pass decode and split-KV (flash-decoding).

Import the modules directly (``from paged_ref.kernels import triton_split``); they import
triton, so ``paged_ref`` itself only loads them when a Triton backend runs.
"""
