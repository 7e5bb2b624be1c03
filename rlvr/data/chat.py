"""Chat data for supervised objectives: conversations as token ids with an assistant-only mask,
preference pairs, and packing.

A conversation is rendered with the tokenizer's chat template one message at a time, and each
piece is tokenized on its own. Splitting at message boundaries has a purpose. The prompt part of
a turn, up to and including the assistant header, is tokenized exactly as the engine tokenizes a
prompt (`rlvr.data.tasks.render_prompt`). So an SFT model is trained on the token sequences it
will be asked to continue during RL and evaluation. Only assistant content is trained, up to and
including the end-of-turn token (the model must learn to stop). Whatever the template writes
after that token, such as a newline, is not trained.

Rows of a JSONL file are either ``{"messages": [{"role": ..., "content": ...}, ...]}`` or
``{"prompt": ..., "completion": ...}`` (one user turn, one assistant turn). A preference row
holds ``chosen`` and ``rejected`` answers to a ``prompt`` (or to ``messages``, the conversation so
far). A malformed row is an error that names its file and line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rlvr.data.tasks import read_jsonl_rows

ROLES = ("system", "user", "assistant", "tool")


class ChatDataError(ValueError):
    """A chat or preference file that cannot be used; the message says where."""


@dataclass(frozen=True)
class Tokenized:
    """One conversation: token ids, and 1 where a token is trained (assistant content)."""

    ids: tuple[int, ...]
    mask: tuple[int, ...]

    @property
    def trained(self) -> int:
        return sum(self.mask)


def read_rows(path: str | Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) for every non-blank line; a line that is not a JSON object is an error."""
    p = Path(path)
    if not p.is_file():
        raise ChatDataError(f"{p}: no such file")
    try:
        rows = read_jsonl_rows(p)
    except ValueError as err:
        raise ChatDataError(str(err)) from None
    if not rows:
        raise ChatDataError(f"{p}: no rows")
    return rows


def messages_of(row: dict[str, Any], where: str) -> list[dict[str, str]]:
    """A row's conversation: its "messages", or a "prompt"/"completion" pair as two turns."""
    if "messages" in row:
        messages = row["messages"]
    elif "prompt" in row and "completion" in row:
        messages = [{"role": "user", "content": row["prompt"]}, {"role": "assistant", "content": row["completion"]}]
    else:
        raise ChatDataError(f"{where}: a row needs \"messages\", or \"prompt\" and \"completion\" (has: {sorted(row)})")
    return _checked(messages, where)


def _checked(messages: Any, where: str) -> list[dict[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise ChatDataError(f"{where}: \"messages\" must be a non-empty list")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("content"), str) or m.get("role") not in ROLES:
            raise ChatDataError(f"{where}: message {k} must be {{\"role\": one of {', '.join(ROLES)}, "
                                f"\"content\": a string}}, got {m!r}")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


def with_system(messages: list[dict[str, str]], system_prompt: str | None) -> list[dict[str, str]]:
    """The conversation with `system_prompt` as its first turn, unless it is unset or the
    conversation already starts with a system turn (`task.system_prompt`, as the engine renders it)."""
    if system_prompt and messages[0]["role"] != "system":
        return [{"role": "system", "content": system_prompt}, *messages]
    return messages


def _render(tokenizer: Any, messages: list[dict[str, str]], generation_prompt: bool = False) -> str:
    return str(tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False))


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """Token ids of `text` without special tokens (a piece of an already-rendered sequence)."""
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]] if text else []


def tokenize_chat(tokenizer: Any, messages: list[dict[str, str]], *, eos_token_ids: set[int],
                  train_turns: str = "all") -> Tokenized:
    """Token ids of a conversation, with mask 1 on the assistant turns' content and end-of-turn
    token (see module docstring). ``train_turns = "last"`` trains the final assistant turn only
    (a preference answer); "all" trains every assistant turn."""
    if not getattr(tokenizer, "chat_template", None):
        raise ChatDataError("this tokenizer has no chat template; chat data needs one (an instruct model)")
    ids: list[int] = []
    mask: list[int] = []
    done = ""  # the text rendered so far
    last = max((k for k, m in enumerate(messages) if m["role"] == "assistant"), default=-1)
    for k, message in enumerate(messages):
        if message["role"] == "assistant":
            header = _render(tokenizer, messages[:k], generation_prompt=True) if k else ""
            piece = _continuation(tokenizer, done, header)
            ids += piece
            mask += [0] * len(piece)
            done = header
        text = _render(tokenizer, messages[: k + 1])
        piece = _continuation(tokenizer, done, text)
        trained = message["role"] == "assistant" and (train_turns == "all" or k == last)
        turn_mask = [1 if trained else 0] * len(piece)
        if trained:  # stop training after the end-of-turn token
            ends = [i for i, t in enumerate(piece) if t in eos_token_ids]
            if ends:
                turn_mask[ends[0] + 1:] = [0] * (len(piece) - ends[0] - 1)
        ids += piece
        mask += turn_mask
        done = text
    return Tokenized(tuple(ids), tuple(mask))


def _continuation(tokenizer: Any, done: str, text: str) -> list[int]:
    """Token ids of what `text` adds to the `done` text rendered before it."""
    if not text.startswith(done):
        raise ChatDataError("the chat template does not render a conversation as a prefix of its "
                            "continuation, so assistant turns cannot be located")
    return encode_text(tokenizer, text[len(done):])


@dataclass(frozen=True)
class PreferencePair:
    """A prompt's preferred and dispreferred answers, as full conversations with the answer trained."""

    chosen: Tokenized
    rejected: Tokenized
    gap: float | None = None
    """The reward gap chosen − rejected, where the row gives one (``score_chosen``/``score_rejected``)."""


def preference_pair(tokenizer: Any, row: dict[str, Any], where: str, *, eos_token_ids: set[int],
                    system_prompt: str | None = None) -> PreferencePair:
    """A row {"prompt" or "messages", "chosen", "rejected"[, "score_chosen", "score_rejected"]}."""
    if "messages" in row:
        context = _checked(row["messages"], where)
    elif isinstance(row.get("prompt"), str):
        context = [{"role": "user", "content": row["prompt"]}]
    else:
        raise ChatDataError(f"{where}: a preference row needs \"prompt\" (a string) or \"messages\" (has: {sorted(row)})")
    context = with_system(context, system_prompt)
    answers = []
    for key in ("chosen", "rejected"):
        answer = row.get(key)
        if not isinstance(answer, str):
            raise ChatDataError(f"{where}: \"{key}\" must be a string (the assistant's answer), got {answer!r}")
        answers.append(tokenize_chat(tokenizer, [*context, {"role": "assistant", "content": answer}],
                                     eos_token_ids=eos_token_ids, train_turns="last"))
    gap = None
    if "score_chosen" in row and "score_rejected" in row:
        scores = [row["score_chosen"], row["score_rejected"]]
        if not all(isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) for x in scores):
            raise ChatDataError(f"{where}: \"score_chosen\" and \"score_rejected\" must be finite numbers, got "
                                f"{scores[0]!r} and {scores[1]!r}")
        gap = float(scores[0]) - float(scores[1])
    return PreferencePair(answers[0], answers[1], gap)


def truncate(t: Tokenized, max_length: int) -> Tokenized:
    return Tokenized(t.ids[:max_length], t.mask[:max_length])


def pack(lengths: list[int], max_length: int) -> list[list[int]]:
    """Indices of sequences grouped into rows of at most max_length tokens: first fit, longest
    first (deterministic). Each sequence keeps its own positions and attends only to itself
    (`packed_batch`)."""
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if lengths[i] > max_length:
            raise ValueError(f"sequence {i} has {lengths[i]} tokens, more than max_length = {max_length}")
        for r, free in enumerate(room):
            if lengths[i] <= free:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(max_length - lengths[i])
    return rows
