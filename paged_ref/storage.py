"""Paged K/V storage (work in progress): per-layer tensors in the DESIGN layout."""

from __future__ import annotations


class PagedKVCache:
    """Placeholder; the full storage class lands shortly."""
