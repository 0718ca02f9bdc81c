"""Reading the files a user hands qual: bounded, regular files only, parsed strictly into one-line errors.

Every file qual reads comes through here (tests/test_io_boundary.py refuses a raw open elsewhere): profiles, gates,
corpora, checkpoint configs and weights, tokenizers, chat templates, result.json, run.json, journals, manifests,
caches, logs, /proc, and the JSON of SQLite rows and of server replies.
- `read_bytes` (and everything built on it) opens without blocking and refuses what is not a regular file (a FIFO
  would block forever, /dev/zero never ends), refuses a regular file whose size is over the cap before reading
  it, and otherwise stops at the cap counted in bytes read (st_size is 0 for a device or a /proc file);
- `descriptor_path` hands a checked, open file to a loader that wants a path (safetensors) as /proc/self/fd/N, so
  the file cannot be swapped between the check and the load;
- `load_yaml` and `load_json` refuse what Python's parsers would take silently or crash on: a key given twice
  (the last would win), nesting deeper than MAX_DEPTH (RecursionError), an integer beyond 64 bits (Python's
  int conversion limit, OverflowError on the way to a float), a number that is not finite (`1e400`, NaN), a
  lone surrogate (`\\ud800`: no UTF-8 encodes it, so a report or the history would fail on it).
A problem is a QualError (exit 2): '<file>:<line>: <field>: <what is wrong>'.

Checkpoint files are read through links (a Hugging Face cache's snapshot is a folder of links to its blobs);
journals, which qual also writes, are not (`follow=False`).
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import yaml

from qual.errors import QualError
from qual.stop_signals import check_stopping

MAX_CONFIG_BYTES = 1 << 20  # profiles, gate files, config.json, manifests, run.json: small by nature
MAX_DEPTH = 64  # nesting of a YAML or JSON document (no file qual reads nests beyond a few levels)
MAX_INT = 2**63 - 1  # the widest integer any file of qual's holds (a seed, a history id: SQLite's int64)
MAX_TOKENIZER_BYTES = 1 << 28  # tokenizer.json: tens of MB for the largest vocabularies
_SURROGATE = re.compile("[\ud800-\udfff]")
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
_CHUNK = 1 << 22


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | Path, what: str = "file", where: str | None = None, follow: bool = True) -> int:
    """A read-only descriptor of a regular file (the caller closes it); a QualError for anything else. OSError of
    the open itself (missing, unreadable, a name too long, a link where follow is False) passes through."""
    where = str(path) if where is None else where
    # O_NONBLOCK: opening a FIFO returns at once instead of waiting for a writer; fstat then refuses it.
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise QualError(f"{where}: is {_kind(mode)}, not a {what} (only regular files are read)")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _too_large(where: str, what: str, limit: int) -> QualError:
    return QualError(f"{where}: larger than a {what} may be ({limit} bytes); refused")


def read_bytes(path: str | Path, limit: int, what: str = "file", where: str | None = None,
               follow: bool = True) -> bytes:
    """At most `limit` bytes of a regular file; a QualError (naming it as `where`, default the path) for anything
    else or anything longer. OSError of the open itself (missing, unreadable, a name too long) passes through
    for the caller to word."""
    where = str(path) if where is None else where
    fd = open_regular(path, what, where, follow)
    try:
        if os.fstat(fd).st_size > limit:  # refused before a byte is read (a 20 GB result.json)
            raise _too_large(where, what, limit)
        chunks, total = [], 0
        while True:  # counted as read: a file that grows while it is read is still cut off
            chunk = os.read(fd, min(1 << 20, limit + 1 - total))
            if not chunk:
                break
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:
                raise _too_large(where, what, limit)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_chunks(path: str | Path, what: str = "file", on_size: Callable[[int, int], None] | None = None
                ) -> Iterator[bytes]:
    """A regular file's bytes in chunks, unbounded (hashing a checkpoint); on_size(bytes, bytes allocated) hears
    the size first (a caller that says so before reading tens of gigabytes)."""
    fd = open_regular(path, what)
    try:
        st = os.fstat(fd)
        if on_size is not None:
            on_size(st.st_size, st.st_blocks * 512)
        while chunk := os.read(fd, _CHUNK):
            yield chunk
    finally:
        os.close(fd)


def read_tail(path: str | Path, limit: int, what: str = "log") -> str:
    """The last `limit` bytes of a regular file as text, undecodable bytes replaced (a log that may be long and
    written by anything)."""
    fd = open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            os.lseek(fd, size - limit, os.SEEK_SET)
        chunks, total = [], 0
        while total < limit and (chunk := os.read(fd, min(1 << 20, limit - total))):
            chunks.append(chunk)
            total += len(chunk)
        return b"".join(chunks).decode("utf-8", errors="replace")
    finally:
        os.close(fd)


@contextmanager
def descriptor_path(path: str | Path, what: str = "file") -> Iterator[str]:
    """/proc/self/fd/N of the checked regular file at path, open while the block runs: a loader given it opens the
    very file checked (a FIFO or a device put there is refused, a swap after the check reads nothing else)."""
    fd = open_regular(path, what)
    try:
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def load_safetensors(path: str | Path) -> dict:
    """Every tensor of one safetensors file (torch tensors on the CPU); QualError naming the file where it is
    unreadable."""
    from safetensors.torch import load_file

    return _safetensors(path, lambda p: load_file(p))


def open_safetensors(path: str | Path, framework: str):
    """safetensors' safe_open handle of one file (its tensors read on demand); QualError naming the file where it is
    unreadable. The handle holds the file open itself once made."""
    from safetensors import safe_open

    return _safetensors(path, lambda p: safe_open(p, framework=framework))


def _safetensors(path: str | Path, load: Callable[[str], Any]) -> Any:
    try:
        with descriptor_path(path, "safetensors file") as fd_path:
            return load(fd_path)
    except QualError:
        raise
    except OSError as exc:
        raise QualError(f"{path}: unreadable ({exc.strerror or exc})") from None
    except Exception as exc:  # safetensors raises its own error types
        check_stopping()  # or a stop signal's KeyboardInterrupt came back as one (qual/stop_signals.py)
        raise QualError(f"{path}: unreadable safetensors file ({exc})") from None


def load_torch(path: str | Path, limit: int, what: str = "tensor file") -> Any:
    """A torch.save file of tensors and plain containers (weights_only: no pickled code runs), on the CPU."""
    import torch

    data = read_bytes(path, limit, what)
    try:
        return torch.load(io.BytesIO(data), weights_only=True, map_location="cpu")
    except Exception as exc:  # torch raises several types for a bad file
        raise QualError(f"{path}: unreadable ({exc})") from None


def load_numpy(path: str | Path, limit: int, what: str = "array file") -> Any:
    """A numpy .npy array (no pickled objects)."""
    import numpy as np

    data = read_bytes(path, limit, what)
    try:
        return np.load(io.BytesIO(data), allow_pickle=False)
    except (ValueError, OSError, EOFError) as exc:
        raise QualError(f"{path}: unreadable ({exc})") from None


def read_text(path: str | Path, limit: int = MAX_CONFIG_BYTES, what: str = "config file", follow: bool = True,
              errors: str = "strict") -> str:
    """read_bytes decoded as UTF-8 (a QualError naming the byte where it is not; errors="replace": a text written
    by anything, such as a package's source, read as well as it decodes)."""
    data = read_bytes(path, limit, what, follow=follow)
    if errors != "strict":
        return data.decode("utf-8", errors=errors)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data.count(b"\n", 0, exc.start) + 1
        raise QualError(f"{path}:{line}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def not_utf8(value: str | Path, option: str) -> QualError | None:
    """The refusal of a name that is not UTF-8 (bytes Python carries as lone surrogates from the command line): qual
    records paths in run.json, result.json and the history, which hold text. None for a name that is text."""
    text = str(value)
    if text.isascii() or _SURROGATE.search(text) is None:
        return None
    raw = os.fsencode(text) if all("\udc80" <= c <= "\udcff" for c in _SURROGATE.findall(text)) else None
    where = raw.decode("utf-8", errors="backslashreplace") if raw is not None else text.encode(
        "utf-8", errors="backslashreplace").decode()
    return QualError(f"{option} {where}: not UTF-8 text; qual records names in run.json, result.json and the history, "
                     "which hold text: rename it")


def check_path_name(value: str | Path, option: str) -> None:
    """A path the file system can name and qual can record: UTF-8 text, no NUL, no component over NAME_MAX bytes,
    not over PATH_MAX bytes in all (the kernel's ENAMETOOLONG, raised by every later stat, is a traceback
    otherwise)."""
    problem = not_utf8(value, option)
    if problem is not None:
        raise problem
    raw = os.fsencode(value)
    if b"\0" in raw:
        raise QualError(f"{option}: a path cannot hold a NUL byte")
    longest = max(raw.split(b"/"), key=len)
    if len(longest) > 255:
        raise QualError(f"{option}: a path component of {len(longest)} bytes is longer than a file name may be "
                        f"(255): {longest[:40].decode(errors='replace')}...")
    if len(raw) > 4095:
        raise QualError(f"{option}: a path of {len(raw)} bytes is longer than the system allows (4095)")


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _field(path: tuple) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _refuse(where: str, line: int | None, path: tuple, problem: str) -> QualError:
    at = f"{where}:{line}" if line is not None else where
    field = _field(path)
    return QualError(f"{at}: {field}: {problem}" if field else f"{at}: {problem}")


def text_problem(text: str) -> str | None:
    """Why a decoded string cannot be text qual writes (a lone surrogate no UTF-8 encodes), or None."""
    if not text.isascii():
        bad = _SURROGATE.search(text)
        if bad is not None:
            return f"a lone surrogate (\\u{ord(bad.group()):04x}) is not text"
    return None


# ---------------------------------------------------------------- YAML


class _Loader(yaml.SafeLoader):
    """SafeLoader whose composer counts nesting: a deep document is refused at its line, not a RecursionError."""

    def __init__(self, stream):
        super().__init__(stream)
        self.depth = 0

    def compose_node(self, parent, index):
        self.depth += 1
        try:
            if self.depth > MAX_DEPTH:
                mark = self.peek_event().start_mark
                raise _Deep(mark.line + 1)
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


class _Deep(Exception):
    def __init__(self, line: int):
        self.line = line


_INT_TAG, _STR_TAG, _MERGE_TAG = "tag:yaml.org,2002:int", "tag:yaml.org,2002:str", "tag:yaml.org,2002:merge"


def _scalar_problem(loader: _Loader, node: yaml.ScalarNode) -> str | None:
    if node.tag == _INT_TAG:
        if len(node.value) > 100:
            return f"an integer of {len(node.value)} characters is beyond what qual reads (64 bits)"
        value = loader.construct_object(node)
        if abs(value) > MAX_INT:
            return f"{node.value} is beyond what qual reads (integers of 64 bits)"
    elif node.tag == _STR_TAG:
        return text_problem(node.value)
    return None


def _check_nodes(loader: _Loader, root: yaml.Node, where: str) -> None:
    """Every mapping's keys distinct (naming both lines), every integer within 64 bits, every string text."""
    seen: set[int] = set()  # an alias shares its anchor's node: each is checked once (a billion laughs stays cheap)
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.ScalarNode):
            problem = _scalar_problem(loader, node)
            if problem:
                raise _refuse(where, node.start_mark.line + 1, path, problem)
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((child, (*path, i)) for i, child in reversed(list(enumerate(node.value))))
        elif isinstance(node, yaml.MappingNode):
            first: dict[Any, int] = {}
            children = []
            for key_node, value_node in node.value:
                line = key_node.start_mark.line + 1
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != _MERGE_TAG:
                    problem = _scalar_problem(loader, key_node)
                    if problem:
                        raise _refuse(where, line, path, problem)
                    key = loader.construct_object(key_node)
                    if key in first:
                        raise _refuse(where, line, path, f"key {_shown(key)} given twice (first at line "
                                                         f"{first[key]}; YAML would keep only the last)")
                    first[key] = line
                    children.append((value_node, (*path, key)))
                else:
                    children.append((key_node, path))
                    children.append((value_node, path))
            stack.extend(reversed(children))


def load_yaml(text: str, where: str) -> Any:
    """A YAML document (safe types only), refused as the module says; None for an empty one."""
    loader = _Loader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_nodes(loader, node, where)
        return loader.construct_document(node)
    except _Deep as exc:
        raise QualError(f"{where}:{exc.line}: nested deeper than {MAX_DEPTH} levels") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        at = f"{where}:{mark.line + 1}" if mark is not None else where
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise QualError(f"{at}: invalid YAML ({problem[:200]})") from None
    finally:
        loader.dispose()


# ---------------------------------------------------------------- JSON


class _BadNumber:
    """What the decoder returns for a number qual refuses; found (with its field) by the walk after decoding."""

    __slots__ = ("literal", "problem")

    def __init__(self, literal: str, problem: str):
        self.literal, self.problem = literal, problem


class _Repeated(dict):
    """An object in which a key was given twice (JSON keeps the last silently)."""

    __slots__ = ("key",)


def _int(literal: str):
    if len(literal) > 20:
        return _BadNumber(literal, f"an integer of {len(literal)} digits is beyond what qual reads (64 bits)")
    value = int(literal)
    return value if abs(value) <= MAX_INT else _BadNumber(literal, f"{literal} is beyond what qual reads "
                                                                   "(integers of 64 bits)")


def _float(literal: str):
    value = float(literal)
    return value if math.isfinite(value) else _BadNumber(literal, f"{literal[:40]} is not a finite number")


def _constant(literal: str):
    return _BadNumber(literal, f"{literal} is not a number JSON allows")


def _pairs(pairs: list[tuple[str, Any]]) -> dict:
    obj: dict = {}
    for key, value in pairs:
        if key in obj:
            repeated = _Repeated(pairs)
            repeated.key = key
            return repeated
        obj[key] = value
    return obj


_SUSPECT = re.compile(r"\d{19}|[eE]\+?0*[1-9]\d\d")
# A JSON string or a bracket: enough to find the line where nesting goes too deep.
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')
# A \u escape of a high surrogate with no low one after it, or of a low one with no high one before it.
_LONE = re.compile(r"\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                   r"|(?<!\\u[dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2}")


def _line_of_literal(text: str, literal: str) -> int | None:
    """The line of the first occurrence of a number literal outside strings."""
    number = re.compile(r'"(?:[^"\\]|\\.)*"|(?<![0-9A-Za-z.+-])' + re.escape(literal) + r"(?![0-9A-Za-z.])")
    for m in number.finditer(text):
        if not m.group().startswith('"'):
            return text.count("\n", 0, m.start()) + 1
    return None


def _line_too_deep(text: str) -> int | None:
    depth = 0
    for m in _TOKEN.finditer(text):
        c = m.group()
        if c in "[{":
            depth += 1
            if depth > MAX_DEPTH:
                return text.count("\n", 0, m.start()) + 1
        elif c in "]}":
            depth -= 1
    return None


_PLAIN = frozenset({int, float, bool, type(None)})
_REPEATED = "given twice in one object (JSON would keep only the last)"


def _walk_json(data: Any, text: str, where: str, offset: int = 0) -> None:
    """The first refused value in document order (iteratively), with its field and, where it can be placed, line."""
    only = offset + 1 if "\n" not in text else None  # a one-line document: every value is on its line

    def refuse(line: int | None, path: tuple, problem: str) -> QualError:
        return _refuse(where, line if line is not None else only, path, problem)

    def check(value: Any, path: tuple) -> None:
        if type(value) is str:
            problem = text_problem(value)
            if problem:
                lone = _LONE.search(text)
                raise refuse(text.count("\n", 0, lone.start()) + 1 + offset if lone else None, path,
                              problem)
        elif type(value) is _BadNumber:
            raise refuse(_plus(_line_of_literal(text, value.literal), offset), path, value.problem)
        elif type(value) is _Repeated:
            raise refuse(None, path, f"key {_shown(value.key)} {_REPEATED}")

    def items(value):
        return iter(value.items()) if isinstance(value, dict) else iter(enumerate(value))

    check(data, ())
    if not isinstance(data, (dict, list)):
        return
    paths, iters = [()], [items(data)]
    while iters:
        for key, value in iters[-1]:
            if type(key) is str and not key.isascii():
                problem = text_problem(key)
                if problem:
                    raise refuse(None, paths[-1], f"key {_shown(key)}: {problem}")
            if type(value) in _PLAIN:
                continue
            path = (*paths[-1], key)
            check(value, path)
            if isinstance(value, (dict, list)):
                if len(iters) >= MAX_DEPTH:
                    raise refuse(_plus(_line_too_deep(text), offset), (),
                                  f"nested deeper than {MAX_DEPTH} levels")
                paths.append(path)
                iters.append(items(value))
                break
        else:
            iters.pop()
            paths.pop()


def _plus(line: int | None, offset: int) -> int | None:
    return None if line is None else line + offset


class _Refused(Exception):
    """Raised by the checking decoder's hooks: the document holds something load_json refuses (found again, with
    its field and line, by the reporting decoder)."""


def _int_or_refuse(literal: str) -> int:
    if len(literal) > 20 or abs(value := int(literal)) > MAX_INT:
        raise _Refused
    return value


def _float_or_refuse(literal: str) -> float:
    value = float(literal)
    if not math.isfinite(value):
        raise _Refused
    return value


def _refuse_constant(literal: str):
    raise _Refused


def _dict_or_refuse(items: list[tuple[str, Any]]) -> dict:
    obj = dict(items)
    if len(obj) != len(items):
        raise _Refused
    return obj


# A small document (a server's reply, one token's event, a JSONL line) is decoded with every number and object
# checked by a hook as it is made: a few Python calls, where scanning its text for suspect literals first would
# cost as much as the decode. A large one (result.json) is scanned first, and hooked only where it must be.
_CHECKING = json.JSONDecoder(object_pairs_hook=_dict_or_refuse, parse_int=_int_or_refuse,
                             parse_float=_float_or_refuse, parse_constant=_refuse_constant)
_SMALL = 1 << 12


def _decode_error(exc: Exception, text: str, where: str, offset: int) -> QualError:
    if isinstance(exc, json.JSONDecodeError):
        return QualError(f"{where}:{exc.lineno + offset}: invalid JSON ({exc.msg}, column {exc.colno})")
    line = _plus(_line_too_deep(text), offset)  # a RecursionError: nesting deeper than the decoder recurses
    return QualError(f"{where}{f':{line}' if line else ''}: nested deeper than {MAX_DEPTH} levels")


def load_json(text: str, where: str, first_line: int = 1) -> Any:
    """A JSON document, refused as the module says; `first_line`: the line of the file the text starts at (one
    line of a JSONL file)."""
    offset = first_line - 1
    suspect = True  # what the reporting decoder below hooks: every number, where the checking one refused
    if len(text) <= _SMALL:
        try:
            data = _CHECKING.decode(text)
        except _Refused:
            pass
        except (json.JSONDecodeError, RecursionError) as exc:
            raise _decode_error(exc, text, where, offset) from None
        else:
            # what the hooks cannot see: a lone surrogate (only a \\u escape makes one), nesting past MAX_DEPTH
            if "\\u" in text or text.count("[") + text.count("{") > MAX_DEPTH:
                _walk_json(data, text, where, offset)
            return data
    else:
        # The number hooks cost a Python call a number (3x the decode of a large result.json): taken only where a
        # literal might be out of range (19 digits in a row, an exponent of 100 or more).
        suspect = _SUSPECT.search(text) is not None
    numbers = {"parse_int": _int, "parse_float": _float} if suspect else {}
    try:
        data = json.loads(text, object_pairs_hook=_pairs, parse_constant=_constant, **numbers)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise _decode_error(exc, text, where, offset) from None
    _walk_json(data, text, where, offset)  # the first refused value, with its field and line
    return data


def json_lines(text: str, where: str) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each non-blank line of a JSONL text, each line loaded as load_json loads a file."""
    for n, line in enumerate(text.splitlines(), 1):
        if line.strip():
            yield n, load_json(line, where, n)


def load_reply(raw: bytes, where: str) -> Any:
    """A server's JSON reply (bounded by its transport's cap), refused as the module says; not UTF-8 is refused
    too."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise QualError(f"{where}: not UTF-8 ({exc.reason} at byte {exc.start})") from None
    return load_json(text, where)


def read_json(path: str | Path, limit: int = MAX_CONFIG_BYTES, what: str = "JSON file", follow: bool = True) -> Any:
    """load_json of a file read by read_text."""
    return load_json(read_text(path, limit, what, follow), str(path))
