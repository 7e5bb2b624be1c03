"""An OpenAI-compatible, token-faithful server in front of an rlvr engine (`rlvr serve`).

- rlvr.serve.protocol: the requests it accepts and the limits on them;
- rlvr.serve.backend: chat rendering, the batching queue before the engine, tool calls, top log-probs;
- rlvr.serve.app: the FastAPI routes, API key, body and concurrency limits, error layout;
- rlvr.serve.server: loading a model to serve, and running the app (in the foreground, or in a
  background thread on a free loopback port for a trainer's agents).

Import from the submodules: this package stays importable without fastapi and uvicorn (the
`serve` extra), so that the CLI can name the missing extra.
"""
