"""`rlvr tinker`: the Tinker training API on rlvr, in the foreground."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from rlvr.log.tracking import import_extra


def run(args: argparse.Namespace) -> int:
    for module in ("fastapi", "uvicorn", "tinker"):
        import_extra(module, f"rlvr tinker needs {module}: pip install 'rlvr[tinker]'")
    from rlvr.commands.serve import vllm_options
    from rlvr.serve.server import is_loopback
    from rlvr.tinker.server import serve_forever
    from rlvr.tinker.service import TinkerService, write_hub_aliases

    api_key = args.api_key or None
    if api_key is not None and not api_key.startswith("tml-"):
        raise SystemExit("--api-key must start with 'tml-': the tinker client refuses any other key")
    if not is_loopback(args.host) and api_key is None:
        print(f"warning: serving on {args.host} without an API key: anyone who can reach it can train and sample "
              "(pass --api-key tml-... or set RLVR_TINKER_API_KEY)", file=sys.stderr)
    vllm_kwargs = vllm_options(args.vllm_kwargs)
    service = TinkerService(args.model, Path(args.root), dtype=args.dtype, device=args.device, seed=args.seed,
                            max_batch_size=args.max_batch_size, session_timeout=args.session_timeout,
                            snapshots=args.snapshots, max_new_tokens=args.max_tokens,
                            micro_batch_tokens=args.micro_batch_tokens, engine=args.engine, vllm_kwargs=vllm_kwargs,
                            ray_workers=args.ray_workers, ray_overrides=args.ray)
    url = f"http://{args.host}:{args.port}"
    names = "\n".join(f"  {b.name}" + (f"   (also: {', '.join(a for a in b.aliases if a != b.name)})"
                                       if len(b.aliases) > 1 else "") for b in service.bases.values())
    hf_home = Path(args.root).resolve() / "hf-home"
    aliases = write_hub_aliases(list(service.bases.values()), hf_home)
    hub = (f" HF_HOME={hf_home} HF_HUB_OFFLINE=1   (so that {', '.join(aliases)} finds its tokenizer offline)"
           if aliases else "")
    print(f"rlvr tinker at {url}  (checkpoints in {Path(args.root).resolve()})\nbase models:\n{names}\n"
          f"clients: TINKER_BASE_URL={url} TINKER_API_KEY={api_key or 'tml-local'}{hub}\n"
          "(any key starting tml- works when the service has none)", file=sys.stderr, flush=True)
    serve_forever(service, host=args.host, port=args.port, api_key=api_key)
    return 0
