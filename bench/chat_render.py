"""Host cost of rendering chat prompts in qual's sandbox (qual/chat.py: the bounded render): microseconds a prompt for
every MT-Bench conversation (both turns, the second with an empty first answer) in each chat template the repository
carries (the toy target's and the real models' templates of tests/fixtures/chat_templates).

    python bench/chat_render.py [--repeats 20]

The figure printed per template is the median over the repeats of one pass over every prompt, divided by the
prompts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from qual import paths
from qual.chat import ChatTemplate
from qual.corpus import load_corpus

ROOT = Path(__file__).resolve().parents[1]
TEMPLATES = {"toy": paths.DATA_DIR / "models" / "toy" / "target" / "chat_template.jinja",
             **{p.stem: p for p in sorted((ROOT / "tests" / "fixtures" / "chat_templates").glob("*.jinja"))}}
TOKENS = {"bos_token": "<s>", "eos_token": "</s>"}


def conversations() -> list[list[dict]]:
    """Every MT-Bench row's first turn, and its second with an empty first answer."""
    out = []
    for row in load_corpus("mt-bench").requests:
        messages, answered = [], 0
        for m in row.messages or ():
            if m.content is None:
                out.append(list(messages))
                messages.append({"role": "assistant", "content": ""})
                answered += 1
            else:
                messages.append({"role": m.role, "content": m.content})
        out.append(messages)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=20)
    a = ap.parse_args()
    prompts = conversations()
    for name, path in TEMPLATES.items():
        template = ChatTemplate(path.read_text(), str(path), None, TOKENS)
        template.render(prompts[0], "warm-up")
        times = []
        for _ in range(a.repeats):
            start = time.perf_counter()
            for i, messages in enumerate(prompts):
                template.render(messages, f"prompt {i}")
            times.append(time.perf_counter() - start)
        print(f"{name}: {statistics.median(times) / len(prompts) * 1e6:.1f} us a prompt ({len(prompts)} prompts, "
              f"median of {a.repeats} passes)")


if __name__ == "__main__":
    main()
