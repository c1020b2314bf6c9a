"""Text in and out: the model's tokenizer and chat template (transformers' AutoTokenizer, loaded once).

Models without a tokenizer (the seeded random `tiny`) take and return token ids only.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cacheflow_common.errors import BadRequestError, ConfigError


class TextCodec:
    def __init__(self, directory: Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # the `model` extra
            raise ConfigError("text prompts need transformers: pip install 'cacheflow[model]'") from exc
        self._tok: Any = AutoTokenizer.from_pretrained(str(directory))
        self.eos_ids = frozenset(i for i in (self._tok.eos_token_id,) if i is not None)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """The prompt of a conversation in the model's chat template, ready for the assistant's turn."""
        if not getattr(self._tok, "chat_template", None):
            raise BadRequestError("this model has no chat template: use /v1/completions")
        ids = self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):  # newer transformers return a BatchEncoding
            ids = ids["input_ids"]
        return [int(i) for i in ids]


def tokenizer_dir(model: str) -> Path | None:
    """Where the tokenizer of the model the workers serve lives (None: the model has none)."""
    if model == "smollm2":
        from cacheflow_common.model.smollm2 import smollm2_dir

        return smollm2_dir()
    path = Path(model)
    return path if (path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file() else None
