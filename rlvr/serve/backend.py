"""What stands behind the server's routes: chat rendering, a batching queue in front of the engine,
tool-call parsing and top log-probs.

The engine samples one batch at a time, so requests wait in one queue, and those waiting when
the engine frees up are sampled together in one `generate` call (one per distinct set of
sampling parameters): concurrent agents share decode steps the way a training group does.

Token faithfulness: a response carries the prompt's token ids exactly as the engine was given
them and each choice's token ids exactly as sampled (the end-of-turn token included, as it is
trained), with each token's log-probability under the distribution it was sampled from (after
temperature, top-k and top-p; at temperature 0, the model's own). The text is decoded from those
ids; a stop string ends the text where it starts (OpenAI's convention) but stays in the ids.
"""

from __future__ import annotations

import asyncio
import functools
import json
import queue
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlvr.agents.tools import parse_tool_calls
from rlvr.data.tasks import chat_prompt_ids
from rlvr.rollout.engine import Engine, draw_seeds
from rlvr.rollout.sampling import process_logits
from rlvr.serve.protocol import Invalid, Message, ToolSpec, utf8
from rlvr.types import Completion, SamplingParams

TOOLS_PREAMBLE = ("You may call one or more functions to help with the user's request. The functions are "
                  "described in JSON within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nTo call a "
                  "function, write a JSON object with its name and arguments within <tool_call></tool_call> "
                  "tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
"""Where the chat template does not render tools itself (SmolLM2's does not): the Hermes/Qwen
convention that `parse_tool_calls` reads back."""


def render_chat(tokenizer: Any, messages: Sequence[Message], tools: Sequence[ToolSpec] | None) -> list[int]:
    """Token ids of the conversation rendered by the model's chat template, ending with the
    assistant turn's header. Tools and earlier tool calls go through the template where it knows
    them, else into the system turn and the assistant's text in the Hermes convention."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise Invalid("this model has no chat template; use /v1/completions", "messages")
    native = "tool_calls" in template
    rendered = []
    for k, m in enumerate(messages):
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role,
                                 "content": utf8(m.text(), f"messages.{k}.content")}
        if m.tool_calls:
            calls = [{"name": c.function.name, "arguments": _arguments(c.function.arguments)} for c in m.tool_calls]
            if native:
                entry["tool_calls"] = [{"type": "function", "function": c} for c in calls]
            else:
                entry["content"] = "\n".join([entry["content"]] * bool(entry["content"]) + [
                    f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls])
        if m.role == "tool" and m.tool_call_id:
            entry["tool_call_id"] = m.tool_call_id
        if m.name:
            entry["name"] = m.name
        rendered.append(entry)
    kwargs: dict[str, Any] = {}
    if tools:
        schemas = [t.model_dump(exclude_none=True) for t in tools]
        if "tools" in template:
            kwargs["tools"] = schemas
        else:
            preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(s) for s in schemas))
            if rendered[0]["role"] == "system":
                rendered[0] = {**rendered[0], "content": f"{rendered[0]['content']}\n\n{preamble}"}
            else:
                rendered.insert(0, {"role": "system", "content": preamble})
    try:
        return chat_prompt_ids(tokenizer, rendered, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template's own complaint (e.g. roles out of order) is the caller's
        raise Invalid(f"the chat template cannot render these messages: {e}", "messages") from e


def _arguments(arguments: str | dict[str, Any]) -> dict[str, Any] | str:
    """A tool call's arguments as templates expect them: an object (OpenAI sends a JSON string)."""
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except json.JSONDecodeError:
        return arguments
    return parsed if isinstance(parsed, dict) else arguments


def tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content before the calls, the calls in OpenAI's layout) of a completion's text. Unless
    every call in it can be read, it is all content: the agent sees what the model wrote, rather
    than some of its calls with the others gone."""
    calls = parse_tool_calls(text)
    if not calls or any(c.error is not None or not c.name for c in calls):
        return text, []
    content = text.split("<tool_call>", 1)[0].strip() or None
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def visible_text(c: Completion, stop: Sequence[str], eos_token_ids: Sequence[int], tokenizer: Any) -> str:
    """The completion's text as a client sees it: special tokens dropped, and where a stop string
    ended it (the engine matches it in the text of the last tokens), cut where it begins. A stop
    string that the engine saw across a special token (dropped from the text) is not cut."""
    text = c.text
    if c.finish_reason != "stop" or not c.token_ids or c.token_ids[-1] in eos_token_ids:
        return text
    tail = len(tokenizer.decode(c.token_ids[-1:], skip_special_tokens=True))
    starts = [text.rfind(s) for s in stop]
    hits = [i for i, s in zip(starts, stop) if i >= 0 and i + len(s) >= len(text) - tail]
    return text[: min(hits)] if hits else text


def token_bytes(tokenizer: Any, token_id: int) -> list[int]:
    """The bytes a token stands for (a piece of a character has no text of its own): byte-level
    BPE pieces through GPT-2's byte table, SentencePiece byte tokens (<0xAB>) as that byte,
    anything else as its decoded text."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    if isinstance(piece, str):
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            return [int(piece[3:5], 16)]
        table = _byte_table()
        if piece and all(ch in table for ch in piece) and tokenizer.decode([token_id]) != piece:
            return [table[ch] for ch in piece]
    return list(tokenizer.decode([token_id]).encode("utf-8"))


@functools.cache
def _byte_table() -> dict[str, int]:
    """GPT-2's byte-level table, inverted: the character each byte is written as → the byte."""
    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    others = [b for b in range(256) if b not in printable]
    return {**{chr(b): b for b in printable}, **{chr(256 + k): b for k, b in enumerate(others)}}


@torch.no_grad()
def top_logprobs(model: Any, prompt_ids: list[int], completions: Sequence[Completion], k: int,
                 params: SamplingParams) -> list[list[list[tuple[int, float]]]]:
    """For each completion, each sampled position's k most likely tokens with their
    log-probabilities under the sampling distribution (`process_logits`), from one forward of
    prompt + completion (the engine keeps only the sampled token's)."""
    out = []
    was_training = model.training
    model.eval()
    try:
        device = next(model.parameters()).device
        for c in completions:
            ids = torch.tensor([prompt_ids + list(c.token_ids)], device=device)
            logits_TV = model(input_ids=ids, logits_to_keep=len(c.token_ids) + 1).logits[0, :-1]
            lp_TV = process_logits(logits_TV, temperature=params.temperature, top_k=params.top_k, top_p=params.top_p)
            values, indices = lp_TV.topk(k, dim=-1)
            # tokens that top-k or top-p removed (log-prob -inf) are not among the likeliest: left out
            out.append([[(t, lp) for t, lp in zip(i.tolist(), v.tolist()) if lp != float("-inf")]
                        for i, v in zip(indices, values)])
    finally:
        model.train(was_training)
    return out


@dataclass
class Job:
    """One request's sampling: its prompts (token ids), parameters and per-sample seeds."""

    prompts: list[list[int]]
    params: SamplingParams
    seed: int | None = None
    top_k_logprobs: int = 0
    result: list[list[Completion]] = field(default_factory=list)
    top: list[list[list[list[tuple[int, float]]]]] = field(default_factory=list)
    abandoned: bool = False
    """Its client went away: not sampled if it has not started (`Batcher`)."""


class Batcher:
    """One thread in front of the engine: takes every job waiting, samples those with equal
    parameters in one call, and hands each its completions (see module docstring)."""

    def __init__(self, engine: Engine, model: Any | None = None) -> None:
        self.engine, self.model = engine, model
        self._queue: queue.Queue[tuple[Job, asyncio.Future[Job], asyncio.AbstractEventLoop] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rlvr-serve-engine", daemon=True)
        self._thread.start()
        self.batches = 0
        """Engine calls made (a test reads it to see that concurrent requests were batched)."""

    async def run(self, job: Job) -> Job:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Job] = loop.create_future()
        self._queue.put((job, future, loop))
        return await future

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=60)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            waiting = [item]
            while True:
                try:
                    nxt = self._queue.get_nowait()
                except queue.Empty:
                    break
                if nxt is None:
                    self._queue.put(None)  # close after this round
                    break
                waiting.append(nxt)
            by_params: dict[SamplingParams, list[Any]] = {}
            for entry in waiting:
                by_params.setdefault(entry[0].params, []).append(entry)
            for params, entries in by_params.items():
                self._sample(params, entries)

    def _sample(self, params: SamplingParams, entries: list[Any]) -> None:
        ready, prompts, seeds = [], [], []
        for entry in entries:  # a job whose seeds cannot be drawn fails alone
            job, future, loop = entry
            if job.abandoned:  # its client disconnected while it waited: nobody reads it
                continue
            try:
                generator = torch.Generator().manual_seed(job.seed % 2**64) if job.seed is not None \
                    else self.engine.generator
                seeds += draw_seeds(generator, len(job.prompts), params)
            except Exception as e:  # noqa: BLE001 - handed to that request, which answers with it
                loop.call_soon_threadsafe(_fail, future, e)
                continue
            ready.append(entry)
            prompts += job.prompts
        if not ready:
            return
        try:
            self.batches += 1
            # every client of the batch gone: the engine stops at its next decode step, where it
            # used to sample a whole max_tokens for nobody while the next request waited behind it
            if getattr(self.engine, "can_cancel", False):
                engine: Any = self.engine  # (the optional keyword is not the protocol's)
                results = engine.generate(prompts, params, seeds=seeds,
                                          cancelled=lambda: all(job.abandoned for job, _, _ in ready))
            else:
                results = self.engine.generate(prompts, params, seeds=seeds)
            start = 0
            for job, _, _ in ready:
                job.result = results[start : start + len(job.prompts)]
                start += len(job.prompts)
                if job.top_k_logprobs and self.model is not None:
                    job.top = [top_logprobs(self.model, p, group, job.top_k_logprobs, params)
                               for p, group in zip(job.prompts, job.result)]
        except Exception as e:  # noqa: BLE001 - handed to each waiting request, which answers with it
            for _, future, loop in ready:
                loop.call_soon_threadsafe(_fail, future, e)
            return
        for job, future, loop in ready:
            loop.call_soon_threadsafe(_succeed, future, job)


def _succeed(future: asyncio.Future[Job], job: Job) -> None:
    if not future.done():
        future.set_result(job)


def _fail(future: asyncio.Future[Job], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
