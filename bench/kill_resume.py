"""Kill `rlvr train` with SIGKILL at chosen and random points, resume it, and compare what it
wrote with an uninterrupted run: every metrics.jsonl and samples.jsonl row (timing fields aside)
and the final weights, bit for bit.

    python bench/kill_resume.py --trials 100 --out /tmp/kills            # the demo config, short
    python bench/kill_resume.py --trials 4 --points generate,checkpoint_state  # a few, named points
    python bench/kill_resume.py --trials 10 --out /tmp/kills_async --points update,optimizer,time \
        dist.rollout_workers=1 'dist.async_rollouts={steps = 1}'     # the asynchronous buffer full

A trial runs the training in a child process that kills itself (SIGKILL, so nothing of rlvr's
gets to clean up) at the k-th time it reaches a named point, or is killed by this script after a
random delay; then `rlvr train --resume` runs it to the end (a resume that is killed again is
resumed again). The named points (`POINTS`) are wrappers this script installs around rlvr's own
functions in the child: inside generation (a decode step), inside the update (after a
micro-batch's backward), between the optimizer step and the checkpoint, in the middle of a
checkpoint write (weights written, trainer state not yet; and after the state, before the
rename), during the prune of old checkpoints, during a held-out evaluation, inside a sandboxed
reward (a weight-0 reward that runs a program in rlvr's sandbox), and at an epoch boundary.

Half of the trials start from scratch; the others start from a hard-linked copy of the reference
run cut back to its step-k checkpoint (what a resume keeps), so that the kill falls in later
steps without training the first ones again. The reference run is made twice and must equal
itself. Results: one JSON line per trial in <out>/trials.jsonl and a table at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent

DEMO_SHORT = ["train.steps=4", "checkpoint_every=1", "keep_checkpoints=2", "task.size=24", "task.eval_size=8",
              "train.eval_every=2", "train.prompts_per_step=8",
              'rewards=[{fn = "reasoning_gym", kwargs = {extract = "tag_or_last_number"}}, '
              '{fn = "bench.kill_resume:sandboxed_check", weight = 0, group = true}]']
"""The demo config, short: 4 steps, a checkpoint after each, an epoch boundary inside step 3 (24
prompts, 8 a step), an evaluation at step 2 and 4, and a sandboxed reward beside the task's."""

TIMING = ("_seconds", "per_second", "memory_gb", "memory_released_gb", "cpu_threads", "cpu_busy_elsewhere")
"""Metric names ending so are measurements of the machine (wall clock, resident memory, the cores
other programs used and the threads fitted to them: rlvr.cores), which no two runs share."""


def sandboxed_check(prompt: str, completions: list[str], **_: Any) -> list[float]:
    """A weight-0 group reward that runs one program per group in rlvr's sandbox (the path a code
    reward takes), so that a kill can land inside a sandboxed reward. It scores the completions'
    lengths' parity, which the policy never sees (weight 0)."""
    from rlvr.sandbox import Sandbox

    result = Sandbox().run_python("import sys\nprint(' '.join(str(len(l) % 2) for l in sys.stdin.read().split('\\0')))",
                                  stdin="\0".join(completions))
    values = [float(v) for v in result.stdout.split()] if result.ok else []
    return values if len(values) == len(completions) else [0.0] * len(completions)


# ---- the child: rlvr train with a kill point installed ------------------------------------------

def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _after(hit: Callable[[], bool]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a function: call it, then die if `hit()` says this call is the chosen one."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if hit():
                _die()
            return out
        return wrapped
    return wrap


def _before(hit: Callable[[], bool]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if hit():
                _die()
            return fn(*args, **kwargs)
        return wrapped
    return wrap


def _during(hit: Callable[[], bool], delay_s: float) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a function: on the chosen call, die `delay_s` into it (from a timer thread)."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            if hit():
                threading.Timer(delay_s, _die).start()
            return fn(*args, **kwargs)
        return wrapped
    return wrap


def install(point: str, k: int) -> None:
    """Patch rlvr so that this process dies the `k`-th time it reaches `point` (`POINTS`)."""
    import torch

    import rlvr.rollout.static_decode as static_decode
    import rlvr.train.checkpoint as checkpoint
    import rlvr.train.evaluate as evaluate
    import rlvr.train.update as update
    from rlvr.data.sampler import UniformSampler
    import rlvr.rollout.engine as engine
    from rlvr.train.learner import Learner

    calls = {"n": 0}

    def hit() -> bool:
        calls["n"] += 1
        return calls["n"] == k

    if point == "generate":  # a decode step, in generation for training or evaluation
        static_decode.StaticDecoder.step = _after(hit)(static_decode.StaticDecoder.step)  # type: ignore[method-assign]
        engine.HFDecoder.step = _after(hit)(engine.HFDecoder.step)  # type: ignore[method-assign]
    elif point == "update":  # after a micro-batch's forward and backward, before the optimizer step
        update._accumulate = _after(hit)(update._accumulate)
    elif point == "optimizer":  # after the optimizer step: before the weight sync, the metrics and the checkpoint
        Learner.step = _after(hit)(Learner.step)  # type: ignore[method-assign]
    elif point == "checkpoint_weights":  # the checkpoint's weights written, its trainer state not yet
        checkpoint.save_merged = _after(hit)(checkpoint.save_merged)
    elif point == "checkpoint_state":  # the trainer state written, the checkpoint not renamed into place
        real_save = torch.save

        def save(obj: Any, path: Any, *args: Any, **kwargs: Any) -> None:
            real_save(obj, path, *args, **kwargs)
            if str(path).endswith(checkpoint.STATE_FILE) and hit():
                _die()

        torch.save = save  # type: ignore[assignment]
    elif point == "prune":  # an old checkpoint renamed for deletion, and the process dies before it is deleted
        real_rmtree = checkpoint.shutil.rmtree

        def rmtree(path: Any, *args: Any, **kwargs: Any) -> None:
            if Path(path).name.startswith(".trash_") and Path(path).exists() and hit():
                _die()
            real_rmtree(path, *args, **kwargs)

        checkpoint.shutil.rmtree = rmtree  # type: ignore[assignment]
    elif point == "evaluate":  # inside a held-out evaluation (the first decode steps of its prompts)
        evaluate._held_out = _during(hit, 0.3)(evaluate._held_out)
    elif point == "reward":  # inside the sandboxed reward's program
        import rlvr.sandbox as sandbox

        sandbox.Sandbox.run_python = _during(hit, 0.02)(sandbox.Sandbox.run_python)  # type: ignore[method-assign]
    elif point == "epoch":  # at the first batch of a new epoch (the sampler's reshuffle)
        real_next = UniformSampler.next_batch

        def next_batch(self: UniformSampler, n: int) -> list[int]:
            before = int(self.epoch)
            out = real_next(self, n)
            if int(self.epoch) > before or (self.position - n) % self.num_prompts == 0 and self.position > n:
                if hit():
                    _die()
            return out

        UniformSampler.next_batch = next_batch  # type: ignore[method-assign]
    elif point != "none":
        raise ValueError(f"unknown kill point {point!r} (one of {', '.join(POINTS)})")


POINTS = ("generate", "update", "optimizer", "checkpoint_weights", "checkpoint_state", "prune", "evaluate", "reward",
          "epoch")
"""The named kill points (`install`); "time" in a trial is a random delay from the parent."""

MAX_HITS = {"generate": 250, "update": 12, "optimizer": 4, "checkpoint_weights": 4, "checkpoint_state": 4,
            "prune": 3, "evaluate": 3, "reward": 24, "epoch": 1}
"""The k drawn for a point lies in 1..MAX_HITS[point]: about how often a 4-step run reaches it (a
k it never reaches leaves the run whole, which the trial reports as 'not reached')."""


def child(argv: list[str]) -> int:
    point, k = argv[0].split(":")
    install(point, int(k))
    from rlvr.cli import main

    return main(argv[1:])


# ---- the parent: trials ----------------------------------------------------------------------

def _run(args: list[str], kill: str = "none:0", delay_s: float | None = None, log: Path | None = None,
         threads: str | None = None, env: dict[str, str] | None = None) -> tuple[int, float]:
    """One child process (``env``: variables added to this one's); returns its exit code (-9:
    killed) and seconds."""
    env = dict(os.environ, **(env or {}), PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if threads:
        env["OMP_NUM_THREADS"] = threads
    start = time.perf_counter()
    out = log.open("a") if log else subprocess.DEVNULL
    proc = subprocess.Popen([sys.executable, __file__, "child", kill, *args], env=env, stdout=out, stderr=out,
                            cwd=ROOT)
    try:
        proc.wait(timeout=delay_s)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return proc.returncode, time.perf_counter() - start


def measured_otherwise(cache: Path, target: Path) -> Path:
    """A copy of the measurements in rlvr's cache folder ``cache`` (not its models) in which every
    one is changed: "auto" flips between bfloat16 and float32, attention widens where it did not
    (and not where it did), and every product runs another form. A process reading it stands for
    a machine that measured otherwise since the run began (the cache cleared and measured again
    under load, written over by another process, another machine of the same kind)."""
    target.mkdir(parents=True, exist_ok=True)
    changes = {
        "dtype.json": lambda v: 0.5 if v >= 1.2 else 5.0,
        "attention.json": lambda v: 0 if v else 512,
        "products.json": lambda v: {part: ["linear" if form == "left" else "left" for form in forms]
                                    for part, forms in v.items()},
    }
    for name, change in changes.items():
        path = cache / name
        if path.exists():
            known = json.loads(path.read_text())
            (target / name).write_text(json.dumps({k: change(v) for k, v in known.items()}))
    return target


def _rows(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [{k: v for k, v in json.loads(line).items() if not k.endswith(TIMING)}
            for line in path.read_text().splitlines() if line.strip()]


def _weights(run: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    last = sorted((run / "checkpoints").glob("step_*"))[-1]
    return {"step": last.name, **load_file(str(last / "model.safetensors"))}


def compare(reference: Path, run: Path) -> list[str]:
    """Where `run` differs from `reference`: rows of metrics.jsonl and samples.jsonl (timing
    aside), the summary's held-out outcomes, and the final weights; [] when identical."""
    problems = []
    for name in ("metrics.jsonl", "samples.jsonl"):
        a, b = _rows(reference / name), _rows(run / name)
        if len(a) != len(b):
            problems.append(f"{name}: {len(b)} rows, the reference has {len(a)}")
        for i, (x, y) in enumerate(zip(a, b)):
            if x != y:
                keys = sorted(k for k in set(x) | set(y) if x.get(k) != y.get(k))
                problems.append(f"{name} row {i + 1} (step {x.get('step')}): {', '.join(keys[:6])}")
                break
    for key in ("held_out_before", "held_out_after", "eval_after"):
        before = json.loads((reference / "summary.json").read_text()).get(key)
        after = json.loads((run / "summary.json").read_text()).get(key) if (run / "summary.json").exists() else None
        if before != after:
            problems.append(f"summary.json {key} differs")
    import torch

    wa, wb = _weights(reference), _weights(run)
    if wa["step"] != wb["step"]:
        problems.append(f"last checkpoint {wb['step']}, the reference's {wa['step']}")
    else:
        differing = [k for k in wa if k != "step" and not torch.equal(wa[k], wb[k])]
        if differing:
            problems.append(f"final weights differ in {len(differing)} tensors ({differing[0]})")
    return problems


def _cut_copy(reference: Path, target: Path, step: int) -> None:
    """`reference` as it was right after its step-`step` checkpoint: the checkpoint hard-linked
    (the resume writes new files and deletes old ones, never edits one in place), the logs
    copied (the resume cuts them back to the checkpoint)."""
    target.mkdir(parents=True)
    for name in ("metrics.jsonl", "samples.jsonl", "summary.json"):
        if (reference / name).exists():
            shutil.copy2(reference / name, target / name)
    shutil.copy2(reference.with_name("reference2") / "config.toml", target / "config.toml")
    summary = json.loads((target / "summary.json").read_text())
    (target / "summary.json").write_text(json.dumps({k: v for k, v in summary.items()
                                                     if k in ("eval_before", "held_out_before")}))
    shutil.copytree(reference / "checkpoints" / f"step_{step:06d}", target / "checkpoints" / f"step_{step:06d}",
                    copy_function=os.link)


def trial(n: int, reference: Path, work: Path, base: list[str], rng: random.Random, points: list[str],
          log: Path, threads: str | None) -> dict[str, Any]:
    run = work / f"t{n:03d}"
    shutil.rmtree(run, ignore_errors=True)
    point = points[n % len(points)]
    from_step = rng.choice([0, 0, 1, 2]) if point not in ("epoch",) else rng.choice([0, 1, 2])
    if from_step:
        _cut_copy(reference, run, from_step)
    # the points a run reaches scale with the steps it has left (4 in all)
    k = rng.randint(1, max(1, MAX_HITS.get(point, 1) * (4 - from_step) // 4)) if point != "time" else 0
    # a random moment of the run's own length: loading (~10 s) and what is left of its 4 steps
    delay = rng.uniform(3.0, 10.0 + (4 - from_step) * 12.0) if point == "time" else None
    args = (["train", "--resume", str(run)] if from_step else
            ["train", *base, f"output_dir={work}", f"name={run.name}"])
    code, seconds = _run(args, f"{point}:{k}" if point != "time" else "none:0", delay, log, threads)
    killed = code == -signal.SIGKILL
    resumes = 0
    while True:  # until the run completes (a resume that dies is resumed again, at most twice)
        summary = run / "summary.json"
        if summary.exists() and "eval_after" in json.loads(summary.read_text() or "{}"):
            break
        if resumes == 3:
            break
        resumes += 1
        code, more = _run(["train", "--resume", str(run)], log=log, threads=threads)
        seconds += more
        if code not in (0, -signal.SIGKILL):
            break
    problems = compare(reference, run)
    result = {"trial": n, "point": point, "k": k, "delay_s": delay, "from_step": from_step, "killed": killed,
              "resumes": resumes, "exit": code, "seconds": round(seconds, 1), "identical": not problems,
              "problems": problems}
    if not problems:
        shutil.rmtree(run, ignore_errors=True)  # keep only the runs that differ, for a look
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trials", type=int, default=100)
    parser.add_argument("--points", default=",".join((*POINTS, "time")),
                        help="comma-separated kill points to cycle through (and 'time': a random delay)")
    parser.add_argument("--out", default="/tmp/kill_resume")
    parser.add_argument("--config", default=str(ROOT / "configs" / "demo.toml"))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", default=None, help="OMP_NUM_THREADS for every child (default: unset)")
    parser.add_argument("overrides", nargs="*", help="config overrides after the short demo's")
    args = parser.parse_args()
    work = Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    log = work / "children.log"
    base = ["--config", args.config, *DEMO_SHORT, *args.overrides]
    reference = work / "reference"
    # the reference keeps every checkpoint, for the trials that start from one (their config is
    # the second reference's, which prunes as the trials do)
    for name, keep in (("reference", ["keep_checkpoints=100"]), ("reference2", [])):
        if not (work / name / "summary.json").exists() or "eval_after" not in (work / name / "summary.json").read_text():
            shutil.rmtree(work / name, ignore_errors=True)
            code, seconds = _run(["train", *base, *keep, f"output_dir={work}", f"name={name}"], log=log,
                                 threads=args.threads)
            print(f"{name}: exit {code} in {seconds:.0f} s", flush=True)
    same = compare(reference, work / "reference2")
    print("the reference equals itself" if not same else f"the reference differs from itself: {same}", flush=True)
    points = args.points.split(",")
    done = {json.loads(line)["trial"] for line in (work / "trials.jsonl").read_text().splitlines()} \
        if (work / "trials.jsonl").exists() else set()
    for n in range(args.trials):
        if n in done:
            continue
        result = trial(n, reference, work, base, random.Random(args.seed * 100_003 + n), points, log, args.threads)
        with (work / "trials.jsonl").open("a") as f:
            f.write(json.dumps(result) + "\n")
        print(json.dumps(result), flush=True)
    results = [json.loads(line) for line in (work / "trials.jsonl").read_text().splitlines()]
    print(f"\n{sum(r['identical'] for r in results)}/{len(results)} identical")
    for point in sorted({r["point"] for r in results}):
        mine = [r for r in results if r["point"] == point]
        print(f"  {point:20s} {sum(r['identical'] for r in mine)}/{len(mine)} identical, "
              f"{sum(r['killed'] for r in mine)} killed at the point")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        sys.exit(child(sys.argv[2:]))
    main()
