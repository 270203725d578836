"""``paged_ref.sampling``: how the engine picks tokens.

* :mod:`paged_ref.sampling.params` -- :class:`SamplingParams` (vLLM's shape), checked at
  construction; ``as_token_ids``.
* :mod:`paged_ref.sampling.sampler` -- temperature / top-k / top-p sampling of a step's rows,
  batched on the device (:func:`sample`, :class:`SamplingBatch`).
* :mod:`paged_ref.sampling.beam` -- :class:`BeamSearch`: one prompt's beams, scores and finished
  hypotheses (transformers' beam search, pure Python; ``Engine.beam_search`` drives it).
"""

from paged_ref.sampling.beam import BeamSearch
from paged_ref.sampling.params import SamplingParams, as_token_ids
from paged_ref.sampling.sampler import SamplingBatch, sample

__all__ = ["BeamSearch", "SamplingBatch", "SamplingParams", "as_token_ids", "sample"]
