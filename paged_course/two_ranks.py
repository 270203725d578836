"""Two processes, two pools: run a function on ranks 0 and 1 of a ``torch.distributed`` group.

Lesson 11 and its tests start two processes on one machine (gloo on CPUs, NCCL on two GPUs),
each with its own KV pool, and move sequences between them with :mod:`paged_ref.transfer`.

    results = run_two_ranks(demo_tiny_disaggregated, prompt_len=37, steps=8)
    results[1]["packed"]["outputs"]  # what rank 1 (decode) computed after the move

The function runs as ``fn(rank, world_size, **kwargs)`` in a fresh process (``spawn``), so it
must be importable (defined in a module, not in a notebook cell); its return value (anything
``torch.save`` can store) comes back per rank.
"""

from __future__ import annotations

import os
import socket
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from paged_course.threads import default_threads, set_threads


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_threads(world_size: int = 2) -> int:
    """torch threads for each of ``world_size`` ranks sharing this machine's CPUs: their
    share of :func:`paged_course.threads.default_threads`, at least one."""
    return max(1, default_threads() // world_size)


def _entry(rank, world_size, backend, port, out_dir, fn, kwargs):
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # leave NVLink multicast off
    if backend == "gloo":
        # NOTE: each spawned rank would start torch's default (a thread per logical CPU):
        # two ranks on a 2-core machine then fight over it and the model runs many times slower.
        set_threads(rank_threads(world_size))
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size)
    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        result = fn(rank, world_size, **kwargs)
        torch.save(result, Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_two_ranks(fn: Callable, *, backend: str | None = None, **kwargs) -> dict[int, object]:
    """Run ``fn(rank, 2, **kwargs)`` on two spawned processes; return ``{rank: result}``.

    ``backend`` defaults to ``"nccl"`` when two CUDA GPUs are present, else ``"gloo"``. An
    exception on either rank is raised here (``torch.multiprocessing`` re-raises it).
    """
    if backend is None:
        backend = "nccl" if torch.cuda.device_count() >= 2 else "gloo"
    with tempfile.TemporaryDirectory() as out_dir:
        mp.spawn(_entry, args=(2, backend, free_port(), out_dir, fn, kwargs), nprocs=2,
                 join=True)
        return {r: torch.load(Path(out_dir) / f"rank{r}.pt", weights_only=False)
                for r in range(2)}


def rank_device(rank: int) -> torch.device:
    """``cuda:rank`` when the group runs on GPUs, else the CPU."""
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", rank)
    return torch.device("cpu")


def demo_tiny_disaggregated(rank: int, world_size: int, *, prompt_len: int = 37, steps: int = 8,
                            block_size: int = 4, modes: tuple[str, ...] = ("packed",),
                            seed: int = 0) -> dict:
    """Prefill on rank 0, decode on rank 1, with lesson 03's tiny attention layer.

    Rank 0 takes a few blocks first (so its block ids differ from rank 1's), prefills a prompt,
    sends the sequence's blocks and the first decode input to rank 1. Rank 1, whose pool also
    holds other blocks already, lands them in the blocks its allocator gives and runs
    ``steps`` decode steps. Once per transfer mode in ``modes``. Returns, per mode, each
    rank's block table, the :class:`~paged_ref.transfer.Transfer` and rank 1's outputs.
    """
    from paged_course.decode_loop import PagedDecoder, TinyAttentionLayer
    from paged_ref import transfer

    device = rank_device(rank)
    model = TinyAttentionLayer.random(seed=seed)
    dec = PagedDecoder(model, num_blocks=256, block_size=block_size, device=device)
    # Other requests already hold blocks, differently on each rank.
    for i in range(3 + 5 * rank):
        dec.manager.add_sequence(f"other-{i}", block_size * (1 + i % 2))
    results = {}
    for mode in modes:
        seq = f"req-{mode}"
        if rank == 0:
            x = dec.prefill([seq], [model.random_prompt(prompt_len, seed=seed + 1)])
            moved = transfer.send_sequence(dec.cache, dec.manager, seq, dst=1, mode=mode)
            dist.send(x.to(device), 1)
            results[mode] = {"table": dec.manager.block_table(seq), "transfer": moved}
            continue
        moved = transfer.recv_sequence(dec.cache, dec.manager, seq, src=0)
        x = torch.empty(1, model.hidden, device=device)
        dist.recv(x, 0)
        outputs = []
        for _ in range(steps):
            x = dec.step([seq], x.cpu())
            outputs.append(x)
        results[mode] = {"table": dec.manager.block_table(seq), "transfer": moved,
                         "outputs": torch.cat(outputs)}
    return results


def tiny_single_process(*, prompt_len: int = 37, steps: int = 8, block_size: int = 4,
                        seed: int = 0, device: str | torch.device = "cpu") -> torch.Tensor:
    """The same prompt and steps as :func:`demo_tiny_disaggregated` in one process, one pool:
    the outputs a transfer must reproduce exactly."""
    from paged_course.decode_loop import PagedDecoder, TinyAttentionLayer

    model = TinyAttentionLayer.random(seed=seed)
    dec = PagedDecoder(model, num_blocks=256, block_size=block_size, device=device)
    x = dec.prefill(["req"], [model.random_prompt(prompt_len, seed=seed + 1)])
    outputs = []
    for _ in range(steps):
        x = dec.step(["req"], x.cpu())
        outputs.append(x)
    return torch.cat(outputs)


def tiny_llama(device: str | torch.device = "cpu", seed: int = 0):
    """A small random-weight Llama (2 layers, hidden 64, 4 query / 2 KV heads, vocab 256,
    float32) with a fixed seed: the same weights in every process."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                         max_position_embeddings=512)
    return LlamaForCausalLM(config).to(device).eval()


def smollm2_shape_random(device: str | torch.device = "cpu", seed: int = 0):
    """SmolLM2-135M's architecture (30 layers, hidden 576, 9 query / 3 KV heads, head_dim 64)
    with seeded random weights in bfloat16: the same model on every GPU, no download."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, vocab_size=49152,
                         max_position_embeddings=8192, rope_theta=100000.0,
                         tie_word_embeddings=True)
    return LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()


def smollm2(device: str | torch.device = "cpu"):
    """SmolLM2-135M-Instruct from the local cache (``paged_ref.engine.load_smollm2``)."""
    from paged_ref.engine import load_smollm2

    return load_smollm2(device=device)[0]


def demo_engine_disaggregated(rank: int, world_size: int, *, prompts: list[list[int]],
                              max_new_tokens: int, model_fn: Callable = tiny_llama,
                              num_blocks: int = 128, block_size: int = 16,
                              mode: str = "packed") -> dict:
    """Prefill on rank 0's engine, decode on rank 1's, with a real transformers model.

    Rank 0's :class:`~paged_ref.engine.Engine` computes the prompts (and their first token);
    :func:`paged_ref.transfer.send_prefix` moves each prompt's full blocks into rank 1's prefix
    cache; rank 1's engine then generates: its prefix cache hits every full block, so it
    computes only the last partial block's tokens (at most ``block_size``) and decodes on.
    Returns rank 1's outputs and what was moved / computed.
    """
    from paged_ref import transfer
    from paged_ref.engine import Engine

    device = rank_device(rank)
    model = model_fn(device)
    engine = Engine(model, num_blocks=num_blocks, block_size=block_size,
                    enable_prefix_caching=True)
    cache, manager = engine.runner.cache, engine.scheduler.manager
    if rank == 0:
        first = engine.generate(prompts, max_new_tokens=1, ignore_eos=True)
        moved = [transfer.send_prefix(cache, manager, p, dst=1, mode=mode) for p in prompts]
        return {"first": first, "moved": moved}
    moved = [transfer.recv_prefix(cache, manager, src=0) for _ in prompts]
    outputs = engine.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=True)
    return {"outputs": outputs, "moved": moved, "cached_tokens": engine.stats.cached_tokens,
            "computed_tokens": engine.stats.computed_tokens}


def engine_single_process(*, prompts: list[list[int]], max_new_tokens: int,
                          model_fn: Callable = tiny_llama, num_blocks: int = 128,
                          block_size: int = 16, device: str | torch.device = "cpu") -> list:
    """The same steps in one engine, one process: compute the prompts (first call), then
    generate, hitting the prefix cache exactly as rank 1 does after the transfer. The tokens
    a transfer must keep, bit for bit (same computations in the same order, minus the move)."""
    from paged_ref.engine import Engine

    engine = Engine(model_fn(device), num_blocks=num_blocks, block_size=block_size,
                    enable_prefix_caching=True)
    engine.generate(prompts, max_new_tokens=1, ignore_eos=True)
    return engine.generate(prompts, max_new_tokens=max_new_tokens, ignore_eos=True)
