"""A fake online engine for the serving driver's tests: the shape of ``paged_ref.engine.Engine``'s
online calls, with behaviour simple enough to work out every latency by hand.

Every step admits all waiting requests (at most ``max_running`` running at once, first come
first served); a request's first step computes its whole prompt and emits its first token,
every later step one token; it finishes at ``max_tokens`` tokens (``params`` is the output
length itself). Its runner reports each step's shape as the real wrappers do.
"""

from __future__ import annotations

from dataclasses import dataclass

from paged_course.serving.cost_model import StepShape


@dataclass
class FakeOutput:
    request_id: int
    new_token_ids: list[int]
    finished: bool


class FakeRunner:
    def __init__(self) -> None:
        self.last_shape = None

    def take_shape(self):
        shape, self.last_shape = self.last_shape, None
        return shape


class FakeEngine:
    vocab_size = 100

    def __init__(self, max_running: int = 1000) -> None:
        self.max_running = max_running
        self.runner = FakeRunner()
        self.waiting: list[int] = []
        self.running: list[int] = []
        self.prompts: dict[int, list[int]] = {}
        self.max_tokens: dict[int, int] = {}
        self.done: dict[int, int] = {}
        self.aborted: list[int] = []
        self.arrival_times: dict[int, float | None] = {}

    def add_request(self, prompt_ids, params, *, arrival_time=None) -> int:
        rid = len(self.prompts)
        assert all(0 <= t < self.vocab_size for t in prompt_ids)
        self.prompts[rid], self.max_tokens[rid], self.done[rid] = list(prompt_ids), params, 0
        self.arrival_times[rid] = arrival_time
        self.waiting.append(rid)
        return rid

    def step(self) -> list[FakeOutput]:
        while self.waiting and len(self.running) < self.max_running:
            self.running.append(self.waiting.pop(0))
        tokens = sum(1 if self.done[r] else len(self.prompts[r]) for r in self.running)
        kv = sum(len(self.prompts[r]) + self.done[r] for r in self.running)
        if hasattr(self, "runner"):  # (a test removes it)
            self.runner.last_shape = StepShape(tokens, len(self.running), kv)
        outputs = []
        for r in list(self.running):
            self.done[r] += 1
            finished = self.done[r] == self.max_tokens[r]
            outputs.append(FakeOutput(r, [7], finished))
            if finished:
                self.running.remove(r)
        return outputs

    def abort(self, rid: int) -> None:
        self.aborted.append(rid)
        for queue in (self.waiting, self.running):
            if rid in queue:
                queue.remove(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)
