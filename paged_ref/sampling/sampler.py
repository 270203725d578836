"""Temperature / top-k / top-p sampling of a step's rows, batched on the device.

    x = logits / temperature;  keep the top_k largest and the smallest set whose softmax
    reaches top_p;  token = argmax(softmax(x) / E),  E ~ Exponential(1) per vocabulary entry

The last line draws token ``i`` with probability ``softmax(x)_i`` (the exponential race: the
smallest of independent ``E_i / p_i`` is ``i`` with probability ``p_i``). Greedy rows never come
here: the runner keeps their argmax. A seeded request's ``E`` comes from its own generator, so
its tokens do not depend on what else runs; nothing is read back to the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingBatch:
    """The sampling rows of one step (a greedy row is not among them).

    rows: indices into the step's sampled rows; temperature (> 0), top_p, top_k (0: off):
    one per row; generators: a seeded request's ``torch.Generator`` (on the model's device),
    None for the others.
    """

    rows: list[int]
    temperature: list[float]
    top_p: list[float]
    top_k: list[int]
    generators: list[torch.Generator | None]

    @classmethod
    def of(cls, params: list, generators: list) -> SamplingBatch | None:
        """The batch of a step's sampled rows: each one's ``SamplingParams`` (or None: greedy)
        and generator; None if every row is greedy."""
        rows = [i for i, p in enumerate(params) if p and not p.greedy]
        if not rows:
            return None
        ps = [params[i] for i in rows]
        return cls(rows, [p.temperature for p in ps], [p.top_p for p in ps],
                   [p.top_k for p in ps], [generators[i] for i in rows])


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """One token per row of ``logits`` (float ``[R, V]``, R = ``len(batch.rows)``): int64 ``[R]``
    on the same device, drawn as the module doc says. One call per step for all rows."""
    dev, vocab = logits.device, logits.shape[-1]
    x = logits.float() / torch.tensor(batch.temperature, device=dev)[:, None]
    if any(batch.top_k) or min(batch.top_p) < 1:
        x, order = x.sort(dim=-1, descending=True)
        k = torch.tensor([k or vocab for k in batch.top_k], device=dev)
        probs = x.softmax(dim=-1)
        drop = torch.arange(vocab, device=dev)[None] >= k[:, None]
        # NOTE: a token is kept while the mass before it is below top_p, so the first always is
        drop |= probs.cumsum(dim=-1) - probs >= torch.tensor(batch.top_p, device=dev)[:, None]
        x = torch.empty_like(x).scatter_(-1, order, x.masked_fill(drop, -torch.inf))
    race = torch.empty_like(x).exponential_()
    for row, gen in zip(race, batch.generators, strict=True):
        if gen is not None:
            row.exponential_(generator=gen)
    return (x.softmax(dim=-1) / race.clamp_min_(1e-10)).argmax(dim=-1)
