"""transformers' KV-cache keyword, whichever release is installed.

transformers 5.24 renamed the ``past_key_values`` argument of a model's ``forward`` (and the
output's field) to ``cache``; the old name still works there until 5.40, with a deprecation
warning. 5.17 knows only ``past_key_values`` and takes an unknown ``cache=`` into its
``**kwargs`` without a word: the cache stays empty. So code that fills a transformers cache
asks the installed model which name it takes (:func:`cache_keyword`), or lets
:func:`forward_into_cache` do it. Configs differ too: some name ``head_dim``, others leave it
to ``hidden_size // num_attention_heads`` (:func:`head_dim_of`).
"""

from __future__ import annotations

import inspect

#: The keyword a model's ``forward`` takes its KV cache by: new name first, then the old one.
CACHE_KEYWORDS = ("cache", "past_key_values")


def cache_keyword(model) -> str:
    """The name ``model.forward`` takes its KV cache by here.

    Args:
        model: a transformers model (``LlamaForCausalLM``, ...).

    Returns:
        ``"cache"`` (transformers >= 5.24) or ``"past_key_values"`` (earlier releases).

    Raises:
        TypeError: ``model.forward`` takes neither (not a transformers causal LM).
    """
    params = inspect.signature(model.forward).parameters
    for name in CACHE_KEYWORDS:
        if name in params:
            return name
    raise TypeError(f"model must be a transformers model whose forward takes a KV cache "
                    f"({' or '.join(CACHE_KEYWORDS)}); {type(model).__name__}.forward takes "
                    f"{list(params)}")


def forward_into_cache(model, input_ids, cache, **kwargs):
    """``model(input_ids, **kwargs)`` with every layer's K/V appended to ``cache``.

    Args:
        model: a transformers causal LM.
        input_ids: int64 ``[batch, tokens]`` on the model's device.
        cache: a transformers ``Cache`` (e.g. ``DynamicCache(config=model.config)``); its
            layers' ``keys`` / ``values`` are ``[batch, Hkv, tokens so far, head_dim]`` after.
        kwargs: more arguments of ``model.forward``.

    Returns:
        The model's output (its logits, ...).
    """
    return model(input_ids, use_cache=True, **{cache_keyword(model): cache}, **kwargs)


def head_dim_of(config) -> int:
    """A transformers config's attention head size: ``head_dim`` where it names one, else
    ``hidden_size // num_attention_heads``."""
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_block_shape(model, block_size: int) -> tuple[int, int, int, int, int]:
    """One KV block of ``model`` (every layer's K and V) as the host and disk tiers hold it:
    ``(2, num_layers, block_size, num_kv_heads, head_dim)``."""
    cfg = model.config
    return (2, len(model.model.layers), block_size, cfg.num_key_value_heads, head_dim_of(cfg))
