"""Chat templates: a tokenizer's own template, found where transformers and vLLM find it, rendered in a sandbox.

A tokenizer directory's template is `chat_template.jinja` (with any named ones in `additional_chat_templates/`), or
else tokenizer_config.json's "chat_template": one template, or a list of {"name", "template"}. Where there are
named templates, "default" is the one used (a run asks no tools); without one the tokenizer is refused, naming
the templates it has. `--chat-template FILE` replaces all of that.

Rendering follows transformers' `apply_chat_template`: a sandboxed Jinja environment (ImmutableSandboxedEnvironment,
trim_blocks and lstrip_blocks, loop controls), the globals and filters chat templates call (`raise_exception`,
`strftime_now`, `tojson` without HTML escaping, a restricted `namespace` and `dict`), the tokenizer's named special
tokens (bos_token, eos_token, ...) as variables, `messages`, no tools or documents, and `add_generation_prompt`
true. The text is tokenized without adding special tokens again, as `apply_chat_template(tokenize=True)` does
(tests/test_chat.py compares token ids with it on real models' templates). The render is bounded in time, size and
depth (qual/chat_sandbox.py): a template that would run for minutes or build gigabytes is an exit-2 error naming
the request. `strftime_now` reads the run's clock (`ChatTemplate.now`, fixed once per run and kept in run.json),
so every arm and every resume renders the same date.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

from qual import chat_sandbox
from qual.chat_sandbox import RenderLimit
from qual.errors import QualError
from qual.userfiles import load_json, read_text

TEMPLATE_FILE = "chat_template.jinja"
NAMED_TEMPLATES_DIR = "additional_chat_templates"
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_TOKENS_FILE = "special_tokens_map.json"
DEFAULT_NAME = "default"
# The special tokens transformers hands every template as variables (its SPECIAL_TOKENS_ATTRIBUTES)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
MAX_TEMPLATE_BYTES = 1 << 20
MAX_TOKENIZER_CONFIG_BYTES = 16 << 20  # a config listing thousands of added tokens is a few MB
# Errors a template may raise while it renders (a wrong role, a string method on a list): the input's fault
_RENDER_ERRORS = (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError)


@dataclass(frozen=True)
class ChatTemplate:
    """One chat template and the variables it renders with."""

    text: str
    source: str  # the file it came from: a tokenizer directory's, or the --chat-template file
    name: str | None = None  # the named template chosen ("default"), None where there is only one
    special_tokens: dict[str, str] = field(default_factory=dict)
    now: datetime | None = None  # what strftime_now reads (None: the time of each render)

    @property
    def sha256(self) -> str:
        return "sha256:" + hashlib.sha256(self.text.encode()).hexdigest()

    def record(self) -> dict:
        """What a run records of the template it rendered with (arms' extra, provenance)."""
        return {"source": self.source, "name": self.name, "sha256": self.sha256}

    @cached_property
    def compiled(self):
        """The template compiled in the sandbox (once: a run renders it for every request)."""
        import jinja2

        try:
            return _environment(self.now).from_string(self.text)
        except jinja2.TemplateSyntaxError as exc:
            raise QualError(f"{self.source}:{exc.lineno}: not a valid chat template: {exc.message}") from None
        except (RecursionError, SyntaxError, MemoryError) as exc:  # nesting deeper than jinja or Python compiles
            raise QualError(f"{self.source}: not a chat template qual compiles ({type(exc).__name__}: "
                            f"{str(exc)[:200]})") from None

    def render(self, messages: list[dict], where: str) -> str:
        """The conversation as the model reads it, ending with the generation prompt; QualError naming `where`.
        Streamed and cut off at chat_sandbox.MAX_CHARS; every step of it counted (qual/chat_sandbox.py)."""
        import jinja2

        template = self.compiled
        template.environment.steps.start()
        try:
            parts, total = [], 0
            for part in template.generate(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                          **self.special_tokens):
                total += len(part)
                if total > chat_sandbox.MAX_CHARS:
                    raise RenderLimit(f"a prompt longer than {chat_sandbox.MAX_CHARS} characters")
                parts.append(part)
            return "".join(parts)
        except RenderLimit as exc:
            raise QualError(f"{where}: the chat template ({self.source}) went past a bound of qual's sandbox: {exc}"
                            ) from None
        except RecursionError:
            raise QualError(f"{where}: the chat template ({self.source}) went past a bound of qual's sandbox: calls "
                            "nested deeper than Python allows (a macro calling itself?)") from None
        except MemoryError:
            raise QualError(f"{where}: the chat template ({self.source}) ran out of memory") from None
        except jinja2.TemplateError as exc:  # raise_exception, a sandbox refusal
            raise QualError(f"{where}: the chat template ({self.source}) refused it: {exc}") from None
        except _RENDER_ERRORS as exc:
            raise QualError(f"{where}: the chat template ({self.source}) failed on it: "
                            f"{type(exc).__name__}: {str(exc)[:300]}") from None
        finally:
            template.environment.steps.stop()


def load_template(tokenizer_dir: str | Path, override: str | Path | None = None) -> ChatTemplate | None:
    """The template of a tokenizer directory (None: it has none), or the file `override` names, with the
    directory's special tokens either way."""
    folder = Path(tokenizer_dir)
    config = _config(folder)
    tokens = _special_tokens(folder, config)
    if override is not None:
        path = Path(override)
        return ChatTemplate(_read(path, "--chat-template"), str(path), None, tokens)
    templates, where, named = _files(folder)
    if not templates:  # the files win over the config, as transformers loads them
        templates, where, named = _from_config(config, folder / CONFIG_FILE)
    if not templates:
        return None
    if DEFAULT_NAME not in templates:
        raise QualError(f"{where}: named chat templates {', '.join(sorted(templates))} and none called "
                        f"\"{DEFAULT_NAME}\": choose one with --chat-template FILE")
    return ChatTemplate(templates[DEFAULT_NAME], where, DEFAULT_NAME if named else None, tokens)


def _read(path: Path, what: str) -> str:
    try:
        return read_text(path, MAX_TEMPLATE_BYTES, "chat template")
    except FileNotFoundError:
        raise QualError(f"{what} {path}: no such file") from None
    except OSError as exc:
        raise QualError(f"{what} {path}: cannot read: {exc.strerror or exc}") from None


def _config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        return {}
    data = load_json(read_text(path, MAX_TOKENIZER_CONFIG_BYTES, "tokenizer config"), str(path))
    if not isinstance(data, dict):
        raise QualError(f"{path}: expected a JSON object")
    return data


def _token_text(value: Any) -> str | None:
    """A special token as the config spells it: a string, or a serialised AddedToken ({"content": ...})."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_tokens(folder: Path, config: dict) -> dict[str, str]:
    """The named special tokens: tokenizer_config.json's, then special_tokens_map.json's for the ones it lacks."""
    legacy: dict = {}
    path = folder / SPECIAL_TOKENS_FILE
    if path.is_file():
        loaded = load_json(read_text(path, MAX_TOKENIZER_CONFIG_BYTES, "special tokens map"), str(path))
        legacy = loaded if isinstance(loaded, dict) else {}
    tokens = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(config.get(key))
        text = text if text is not None else _token_text(legacy.get(key))
        if text is not None:
            tokens[key] = text
    return tokens


def _files(folder: Path) -> tuple[dict[str, str], str, bool]:
    """chat_template.jinja ("default") and additional_chat_templates/<name>.jinja; named: more than the one file."""
    templates, where = {}, ""
    main = folder / TEMPLATE_FILE
    if main.is_file():
        templates[DEFAULT_NAME], where = _read(main, "chat template"), str(main)
    extra = folder / NAMED_TEMPLATES_DIR
    named = False
    if extra.is_dir():
        for path in sorted(extra.glob("*.jinja")):
            templates.setdefault(path.stem, _read(path, "chat template"))
            named = True
        where = where or str(extra)
    return templates, where, named


def _from_config(config: dict, path: Path) -> tuple[dict[str, str], str, bool]:
    """tokenizer_config.json's "chat_template": one template, or a list of named ones (named: True)."""
    value = config.get("chat_template")
    if value is None:
        return {}, str(path), False
    if isinstance(value, str):
        return {DEFAULT_NAME: value}, str(path), False
    if isinstance(value, list) and all(isinstance(t, dict) and isinstance(t.get("name"), str)
                                       and isinstance(t.get("template"), str) for t in value):
        return {t["name"]: t["template"] for t in value}, str(path), True
    raise QualError(f"{path}: chat_template must be a template or a list of {{\"name\", \"template\"}}")


# ---------------------------------------------------------------- the sandbox


def _raise_exception(message: Any) -> None:
    import jinja2

    raise jinja2.TemplateError(str(message))


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML; chat templates want plain JSON.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002 - jinja's names
    from jinja2.utils import generate_lorem_ipsum

    if not (isinstance(n, int) and isinstance(max, int)) or n * max > chat_sandbox.MAX_ARGUMENT:
        raise RenderLimit(f"lipsum(): more than {chat_sandbox.MAX_ARGUMENT} words")
    return generate_lorem_ipsum(n=n, html=html, min=min, max=max)


_lipsum.__name__ = "lipsum"  # how a refusal names it


class _Dicts:
    """`dict(...)` for templates, without the class's attributes (dict.fromkeys is its one classmethod they use)."""

    def __call__(self, *args, **kwargs) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, keys, value=None) -> dict:
        return dict.fromkeys(keys, value)


def _environment(now: datetime | None = None):
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Namespace(jinja2.utils.Namespace):
        """A namespace that stores no underscore names (a way to CPython internals)."""

        def __init__(*args, **kwargs):  # noqa: N805 - jinja's signature: `self` may be a keyword
            self, rest = args[0], args[1:]
            for name in dict(*rest, **kwargs):
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, *rest, **kwargs)

        def __setitem__(self, name, value):
            Namespace._check(name)
            chat_sandbox.check_size(value, f"namespace.{name}")
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"a chat template may not store {name!r} on a namespace")

    class Generation(Extension):
        """`{% generation %}...{% endgeneration %}` (marks training targets): renders its body as it is."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    class OneFile(jinja2.BaseLoader):
        """A chat template is one file: include, import and extends are refused by name, not "no loader"."""

        def get_source(self, environment, template):
            raise jinja2.TemplateError(f"a chat template cannot include, import or extend another template "
                                       f"({template!r}): qual renders the one file")

    class Bounded(ImmutableSandboxedEnvironment):
        """The sandbox with every operator, call, loop and concatenation bounded (qual/chat_sandbox.py)."""

        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.steps = chat_sandbox.Steps()

        def call_binop(self, context, operator, left, right):
            self.steps.step()
            chat_sandbox.check_binop(operator, left, right)
            return chat_sandbox.check_size(super().call_binop(context, operator, left, right), f"'{operator}'")

        def call(__self, __context, __obj, *args, **kwargs):  # noqa: N805 - jinja's signature
            __self.steps.step()
            target = getattr(__obj, "__wrapped__", __obj)
            args = chat_sandbox.settled(target, args)
            chat_sandbox.check_call(target, args, kwargs)
            result = super().call(__context, __obj, *args, **kwargs)
            return chat_sandbox.check_size(result, f"{getattr(__obj, '__name__', 'a call')}()")

        def _parse(self, source, name, filename):
            """Each loop's iterable counted, each `~` checked: jinja runs both without the sandbox's hooks."""
            tree = super()._parse(source, name, filename)
            for loop in list(tree.find_all(nodes.For)):
                loop.iter = nodes.Call(nodes.Name(LOOP, "load"), [loop.iter], [], None, None).set_lineno(loop.lineno)
            for parent in [tree, *tree.find_all(nodes.Node)]:
                for field_name, value in parent.iter_fields():
                    if isinstance(value, nodes.Concat):
                        setattr(parent, field_name, _checked_concat(value))
                    elif isinstance(value, list):
                        value[:] = [_checked_concat(v) if isinstance(v, nodes.Concat) else v for v in value]
            return tree

    def _checked_concat(node):
        return nodes.Call(nodes.Name(CONCAT, "load"), [nodes.List(node.nodes)], [], None, None).set_lineno(node.lineno)

    def concat(items) -> str:
        parts = [str(item) for item in items]
        if sum(map(len, parts)) > chat_sandbox.MAX_CHARS:
            raise RenderLimit(f"'~': a result longer than {chat_sandbox.MAX_CHARS} characters")
        return "".join(parts)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols], loader=OneFile())
    env.filters = {name: chat_sandbox.bounded_filter(name, f) for name, f in {**env.filters, "tojson": _tojson}.items()}
    env.globals.update(raise_exception=_raise_exception, namespace=Namespace, dict=_Dicts(), lipsum=_lipsum,
                       strftime_now=lambda fmt: (now or datetime.now()).strftime(fmt))
    def loop(items):
        return chat_sandbox.Counted(items, env.steps)

    loop.__name__, concat.__name__ = "a loop", "'~'"  # how a refusal names them
    env.globals[LOOP], env.globals[CONCAT] = loop, concat
    return env


LOOP, CONCAT = "__qual_loop", "__qual_concat"  # the names the bounded sandbox calls loops and `~` through
