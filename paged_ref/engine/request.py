"""One request's state as it moves through the engine: waiting -> running -> finished.

A request is a list of token ids (prompt, then the tokens generated so far). The engine only
ever asks one question of it: how many of its tokens still need their K/V computed? A prompt
needs all of them (prefill, maybe in chunks); a running request needs one, the token it just
sampled (decode); a request that was preempted and must recompute needs its whole prompt plus
its output again -- the same code path as a long prompt.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class Status(enum.Enum):
    WAITING = "waiting"  #: in the queue, holds no blocks
    RUNNING = "running"  #: holds blocks; scheduled every step while the token budget allows
    SWAPPED = "swapped"  #: preempted, its blocks copied to the CPU tier
    FINISHED = "finished"  #: emitted EOS or max_new_tokens; its blocks are freed


@dataclass(eq=False)
class Request:
    """A generation request.

    Attributes:
        req_id: its id (also its ``seq_id`` in the block manager); arrival order.
        prompt: the prompt's token ids.
        max_new_tokens: stop after this many generated tokens.
        output: generated token ids so far.
        num_computed: leading tokens whose K/V are in the cache (or were, before preemption).
        num_preemptions: how many times it lost its blocks.
    """

    req_id: int
    prompt: list[int]
    max_new_tokens: int
    output: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: Status = Status.WAITING
    num_preemptions: int = 0
    first_token_step: int | None = None

    @property
    def tokens(self) -> list[int]:
        """Prompt then output: every token whose K/V the cache may need."""
        return self.prompt + self.output

    def token_at(self, i: int) -> int:
        """Token ``i`` of prompt + output (without building the joined list)."""
        n = len(self.prompt)
        return self.prompt[i] if i < n else self.output[i - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def num_to_compute(self) -> int:
        """Tokens whose K/V are still missing: the prompt (prefill) or 1 (decode)."""
        return self.num_tokens - self.num_computed

    @property
    def in_prefill(self) -> bool:
        """Still computing tokens it already knows (its prompt, or a recompute)."""
        return self.num_to_compute > 1 or not self.output

    @property
    def max_tokens_held(self) -> int:
        """Most tokens it can ever hold in the cache: the last generated token is never fed
        back, so ``len(prompt) + max_new_tokens - 1``."""
        return len(self.prompt) + max(self.max_new_tokens, 1) - 1
