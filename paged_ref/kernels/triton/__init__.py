"""The Triton kernels: decode (one pass), split-KV and its merge, prefill, the K/V stores
(plain and quantising), the engine's fused layer ops, and the device-side input checks.

Each module holds a kernel and its wrapper; the wrappers take inputs already checked by the
public calls (:func:`paged_ref.paged_attention`, :func:`paged_ref.paged_prefill`, ...).
"""
