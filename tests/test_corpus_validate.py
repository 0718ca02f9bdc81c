"""Every malformed-line class is named with file:line; nothing is skipped."""

from __future__ import annotations

import json

import pytest

from qual.corpus import CorpusFormatError, load_corpus
from qual.corpus.validate import MAX_DETAILED, display_path, parse_jsonl
from qual.errors import QualError

GOOD = '{"id": "a", "prompt": "p"}'


def write(tmp_path, *lines, name="c.jsonl", end="\n"):
    path = tmp_path / name
    path.write_text("\n".join(lines) + end, encoding="utf-8")
    return path


@pytest.mark.parametrize(
    "line, expected",
    [
        ('{"id": "b", "prompt": }', "invalid JSON"),
        ('["b", "p"]', "expected a JSON object, got list"),
        ('"just a string"', "expected a JSON object, got str"),
        ("", "blank line"),
        ("   ", "blank line"),
        ('{"prompt": "p"}', 'missing field "id"'),
        ('{"id": "b"}', 'missing field "prompt"'),
        ('{"id": "", "prompt": "p"}', 'field "id" is empty'),
        ('{"id": "b", "prompt": "  \\n "}', 'field "prompt" is empty'),
        ('{"id": 7, "prompt": "p"}', 'field "id" must be a string, got int'),
        ('{"id": "b", "prompt": ["p"]}', 'field "prompt" must be a string, got list'),
        ('{"id": "b", "prompt": null}', 'field "prompt" must be a string, got null'),
        ('{"id": "b", "prompt": "p", "category": 3}', 'field "category" must be a string, got int'),
        ('{"id": "b", "prompt": "p", "category": ""}', 'field "category" is empty'),
        ('{"id": "b", "prompt": "p", "max_tokens": 0}', 'field "max_tokens" must be >= 1, got 0'),
        ('{"id": "b", "prompt": "p", "max_tokens": -5}', 'field "max_tokens" must be >= 1, got -5'),
        (
            '{"id": "b", "prompt": "p", "max_tokens": 1.5}',
            'field "max_tokens" must be an integer, got float',
        ),
        (
            '{"id": "b", "prompt": "p", "max_tokens": "8"}',
            'field "max_tokens" must be an integer, got str',
        ),
        (
            '{"id": "b", "prompt": "p", "max_tokens": true}',
            'field "max_tokens" must be an integer, got bool',
        ),
        ('{"id": "b", "prompt": "p", "max_token": 8}', 'unknown field "max_token"'),
        # JSON keeps the last of two equal keys: which id or prompt was meant is not for qual to guess
        ('{"id": "b", "prompt": "p", "id": "c"}', "key 'id' given twice in one object (JSON would keep only the last)"),
        ('{"id": "b", "prompt": "p", "prompt": "q"}',
         "key 'prompt' given twice in one object (JSON would keep only the last)"),
        # Arrow stores max_tokens as int64: a larger number was an OverflowError
        ('{"id": "b", "prompt": "p", "max_tokens": 100000000000000000000}',
         "max_tokens: an integer of 21 digits is beyond what qual reads (64 bits)"),
        ('{"id": "b", "prompt": "p", "max_tokens": 1' + "0" * 5000 + "}",
         "max_tokens: an integer of 5001 digits is beyond what qual reads (64 bits)"),
        # chat rows: messages in the prompt's place
        ('{"id": "b", "prompt": "p", "messages": [{"role": "user", "content": "x"}]}',
         'both "prompt" and "messages": a row is raw text or a chat, not both'),
        ('{"id": "b", "messages": []}', 'field "messages" must be a non-empty list of {"role", "content"}, got an empty list'),
        ('{"id": "b", "messages": "hi"}', 'field "messages" must be a non-empty list of {"role", "content"}, got str'),
        ('{"id": "b", "messages": ["hi"]}', "messages[0]: expected an object, got str"),
        ('{"id": "b", "messages": [{"role": "tool", "content": "x"}]}',
         'messages[0]: role must be one of system, user, assistant, got "tool"'),
        ('{"id": "b", "messages": [{"role": "user", "content": "x", "name": "n"}]}',
         'messages[0]: unknown field "name" (allowed: role, content)'),
        ('{"id": "b", "messages": [{"role": "user", "content": " "}]}', "messages[0]: content is empty"),
        ('{"id": "b", "messages": [{"role": "user", "content": 3}]}', "messages[0]: content must be a string"),
        ('{"id": "b", "messages": [{"role": "user", "content": null}]}',
         "messages[0]: content null is an answer to generate: only an assistant message has it"),
        ('{"id": "b", "messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": null}, '
         '{"role": "user", "content": "x"}]}', "messages[1]: an answer to generate (content null) must follow a user message"),
        ('{"id": "b", "messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": null}]}',
         "the last message must be a user's (the one the arm answers)"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path, line, expected):
    path = write(tmp_path, GOOD, line, '{"id": "z", "prompt": "q"}')
    with pytest.raises(CorpusFormatError) as err:
        parse_jsonl(path)
    msg = str(err.value)
    assert msg.startswith(f"{display_path(path)}:2: {expected}")
    assert ":1:" not in msg and ":3:" not in msg  # the good lines are not blamed
    assert "\n" not in msg
    assert len(err.value.problems) >= 1
    assert isinstance(err.value, QualError)


def test_a_chat_row_loads_with_its_turns(tmp_path):
    path = write(tmp_path, GOOD, json.dumps({"id": "c", "category": "chat", "messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "One?"},
        {"role": "assistant", "content": "Given."}, {"role": "user", "content": "Two?"},
        {"role": "assistant", "content": None}, {"role": "user", "content": "Three?"}]}))
    a, c = parse_jsonl(path)
    assert (a.turns, a.messages, c.prompt, c.turns) == (1, None, None, 2)
    assert [m.content for m in c.messages] == ["Be brief.", "One?", "Given.", "Two?", None, "Three?"]
    assert json.loads(json.dumps(c.to_json())) == json.loads(path.read_text().splitlines()[1])


def test_invalid_utf8_is_named(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"id": "b", "prompt": "\xff"}\n')
    with pytest.raises(CorpusFormatError, match=r"c\.jsonl:2: not valid UTF-8"):
        parse_jsonl(path)


def test_every_bad_line_is_reported_in_order(tmp_path):
    path = write(tmp_path, GOOD, "{bad", '{"id": "c"}', GOOD, '{"id": "d", "prompt": "p", "x": 1}')
    with pytest.raises(CorpusFormatError) as err:
        parse_jsonl(path)
    lines = [p.split(":")[1] for p in err.value.problems]
    assert lines == ["2", "3", "4", "5"]  # line 4 repeats id "a" from line 1
    assert 'c.jsonl:4: duplicate id "a" (first at ' in str(err.value)
    assert str(err.value).count(";") == 3


def test_duplicate_id_names_both_lines(tmp_path):
    path = write(tmp_path, GOOD, '{"id": "b", "prompt": "p"}', '{"id": "a", "prompt": "other"}')
    with pytest.raises(CorpusFormatError) as err:
        parse_jsonl(path)
    where = display_path(path)
    assert err.value.problems == [f'{where}:3: duplicate id "a" (first at {where}:1)']


@pytest.mark.parametrize("content", ["", "\n"])
def test_empty_corpus_is_an_error(tmp_path, content):
    path = tmp_path / "c.jsonl"
    path.write_text(content)
    with pytest.raises(
        CorpusFormatError,
        match="c.jsonl" + (r":1: blank line" if content else r": corpus is empty"),
    ):
        parse_jsonl(path)


def test_many_problems_stay_on_one_line_and_name_every_line(tmp_path):
    n = MAX_DETAILED + 15
    path = write(tmp_path, *["{oops"] * n)
    with pytest.raises(CorpusFormatError) as err:
        parse_jsonl(path)
    msg = str(err.value)
    assert "\n" not in msg
    assert len(err.value.problems) == n
    assert "and 15 more problems" in msg
    tail = msg.split("on lines ")[1]
    assert tail.split(", ") == [str(i) for i in range(MAX_DETAILED + 1, n + 1)]


def test_optional_fields_and_null(tmp_path):
    path = write(
        tmp_path,
        '{"id": "a", "prompt": "p"}',
        '{"id": "b", "prompt": "p", "category": null, "max_tokens": null}',
        '{"id": "c", "prompt": "p", "category": "math", "max_tokens": 16}',
    )
    reqs = parse_jsonl(path)
    assert [(r.category, r.max_tokens) for r in reqs] == [
        ("default", None),
        ("default", None),
        ("math", 16),
    ]


def test_crlf_and_missing_final_newline_are_fine(tmp_path):
    path = tmp_path / "c.jsonl"
    path.write_bytes(b'{"id": "a", "prompt": "p"}\r\n{"id": "b", "prompt": "q"}')
    assert [r.id for r in load_corpus(path).requests] == ["a", "b"]


def test_missing_file_and_directory(tmp_path):
    with pytest.raises(QualError, match="no such corpus file"):
        parse_jsonl(tmp_path / "nope.jsonl")
    with pytest.raises(QualError, match="is a directory"):
        parse_jsonl(tmp_path)


def test_newline_in_duplicate_id_keeps_message_on_one_line(tmp_path):
    rec = json.dumps({"id": "a\nb", "prompt": "p"})
    path = write(tmp_path, rec, rec)
    with pytest.raises(CorpusFormatError) as err:
        parse_jsonl(path)
    assert "\n" not in str(err.value)
