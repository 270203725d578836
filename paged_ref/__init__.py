"""paged_ref: the reference implementation of the paged attention course.

Memory management (plain Python): :class:`BlockAllocator`, :class:`KVCacheManager`,
:class:`PagedKVCache`, :class:`DiskTier` (evicted blocks in a file, under the host tier).
Attention: :func:`paged_attention` with backends ``"torch"``,
``"triton"``, ``"triton_split"`` and ``"auto"``;
:func:`paged_prefill` for many query tokens per sequence (prompts, chunks, prefix hits);
:func:`plan_decode` / :func:`plan_prefill` plan a batch once, from its lengths on the host;
:func:`write_kv` stores new tokens' K/V through the slot mapping.
Layouts: docs/contract.md and the docstrings.
"""

# Must come first: sets TRITON_INTERPRET=1 on machines without a GPU, before triton is imported.
from paged_ref import _device  # noqa: F401, I001
from paged_ref.memory.allocator import BlockAllocator, OutOfBlocksError
from paged_ref.attention import BACKENDS, paged_attention
from paged_ref.kv_write import write_kv
from paged_ref.memory.manager import KVCacheManager, hash_block_tokens
from paged_ref.plan import DecodePlan, plan_decode
from paged_ref.prefill import paged_prefill
from paged_ref.prefill_plan import PrefillPlan, plan_prefill
from paged_ref.quant import KVFormat, QuantizedKV, dequantize, quantize
from paged_ref.memory.storage import PagedKVCache
from paged_ref.memory.disk_tier import DiskTier

__all__ = [
    "BACKENDS",
    "BlockAllocator",
    "DecodePlan",
    "DiskTier",
    "KVCacheManager",
    "KVFormat",
    "OutOfBlocksError",
    "PagedKVCache",
    "PrefillPlan",
    "QuantizedKV",
    "dequantize",
    "hash_block_tokens",
    "paged_attention",
    "paged_prefill",
    "plan_decode",
    "plan_prefill",
    "quantize",
    "write_kv",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """``paged_ref.transfer`` (moving blocks between pools, lesson 11) is imported on first use:
    it needs ``torch.distributed``, which plain attention and memory management do not."""
    if name == "transfer":
        import importlib

        return importlib.import_module("paged_ref.transfer")
    raise AttributeError(f"module 'paged_ref' has no attribute {name!r}")
