"""Conversations of several turns (qual.harness.turns): each arm's later turns hold its own earlier answers, the arm
runs in waves, acceptance is reported per turn, and a resumed run builds the same later prompts from its journal."""

import json
import shutil
import subprocess
import sys

import pytest

from checkpoints import make_profile
from qual.chat import load_template
from qual.corpus.records import CorpusRequest, Message
from qual.harness.journal import sealed
from qual.harness.turns import ChatPrompts, Conversation, request_ids
from qual.tokenize import PromptTokenizer

QUAL = [sys.executable, "-m", "qual"]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{% if add_generation_prompt %}<a>{% endif %}"
CORPUS = [
    {"id": "plain", "prompt": "def f(x):"},
    {"id": "one", "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]},
    {"id": "two", "category": "chat", "messages": [
        {"role": "user", "content": "Count to three."}, {"role": "assistant", "content": None},
        {"role": "user", "content": "Now backwards."}]},
    {"id": "three", "category": "chat", "messages": [
        {"role": "user", "content": "A?"}, {"role": "assistant", "content": None},
        {"role": "user", "content": "B?"}, {"role": "assistant", "content": "given"},
        {"role": "user", "content": "C?"}, {"role": "assistant", "content": None},
        {"role": "user", "content": "D?"}]},
]
IDS = ["plain", "one", "two/turn1", "two/turn2", "three/turn1", "three/turn2", "three/turn3"]


def test_a_turns_prompt_holds_the_earlier_answers():
    row = CorpusRequest("three", None, messages=tuple(Message(m["role"], m["content"]) for m in CORPUS[3]["messages"]))
    conv = Conversation(row, 8)
    assert conv.turns == 3 and [conv.request_id(t) for t in (1, 2, 3)] == IDS[4:]
    assert conv.messages(1, []) == [{"role": "user", "content": "A?"}]
    assert conv.messages(3, ["a1", "a2"]) == [
        {"role": "user", "content": "A?"}, {"role": "assistant", "content": "a1"}, {"role": "user", "content": "B?"},
        {"role": "assistant", "content": "given"}, {"role": "user", "content": "C?"},
        {"role": "assistant", "content": "a2"}, {"role": "user", "content": "D?"}]
    request = conv.request(2, [5, 6])
    assert (request.id, request.turn, request.conversation, request.max_tokens) == ("three/turn2", 2, "three", 8)
    rows = [CorpusRequest(r["id"], r.get("prompt"), messages=tuple(Message(m["role"], m["content"])
                                                                    for m in r.get("messages", [])) or None)
            for r in CORPUS]
    assert request_ids(rows) == IDS


def qual(*args, timeout=300):
    return subprocess.run([*QUAL, *map(str, args)], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def chat_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    profile = make_profile(root, reference={"max_num_seqs": 2})
    corpus, template = root / "chat.jsonl", root / "t.jinja"
    corpus.write_text("".join(json.dumps(r) + "\n" for r in CORPUS))
    template.write_text(TEMPLATE)
    proc = qual("run", "--model", profile, "--dcp", 2, "--corpus", corpus, "--chat-template", template,
                "--out", root / "out", "--history", root / "h.sqlite")
    return proc, root


def test_each_arm_builds_its_later_turns_from_its_own_answers(chat_run):
    proc, root = chat_run
    assert proc.returncode == 0, proc.stderr
    result = json.loads((root / "out" / "result.json").read_text())
    tokenizer = PromptTokenizer(str(root / "target"))
    prompts = ChatPrompts(tokenizer, load_template(root / "target", root / "t.jinja"))
    for arm in ("control", "candidate"):
        rows = {r["id"]: r for r in result["arms"][arm]["per_request"]}
        assert list(rows) == IDS
        assert [(r["turn"], r["conversation"]) for r in rows.values()] == [
            (1, None), (1, None), (1, "two"), (2, "two"), (1, "three"), (2, "three"), (3, "three")]
        answers = [tokenizer.decode(rows[f"three/turn{t}"]["output_token_ids"], skip_special_tokens=True)
                   for t in (1, 2)]
        text = ("<user>A?<assistant>" + answers[0] + "<user>B?<assistant>given<user>C?<assistant>" + answers[1]
                + "<user>D?<a>")
        assert rows["three/turn3"]["prompt_token_ids"] == tokenizer.encode(text)
        assert rows["one"]["prompt_token_ids"] == prompts.encode(
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}], "one")
        assert rows["plain"]["prompt_token_ids"] == tokenizer.encode("def f(x):")
    cmp = result["comparison"]
    assert [(t["turn"], t["n"]) for t in cmp["per_turn"]] == [(1, 4), (2, 2), (3, 1)]
    assert cmp["earlier_turns_differ"] == [] and cmp["target_outputs_identical"] is True
    assert cmp["bootstrap"]["unit"] == "conversation" and cmp["bootstrap"]["n_requests"] == 4
    record = result["arms"]["candidate"]["config"]["extra"]["chat_template"]
    assert record == result["arms"]["candidate"]["provenance"]["chat_template"]
    assert record["source"] == str(root / "t.jinja") and record["name"] is None
    assert "--chat-template" in result["reproduce"]
    info = json.loads((root / "out" / "control.arm.json").read_text())  # three waves: three pieces
    assert len(info["extra"]["earlier_pieces"]) == 2 and info["extra"]["requests_run"] == 1
    report = (root / "out" / "report.html").read_text()
    assert 'id="per-turn"' in report and "7 requests (4 conversations)" in report
    assert "### Per turn" in (root / "out" / "summary.md").read_text()


def test_a_resumed_run_rebuilds_the_same_later_turns(chat_run, tmp_path):
    """Killed after the first wave: the later turns are built again from the journaled first answers."""
    _, root = chat_run
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    for name in ("result.json", "control.arm.json", "candidate.arm.json", "candidate.requests.jsonl"):
        (out / name).unlink()
    journal = out / "control.requests.jsonl"
    first = [line for line in journal.read_text().splitlines() if json.loads(line)["turn"] == 1]
    journal.write_text("\n".join(first) + "\n")
    resumed = qual("run", "--resume", out)
    assert resumed.returncode == 0, resumed.stderr
    full = json.loads((root / "out" / "result.json").read_text())
    got = json.loads((out / "result.json").read_text())
    for arm in ("control", "candidate"):
        keep = ("id", "turn", "prompt_token_ids", "output_token_ids", "accepted_tokens")
        assert [{k: r[k] for k in keep} for r in got["arms"][arm]["per_request"]] == \
               [{k: r[k] for k in keep} for r in full["arms"][arm]["per_request"]]
    assert json.loads((out / "control.arm.json").read_text())["extra"]["resumed_with"] == 6
    # a journaled later turn whose prompt is not the one its journaled answers give: refused before any arm runs
    lines = (out / "control.requests.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    turn3 = next(i for i, r in enumerate(records) if r["id"] == "three/turn3")
    records[turn3]["prompt_token_ids"] = records[turn3]["prompt_token_ids"][:-1]
    (out / "control.requests.jsonl").write_text("".join(json.dumps(sealed(r)) + "\n" for r in records))
    proc = qual("run", "--resume", out)
    assert proc.returncode == 2 and "three/turn3 was journaled with another prompt" in proc.stderr


def test_a_later_turn_whose_earlier_turn_differs_is_marked_not_compared(chat_run, tmp_path):
    """The candidate's first answer of a conversation changed: its second turn's prompt differs; the first turn's
    difference is the one the gate judges, the second is marked."""
    _, root = chat_run
    out = tmp_path / "out"
    shutil.copytree(root / "out", out)
    journal = out / "candidate.requests.jsonl"
    records = [json.loads(line) for line in journal.read_text().splitlines()]
    records = [r for r in records if r["id"] != "two/turn2"]
    first = next(r for r in records if r["id"] == "two/turn1")
    first["output_token_ids"][-1] = (first["output_token_ids"][-1] + 1) % 90  # one token: a turn built on it differs
    first["top2_margins"] = None
    journal.write_text("".join(json.dumps(sealed(r)) + "\n" for r in records))  # resealed: past the digest
    for name in ("result.json", "candidate.arm.json"):
        (out / name).unlink()
    proc = qual("run", "--resume", out)
    assert proc.returncode == 1, proc.stderr  # the first turn's output differs: the gate fails on it
    result = json.loads((out / "result.json").read_text())
    cmp = result["comparison"]
    assert [d["id"] for d in cmp["output_divergence"]] == ["two/turn1"]
    assert cmp["earlier_turns_differ"] == ["two/turn2"]
    assert [t["earlier_turns_differ"] for t in cmp["per_turn"]] == [0, 1, 0]
    row = next(r for r in cmp["per_request_deltas"] if r["id"] == "two/turn2")
    assert row["earlier_turns_differ"] is True
    assert "1 later turns not compared (their earlier turns differ)" in proc.stdout
    assert "earlier turns differ</span>" in (out / "report.html").read_text()


def test_a_shipped_chat_corpus_renders_with_the_profiles_own_template(tmp_path):
    """`qual run --dcp 4 --corpus mt-bench --limit 8` as README shows it: the toy target's chat_template.jinja, and
    with --chat-template the tokenizer folder's special tokens (eos_token) all the same."""
    from qual.harness.plan import make_plan, run_options
    from qual.paths import DATA_DIR

    toy = DATA_DIR / "models" / "toy" / "target"
    plan = make_plan(run_options(dcp="4", corpus="mt-bench", limit=8, out=str(tmp_path / "o")), dry_run=True)
    assert plan.prompts.template.source == str(toy / "chat_template.jinja")
    eos = json.loads((toy / "tokenizer_config.json").read_text())["eos_token"]
    assert plan.prompts.template.special_tokens["eos_token"] == eos
    mine = tmp_path / "mine.jinja"
    mine.write_text("{{ eos_token }}")
    plan = make_plan(run_options(dcp="4", corpus="mt-bench", limit=8, chat_template=str(mine), out=str(tmp_path / "o")),
                     dry_run=True)
    assert plan.prompts.template.special_tokens["eos_token"] == eos
