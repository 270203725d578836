"""Quantised KV caches: FP8 (e4m3) and INT4 codes plus the scales that give them meaning.

:mod:`.formats` says what a quantised cache is (:class:`KVFormat`, :class:`QuantizedKV`, the
layout table); :mod:`.codes` is the arithmetic of the codes; :mod:`.encode` writes values in
(:func:`quantize`, :func:`write_slots`). Every name is importable from ``paged_ref.quant``.
"""

from paged_ref.quant.codes import (
    FP8_DTYPE,
    FP8_MAX,
    INT4_MAX,
    dequantize_fp8,
    fp8_encode,
    fp8_scale,
    int4_decode,
    int4_encode,
    int4_scale_zero,
    pack_int4,
    unpack_int4,
)
from paged_ref.quant.encode import check_tensor_scale, quantize, write_slots
from paged_ref.quant.formats import (
    COMPUTE_DTYPES,
    FORMAT_NAMES,
    KVFormat,
    QuantizedKV,
    dequantize,
)

__all__ = ["COMPUTE_DTYPES", "FORMAT_NAMES", "FP8_DTYPE", "FP8_MAX", "INT4_MAX", "KVFormat",
           "QuantizedKV", "check_tensor_scale", "dequantize", "dequantize_fp8", "fp8_encode",
           "fp8_scale", "int4_decode", "int4_encode", "int4_scale_zero", "pack_int4",
           "quantize", "unpack_int4", "write_slots"]
