"""Chat prompts and conversations of several turns.

A chat row's messages may hold answers to generate (an assistant message whose content is null): the turn that ends
at each is generated first, and the conversation goes on with the arm's own answer in its place. So each arm builds
its own conversation from its own answers, and runs in waves: every first turn, then every second turn built from its
first answers, and so on, each wave through the engine's run() (qual.harness.execute). A later turn's prompt is the
chat template over the conversation so far, tokenized as every prompt is; a resumed run builds the same prompts from
the journaled answers. A conversation of one turn keeps its row's id; turn t of a longer one is `<id>/turn<t>`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from qual.chat import ChatTemplate
from qual.corpus.records import CorpusRequest
from qual.errors import QualError
from qual.records import EngineRequest, RequestResult
from qual.tokenize import PromptTokenizer


@dataclass(frozen=True)
class ChatPrompts:
    """Conversations to token ids: the chat template, then the profile's tokenizer without special tokens added
    (as transformers' apply_chat_template(tokenize=True)); and an arm's answer back to the text a history holds."""

    tokenizer: PromptTokenizer
    template: ChatTemplate

    def render(self, messages: list[dict], where: str) -> str:
        return self.template.render(messages, where)

    def encode(self, messages: list[dict], where: str) -> list[int]:
        return self.tokenizer.encode(self.render(messages, where))

    def answer(self, output_token_ids: Sequence[int]) -> str:
        """An answer as the next turn's history holds it: its text without special tokens (the end of turn), as an
        OpenAI-compatible server returns a message's content."""
        return self.tokenizer.decode(list(output_token_ids), skip_special_tokens=True)


@dataclass(frozen=True)
class Conversation:
    """A chat row of the corpus and the tokens each of its turns may generate."""

    row: CorpusRequest
    max_tokens: int

    @property
    def turns(self) -> int:
        return self.row.turns

    def request_id(self, turn: int) -> str:
        return self.row.id if self.turns == 1 else f"{self.row.id}/turn{turn}"

    def messages(self, turn: int, answers: Sequence[str]) -> list[dict]:
        """What turn `turn` renders: the messages before its answer slot, earlier slots holding `answers`."""
        out: list[dict] = []
        slot = 0
        for m in self.row.messages or ():
            if m.content is None:
                slot += 1
                if slot == turn:
                    break
                out.append({"role": m.role, "content": answers[slot - 1]})
            else:
                out.append({"role": m.role, "content": m.content})
        return out

    def request(self, turn: int, prompt_token_ids: Sequence[int]) -> EngineRequest:
        return EngineRequest(self.request_id(turn), self.row.category, tuple(prompt_token_ids), self.max_tokens, turn,
                             self.row.id if self.turns > 1 else None)


def request_ids(rows: Sequence[CorpusRequest]) -> list[str]:
    """Every request a run replays, in corpus order, each conversation's turns in order."""
    out: list[str] = []
    for r in rows:
        conv = Conversation(r, 0)
        out += [conv.request_id(t) for t in range(1, r.turns + 1)]
    return out


def wave(conversations: Sequence[Conversation], prompts: ChatPrompts | None, turn: int,
         results: Mapping[str, RequestResult], corpus: str) -> list[EngineRequest]:
    """Turn `turn` (2 or more) of each conversation that has one and whose earlier turns the arm answered (in
    `results`); empty when none."""
    out = []
    for c in conversations:
        if c.turns < turn:
            continue
        earlier = [results.get(c.request_id(t)) for t in range(1, turn)]
        if any(r is None for r in earlier) or prompts is None:
            continue
        where = f"corpus {corpus}: request {c.request_id(turn)}"
        ids = prompts.encode(c.messages(turn, [prompts.answer(r.output_token_ids) for r in earlier]), where)
        if not ids:
            raise QualError(f"{where} tokenizes to nothing")
        out.append(c.request(turn, ids))
    return out


def later_turns(conversations: Sequence[Conversation], prompts: ChatPrompts | None,
                results: Mapping[str, RequestResult], corpus: str) -> list[EngineRequest]:
    """Every later turn whose prompt the answers in `results` already decide (a resumed run's journal)."""
    out: list[EngineRequest] = []
    for turn in range(2, max((c.turns for c in conversations), default=1) + 1):
        out += wave(conversations, prompts, turn, results, corpus)
    return out
