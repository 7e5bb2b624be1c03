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
import json
import queue
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from rlvr.agents.tools import parse_tool_calls
from rlvr.rollout.engine import Engine, draw_seeds
from rlvr.rollout.sampling import process_logits
from rlvr.serve.protocol import Message, ToolSpec
from rlvr.types import Completion, SamplingParams

TOOLS_PREAMBLE = ("You may call one or more functions to help with the user's request. The functions are "
                  "described in JSON within <tools></tools> tags:\n<tools>\n{tools}\n</tools>\n\nTo call a "
                  "function, write a JSON object with its name and arguments within <tool_call></tool_call> "
                  "tags:\n<tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>")
"""Where the chat template does not render tools itself (SmolLM2's does not): the Hermes/Qwen
convention that `parse_tool_calls` reads back."""


class BadRequest(ValueError):
    """A request the server cannot serve as asked (a 400 naming ``param``)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def render_chat(tokenizer: Any, messages: Sequence[Message], tools: Sequence[ToolSpec] | None) -> list[int]:
    """Token ids of the conversation rendered by the model's chat template, ending with the
    assistant turn's header. Tools and earlier tool calls go through the template where it knows
    them, else into the system turn and the assistant's text in the Hermes convention."""
    template = getattr(tokenizer, "chat_template", None)
    if not template:
        raise BadRequest("this model has no chat template; use /v1/completions", "messages")
    native = "tool_calls" in template
    rendered = []
    for m in messages:
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
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
        text = tokenizer.apply_chat_template(rendered, add_generation_prompt=True, tokenize=False, **kwargs)
    except Exception as e:  # noqa: BLE001 - a template's own complaint (e.g. roles out of order) is the caller's
        raise BadRequest(f"the chat template cannot render these messages: {e}", "messages") from e
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


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
    """(content before the calls, the calls in OpenAI's layout) of a completion's text; text
    with no readable call is all content (an agent sees a malformed call as the model wrote it)."""
    calls = [c for c in parse_tool_calls(text) if c.error is None]
    if not calls:
        return text, []
    content = text.split("<tool_call>", 1)[0].strip() or None
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": c.name, "arguments": json.dumps(c.arguments)}} for c in calls]


def visible_text(c: Completion, stop: Sequence[str]) -> str:
    """The completion's text as a client sees it: special tokens dropped, cut at a stop string."""
    text = c.text
    hits = [text.find(s) for s in stop if s in text]
    return text[: min(hits)] if hits else text


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
            out.append([list(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)])
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
        try:
            prompts, seeds = [], []
            for job, _, _ in entries:
                generator = torch.Generator().manual_seed(job.seed) if job.seed is not None else self.engine.generator
                prompts += job.prompts
                seeds += draw_seeds(generator, len(job.prompts), params)
            self.batches += 1
            results = self.engine.generate(prompts, params, seeds=seeds)  # type: ignore[call-arg]
            start = 0
            for job, _, _ in entries:
                job.result = results[start : start + len(job.prompts)]
                start += len(job.prompts)
                if job.top_k_logprobs and self.model is not None:
                    job.top = [top_logprobs(self.model, p, group, job.top_k_logprobs, params)
                               for p, group in zip(job.prompts, job.result)]
        except Exception as e:  # noqa: BLE001 - handed to each waiting request, which answers with it
            for _, future, loop in entries:
                loop.call_soon_threadsafe(_fail, future, e)
            return
        for job, future, loop in entries:
            loop.call_soon_threadsafe(_succeed, future, job)


def _succeed(future: asyncio.Future[Job], job: Job) -> None:
    if not future.done():
        future.set_result(job)


def _fail(future: asyncio.Future[Job], error: Exception) -> None:
    if not future.done():
        future.set_exception(error)
