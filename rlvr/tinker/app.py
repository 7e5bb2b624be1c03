"""The Tinker API's HTTP routes (``/api/v1/...``), as the ``tinker`` client 0.38 calls them.

Requests are validated with the client's own pydantic types; a malformed one gets a 400 whose
body says what and where (``{"detail": ...}``, FastAPI's layout, which the client prints). A
call that runs on the model answers at once with a future (``{"request_id": ...}``), whose
result `retrieve_future` long-polls: the result, ``{"type": "try_again"}`` while it runs, or the
API's failure shape ``{"error": ..., "category": "user" | "server"}``. The client config this
service hands out turns off what it does not run (JWT auth, server-side custom losses, the
futures poller, parallel chunks).
"""

from __future__ import annotations

import asyncio
import hmac
import json
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from rlvr.tinker.service import Job, TinkerService, UserError
from rlvr.tinker.wire import Invalid, forward_backward_output, parse_forward_backward, sample_response

PROTO = "application/x-protobuf"
POLL_SECONDS = 35.0
"""How long `retrieve_future` holds a request for a result before saying try_again (the client
waits 45 s for an answer)."""

CLIENT_CONFIG = {
    "pjwt_auth_enabled": False, "credential_default_source": "api_key", "parallel_fwdbwd_chunks": False,
    "proto_compress_fwdbwd": False, "use_pyqwest_transport": False, "sample_use_retrieve_futures": False,
    "custom_loss_server_side": False, "sample_join_sampling_session": False, "sample_no_retries": False,
}


class _Refused(Exception):
    def __init__(self, status: int, detail: str) -> None:
        super().__init__(detail)
        self.status, self.detail = status, detail


def _validated(kind: Any, body: Any) -> Any:
    from pydantic import ValidationError

    try:
        return kind.model_validate(body)
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ())) or "body"
        raise _Refused(400, f"{kind.__name__}: {where}: {first.get('msg', 'invalid')}") from None


async def _json(request: Request) -> Any:
    try:
        return json.loads(await request.body())
    except json.JSONDecodeError as e:
        raise _Refused(400, f"the body is not valid JSON: {e}") from None


def create_app(service: TinkerService, api_key: str | None = None) -> FastAPI:
    """The service's routes; with ``api_key``, every request must carry it (``X-API-Key``)."""
    from tinker import types

    app = FastAPI(title="rlvr tinker", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Any:
        if api_key is not None and request.url.path != "/api/v1/healthz":
            given = request.headers.get("x-api-key", "")
            if not hmac.compare_digest(given.encode(), api_key.encode()):
                return JSONResponse({"detail": "missing or wrong API key (TINKER_API_KEY, sent as X-API-Key)"}, 401)
        return await call_next(request)

    @app.exception_handler(_Refused)
    async def refused(_: Request, err: _Refused) -> JSONResponse:
        return JSONResponse({"detail": err.detail}, err.status)

    @app.exception_handler(Invalid)
    async def invalid(_: Request, err: Invalid) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, 400)

    @app.exception_handler(UserError)
    async def user(_: Request, err: UserError) -> JSONResponse:
        return JSONResponse({"detail": str(err)}, 400)

    def future(run: Any, model_id: str | None = None, **queued: Any) -> dict[str, Any]:
        return {"request_id": service.submit(run, **queued), "model_id": model_id}

    # --- service ---------------------------------------------------------------------------

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/api/v1/get_server_capabilities")
    async def capabilities() -> dict[str, Any]:
        return {"supported_models": [{"model_name": b.name, "max_context_length": b.context_length,
                                      "trainable": True, "sampleable": True} for b in service.bases.values()]}

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        return CLIENT_CONFIG

    @app.post("/api/v1/client/dynamic_config")
    async def dynamic_config() -> dict[str, Any]:
        return {"refresh_interval_sec": 300, "sample_cancel_enabled": False}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:  # the client's telemetry stays here, unread
        return {"status": "accepted"}

    @app.post("/api/v1/create_session")
    async def create_session(request: Request) -> dict[str, Any]:
        _validated(types.CreateSessionRequest, await _json(request))
        return {"type": "create_session", "session_id": service.create_session()}

    @app.post("/api/v1/session_heartbeat")
    async def heartbeat(request: Request) -> dict[str, str]:
        req = _validated(types.SessionHeartbeatRequest, await _json(request))
        if not service.heartbeat(req.session_id):
            raise _Refused(410, f"session {req.session_id} has ended")
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish(session_id: str, request: Request) -> dict[str, Any]:
        body = await _json(request)
        reason = body.get("reason", {}).get("type", "finished") if isinstance(body, dict) else "finished"
        # after the session's queued work: a client that closes right after its last call keeps it
        service.submit(lambda: service.end_session(session_id, f"its client closed it: {reason}"))
        return {}

    # --- training ----------------------------------------------------------------------

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        req = _validated(types.CreateModelRequest, await _json(request))
        if getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise _Refused(400, f"optimizer {req.optimizer_config.type!r} is not available: rlvr tinker trains with Adam")
        lora = None if req.lora_config is None else req.lora_config.model_dump()
        service.base(req.base_model)  # an unknown model is refused now, not in the future
        model_id = f"{req.session_id}:train:{req.model_seq_id}"  # the id the client derives too
        return future(lambda: {"model_id": service.create_model(req.session_id, req.base_model, lora, req.user_metadata,
                                                                model_id).model_id, "type": "create_model"})

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        req = _validated(types.GetInfoRequest, await _json(request))
        return service.info(req.model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        if PROTO not in request.headers.get("content-type", ""):
            raise _Refused(415, f"forward_backward takes a protobuf body (Content-Type: {PROTO})")
        fb = parse_forward_backward(await request.body(), request.headers.get("content-encoding"))
        service.trainer(fb.model_id)

        def run() -> bytes:
            outputs, metrics = service.forward_backward(fb.model_id, fb.data, fb.loss_fn, fb.config, fb.forward_only)
            return forward_backward_output(outputs, metrics)

        return future(run, fb.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        body = await _json(request)
        req = _validated(types.OptimStepRequest, body)
        params = req.optim_params.model_dump()
        if "type" in params and params["type"] not in (None, "adam", "adamw"):
            raise _Refused(400, f"optimizer {params['type']!r} is not available: rlvr tinker trains with Adam")
        service.trainer(req.model_id)
        return future(lambda: {"metrics": service.optim_step(req.model_id, params)}, req.model_id)

    # --- weights -----------------------------------------------------------------------

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        req = _validated(types.SaveWeightsRequest, await _json(request))
        name = req.path or f"step-{service.trainer(req.model_id).steps:06d}"
        return future(lambda: {"path": service.save_state(req.model_id, name, req.user_metadata),
                               "type": "save_weights"}, req.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_for_sampler(request: Request) -> dict[str, Any]:
        req = _validated(types.SaveWeightsForSamplerRequest, await _json(request))
        service.trainer(req.model_id)
        if req.path is None:
            return future(lambda: {"sampling_session_id": service.save_for_sampler(req.model_id, None),
                                   "type": "save_weights_for_sampler"}, req.model_id)
        return future(lambda: {"path": service.save_for_sampler(req.model_id, req.path),
                               "type": "save_weights_for_sampler"}, req.model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        req = _validated(types.LoadWeightsRequest, await _json(request))
        if req.weights_access_token:
            raise _Refused(400, "weights_access_token: checkpoints here belong to this service; there are no accounts")
        meta = service.checkpoint_meta(req.path)

        def run() -> dict[str, Any]:
            model_id = req.model_id
            if model_id is None:  # create-via-load: a new training model shaped like the checkpoint
                if req.session_id is None or req.model_seq_id is None:
                    raise UserError("load_weights needs model_id, or session_id and model_seq_id")
                model_id = service.create_model(req.session_id, req.base_model or meta["base_model"], meta["lora"],
                                                req.user_metadata, f"{req.session_id}:train:{req.model_seq_id}").model_id
            service.load_state(model_id, req.path, req.optimizer)
            return {"path": req.path, "model_id": model_id, "type": "load_weights"}

        return future(run, req.model_id)

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        body = await _json(request)
        path = body.get("tinker_path") if isinstance(body, dict) else None
        if not isinstance(path, str):
            raise _Refused(400, "weights_info: tinker_path (a string) is required")
        meta = service.checkpoint_meta(path)
        lora = meta["lora"]
        return {"base_model": meta["base_model"], "is_lora": lora is not None,
                "lora_rank": None if lora is None else int(lora["rank"]),
                "train_unembed": None if lora is None else bool(lora.get("train_unembed", False)),
                "train_mlp": None if lora is None else bool(lora.get("train_mlp", True)),
                "train_attn": None if lora is None else bool(lora.get("train_attn", True))}

    # --- sampling ----------------------------------------------------------------------

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        req = _validated(types.CreateSamplingSessionRequest, await _json(request))
        sampler = service.create_sampler(req.session_id, req.model_path, req.base_model)
        return {"type": "create_sampling_session", "sampling_session_id": sampler.sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        s = service.sampler(sampler_id)
        return {"sampler_id": s.sampler_id, "base_model": s.base.name, "model_path": s.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        req = _validated(types.SampleRequest, await _json(request))
        if req.sampling_session_id is None:
            raise _Refused(400, "asample: sampling_session_id is required (create_sampling_session first)")
        service.sampler(req.sampling_session_id)
        unsupported = [name for name, on in (("topk_prompt_logprobs", req.topk_prompt_logprobs),
                                             ("topk_sample_logprobs", req.topk_sample_logprobs),
                                             ("target_prompt_logprobs", req.target_prompt_logprobs is not None),
                                             ("prompt_alt_tokens_k", req.prompt_alt_tokens_k)) if on]
        if unsupported:
            raise _Refused(400, f"asample: {', '.join(unsupported)} not supported by rlvr tinker (sampled tokens, their "
                                "log-probs and the prompt's log-probs are)")
        if req.num_samples < 1:
            raise _Refused(400, f"asample: num_samples must be >= 1, got {req.num_samples}")
        try:
            prompt = req.prompt.to_ints()
        except ValueError as e:
            raise _Refused(400, f"asample: the prompt must be token chunks only ({e})") from None
        if not prompt:
            raise _Refused(400, "asample: the prompt is empty")
        params = req.sampling_params.model_dump()
        if params.get("max_tokens") is not None and params["max_tokens"] < 1:
            raise _Refused(400, f"asample: sampling_params.max_tokens must be >= 1, got {params['max_tokens']}")
        if not 0 < params.get("top_p", 1.0) <= 1 or params.get("temperature", 1.0) < 0:
            raise _Refused(400, "asample: need temperature >= 0 and 0 < top_p <= 1")
        payload = {"prompt": prompt, "num_samples": req.num_samples, "sampling_params": params,
                   "prompt_logprobs": bool(req.prompt_logprobs), "last_n": req.prompt_logprobs_last_n}
        key = (req.sampling_session_id, req.num_samples,
               json.dumps({k: v for k, v in params.items() if k != "seed"}, sort_keys=True, default=str))

        def run_batch(jobs: list[Job]) -> list[bytes]:
            results = service.sample(req.sampling_session_id, [j.payload for j in jobs])  # type: ignore[arg-type]
            out = []
            for job, (sequences, prompt_lp) in zip(jobs, results):
                last_n = job.payload["last_n"]
                if prompt_lp is not None and last_n is not None:  # only the last n scored
                    prompt_lp = [None if i < len(prompt_lp) - last_n else v for i, v in enumerate(prompt_lp)]
                out.append(sample_response(sequences, prompt_lp))
            return out

        request_id = service.submit(lambda: None, batch_key=key,
                                    run_batch=run_batch, payload=payload)
        return {"request_id": request_id, "model_id": None,
                "sample_sequence_ids": [f"{request_id}-{j}" for j in range(req.num_samples)]}

    # --- futures -----------------------------------------------------------------------

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Any:
        req = _validated(types.FutureRetrieveRequest, await _json(request))
        try:
            outcome = await service.wait(req.request_id, POLL_SECONDS)
        except KeyError:
            raise _Refused(404, f"no request {req.request_id!r}: never submitted here, its result was fetched long ago, "
                                "or the service restarted since (its sessions and models are gone)") from None
        if outcome is None:
            return {"type": "try_again", "request_id": req.request_id, "queue_state": "active"}
        if outcome.error is not None:
            return {"error": outcome.error, "category": outcome.category}
        if isinstance(outcome.body, bytes):
            return Response(outcome.body, media_type=PROTO)
        return outcome.body

    @app.post("/api/v1/cancel_future")
    async def cancel_future() -> dict[str, Any]:
        return {}

    async def sweep() -> None:
        while True:
            await asyncio.sleep(min(60.0, service.session_timeout / 4))
            service.expire_sessions()

    @app.on_event("startup")
    async def start_sweeper() -> None:
        app.state.sweeper = asyncio.get_running_loop().create_task(sweep())

    return app
