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

import asyncio
import hmac
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from rlvr.rollout.engine import Engine
from rlvr.serve.backend import Batcher, Job, render_chat, token_bytes, tool_calls, visible_text
from rlvr.serve.protocol import ChatRequest, CompletionRequest, Invalid, Limits, error_body, utf8
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


class Recorder(Protocol):
    """What a trainer plugs in to see every call: the tag is the ``{tag}`` of a request sent to
    ``/e/{tag}/v1/...`` (one per agent episode), None for plain ``/v1`` routes."""

    def admit(self, tag: str | None, prompt_ids: list[int], params: SamplingParams) -> SamplingParams:
        """The parameters to sample this prompt with (e.g. the token budget an episode has left);
        raise Invalid to refuse the call."""
        ...

    def record(self, tag: str | None, prompt_ids: list[int], completions: list[Completion]) -> None:
        """A prompt served, with its completions exactly as sampled."""
        ...

    def failed(self, tag: str | None, why: str) -> None:
        """A call the server could not serve (the engine failed: its 500): whatever the agent makes
        of it, its episode's outcome is not the model's."""
        ...


def create_app(served: Served, *, limits: Limits = Limits(), api_key: str | None = None,
               recorder: Recorder | None = None) -> FastAPI:
    api_key = api_key or None  # an empty key is no key (not one that only "Bearer " matches)
    handlers = _Handlers(served, limits, recorder, Batcher(served.engine, served.model))

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        handlers.batcher.close()

    app = FastAPI(title="rlvr", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.batcher = handlers.batcher
    _guard(app, limits, api_key)
    _error_layout(app)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def plain_models() -> dict[str, Any]:
        return handlers.models()

    @app.get("/v1/models/{model:path}")
    async def one_model(model: str) -> dict[str, Any]:
        _check_model(served, model)
        return handlers.models()["data"][0]  # type: ignore[no-any-return]

    @app.post("/v1/chat/completions")
    async def plain_chat(req: ChatRequest, request: Request) -> Any:
        return await handlers.chat(req, gone=request.receive)

    @app.post("/v1/completions")
    async def plain_completions(req: CompletionRequest, request: Request) -> Any:
        return await handlers.completions(req, gone=request.receive)

    # the same routes under /e/{tag}/v1: a trainer gives each agent episode its own base URL

    @app.get("/e/{tag}/v1/models")
    async def tagged_models(tag: str) -> dict[str, Any]:
        return handlers.models()

    @app.post("/e/{tag}/v1/chat/completions")
    async def tagged_chat(tag: str, req: ChatRequest, request: Request) -> Any:
        return await handlers.chat(req, tag, gone=request.receive)

    @app.post("/e/{tag}/v1/completions")
    async def tagged_completions(tag: str, req: CompletionRequest, request: Request) -> Any:
        return await handlers.completions(req, tag, gone=request.receive)

    return app


class _Handlers:
    """What the routes do, shared by the plain /v1 routes and the tagged /e/{tag}/v1 ones (a tag
    names an agent episode; the recorder, if any, sees each call under it)."""

    def __init__(self, served: Served, limits: Limits, recorder: Recorder | None, batcher: Batcher) -> None:
        self.served, self.limits, self.recorder, self.batcher = served, limits, recorder, batcher
        self.active = 0

    @contextmanager
    def slot(self) -> Iterator[None]:
        """One request in flight, refused (429) beyond ``limits.max_concurrent``."""
        if self.active >= self.limits.max_concurrent:
            raise _Refused(429, f"{self.active} requests are in flight, the server's limit (max_concurrent)",
                           "rate_limit_exceeded")
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    def models(self) -> dict[str, Any]:
        return {"object": "list",
                "data": [{"id": self.served.name, "object": "model", "created": 0, "owned_by": "rlvr"}]}

    async def _sampled(self, job: Job, tag: str | None, gone: Gone | None) -> Job:
        """`_sampled`, and an engine failure told to the recorder (an agent may catch the 500 and
        answer anyway: its episode must not be scored as the model's answer)."""
        try:
            return await _sampled(self.batcher, job, gone)
        except _Refused as refused:
            if refused.status == 500 and self.recorder is not None:
                self.recorder.failed(tag, refused.message)
            raise

    async def chat(self, req: ChatRequest, tag: str | None = None, gone: Gone | None = None) -> Any:
        served, limits, recorder = self.served, self.limits, self.recorder
        req.check()
        with self.slot():
            if tag is None:  # an episode's agent may name any model: the policy is the only one
                _check_model(served, req.model)
            tools = req.tools if req.tool_choice != "none" else None
            prompt = render_chat(served.tokenizer, req.messages, tools)
            params = _params(served, limits, req, len(prompt))
            if recorder is not None:
                params = recorder.admit(tag, prompt, params)
            top = _top(limits, req.top_logprobs, served, "top_logprobs") if req.logprobs else 0
            job = await self._sampled(Job([prompt], params, req.seed, top), tag, gone)
        if recorder is not None:
            recorder.record(tag, prompt, job.result[0])
        body = _chat_body(served, req, job, bool(tools))
        return _sse(body, chat=True, usage=_wants_usage(req)) if req.stream else body

    async def completions(self, req: CompletionRequest, tag: str | None = None, gone: Gone | None = None) -> Any:
        served, limits, recorder = self.served, self.limits, self.recorder
        req.check()
        with self.slot():
            if tag is None:
                _check_model(served, req.model)
            prompts = [_prompt_ids(served, p) for p in _listed(req)]
            params = _params(served, limits, req, max(len(p) for p in prompts), rows=len(prompts))
            if recorder is not None:
                for p in prompts:
                    params = recorder.admit(tag, p, params)
            top = _top(limits, req.logprobs, served, "logprobs") if req.logprobs is not None else 0
            job = await self._sampled(Job(prompts, params, req.seed, top), tag, gone)
        if recorder is not None:
            for prompt, group in zip(prompts, job.result):
                recorder.record(tag, prompt, group)
        body = _completion_body(served, req, job)
        return _sse(body, chat=False, usage=_wants_usage(req)) if req.stream else body


def _guard(app: FastAPI, limits: Limits, api_key: str | None) -> None:
    """Before any route: the API key (401), the body's declared size (413), and a Content-Length on
    every POST (411), in OpenAI's error layout."""
    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        if api_key is not None and "/v1/" in request.url.path + "/":
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


def _error_layout(app: FastAPI) -> None:
    """Every failure answered in OpenAI's error layout: validation (400 naming the field), the
    server's own refusals, HTTP errors (unknown routes, wrong methods, unparsable bodies), and any
    other exception (500)."""
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

    @app.exception_handler(Invalid)
    async def bad(_: Request, err: Invalid) -> JSONResponse:
        message = str(err) if err.param is None or err.param in str(err) else f"{err.param}: {err}"
        return JSONResponse(error_body(message, param=err.param), 400)

    @app.exception_handler(_Refused)
    async def refused(_: Request, err: _Refused) -> JSONResponse:
        return JSONResponse(error_body(err.message, kind=err.kind, code=err.code), err.status)

    @app.exception_handler(HTTPException)
    async def http(_: Request, err: HTTPException) -> JSONResponse:  # unknown routes, wrong methods, unparsable bodies
        return JSONResponse(error_body(str(err.detail), code=f"http_{err.status_code}"), err.status_code)

    @app.exception_handler(Exception)
    async def failed(_: Request, err: Exception) -> JSONResponse:
        return JSONResponse(error_body(f"internal server error: {type(err).__name__}: {err}", kind="server_error"), 500)


class _Refused(Exception):
    def __init__(self, status: int, message: str, code: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.kind = status, message, code, kind


Gone = Callable[[], Awaitable[Any]]
"""The request's ASGI `receive`: once its body is read, the next message it gives is the client's
disconnect. (Starlette's `Request.is_disconnected` never saw one behind the HTTP middleware: it
polls with a cancelled scope, which the middleware's receive gives up on before asking uvicorn.)"""


async def _sampled(batcher: Batcher, job: Job, gone: Gone | None = None) -> Job:
    """The job sampled. A client that disconnects meanwhile gives up its place: the job is not
    sampled if it has not started (one already in the engine runs to its end, unread), and its
    slot (`_Handlers.slot`) is free at once, where it used to refuse others with 429 until the
    abandoned work was done (a red-team review, session 19)."""
    waiting = asyncio.ensure_future(batcher.run(job))
    try:
        while gone is not None and not waiting.done():
            watch = asyncio.ensure_future(gone())
            await asyncio.wait({waiting, watch}, return_when=asyncio.FIRST_COMPLETED)
            if waiting.done():
                watch.cancel()
            elif not watch.cancelled() and watch.exception() is None and watch.result().get("type") == "http.disconnect":
                job.abandoned = True
                waiting.cancel()
                raise _Refused(499, "the client closed the request", "client_closed_request")
            else:  # a receive that said something else: stop watching, and wait for the job
                gone = None
        return await waiting
    except ValueError as e:  # the engine's own check of the request (e.g. an empty prompt)
        raise Invalid(str(e)) from e
    except _Refused:
        raise
    except Exception as e:  # noqa: BLE001 - an infrastructure failure: a 500 that says so, and the server goes on
        raise _Refused(500, f"the engine failed: {type(e).__name__}: {e}", "engine_error", "server_error") from e


def _check_model(served: Served, model: str | None) -> None:
    if model is not None and model != served.name:
        raise _Refused(404, f"this server serves model {served.name!r}, not {model!r}", "model_not_found")


def _listed(req: CompletionRequest) -> list[str | list[int]]:
    try:
        return req.prompts()
    except ValueError as e:
        raise Invalid(str(e), "prompt") from e


def _prompt_ids(served: Served, prompt: str | list[int]) -> list[int]:
    if isinstance(prompt, str):
        utf8(prompt, "prompt")
        ids = [int(i) for i in served.tokenizer(prompt)["input_ids"]]
    else:
        vocab = len(served.tokenizer)
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise Invalid(f"token id {bad[0]} is outside the vocabulary (0..{vocab - 1})", "prompt")
        ids = list(prompt)
    if not ids:
        raise Invalid("prompt is empty", "prompt")
    return ids


def _params(served: Served, limits: Limits, req: ChatRequest | CompletionRequest, prompt_len: int,
            rows: int = 1) -> SamplingParams:
    field = "max_completion_tokens" if isinstance(req, ChatRequest) and req.max_completion_tokens else "max_tokens"
    room = served.context_length - prompt_len
    if room < 1:
        raise Invalid(f"the prompt is {prompt_len} tokens; the model's context is {served.context_length}",
                         "messages" if isinstance(req, ChatRequest) else "prompt")
    asked = req.token_limit()
    if asked is not None and asked > limits.max_tokens:
        raise Invalid(f"{field} = {asked} is over this server's limit of {limits.max_tokens}", field)
    if asked is not None and asked > room:
        raise Invalid(f"the prompt is {prompt_len} tokens and {field} = {asked}: over the model's context of "
                         f"{served.context_length}", field)
    if req.n * rows > limits.max_n:
        raise Invalid(f"n = {req.n}" + (f" for {rows} prompts" if rows > 1 else "") +
                         f" is over this server's limit of {limits.max_n} completions per request", "n")
    try:
        stop = tuple(utf8(x, "stop") for x in req.stops())
    except Invalid:
        raise
    except ValueError as e:
        raise Invalid(str(e), "stop") from e
    if len(stop) > limits.max_stop:
        raise Invalid(f"{len(stop)} stop strings; at most {limits.max_stop}", "stop")
    return SamplingParams(temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, n=req.n, stop=stop,
                          max_new_tokens=asked if asked is not None else min(limits.max_tokens, room))


def _top(limits: Limits, k: int | None, served: Served, field: str) -> int:
    if not k:
        return 0
    if k > limits.max_top_logprobs:
        raise Invalid(f"{field} = {k}; at most {limits.max_top_logprobs}", field)
    if served.model is None:
        raise Invalid(f"{field} needs the model in this process (the embedded engine)", field)
    return k


def _wants_usage(req: ChatRequest | CompletionRequest) -> bool:
    return bool((req.stream_options or {}).get("include_usage"))


def _piece(tokenizer: Any, token_id: int) -> dict[str, Any]:
    return {"token": tokenizer.decode([token_id]), "bytes": token_bytes(tokenizer, token_id)}


def _chat_body(served: Served, req: ChatRequest, job: Job, tools: bool) -> dict[str, Any]:
    prompt, group = job.prompts[0], job.result[0]
    choices = []
    for i, c in enumerate(group):
        text = visible_text(c, job.params.stop, served.engine.eos_token_ids, served.tokenizer)
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
            text = visible_text(c, job.params.stop, served.engine.eos_token_ids, served.tokenizer)
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


def _sse(body: dict[str, Any], *, chat: bool, usage: bool) -> StreamingResponse:
    """A finished response as a server-sent event stream (each choice in one chunk, then its end,
    then the usage if `stream_options.include_usage` asked for it): for clients that only stream.
    Sampling is not incremental here; the events come at once."""
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
            ids = {"prompt_token_ids": body["prompt_token_ids"]} if chat else {}
            for part, more in ((first, ids), (last, {})):
                yield f"data: {json.dumps({**head, 'object': kind, 'choices': [part], **more})}\n\n"
        if usage:
            yield f"data: {json.dumps({**head, 'object': kind, 'choices': [], 'usage': body['usage']})}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")
