"""Prompt tokenization, done once by the harness so both arms receive identical token ids."""

from __future__ import annotations

from pathlib import Path

from qual.errors import QualError
from qual.userfiles import MAX_TOKENIZER_BYTES, read_text


class PromptTokenizer:
    """A tokenizer.json (Hugging Face `tokenizers` format) from a model directory."""

    def __init__(self, model_dir: str):
        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise QualError(f"no tokenizer.json in {model_dir}")
        from tokenizers import Tokenizer

        self.path = str(path)
        self.directory = str(Path(model_dir))  # where the chat template and special tokens are (qual.chat)
        try:  # read as every user file is (a FIFO refused, the size capped), then parsed by the tokenizers library
            text = read_text(path, MAX_TOKENIZER_BYTES, "tokenizer file")
        except OSError as exc:
            raise QualError(f"{path}: unreadable ({exc.strerror or exc})") from None
        try:
            self._tok = Tokenizer.from_str(text)
        except Exception as exc:  # the library raises its own error type for a malformed file
            raise QualError(f"{path}: not a tokenizer the tokenizers library reads ({str(exc)[:200]})") from None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)
