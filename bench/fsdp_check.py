"""Sharded learners without Ray: the check bench/gpu.sh runs on a lent GPU, where Ray is not
installed (nor can it be carried). Ranks spawned by torch.multiprocessing each shard the same
model with rlvr.scaleout.sharded.shard (NCCL on CUDA, gloo on the CPU) and run rlvr's
`update_policy` on the same groups for a few updates; rank 0 compares the gathered weights with
the same updates unsharded in its own process, and times both. fp32, so that the comparison
measures the summation order only (~1e-7 relative per step, Adam's normalised steps carry it).

    python bench/fsdp_check.py --device cuda --world 1 --model /tmp/student      # one GPU: NCCL
    python bench/fsdp_check.py --device cpu --world 2                            # here: gloo, 2 ranks
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rlvr.bench import fake_groups  # noqa: E402
from rlvr.models import load_model  # noqa: E402
from rlvr.train.learner import Learner  # noqa: E402
from rlvr.train.settings import LossSettings, Passes  # noqa: E402
from rlvr.train.update import UpdateSettings, update_policy  # noqa: E402

SETTINGS = UpdateSettings(loss=LossSettings(max_tokens=32), passes=Passes(micro_batch_size=4, share_prompts=False))


def updates(learner: Learner, steps: int, vocab: int) -> float:
    """`steps` updates on fixed groups (16 samples: 4 micro-batches); the seconds they took."""
    groups = fake_groups(16, 8, 24, 32, vocab)
    device = next(learner.model.parameters()).device
    start = time.perf_counter()
    for step in range(steps):
        update_policy(learner, groups, SETTINGS, pad_token_id=0, generator=torch.Generator().manual_seed(step))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def rank(r: int, world: int, port: int, args: argparse.Namespace, out: str) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from rlvr.scaleout.sharded import local_bytes, shard

    device = torch.device(args.device, r) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", init_method=f"tcp://127.0.0.1:{port}",
                            rank=r, world_size=world)
    model = load_model(args.model, torch.float32, device)
    vocab = model.config.vocab_size
    sharded = Learner(shard(model, mixed=False), lr=1e-4)
    seconds = updates(sharded, args.steps, vocab)
    weights = get_model_state_dict(sharded.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    held = local_bytes(sharded)
    dist.destroy_process_group()
    if r != 0:
        return
    whole = Learner(load_model(args.model, torch.float32, device), lr=1e-4)
    whole_seconds = updates(whole, args.steps, vocab)
    worst = max(float((weights[k] - v.cpu()).abs().max() / max(1.0, float(v.abs().max())))
                for k, v in whole.model.state_dict().items())
    moved = max(float((weights[k] - v).abs().max()) for k, v in load_model(args.model, torch.float32).state_dict().items())
    Path(out).write_text(json.dumps({
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "world": world,
        "steps": args.steps, "max_relative_weight_difference": worst, "max_weight_change": moved,
        "agrees": worst <= 1e-4 and moved > 0, "sharded_seconds": round(seconds, 3),
        "unsharded_seconds": round(whole_seconds, 3), "rank0_bytes": held}))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--model", default=None, help="a model folder (default: the tests' tiny model)")
    args = ap.parse_args()
    if args.model is None:
        from tests.tiny import make_tiny_model, make_tiny_tokenizer

        args.model = tempfile.mkdtemp(prefix="fsdp-check-")
        make_tiny_model().save_pretrained(args.model)
        make_tiny_tokenizer().save_pretrained(args.model)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = os.path.join(tempfile.mkdtemp(), "result.json")
    mp.spawn(rank, args=(args.world, port, args, out), nprocs=args.world)
    result: dict[str, Any] = json.loads(Path(out).read_text())
    print(json.dumps(result))
    sys.exit(0 if result["agrees"] else 1)


if __name__ == "__main__":
    main()
