"""Running the Tinker service: in the foreground (`rlvr tinker`), or in a daemon thread on a free
loopback port (tests, notebooks)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import uvicorn

from rlvr.serve.server import ThreadedApp
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
        self._threaded = ThreadedApp(create_app(self.service, api_key=api_key), timeout=timeout, name="rlvr-tinker")
        self.port = self._threaded.port
        self.base_url = f"http://127.0.0.1:{self.port}"

    def close(self) -> None:
        self._threaded.close()
        self.service.close()

    def __enter__(self) -> BackgroundTinker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
