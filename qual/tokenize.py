"""Prompt tokenization, done once by the harness so both arms receive identical token ids."""

from __future__ import annotations

from pathlib import Path

from qual.errors import QualError


class PromptTokenizer:
    """A tokenizer.json (Hugging Face `tokenizers` format) from a model directory."""

    def __init__(self, model_dir: str):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise QualError(f"no tokenizer.json in {model_dir}")
        from tokenizers import Tokenizer

        self.path = str(path)
        self._tok = Tokenizer.from_file(self.path)

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
