"""One way in, one way out: every file qual reads goes through qual/userfiles.py and every file it writes through
qual/files.py. The source of qual/ is read as an AST and any call that reads, writes, copies or removes a file on its
own is refused outside those two modules, unless ALLOWED names it with its reason; a planted module proves that each
rule finds what it is for, and that the forms the two modules offer pass."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

QUAL = Path(__file__).resolve().parents[1] / "qual"
BOUNDARY = {"userfiles.py", "files.py"}  # the one way in and the one way out (paths relative to qual/)

# (file relative to qual/, rule) -> why that file does it itself. A stale entry (nothing found) fails too.
ALLOWED = {
    ("cli/streams.py", "os.open"): "a stdin/stdout/stderr closed at start is pointed at /dev/null by descriptor "
                                   "number; nothing is read or written there",
    ("cli/streams.py", "open"): "wraps the descriptor of /dev/null (above) in a stream: no path is opened",
    ("engines/vllm/transport.py", ".open"): "urllib's opener.open sends an HTTP request; the reply is capped by "
                                            "the transport itself",
    ("validation.py", ".isdigit"): "ascii_digits itself: isdigit once isascii has said the text is ASCII",
}

# What each rule stands for, as the failure message names it.
RULES = {
    "open": "builtin open(): read with qual.userfiles, write with qual.files",
    "os.open": "os.open(): qual.userfiles.open_regular / qual.files",
    "os.fdopen": "os.fdopen(): qual.files",
    ".open": "Path.open() / gzip.open() / tarfile.open() ...: qual.userfiles / qual.files",
    ".read_text": "Path.read_text(): qual.userfiles.read_text",
    ".read_bytes": "Path.read_bytes(): qual.userfiles.read_bytes",
    ".write_text": "Path.write_text(): qual.files.write_text",
    ".write_bytes": "Path.write_bytes(): qual.files.write_bytes",
    "json.load": "json.load/json.loads: qual.userfiles.load_json / read_json / load_reply",
    "yaml.load": "yaml.*load*: qual.userfiles.load_yaml",
    "savefig": "savefig() to a path: qual.files.write_with",
    "safetensors": "safetensors' functions (safe_open, load_file, save_file, and save/load to bytes): "
                   "qual.userfiles.open_safetensors / load_safetensors, qual.files.save_safetensors",
    "torch.load": "torch.load/torch.save: qual.userfiles.load_torch / qual.files.write_with",
    "numpy.load": "np.load/np.save: qual.userfiles.load_numpy / qual.files.write_with",
    "shutil": "shutil copy/move/remove: qual.files.copy_file / remove_tree",
    "tempfile": "tempfile's files: qual.files.write_new / write_with",
    ".isdigit": "str.isdigit/isdecimal/isnumeric take '²' and '٢': qual.validation.ascii_digits",
    "from_file": "a library's from_file (tokenizers): read with qual.userfiles.read_text, then from_str",
}
_BOUNDARY_MODULES = {"qual.files", "qual.userfiles", "files", "userfiles"}
_SHUTIL = {"copy", "copy2", "copyfile", "copyfileobj", "copytree", "move", "rmtree"}
_TEMPFILE = {"mkstemp", "NamedTemporaryFile", "TemporaryFile", "SpooledTemporaryFile"}


def _dotted(node: ast.AST) -> str | None:
    """`a.b.c` of a Name/Attribute chain, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id, *reversed(parts)])
    return None


class _Finder(ast.NodeVisitor):
    """(line, rule) of every call that does file I/O on its own."""

    def __init__(self, tree: ast.Module):
        self.found: list[tuple[int, str]] = []
        self.aliases: dict[str, str] = {}  # local name -> module or "module.name" it was imported as
        self.buffers: list[set[str]] = [set()]  # names bound to io.BytesIO()/StringIO() in the enclosing function
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]
            elif isinstance(node, ast.ImportFrom) and node.module:
                for a in node.names:
                    self.aliases[a.asname or a.name] = f"{node.module}.{a.name}"

    def _resolve(self, dotted: str) -> str:
        head, _, rest = dotted.partition(".")
        full = self.aliases.get(head, head)
        return f"{full}.{rest}" if rest else full

    def visit_FunctionDef(self, node):
        self.buffers.append(set())
        self.generic_visit(node)
        self.buffers.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_Assign(self, node):
        if isinstance(node.value, ast.Call) and (_dotted(node.value.func) or "").split(".")[-1] in ("BytesIO", "StringIO"):
            self.buffers[-1] |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        self.generic_visit(node)

    def visit_Call(self, node):
        rule = self._rule(node)
        if rule:
            self.found.append((node.lineno, rule))
        self.generic_visit(node)

    def _rule(self, node: ast.Call) -> str | None:
        func = node.func
        dotted = _dotted(func)
        full = self._resolve(dotted) if dotted else None
        name = full.rsplit(".", 1)[-1] if full else (func.attr if isinstance(func, ast.Attribute) else None)
        if full == "open":
            return "open"
        if full in ("os.open", "os.fdopen"):
            return full
        module = full.rsplit(".", 1)[0] if full and "." in full else None
        if module in ("json",) and name in ("load", "loads"):
            return "json.load"
        if module == "yaml" and "load" in name:
            return "yaml.load"
        if full and full.split(".")[0] == "safetensors":  # any of its functions, to a path or to bytes: a format
            return "safetensors"                           # spelled in one reader and one writer
        if full in ("torch.load", "torch.save"):
            return "torch.load"
        if full in ("numpy.load", "numpy.save", "numpy.savez", "numpy.savez_compressed"):
            return "numpy.load"
        if module == "shutil" and name in _SHUTIL:
            return "shutil"
        if module == "tempfile" and name in _TEMPFILE:
            return "tempfile"
        if isinstance(func, ast.Attribute):
            receiver = _dotted(func.value)
            through_boundary = receiver is not None and self._resolve(receiver) in _BOUNDARY_MODULES
            if func.attr in ("read_text", "read_bytes", "write_text", "write_bytes", "open") and not through_boundary:
                return f".{func.attr}"
            if func.attr == "savefig":
                target = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "fname"), None)
                if not (isinstance(target, ast.Name) and target.id in self.buffers[-1]):
                    return "savefig"
            if func.attr in ("isdigit", "isdecimal", "isnumeric"):
                return ".isdigit"
            if func.attr == "from_file":
                return "from_file"
        return None


def find(source: str, filename: str = "<planted>") -> list[tuple[int, str]]:
    tree = ast.parse(source, filename)
    finder = _Finder(tree)
    finder.visit(tree)
    return finder.found


def _sources() -> dict[str, str]:
    return {p.relative_to(QUAL).as_posix(): p.read_text() for p in sorted(QUAL.rglob("*.py"))}


def test_every_file_qual_touches_goes_through_the_one_way_in_and_the_one_way_out():
    bad, used = [], set()
    for rel, source in _sources().items():
        if rel in BOUNDARY:
            continue
        for line, rule in find(source, rel):
            if (rel, rule) in ALLOWED:
                used.add((rel, rule))
                continue
            bad.append(f"qual/{rel}:{line}: {RULES[rule]}")
    assert bad == [], "\n".join(bad)
    assert set(ALLOWED) - used == set(), "allow-list entries that match nothing (remove them)"


PLANTED = '''
import json, yaml, shutil, tempfile, gzip, io, os
import numpy as np
import torch
from pathlib import Path
from json import loads
from safetensors.torch import load_file
from safetensors import safe_open as so
from safetensors.torch import save as to_bytes
import safetensors.torch as st
from qual import files
from qual.userfiles import read_text

def f(p, fig):
    open(p)                          # open
    os.open(p, os.O_RDONLY)          # os.open
    os.fdopen(3)                     # os.fdopen
    Path(p).open()                   # .open
    gzip.open(p)                     # .open
    Path(p).read_text()              # .read_text
    p.read_bytes()                   # .read_bytes
    p.write_text("x")                # .write_text
    p.write_bytes(b"x")              # .write_bytes
    json.loads("1")                  # json.load
    loads("1")                       # json.load
    json.load(p)                     # json.load
    yaml.safe_load("a: 1")           # yaml.load
    yaml.load("a: 1", Loader=None)   # yaml.load
    load_file(p)                     # safetensors
    so(p, framework="pt")            # safetensors
    to_bytes({})                     # safetensors
    st.load(b"")                     # safetensors
    torch.load(p)                    # torch.load
    torch.save({}, p)                # torch.load
    np.load(p)                       # numpy.load
    np.save(p, 1)                    # numpy.load
    shutil.rmtree(p)                 # shutil
    shutil.copy(p, p)                # shutil
    tempfile.mkstemp()               # tempfile
    fig.savefig(p)                   # savefig
    "2".isdigit()                    # .isdigit
    Tokenizer.from_file(p)           # from_file

def allowed(p, fig):
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    files.write_text(p, "x")
    read_text(p)
    json.dumps({})
'''


def test_the_guard_finds_every_planted_call_and_passes_the_boundarys_own():
    found = find(PLANTED)
    lines = PLANTED.splitlines()
    expected = [(n, line.split("# ")[1].strip()) for n, line in enumerate(lines, 1) if "  # " in line]
    assert found == expected
    assert {rule for _, rule in expected} == set(RULES)  # every rule has a planted call


@pytest.mark.parametrize("allowed", sorted(ALLOWED))
def test_every_allow_list_entry_gives_its_reason(allowed):
    assert len(ALLOWED[allowed]) > 20 and allowed[1] in RULES
