"""Chat templates (qual.chat): token ids equal to transformers' apply_chat_template(tokenize=True) on real models'
templates, where a tokenizer keeps its template, and the sandbox."""

import json
from pathlib import Path

import pytest

from qual import paths
from qual.chat import load_template
from qual.errors import QualError
from qual.harness.turns import ChatPrompts
from qual.tokenize import PromptTokenizer
from qual.toy.tokenizer import CHAT_TEMPLATE

FIXTURES = Path(__file__).parent / "fixtures" / "chat_templates"
FAMILIES = json.loads((FIXTURES / "families.json").read_text())
TOY_TARGET = paths.DATA_DIR / "models" / "toy" / "target"

CONVERSATIONS = {
    "system_user": [{"role": "system", "content": "You are a terse assistant."},
                    {"role": "user", "content": "Write a function that reverses a list."}],
    "user": [{"role": "user", "content": "What is 17 * 23?"}],
    "two_turns": [{"role": "user", "content": "Compose a haiku about the sea."},
                  {"role": "assistant", "content": "Grey waves fold and break,\nsalt wind combs the dune grass flat,\n"
                                                   "gulls write on the foam."},
                  {"role": "user", "content": "Rewrite it so every line starts with the letter A."}],
    "system_three_turns": [{"role": "system", "content": "Answer in one sentence."},
                           {"role": "user", "content": "Name a prime."},
                           {"role": "assistant", "content": "  7 is prime.  "},
                           {"role": "user", "content": "Another?"},
                           {"role": "assistant", "content": "<think>\nsmall ones\n</think>\n\n11."},
                           {"role": "user", "content": "Sum them."}],
    "unicode": [{"role": "user", "content": "Traduis: «ça va?» — 你好，世界 🌍; مرحبا; e\u0301; tab\tend\n\n"},
                {"role": "assistant", "content": "Ça va. 你好 🙂"},
                {"role": "user", "content": "Literal markup: {{ x }} {% if %} <|im_end|> [INST] </s> \\n"}],
}


def _tokenizer_dir(tmp_path: Path, family: dict, *, template_in: str = "config") -> Path:
    """The toy tokenizer with a family's control tokens added (special or not, as the model's own tokenizer has them)
    and its template and named special tokens: a tokenizer directory as transformers and qual read one."""
    from tokenizers import AddedToken, Tokenizer

    out = tmp_path / "tokenizer"
    out.mkdir(parents=True)
    tok = Tokenizer.from_file(str(TOY_TARGET / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in family["added_special"]])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in family["added"]])
    tok.save(str(out / "tokenizer.json"))
    template = (FIXTURES / family["template"]).read_text(encoding="utf-8")
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              **family["special_tokens"]}
    if template_in == "config":
        config["chat_template"] = template
    else:
        (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False))
    return out


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_token_ids_equal_transformers_apply_chat_template(tmp_path, family):
    from transformers import AutoTokenizer

    folder = _tokenizer_dir(tmp_path, FAMILIES[family], template_in="config" if family != "glm" else "file")
    hf = AutoTokenizer.from_pretrained(str(folder))
    prompts = ChatPrompts(PromptTokenizer(str(folder)), load_template(folder))
    for name, messages in CONVERSATIONS.items():
        want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert prompts.render(messages, name) == text, (family, name)
        assert prompts.encode(messages, name) == list(want), (family, name)
    # the control tokens the template writes are single tokens, as in the model's own tokenizer
    first = prompts.encode(CONVERSATIONS["two_turns"], "two_turns")
    assert any(first.count(hf.convert_tokens_to_ids(t)) for t in FAMILIES[family]["added_special"])


def test_every_family_renders_its_special_tokens(tmp_path):
    """bos_token / eos_token reach the templates that use them (DeepSeek's and Mistral's bos, Mistral's eos)."""
    for family, token in (("deepseek", "<\uff5cbegin\u2581of\u2581sentence\uff5c>"), ("mistral", "</s>")):
        folder = _tokenizer_dir(tmp_path / family, FAMILIES[family])
        text = load_template(folder).render(CONVERSATIONS["two_turns"], "two_turns")
        assert token in text


def test_the_toy_tokenizer_ships_its_template_and_matches_transformers():
    from transformers import AutoTokenizer

    assert (TOY_TARGET / "chat_template.jinja").read_text() == CHAT_TEMPLATE  # `make toy` writes the same file
    hf = AutoTokenizer.from_pretrained(str(TOY_TARGET))
    prompts = ChatPrompts(PromptTokenizer(str(TOY_TARGET)), load_template(TOY_TARGET))
    for name, messages in CONVERSATIONS.items():
        want = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert prompts.encode(messages, name) == list(want), name
    assert prompts.render(CONVERSATIONS["user"], "u") == "# user:\n# What is 17 * 23?\n# assistant:\n"


def _folder(tmp_path: Path, config: dict | None = None, files: dict | None = None) -> Path:
    folder = tmp_path / "tok"
    folder.mkdir(parents=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config or {}))
    for name, text in (files or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def test_where_a_tokenizer_keeps_its_template(tmp_path):
    one = [{"role": "user", "content": "x"}]
    # chat_template.jinja wins over tokenizer_config.json, as transformers loads them
    t = load_template(_folder(tmp_path / "a", {"chat_template": "config"}, {"chat_template.jinja": "file"}))
    assert t.render(one, "r") == "file" and t.source.endswith("chat_template.jinja") and t.name is None
    # a list of named templates: "default"
    t = load_template(_folder(tmp_path / "b", {"chat_template": [{"name": "tool_use", "template": "tools"},
                                                                  {"name": "default", "template": "plain"}]}))
    assert t.render(one, "r") == "plain" and t.name == "default"
    t = load_template(_folder(tmp_path / "c", {}, {"chat_template.jinja": "main",
                                                   "additional_chat_templates/rag.jinja": "rag"}))
    assert t.render(one, "r") == "main" and t.name == "default"
    # named templates without a default: refused by name
    with pytest.raises(QualError, match=r'named chat templates rag, tool_use and none called "default"'):
        load_template(_folder(tmp_path / "d", {"chat_template": [{"name": "tool_use", "template": "t"},
                                                                  {"name": "rag", "template": "r"}]}))
    assert load_template(_folder(tmp_path / "e", {"eos_token": "</s>"})) is None
    # --chat-template replaces the tokenizer's; the tokenizer's special tokens still apply
    override = tmp_path / "mine.jinja"
    override.write_text("{{ eos_token }}{{ messages[0].content }}")
    t = load_template(_folder(tmp_path / "f", {"chat_template": "theirs", "eos_token": {"content": "</s>"}}), override)
    assert t.render(one, "r") == "</s>x" and t.source == str(override)
    with pytest.raises(QualError, match="--chat-template .*nope.jinja: no such file"):
        load_template(tmp_path / "f" / "tok", tmp_path / "nope.jinja")


def test_special_tokens_come_from_the_config_then_the_legacy_map(tmp_path):
    folder = _folder(tmp_path, {"chat_template": "{{ bos_token }}|{{ eos_token }}", "eos_token": "E"},
                     {"special_tokens_map.json": json.dumps({"bos_token": {"content": "B"}, "eos_token": "X"})})
    assert load_template(folder).render([{"role": "user", "content": "x"}], "r") == "B|E"


@pytest.mark.parametrize("template, error", [
    ("{{ raise_exception('roles must alternate') }}", r"corpus c: request r1: the chat template .* refused it: roles must alternate"),
    ("{{ ''.__class__.__mro__ }}", r"refused it: .*unsafe"),
    ("{% set ns = namespace() %}{% set ns._x = 1 %}", r"refused it: .*may not store '_x'"),
    ("{{ messages[5].content.upper() }}", r"refused it|failed on it"),
    ("{% for %}", r"tok/tokenizer_config.json:1: not a valid chat template"),
])
def test_a_template_that_fails_is_refused_naming_the_request(tmp_path, template, error):
    folder = _folder(tmp_path, {"chat_template": template})
    with pytest.raises(QualError, match=error):
        load_template(folder).render([{"role": "user", "content": "x"}], "corpus c: request r1")


def test_the_sandbox_keeps_what_templates_use(tmp_path):
    template = ("{{ messages | tojson }}|{{ {'a': '<&>'} | tojson(indent=1) }}|{{ strftime_now('%Y') | length }}|"
                "{% set ns = namespace(n=0) %}{% for m in messages %}{% set ns.n = ns.n + 1 %}{% endfor %}{{ ns.n }}|"
                "{{ dict(a=1) }}|{% for i in range(3) %}{% if i == 1 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
                "{% generation %}g{% endgeneration %}")
    out = load_template(_folder(tmp_path, {"chat_template": template})).render([{"role": "user", "content": "é"}], "r")
    assert out == '[{"role": "user", "content": "é"}]|{\n "a": "<&>"\n}|4|1|{\'a\': 1}|0|g'
    # str.join over a generator (map, select): the bound's estimate must not read it before the join does
    joined = load_template(_folder(tmp_path / "join", {"chat_template": "{{ ', '.join(messages | map(attribute="
                                                       "'content')) }}|{{ messages | map(attribute='role') | join('+') }}"}))
    assert joined.render([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], "r") == \
        "hi, yo|user+assistant"
