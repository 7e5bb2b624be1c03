"""`rlvr serve`: the OpenAI-compatible server on a model, in the foreground."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from rlvr.log.tracking import import_extra
from rlvr.serve.protocol import Limits


def run(args: argparse.Namespace) -> int:
    for module in ("fastapi", "uvicorn"):
        import_extra(module, f"rlvr serve needs {module}: pip install 'rlvr[serve]'")
    # the optional extra: imported once the lines above have said how to install what is missing
    from rlvr.serve.server import is_loopback, load_served, serve_forever, warm_up

    limits = Limits(max_n=args.max_n, max_tokens=args.max_tokens, max_concurrent=args.max_concurrent,
                    max_body_bytes=args.max_body_bytes)
    args.api_key = args.api_key or None  # an empty RLVR_API_KEY is no key
    if not is_loopback(args.host) and not args.api_key:
        print(f"warning: serving on {args.host} without an API key: anyone who can reach it can use the model "
              "(pass --api-key or set RLVR_API_KEY)", file=sys.stderr)
    vllm_kwargs = vllm_options(args.vllm_kwargs)
    served = load_served(args.model, name=args.name, dtype=args.dtype, device=args.device, seed=args.seed,
                         max_batch_size=args.max_batch_size, backend=args.engine, vllm_kwargs=vllm_kwargs)
    if args.warmup:  # else the first request waits for it (~19 s on an Intel Xeon the first time on a machine)
        largest = min(args.max_batch_size, 8)
        print(f"warming up the engine (batches of 1 to {largest}; --no-warmup skips it)", file=sys.stderr, flush=True)
        print(f"warm in {warm_up(served, largest):.1f} s", file=sys.stderr, flush=True)
    print(f"serving {served.name!r} at http://{args.host}:{args.port}/v1", file=sys.stderr, flush=True)
    serve_forever(served, host=args.host, port=args.port, limits=limits, api_key=args.api_key)
    return 0


def vllm_options(text: str) -> dict[str, Any]:
    """--vllm-kwargs: a JSON object, or the command stops saying what is wrong with it."""
    try:
        options = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(f"--vllm-kwargs is not JSON: {e}") from None
    if not isinstance(options, dict):
        raise SystemExit("--vllm-kwargs must be a JSON object, e.g. '{\"enforce_eager\": true}'")
    return options
