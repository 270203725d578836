"""The cache's arithmetic, in one torch-free place: block counts, slots, bytes, scale, dtypes.

Everything else (the manager, the storage, the kernels' wrappers, the simulations, the
benchmarks, the pictures, the notebooks) calls these instead of writing the formula again.

    blocks_needed(37, 16)                 # 3: ceil(37 / 16)
    tokens_in_block(37, 2, 16)            # 5: block 2 of a 37-token sequence holds tokens 32..36
    token_slot([7, 2, 5], 20, 16)         # 2 * 16 + 4 = 36: token 20 is in block 2, offset 4
    token_slots([7, 2], 18, 16, start=15) # [127, 32, 33]
    kv_bytes_per_token(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16")  # 131072
    split_chunks(131072, 64, 64)          # (2048, 64): 64 chunks of 2048 tokens
    attention_flops(6, 2, num_q_heads=1, head_dim=1)  # 4 * (5 + 6) = 44: rows see 5 and 6 keys

``cdiv`` and ``slot_of`` use only ``//``, ``%``, ``*`` and ``+``, so they also work elementwise
on NumPy arrays and torch tensors (the vectorised gathers call them that way).
"""

from __future__ import annotations

#: Cache element types the kernels read, by name, and their size in bytes.
CACHE_DTYPE_BYTES: dict[str, int] = {"float16": 2, "bfloat16": 2, "float32": 4}


def cdiv(a, b):
    """Ceiling division ``ceil(a / b)`` for integers, ``b > 0`` (vLLM's ``cdiv``).

    Elementwise on integer NumPy arrays and torch tensors too."""
    return -(-a // b)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """Blocks that hold ``num_tokens`` tokens: ``ceil(num_tokens / block_size)``."""
    return cdiv(num_tokens, block_size)


def tokens_in_block(seq_len: int, block: int, block_size: int) -> int:
    """Tokens of a ``seq_len``-token sequence that its logical block ``block`` holds:
    ``block_size`` for a full block, fewer for the last one, 0 past the end."""
    return min(block_size, max(0, seq_len - block * block_size))


def slot_of(block_id, token, block_size):
    """Slot of ``token`` once its physical block is known: ``block_id * block_size + offset``
    with ``offset = token % block_size``. Elementwise on NumPy arrays and torch tensors too."""
    return block_id * block_size + token % block_size


def token_slot(block_table: list[int], token: int, block_size: int) -> int:
    """Slot of token ``token``: ``block_table[token // block_size] * block_size + offset``."""
    return slot_of(block_table[token // block_size], token, block_size)


def token_slots(block_table: list[int], seq_len: int, block_size: int, start: int = 0) -> list[int]:
    """Slots of tokens ``start .. seq_len-1`` of one sequence: ``block * block_size + offset``."""
    return [token_slot(block_table, t, block_size) for t in range(start, seq_len)]


def default_scale(head_dim: int, scale: float | None = None) -> float:
    """``scale`` if given, else the softmax scale ``head_dim ** -0.5``."""
    return head_dim**-0.5 if scale is None else float(scale)


def dtype_bytes(dtype) -> int:
    """Bytes per element of a cache dtype: a name (``"bfloat16"``), a torch dtype, or already a
    byte count (an int, e.g. 1 for an 8-bit cache)."""
    if isinstance(dtype, int) and not isinstance(dtype, bool):
        if dtype < 1:
            raise ValueError(f"dtype as a byte count must be >= 1, got {dtype}")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name not in CACHE_DTYPE_BYTES:
        raise TypeError(f"dtype must be one of {tuple(CACHE_DTYPE_BYTES)}, got {dtype!r}")
    return CACHE_DTYPE_BYTES[name]


def kv_bytes_per_token(*, num_layers: int, num_kv_heads: int, head_dim: int, dtype) -> int:
    """Bytes one token's K and V take over all layers:
    ``2 * layers * heads * bytes per token-head``, the last ``head_dim * dtype_bytes(dtype)``.

    ``dtype`` as for :func:`dtype_bytes`, or a quantised format (a :class:`~paged_ref.KVFormat`:
    anything with ``bytes_per_token_head(head_dim)``, codes plus per-token scales; a per-tensor
    scale is not counted). Llama-3-8B in bf16: ``2 * 32 * 8 * 128 * 2 = 131072`` bytes (128 KiB)
    per token. ``ValueError`` naming the argument for a count below 1.
    """
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads),
                        ("head_dim", head_dim)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if hasattr(dtype, "bytes_per_token_head"):
        per_head = dtype.bytes_per_token_head(head_dim)
    else:
        per_head = head_dim * dtype_bytes(dtype)
    return int(2 * num_layers * num_kv_heads * per_head)


def split_chunks(max_len: int, num_chunks: int, multiple: int) -> tuple[int, int]:
    """Cut ``max_len`` tokens into about ``num_chunks`` equal chunks whose size is a multiple of
    ``multiple`` (the kernel's tile). Returns ``(chunk_size, num_chunks)``; the count may come
    out lower than asked, so that no chunk is empty."""
    chunk_size = cdiv(cdiv(max_len, num_chunks), multiple) * multiple
    return chunk_size, cdiv(max_len, chunk_size)


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
