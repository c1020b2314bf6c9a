"""Text in and out: the model's tokenizer and chat template (transformers' AutoTokenizer, loaded once).

Models without a tokenizer (the seeded random `tiny`) take and return token ids only.

A text too long to fit the context is refused before it is tokenized (tokenizing megabytes only to
count them is work a client could make the coordinator do for nothing). The bound must never refuse
a text that fits: one token stands for at most as many characters as its piece in the vocabulary has
(a byte-level BPE piece has one character per byte, a SentencePiece piece one per character or a
`<0x..>` form longer than its byte), so a text of more than `max_tokens` times the longest piece's
characters needs more than `max_tokens` tokens. A normalizer could join characters first (Unicode
composition joins at most 3 into 1, as Hangul jamo): with one, the bound is NORMALIZER_SLACK times that.
(Not covered: a tokenizer whose `<unk>` swallows a whole run of unknown characters; byte-level ones, as
SmolLM2's, and those with byte fallback have no unknown characters.)
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from cacheflow_common.errors import BadRequestError, ConfigError

NORMALIZER_SLACK = 4


class TextCodec:
    def __init__(self, directory: Path) -> None:
        try:
            from transformers import AutoTokenizer
        except ImportError as exc:  # the `model` extra
            raise ConfigError("text prompts need transformers: pip install 'cacheflow[model]'") from exc
        self._tok: Any = AutoTokenizer.from_pretrained(str(directory))
        self.eos_ids = frozenset(i for i in (self._tok.eos_token_id,) if i is not None)
        backend = getattr(self._tok, "backend_tokenizer", None)
        normalizes = backend is None or backend.normalizer is not None  # a slow tokenizer: assume it may
        self.max_chars_per_token = max(map(len, self._tok.get_vocab())) * (NORMALIZER_SLACK if normalizes else 1)

    def check_length(self, characters: int, max_tokens: int) -> None:
        """BadRequestError when a text of `characters` cannot fit in `max_tokens` tokens, whatever it says."""
        if characters > max_tokens * self.max_chars_per_token:
            raise BadRequestError(f"a text of {characters} characters cannot fit the model's context of {max_tokens} "
                                  f"tokens (a token covers at most {self.max_chars_per_token} characters)")

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return str(self._tok.decode(token_ids, skip_special_tokens=True))

    def chat(self, messages: list[dict[str, str]], max_tokens: int) -> list[int]:
        """The prompt of a conversation in the model's chat template, ready for the assistant's turn;
        BadRequestError, without tokenizing, when it cannot fit in `max_tokens`."""
        if not getattr(self._tok, "chat_template", None):
            raise BadRequestError("this model has no chat template: use /v1/completions")
        self.check_length(len(self._tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)),
                          max_tokens)
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
