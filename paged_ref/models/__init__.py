"""``paged_ref.models``: the model the engine runs.

* :mod:`paged_ref.models.loader` -- ``load_smollm2``: SmolLM2-135M-Instruct from the GGUF file
  shipped on PyPI, cached locally.
* :mod:`paged_ref.models.fused` -- the runner's fused layer ops (RMSNorm with the residual add,
  rotary embedding with the K/V write, SiLU-and-multiply, fused projections).
* :mod:`paged_ref.models.compat` -- transformers' KV-cache keyword (``cache`` from 5.24,
  ``past_key_values`` before), for code that fills a transformers cache.
"""
