"""Every `qual ...` command the docs show a user parses against the real command line.

The commands are read from README.md, docs/**/*.md, configs/**/README.md and corpora/README.md (inline code spans,
indented and fenced code blocks) and from the `run:` steps of docs/ci/github-nightly.yml. Each is parsed by the
click command `qual` is built on (the subcommand exists, every option exists, every value converts), and a `qual run`
also through run_options, which refuses a bad --dcp, --draft-kv, --meta or --axis by name; nothing runs.

The docs' notation is expanded first: `[--opt V]` is tried with and without, `a|b` (one word) as each value,
`A | B` as alternatives (B a subcommand of A's group, else a value in place of A's last word), `...` dropped, and a
placeholder (ID, N, URL, `$VAR`, `<run-dir>`) given a value of its parameter's type. A code span that ends in an
option expecting a value (`qual run --out`) names the option: the option must exist.
"""

from __future__ import annotations

import itertools
import re
import shlex
from pathlib import Path

import pytest
import typer
import yaml

from qual.cli.main import _register, app

REPO = Path(__file__).resolve().parents[1]

_register()
QUAL = typer.main.get_command(app)

# Where qual is started in a line of code: at its start, after a path (.venv/bin/qual), an env assignment or `&&`.
START = re.compile(r"(?:(?<=^)|(?<=[\s/]))qual(?= [a-z-])")
PLACEHOLDER = re.compile(r"[A-Z][A-Z0-9_]*|.*[$<].*")
# Values for placeholders that qual checks before any work (run_options): a name a reader substitutes
NAMED_SAMPLES = {"--dcp": "4", "--tp": "4", "--engine": "reference", "--device": "cpu", "--dtype": "float32",
                 "--draft-kv": "replicated", "--numerics": "exact", "--axis": "date", "--meta": "ci_run=x",
                 "--control-url": "http://127.0.0.1:8000", "--candidate-url": "http://127.0.0.1:8001"}


def _doc_files() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md")), *sorted((REPO / "configs").rglob("README.md")),
            REPO / "corpora" / "README.md"]


def _code_of_markdown(text: str) -> list[tuple[int, str, bool]]:
    """(line, code, whole) of a markdown text: each inline code span (whole=False: it may name a flag alone) and each
    line of an indented or fenced code block, comments dropped and `\\` continuations joined."""
    out: list[tuple[int, str, bool]] = []
    lines = text.splitlines()
    fenced = False
    pending, start = "", 0
    for n, line in enumerate(lines, 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if fenced or pending or (line.startswith("    ") and not line.lstrip().startswith(("-", "*", "|"))):
            code = re.sub(r"(^|\s)#.*", "", line).strip()
            if pending:
                code, n = pending + " " + code, start
            if code.endswith("\\"):
                pending, start = code[:-1].strip(), n
                continue
            pending = ""
            out.append((n, code, True))
            continue
        out.extend((n, span, False) for span in re.findall(r"`([^`]+)`", line))
    return out


def _code_of_workflow(path: Path) -> list[tuple[int, str, bool]]:
    """(0, line, True) of every line of every `run:` step of a workflow, continuations joined."""
    steps = [step.get("run", "") for job in yaml.safe_load(path.read_text())["jobs"].values() for step in job["steps"]]
    out = []
    for script in steps:
        for line in re.sub(r"\\\n\s*", " ", script).splitlines():
            out.append((0, re.sub(r"(^|\s)#.*", "", line).strip(), True))
    return out


def documented_commands() -> list[tuple[str, str, bool, bool]]:
    """(where, command, whole, shell) of every `qual ...` the docs show, as written from `qual` on."""
    found = []
    sources = [(p, _code_of_markdown(p.read_text()), False) for p in _doc_files()]
    workflow = REPO / "docs" / "ci" / "github-nightly.yml"
    sources.append((workflow, _code_of_workflow(workflow), True))
    for path, codes, shell in sources:
        for n, code, whole in codes:
            for m in START.finditer(code):
                command = code[m.start():]
                if command.split()[1].startswith("-") or command.split()[1] in QUAL.commands:
                    found.append((f"{path.relative_to(REPO)}:{n}", command, whole, shell))
    return found


def _shell_words(command: str) -> list[str]:
    """The words of one shell command: up to a `&&`, `||`, `;` or pipe; redirections and array expansions dropped."""
    lexer = shlex.shlex(command, posix=True, punctuation_chars="|&;<>")
    lexer.whitespace_split = True
    words: list[str] = []
    tokens = iter(lexer)
    for token in tokens:
        if token in ("&&", "||", ";", "|", "&"):
            break
        if set(token) <= set("<>&"):  # `2> log`, `>&-`, `>> file`: the descriptor and the target go too
            if words and words[-1].isdigit():
                words.pop()
            next(tokens, None)
            continue
        if not re.fullmatch(r"\$\{\w+\[@\]\}", token):
            words.append(token)
    return words


def _brackets(command: str) -> list[str]:
    """A command with each top-level `[...]` left out and put in."""
    m = re.search(r"\s\[([^\[\]]*)\]", command)
    if m is None:
        return [command]
    inner = [m.group(1)]
    if " | " in m.group(1):  # `[--sweep | --profile]`: one option of several; `[--numerics a | b]`: one value
        first, *rest = m.group(1).split(" | ")
        inner = [first, *(alt if alt.startswith("-") else first.rsplit(" ", 1)[0] + " " + alt for alt in rest)]
    return [c for part in ["", *(" " + i for i in inner)]
            for c in _brackets(command[:m.start()] + part + command[m.end():])]


def _group_path(words: list[str]) -> int:
    """How many leading words name groups (`qual history baseline pin` -> 3)."""
    command, depth = QUAL, 1
    for word in words[1:]:
        sub = getattr(command, "commands", {}).get(word)
        if sub is None or not hasattr(sub, "commands"):
            return depth
        command, depth = sub, depth + 1
    return depth


def _alternatives(command: str) -> list[str]:
    """`qual corpus list | show NAME` -> both commands; `--axis a | b` -> both values."""
    first, *rest = command.split(" | ")
    words = first.split()
    out = [first]
    for alt in rest:
        depth = _group_path(words)
        group = QUAL
        for w in words[1:depth]:
            group = group.commands[w]
        if alt.split()[0] in getattr(group, "commands", {}):
            out.append(" ".join(words[:depth] + [alt]))
        else:
            out.append(" ".join(words[:-1] + [alt]))
    return out


def _values(command: str) -> list[str]:
    """Each word `a|b` (no spaces) tried as each of its values."""
    choices = [w.split("|") if "|" in w and not w.startswith("-") else [w] for w in command.split()]
    return [" ".join(c) for c in itertools.product(*choices)]


def expand(command: str, shell: bool) -> list[list[str]]:
    """The argument lists (after `qual`) a documented command stands for."""
    if shell:
        return [_shell_words(command)[1:]]
    command = re.sub(r"\s\.\.\.(?=\s|$)", "", command)
    command = re.sub(r"<([\w-]+)>", r"\1", command)  # `reports/<run-dir>`: a placeholder, not a redirection
    out = []
    for bracketed in _brackets(command):
        for alt in _alternatives(bracketed):
            out.extend(_shell_words(v)[1:] for v in _values(alt))
    return out


def _sample(param, token: str) -> str:
    """A placeholder's value of the parameter's type."""
    if not PLACEHOLDER.fullmatch(token):
        return token
    named = next((NAMED_SAMPLES[o] for o in getattr(param, "opts", []) if o in NAMED_SAMPLES), None)
    if named is not None:
        return named
    # click's type where the parameter has one; typer 0.2x's carries the annotation until it parses
    kind = getattr(getattr(param, "type", None), "name", "") or getattr(
        getattr(param, "type_descriptor", None), "annotation", str).__name__
    return {"integer": "8", "integer range": "8", "int": "8", "float": "0.5", "float range": "0.5"}.get(kind, token)


def resolve(args: list[str], whole: bool) -> tuple[object, list[str], list[str]]:
    """(command, its arguments with placeholders filled, problems) of `qual ARGS`."""
    command, path = QUAL, []
    while args and hasattr(command, "commands") and not args[0].startswith("-"):
        if args[0] not in command.commands:
            return command, [], [f"no command {' '.join(['qual', *path, args[0]])}"]
        path.append(args[0])
        command, args = command.commands[args[0]], args[1:]
    options = {o: p for p in command.params for o in [*p.opts, *p.secondary_opts] if p.param_type_name == "option"}
    positional = [p for p in command.params if p.param_type_name == "argument"]
    filled, problems, i = [], [], 0
    while i < len(args):
        word = args[i]
        name = word.split("=", 1)[0]
        if word.startswith("-") and len(word) > 1:
            param = options.get(name)
            if param is None and name not in ("-h", "--help"):
                problems.append(f"qual {' '.join(path)}: no option {name}")
                i += 1
                continue
            filled.append(word)
            takes_value = param is not None and not param.is_flag and "=" not in word
            if takes_value:
                if i + 1 == len(args):
                    if whole:
                        problems.append(f"qual {' '.join(path)}: {name} without its value")
                    else:
                        filled.pop()  # a span naming the option: it exists
                    i += 1
                    continue
                filled.append(_sample(param, args[i + 1]))
                i += 1
        else:
            param = positional.pop(0) if positional and positional[0].nargs == 1 else (positional[0] if positional
                                                                                        else None)
            filled.append(_sample(param, word) if param is not None else word)
        i += 1
    return command, filled, problems


def parse_problems(args: list[str], whole: bool) -> list[str]:
    """What is wrong with `qual ARGS` as the real command line parses it (empty: it parses)."""
    from qual.harness.plan import run_options

    command, filled, problems = resolve(args, whole)
    if problems or not hasattr(command, "make_context") or hasattr(command, "commands"):
        return problems
    if not whole and len(filled) < len([p for p in command.params if p.param_type_name == "argument" and p.required]):
        return []  # a span that names a command whose arguments the prose gives
    try:
        ctx = command.make_context(command.name, list(filled))
    except Exception as exc:  # click's usage errors and its Exit for -h
        if type(exc).__name__ == "Exit" or not whole and type(exc).__name__.startswith("Missing"):
            return []  # -h or --version; a span naming a few options of a command
        return [f"{type(exc).__name__}: {getattr(exc, 'format_message', lambda: str(exc))()}"]
    if command.name == "run" and ctx.params.get("resume") is None:
        values = {k: v for k, v in ctx.params.items() if k not in ("resume", "dry_run", "quiet")}
        try:
            run_options(**values)
        except Exception as exc:
            return [f"run_options: {exc}"]
    return []


COMMANDS = documented_commands()


def test_the_docs_show_commands_of_every_subcommand():
    """The extraction is live: it finds the README's, the configs' and the workflow's commands."""
    where = {w.split(":")[0] for w, *_ in COMMANDS}
    assert {"README.md", "configs/README.md", "corpora/README.md", "docs/ci/github-nightly.yml"} <= where
    shown = {args[0] for _, c, whole, shell in COMMANDS for args in expand(c, shell) if args}
    assert {"run", "compare", "corpus", "history", "doctor", "schema", "--version"} <= shown


@pytest.mark.parametrize("where,command,whole,shell", COMMANDS, ids=[f"{w} {c[:60]}" for w, c, _, _ in COMMANDS])
def test_every_documented_command_parses(where, command, whole, shell):
    problems = [f"qual {' '.join(args)}: {p}" for args in expand(command, shell) for p in parse_problems(args, whole)]
    assert problems == [], f"{where}: {command}"


@pytest.mark.parametrize("args,whole", [
    (["run", "--dcpp", "4"], True),                 # an option that does not exist
    (["run", "--dcp", "four"], True),               # a value run_options refuses
    (["run", "--limit", "many"], True),             # a value click refuses
    (["run", "--draft-kv", "shared"], True),        # a mode that does not exist
    (["history", "tremd"], True),                   # a subcommand that does not exist
    (["history", "prune", "DIR", "--keep"], True),  # a whole command missing a value
])
def test_a_broken_command_is_caught(args, whole):
    assert parse_problems(args, whole) != []


def test_the_notation_expands():
    assert expand("qual corpus list | show NAME | import SOURCE --name NAME", False) == [
        ["corpus", "list"], ["corpus", "show", "NAME"], ["corpus", "import", "SOURCE", "--name", "NAME"]]
    assert expand("qual history export DIR [--format csv|parquet]", False) == [
        ["history", "export", "DIR"], ["history", "export", "DIR", "--format", "csv"],
        ["history", "export", "DIR", "--format", "parquet"]]
    assert expand("qual run --numerics a [--x vllm | vllm-hopper]", False)[1:] == [
        ["run", "--numerics", "a", "--x", "vllm"], ["run", "--numerics", "a", "--x", "vllm-hopper"]]
    assert expand('qual run "${args[@]}" 2> log', True) == [["run"]]
    assert expand("qual schema >&-", True) == [["schema"]]
    assert expand("qual schema [--sweep | --profile]", False) == [["schema"], ["schema", "--sweep"],
                                                                   ["schema", "--profile"]]
    assert expand("qual run --resume reports/<run-dir> ...", False) == [["run", "--resume", "reports/run-dir"]]
