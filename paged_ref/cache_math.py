"""The cache's arithmetic, in one torch-free place: block counts, slots, bytes, scale, dtypes.

Everything else (the manager, the storage, the kernels' wrappers, the simulations, the
benchmarks, the notebooks) calls these instead of writing the formula again.

    blocks_needed(37, 16)                 # 3: ceil(37 / 16)
    token_slot([7, 2, 5], 20, 16)         # 2 * 16 + 4 = 36: token 20 is in block 2, offset 4
    token_slots([7, 2], 18, 16, start=15) # [127, 32, 33]
    kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # 131072
    attention_flops(6, 2, num_q_heads=1, head_dim=1)  # 4 * (5 + 6) = 44: rows see 5 and 6 keys
"""

from __future__ import annotations

#: Cache element types the kernels read, by name, and their size in bytes.
CACHE_DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}


def cdiv(a: int, b: int) -> int:
    """Ceiling division ``ceil(a / b)`` for integers, ``b > 0`` (vLLM's ``cdiv``)."""
    return -(-a // b)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return cdiv(num_tokens, block_size)


def token_slot(block_table: list[int], token: int, block_size: int) -> int:
    """Slot of token ``token``: ``block_table[token // block_size] * block_size + offset``."""
    return block_table[token // block_size] * block_size + token % block_size


def token_slots(block_table: list[int], seq_len: int, block_size: int, start: int = 0) -> list[int]:
    """Slots of tokens ``start .. seq_len-1`` of one sequence: ``block * block_size + offset``."""
    return [block_table[t // block_size] * block_size + t % block_size
            for t in range(start, seq_len)]


def default_scale(head_dim: int, scale: float | None = None) -> float:
    """``scale`` if given, else the softmax scale ``head_dim ** -0.5``."""
    return head_dim**-0.5 if scale is None else float(scale)


def dtype_bytes(dtype) -> int:
    """Bytes per element of a cache dtype, given by name (``"bfloat16"``) or as a torch dtype."""
    name = str(dtype).removeprefix("torch.")
    if name not in CACHE_DTYPE_BYTES:
        raise TypeError(f"dtype must be one of {tuple(CACHE_DTYPE_BYTES)}, got {dtype!r}")
    return CACHE_DTYPE_BYTES[name]


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes one token's K and V take over all layers: ``2 * layers * heads * dim * bytes``."""
    return 2 * num_layers * num_kv_heads * head_dim * dtype_bytes(dtype)


def visible_keys(seq_len: int, q_len: int, causal: bool = True) -> int:
    """Keys seen, summed over the ``q_len`` query rows that are the last tokens of a sequence of
    ``seq_len``: row ``i`` sees ``seq_len - q_len + i + 1`` keys when causal, all otherwise."""
    if not causal:
        return q_len * seq_len
    return q_len * (seq_len - q_len) + q_len * (q_len + 1) // 2


def attention_flops(seq_len: int, q_len: int, num_q_heads: int, head_dim: int,
                    causal: bool = True) -> int:
    """Matmul FLOPs of attention for those rows, counted exactly (masked scores are not work):
    ``2 * head_dim`` for a score ``q . k`` plus ``2 * head_dim`` to add ``p * v``, per visible
    key, per query head."""
    return 4 * num_q_heads * head_dim * visible_keys(seq_len, q_len, causal)
