"""`rlvr serve`: an OpenAI-compatible, token-faithful HTTP server in front of an rlvr engine.

Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. Any OpenAI
client works against it (`base_url="http://127.0.0.1:8000/v1"`). Beyond OpenAI's fields, every
response carries the exact token ids: `prompt_token_ids` (top level for chat, per choice for
completions) and `token_ids` per choice, as vLLM's `return_token_ids` does, so a trainer never
re-tokenises text (rlvr.serve.backend says exactly what the ids and log-probs are).

Safe by default: the CLI binds the loopback address; with an API key every /v1 route needs
``Authorization: Bearer <key>``; `Limits` bounds each request (400 naming the field), the body
size (413) and the requests in flight (429). Bad requests get OpenAI's error layout with the
offending field in ``param``; an engine failure is a 500 that says so, never a crash.
"""

from __future__ import annotations

import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from rlvr.rollout.engine import Engine
from rlvr.serve.backend import Batcher, BadRequest, Job, render_chat, tool_calls, visible_text
from rlvr.serve.protocol import ChatRequest, CompletionRequest, Limits, error_body
from rlvr.types import Completion, SamplingParams


@dataclass
class Served:
    """The model behind the server: its public name, tokenizer, engine, and the model itself
    (for top log-probs; None where the engine holds it elsewhere, e.g. vLLM)."""

    name: str
    tokenizer: Any
    engine: Engine
    model: Any | None
    context_length: int


CallHook = Callable[[list[int], list[Completion]], None]
"""Called with (prompt ids, completions) after every served prompt (a trainer records them)."""


def create_app(served: Served, *, limits: Limits = Limits(), api_key: str | None = None,
               on_call: CallHook | None = None) -> FastAPI:
    batcher = Batcher(served.engine, served.model)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        batcher.close()

    app = FastAPI(title="rlvr", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.batcher = batcher
    active = [0]

    @contextmanager
    def slot() -> Iterator[None]:
        if active[0] >= limits.max_concurrent:
            raise _Refused(429, f"{active[0]} requests are in flight, the server's limit (max_concurrent)",
                           "rate_limit_exceeded")
        active[0] += 1
        try:
            yield
        finally:
            active[0] -= 1

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        if api_key is not None and request.url.path.startswith("/v1"):
            given = request.headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
                return JSONResponse(error_body("missing or wrong API key (Authorization: Bearer <key>)",
                                               kind="authentication_error", code="invalid_api_key"), 401)
        size = request.headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > limits.max_body_bytes):
            return JSONResponse(error_body(f"the request body is over {limits.max_body_bytes} bytes (max_body_bytes)",
                                           code="body_too_large"), 413)
        if request.method == "POST" and size is None:  # a chunked body could be any size
            return JSONResponse(error_body("send the body with a Content-Length", code="length_required"), 411)
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0]
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        # pydantic names the union member it tried (e.g. "str", "list[TextPart]"): keep the field path
        param = ".".join(p for p in loc if not any(c in p for c in "[]'\"") and p not in ("str", "int", "list"))
        message = first.get("msg", "invalid request")
        if first.get("type") == "json_invalid":
            return JSONResponse(error_body(f"the body is not valid JSON: {message}"), 400)
        return JSONResponse(error_body(f"{param or 'body'}: {message}", param=param or None), 400)

    @app.exception_handler(BadRequest)
    async def bad(_: Request, err: BadRequest) -> JSONResponse:
        return JSONResponse(error_body(str(err), param=err.param), 400)

    @app.exception_handler(_Refused)
    async def refused(_: Request, err: _Refused) -> JSONResponse:
        return JSONResponse(error_body(err.message, kind=err.kind, code=err.code), err.status)

    @app.exception_handler(Exception)
    async def failed(_: Request, err: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"the engine failed: {type(err).__name__}: {err}", kind="server_error"), 500)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": served.name, "object": "model", "created": 0, "owned_by": "rlvr"}]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> Any:
        with slot():
            _check_model(served, req.model)
            tools = req.tools if req.tool_choice != "none" else None
            prompt = render_chat(served.tokenizer, req.messages, tools)
            params = _params(served, limits, req, len(prompt))
            top = _top(limits, req.top_logprobs, served) if req.logprobs else 0
            job = await _sampled(batcher, Job([prompt], params, req.seed, top))
        if on_call is not None:
            on_call(prompt, job.result[0])
        body = _chat_body(served, req, job, bool(tools))
        return _sse(body, chat=True) if req.stream else body

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest) -> Any:
        with slot():
            _check_model(served, req.model)
            prompts = [_prompt_ids(served, p) for p in _listed(req)]
            params = _params(served, limits, req, max(len(p) for p in prompts), rows=len(prompts))
            top = _top(limits, req.logprobs, served) if req.logprobs is not None else 0
            job = await _sampled(batcher, Job(prompts, params, req.seed, top))
        if on_call is not None:
            for prompt, group in zip(prompts, job.result):
                on_call(prompt, group)
        body = _completion_body(served, req, job)
        return _sse(body, chat=False) if req.stream else body

    return app


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


async def _sampled(batcher: Batcher, job: Job) -> Job:
    try:
        return await batcher.run(job)
    except ValueError as e:  # the engine's own check of the request (e.g. an empty prompt)
        raise BadRequest(str(e)) from e
    except Exception as e:  # noqa: BLE001 - an infrastructure failure: a 500 that says so, and the server goes on
        raise _Refused(500, f"the engine failed: {type(e).__name__}: {e}", "engine_error", "server_error") from e


def _check_model(served: Served, model: str | None) -> None:
    if model is not None and model != served.name:
        raise _Refused(404, f"this server serves model {served.name!r}, not {model!r}", "model_not_found")


def _listed(req: CompletionRequest) -> list[str | list[int]]:
    try:
        return req.prompts()
    except ValueError as e:
        raise BadRequest(str(e), "prompt") from e


def _prompt_ids(served: Served, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        ids = [int(i) for i in served.tokenizer(prompt)["input_ids"]]
    else:
        vocab = len(served.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise BadRequest(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
        ids = list(prompt)
    if not ids:
        raise BadRequest("prompt is empty", "prompt")
    return ids


def _params(served: Served, limits: Limits, req: ChatRequest | CompletionRequest, prompt_len: int,
            rows: int = 1) -> SamplingParams:
    field = "max_completion_tokens" if isinstance(req, ChatRequest) and req.max_completion_tokens else "max_tokens"
    room = served.context_length - prompt_len
    if room < 1:
        raise BadRequest(f"the prompt is {prompt_len} tokens; the model's context is {served.context_length}",
                         "messages" if isinstance(req, ChatRequest) else "prompt")
    asked = req.token_limit()
    if asked is not None and asked > limits.max_tokens:
        raise BadRequest(f"{field} = {asked} is over this server's limit of {limits.max_tokens}", field)
    if asked is not None and asked > room:
        raise BadRequest(f"the prompt is {prompt_len} tokens and {field} = {asked}: over the model's context of "
                         f"{served.context_length}", field)
    if req.n * rows > limits.max_n:
        raise BadRequest(f"n = {req.n}" + (f" for {rows} prompts" if rows > 1 else "") +
                         f" is over this server's limit of {limits.max_n} completions per request", "n")
    try:
        stop = req.stops()
    except ValueError as e:
        raise BadRequest(str(e), "stop") from e
    if len(stop) > limits.max_stop:
        raise BadRequest(f"{len(stop)} stop strings; at most {limits.max_stop}", "stop")
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, n=req.n, stop=stop,
                          max_new_tokens=asked if asked is not None else min(limits.max_tokens, room))


def _top(limits: Limits, k: int | None, served: Served) -> int:
    if not k:
        return 0
    if k > limits.max_top_logprobs:
        raise BadRequest(f"top_logprobs = {k}; at most {limits.max_top_logprobs}", "top_logprobs")
    if served.model is None:
        raise BadRequest("top_logprobs needs the model in this process (the embedded engine)", "top_logprobs")
    return k


def _piece(tokenizer: Any, token_id: int) -> dict[str, Any]:
    text = tokenizer.decode([token_id])
    return {"token": text, "bytes": list(text.encode("utf-8"))}


def _chat_body(served: Served, req: ChatRequest, job: Job, tools: bool) -> dict[str, Any]:
    prompt, group = job.prompts[0], job.result[0]
    choices = []
    for i, c in enumerate(group):
        text = visible_text(c, job.params.stop)
        content, calls = tool_calls(text) if tools else (text, [])
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if calls:
            message["tool_calls"] = calls
        logprobs = None
        if req.logprobs:
            top = job.top[0][i] if job.top else [[] for _ in c.token_ids]
            logprobs = {"content": [
                {**_piece(served.tokenizer, t), "logprob": lp,
                 "top_logprobs": [{**_piece(served.tokenizer, a), "logprob": b} for a, b in alts]}
                for t, lp, alts in zip(c.token_ids, c.logprobs, top)]}
        choices.append({"index": i, "message": message, "logprobs": logprobs,
                        "finish_reason": "tool_calls" if calls else c.finish_reason, "token_ids": list(c.token_ids)})
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": served.name, "choices": choices, "usage": _usage([prompt], [group]), "prompt_token_ids": prompt}


def _completion_body(served: Served, req: CompletionRequest, job: Job) -> dict[str, Any]:
    choices = []
    for p, (prompt, group) in enumerate(zip(job.prompts, job.result)):
        for j, c in enumerate(group):
            text = visible_text(c, job.params.stop)
            logprobs = None
            if req.logprobs is not None:
                pieces = [served.tokenizer.decode([t]) for t in c.token_ids]
                top = job.top[p][j] if job.top else None
                logprobs = {"tokens": pieces, "token_logprobs": list(c.logprobs),
                            "top_logprobs": [{served.tokenizer.decode([a]): b for a, b in alts} for alts in top]
                            if top is not None else None,
                            "text_offset": [sum(len(x) for x in pieces[:k]) for k in range(len(pieces))]}
            choices.append({"index": p * job.params.n + j, "text": text, "logprobs": logprobs,
                            "finish_reason": c.finish_reason, "token_ids": list(c.token_ids),
                            "prompt_token_ids": prompt})
    return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
            "model": served.name, "choices": choices, "usage": _usage(job.prompts, job.result)}


def _usage(prompts: list[list[int]], groups: list[list[Completion]]) -> dict[str, int]:
    prompt = sum(len(p) for p in prompts)
    completion = sum(len(c.token_ids) for g in groups for c in g)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _sse(body: dict[str, Any], *, chat: bool) -> StreamingResponse:
    """A finished response as a server-sent event stream (each choice in one chunk, then its end):
    for clients that only stream. Sampling is not incremental here; the events come at once."""
    kind = "chat.completion.chunk" if chat else "text_completion"
    head = {k: body[k] for k in ("id", "created", "model")}

    async def events() -> AsyncIterator[str]:
        for choice in body["choices"]:
            if chat:
                message = choice["message"]
                delta: dict[str, Any] = {"role": "assistant", "content": message["content"]}
                if "tool_calls" in message:
                    delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
                first = {"index": choice["index"], "delta": delta, "logprobs": choice["logprobs"], "finish_reason": None,
                         "token_ids": choice["token_ids"]}
                last = {"index": choice["index"], "delta": {}, "logprobs": None, "finish_reason": choice["finish_reason"]}
            else:
                first = {**choice, "finish_reason": None}
                last = {"index": choice["index"], "text": "", "logprobs": None, "finish_reason": choice["finish_reason"]}
            for part in (first, last):
                yield f"data: {json.dumps({**head, 'object': kind, 'choices': [part]})}\n\n"
        if chat:
            yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': body['usage'], 'prompt_token_ids': body['prompt_token_ids']})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
