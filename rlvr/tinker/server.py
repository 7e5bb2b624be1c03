"""Running the Tinker service: in the foreground (`rlvr tinker`), or in a daemon thread on a free
loopback port (tests, notebooks)."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path
from typing import Any

import uvicorn

from rlvr.tinker.app import create_app
from rlvr.tinker.service import TinkerService


def serve_forever(service: TinkerService, *, host: str = "127.0.0.1", port: int = 8000,
                  api_key: str | None = None) -> None:
    uvicorn.run(create_app(service, api_key=api_key), host=host, port=port, log_level="warning")


class BackgroundTinker:
    """The service on ``http://127.0.0.1:<port>`` in a daemon thread; `base_url` is what the client
    takes (``tinker.ServiceClient(base_url=...)``). A context manager, or call `close`."""

    def __init__(self, models: list[str], root: Path, *, api_key: str | None = None, timeout: float = 60.0,
                 **service_kwargs: Any) -> None:
        self.service = TinkerService(models, root, **service_kwargs)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = int(self._socket.getsockname()[1])
        self.base_url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(create_app(self.service, api_key=api_key), log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="rlvr-tinker", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the tinker service did not start on port {self.port}")
            time.sleep(0.01)

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()
        self.service.close()

    def __enter__(self) -> BackgroundTinker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
