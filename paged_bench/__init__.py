"""``paged_bench``: the benchmark suites, run on a GPU; they write ``results/``.

    python -m paged_bench decode      # decode attention vs copy bandwidth and the peers
    python -m paged_bench prefill     # prefill attention vs the matmul rate and the peers
    python -m paged_bench quant       # decode over FP8 / INT4 caches vs bf16
    python -m paged_bench engine      # the serving engine vs transformers
    python -m paged_bench transfer    # KV blocks between two GPUs
    python -m paged_bench serving     # latency vs request rate: paging vs reservation
    python -m paged_bench scheduling  # prefix-aware admission vs FCFS (CPU, simulated time)
    python -m paged_bench tiers       # a cached prefix back from disk vs host vs recomputed
    python -m paged_bench host_path   # host time of one planned decode call (vs FlashInfer)
    python -m paged_bench warmup      # the engine's first generate vs its second (warm-up)
    python -m paged_bench sharing     # memory saved by forks: parallel samples, beams (CPU)

Each suite is a module here with a ``main(argv)`` and its own ``--help``; :mod:`.common` is
what they share. On a machine with no GPU a suite says so and prints what it would measure.
"""

SUITES = ("decode", "prefill", "quant", "engine", "transfer", "serving", "tiers", "scheduling",
          "host_path", "warmup", "sharing")
