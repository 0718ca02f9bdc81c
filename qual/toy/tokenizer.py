"""Stages 2-3: train the byte-level BPE tokenizer and turn the code into token arrays."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from qual.errors import QualError
from qual.files import write_text
from qual.userfiles import MAX_TOKENIZER_BYTES, read_text
from qual.toy.config import EOS_TOKEN, MASK_TOKEN, SPECIAL_TOKENS

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# The toy pair's chat format. The target is a code model: turns read as Python comments, so a chat prompt stays text
# it has seen; an answer ends with the end-of-text token, as real templates end an assistant turn with theirs.
CHAT_TEMPLATE = """\
{%- for message in messages %}
    {%- if message.role == 'system' or message.role == 'user' %}
        {{- '# ' + message.role + ':\\n# ' + message.content | replace('\\n', '\\n# ') + '\\n' }}
    {%- elif message.role == 'assistant' %}
        {{- '# assistant:\\n' + message.content + eos_token + '\\n' }}
    {%- else %}
        {{- raise_exception('the toy chat template knows the roles system, user and assistant, not ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '# assistant:\\n' }}
{%- endif %}
"""


def train_tokenizer(texts: list[str], vocab_size: int, out_dir: Path) -> None:
    """Byte-level BPE with `<|endoftext|>` (id 0) and `<|mask|>` (id 1), saved for AutoTokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    save_tokenizer(tok, out_dir)


def save_tokenizer(tok, out_dir: Path) -> None:
    """Write tokenizer.json, tokenizer_config.json and chat_template.jinja without importing transformers."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text(out_dir / "tokenizer.json", tok.to_str())
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 2048,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "mask_token": MASK_TOKEN,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "added_tokens_decoder": {
            str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False,
                                      "rstrip": False, "single_word": False, "special": True}
            for t in SPECIAL_TOKENS
        },
    }
    write_text(out_dir / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    write_text(out_dir / "chat_template.jinja", CHAT_TEMPLATE)


def load_tokenizer(tok_dir: Path):
    """The raw `tokenizers.Tokenizer` (fast, no transformers import)."""
    from tokenizers import Tokenizer

    path = tok_dir / "tokenizer.json"
    if not path.exists():
        raise QualError(f"{path}: no tokenizer (run the tokenizer stage first)")
    return Tokenizer.from_str(read_text(path, MAX_TOKENIZER_BYTES, "tokenizer file"))


def special_ids(tok) -> dict[str, int]:
    ids = {t: tok.token_to_id(t) for t in SPECIAL_TOKENS}
    if any(v is None for v in ids.values()):
        raise QualError(f"tokenizer lacks special tokens: {ids}")
    return {"eos_token_id": ids[EOS_TOKEN], "mask_token_id": ids[MASK_TOKEN]}


def encode_files(tok, texts: list[str]) -> np.ndarray:
    """Concatenate every file's tokens followed by EOS into one uint16 stream."""
    eos = special_ids(tok)["eos_token_id"]
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.uint16))
        parts.append(np.asarray([eos], dtype=np.uint16))
    if tok.get_vocab_size() > np.iinfo(np.uint16).max:
        raise QualError("vocabulary does not fit uint16")
    return np.concatenate(parts)
