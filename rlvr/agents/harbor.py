"""Harbor tasks (`env.name = "harbor"`): a task directory as Harbor lays it out (`harbor` on PyPI;
SkyRL, TRL, tinker-cookbook and ROLL read the same directories) is an episode in rlvr's own
sandbox, where the task needs no container, and its verifier's result is the reward.

    task/
      instruction.md        the prompt
      task.toml             [verifier] timeout_sec, env; [agent] timeout_sec; [environment] workdir,
                            env, docker_image, ...
      environment/          Dockerfile (FROM, WORKDIR, COPY, ENV) and the files it copies
      tests/test.sh         run after the agent; writes /logs/verifier/reward.txt (a number) or
                            reward.json ({"reward": ..., other numbers})
      solution/solve.sh     the reference solution (Harbor's oracle agent; not shown to the policy)

    [env]
    name = "harbor"
    kwargs = {tasks = "path/to/tasks"}      # one task directory, or a directory of them

The episode: the task's instruction, then ``instruction`` (how to act; the default says it), and
the policy acts in shell commands, each in a ```bash block (or a JSON
``<tool_call>`` to ``bash`` with ``{"command": ...}``), run in rlvr's sandbox (rlvr.sandbox: no
network, rlimits) with the episode's own copy of the task's workdir bound at its path (/app), so
its files persist from one command to the next. It sees each command's output. A turn without a
command ends the episode ("done"); then, as Harbor's verifier does: stale reward files are
removed, tests/ is bound at /tests (read-only) and /logs is fresh, ``bash /tests/test.sh`` runs in
the workdir (within ``[verifier] timeout_sec``), and ``reward.json``'s "reward" (else
``reward.txt``'s number) is the episode's reward, its other numbers logged as metrics. The policy
never sees /tests or /logs.

Where Harbor runs a container built from environment/Dockerfile, rlvr runs the host's own runtime
(its /usr): a task whose Dockerfile only does FROM, WORKDIR, COPY, ENV (and ARG, LABEL) and that
sets no docker_image and no docker-compose file runs here; any other task is refused when the run
starts, naming what needs a container. The base image itself is not reproduced (the host's Python
and tools stand in for it). Harbor runs test.sh whatever its exit status; so does rlvr.

No verdict: a test.sh that writes no reward file (or an unreadable one), or that runs past its
timeout, ends the episode "infra": excluded from the update, never scored 0. An episode that runs
out of turns before it says it is done gets no verification: reward 0, ending "max_turns".
"""

from __future__ import annotations

import json
import math
import os
import re
import shlex
import shutil
import tempfile
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlvr import sandbox
from rlvr.agents.env import StepResult, timeout_seconds
from rlvr.agents.tools import parse_tool_calls
from rlvr.data import Example
from rlvr.errors import InfrastructureError
from rlvr.options import check_names

INSTRUCTION = ("Work in the shell: write commands in a ```bash block and you will see their output. When the task "
               "is done, reply without a command.")
RUNNABLE = frozenset({"FROM", "WORKDIR", "COPY", "ENV", "ARG", "LABEL"})
"""The Dockerfile instructions a task may use to run without a container."""


@dataclass(frozen=True)
class HarborTask:
    path: Path
    name: str
    instruction: str
    workdir: str = "/app"
    env: dict[str, str] = field(default_factory=dict)
    copies: tuple[tuple[str, str], ...] = ()
    """(source under environment/, destination in the container) of each COPY, in order."""
    verifier_timeout: float = 600.0
    verifier_env: dict[str, str] = field(default_factory=dict)
    needs_container: tuple[str, ...] = ()
    """Why it cannot run without a container (empty: it can)."""


def load_task(path: str | Path) -> HarborTask:
    """A Harbor task directory, read as Harbor's task model reads it (see the module docstring)."""
    path = Path(path)
    if not (path / "instruction.md").is_file():
        raise ValueError(f"{path}: a Harbor task needs instruction.md")
    if not (path / "tests" / "test.sh").is_file():
        raise ValueError(f"{path}: a Harbor task needs tests/test.sh (its verifier)")
    config: dict[str, Any] = {}
    if (path / "task.toml").is_file():
        try:
            config = tomllib.loads((path / "task.toml").read_text())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"{path / 'task.toml'}: invalid TOML: {e}") from None
    environment = config.get("environment", {})
    verifier = config.get("verifier", {})
    needs: list[str] = []
    if environment.get("docker_image"):
        needs.append(f"[environment] docker_image = {environment['docker_image']!r}")
    if any((path / "environment" / name).exists() for name in ("docker-compose.yaml", "docker-compose.yml")):
        needs.append("environment/docker-compose.yaml")
    workdir: str = "/app"
    env: dict[str, str] = {}
    copies: list[tuple[str, str]] = []
    dockerfile = path / "environment" / "Dockerfile"
    if dockerfile.is_file():
        workdir, env, copies, more = _dockerfile(dockerfile)
        needs += more
    workdir = environment.get("workdir") or workdir
    env |= {str(k): str(v) for k, v in environment.get("env", {}).items()}
    name = config.get("task", {}).get("name") or path.name
    instruction = re.sub(r"\A(\s*<!--.*?-->\s*)+", "", (path / "instruction.md").read_text(), flags=re.S).strip()
    return HarborTask(path, str(name), instruction, workdir, env, tuple(copies),
                      float(verifier.get("timeout_sec", 600.0)),
                      {str(k): str(v) for k, v in verifier.get("env", {}).items()}, tuple(needs))


def _dockerfile(path: Path) -> tuple[str, dict[str, str], list[tuple[str, str]], list[str]]:
    """(workdir, env, copies, what needs a container) of a Dockerfile."""
    workdir = "/"
    env: dict[str, str] = {}
    copies: list[tuple[str, str]] = []
    needs: list[str] = []
    text = re.sub(r"\\\n", " ", path.read_text())  # continuation lines
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        word, _, rest = line.partition(" ")
        word = word.upper()
        if word not in RUNNABLE:
            needs.append(f"environment/Dockerfile: {line[:80]}")
        elif word == "WORKDIR":
            workdir = os.path.normpath(os.path.join(workdir, rest.strip()))
        elif word == "ENV":
            pairs = re.findall(r'(\w+)=("[^"]*"|\S+)', rest)
            if not pairs and len(rest.split(None, 1)) == 2:  # ENV KEY value
                pairs = [tuple(rest.split(None, 1))]  # type: ignore[list-item]
            env |= {k: v.strip('"') for k, v in pairs}
        elif word == "COPY":
            parts = [p for p in shlex.split(rest) if not p.startswith("--")]
            if any(p.startswith("--from") for p in shlex.split(rest)) or len(parts) < 2:
                needs.append(f"environment/Dockerfile: {line[:80]}")
                continue
            *sources, dest = parts
            dest = dest if os.path.isabs(dest) else os.path.join(workdir, dest)
            copies += [(src, dest) for src in sources]
    return workdir, env, copies, needs


def load_tasks(where: str | Path) -> list[HarborTask]:
    """The task at `where`, or every task directory in it (sorted by name)."""
    where = Path(where)
    if not where.is_dir():
        raise ValueError(f"env.kwargs.tasks = {str(where)!r} is not a directory")
    if (where / "instruction.md").exists():
        return [load_task(where)]
    tasks = [load_task(p) for p in sorted(where.iterdir()) if (p / "instruction.md").exists()]
    if not tasks:
        raise ValueError(f"{where}: no Harbor task directories (folders with instruction.md) in it")
    return tasks


def examples(env_kwargs: dict[str, Any], size: int) -> list[Example]:
    """The tasks as examples (task.source = "env"): the instruction is the prompt. A task with a
    reference solution carries its commands as the field `solution` (solution/solve.sh less its
    `#!` line; never shown to the policy), for a warm start on them:
    expert.mode = "warm_start", expert.template = "```bash\n{solution}\n```{next_turn}Done."."""
    tasks = runnable(_options(env_kwargs)[0])
    return [Example(t.instruction, None, {"task_dir": str(t.path), **_solution(t.path)}, f"harbor/{t.name}")
            for t in tasks]


def _solution(path: Path) -> dict[str, str]:
    solve = path / "solution" / "solve.sh"
    if not solve.is_file():
        return {}
    lines = solve.read_text().splitlines()
    return {"solution": "\n".join(lines[1:] if lines and lines[0].startswith("#!") else lines).strip()}


def runnable(where: str) -> list[HarborTask]:
    """The tasks at `where`, refusing any that needs a container."""
    tasks = load_tasks(where)
    needing = [t for t in tasks if t.needs_container]
    if needing:
        t = needing[0]
        raise ValueError(f"{len(needing)} of {len(tasks)} Harbor tasks need a container, which rlvr does not run "
                         f"(it runs tasks in its sandbox on the host's runtime); the first, {t.name} ({t.path}), "
                         f"for: {'; '.join(t.needs_container)}")
    return tasks


def _options(kwargs: dict[str, Any]) -> tuple[str, float, int]:
    check_names("env.kwargs for harbor", kwargs, ["tasks", "timeout", "max_output", "instruction"])
    tasks, timeout, output = kwargs.get("tasks"), kwargs.get("timeout", 30.0), kwargs.get("max_output", 2000)
    if not isinstance(tasks, str):
        raise ValueError('env.name = "harbor" needs env.kwargs.tasks = "path": a Harbor task directory or a '
                         "directory of them")
    return tasks, timeout_seconds(timeout), int(output)


def check(env: Any) -> None:
    """Before the model loads: the tasks load and need no container, and the sandbox isolates."""
    runnable(_options(dict(env.kwargs))[0])
    sandbox.check_isolation("bwrap")


class HarborEpisode:
    """One episode of a task in its own copy of the workdir (see the module docstring).
    ``timeout``: seconds one command may run; ``max_output``: characters of its output shown."""

    runs_code = True
    """It runs the policy's commands in rlvr's sandbox: `rlvr train` checks the sandbox first."""

    def __init__(self, example: Example, rewards: list[Any], *, tasks: str, timeout: float = 30.0,
                 max_output: int = 2000, instruction: str = INSTRUCTION) -> None:
        self.task = load_task(example.fields["task_dir"])
        self.timeout, self.max_output, self.instruction = timeout, max_output, instruction
        self.root = tempfile.mkdtemp(prefix="rlvr-harbor-")
        os.chmod(self.root, 0o755)  # the sandbox's own user reaches the folders bound from it
        self.work = os.path.join(self.root, "work")
        os.makedirs(self.work)
        for src, dest in self.task.copies:  # the Dockerfile's COPYs, into the workdir's copy
            self._copy(src, dest)
        _open_to_all(self.work)

    def _copy(self, src: str, dest: str) -> None:
        source = (self.task.path / "environment" / src).resolve()
        if not source.is_relative_to((self.task.path / "environment").resolve()) or not source.exists():
            raise ValueError(f"{self.task.path}: COPY {src} names nothing in environment/")
        rel = os.path.relpath(dest, self.task.workdir)
        if rel.startswith(".."):
            raise ValueError(f"{self.task.path}: COPY to {dest}, outside the workdir {self.task.workdir}, needs a "
                             "container")
        target = os.path.normpath(os.path.join(self.work, rel))
        if dest.endswith("/") or (source.is_file() and os.path.isdir(target)):
            target = os.path.join(target, source.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)

    def initial_observation(self) -> str:
        return f"{self.task.instruction}\n\n{self.instruction}" if self.instruction else self.task.instruction

    def step(self, action: str) -> StepResult:
        commands = _commands(action)
        if not commands:
            return self._verify()
        outputs = [self._run(command) for command in commands]
        return StepResult("\n\n".join(outputs), metrics={"commands": float(len(commands))})

    def _run(self, command: str) -> str:
        limits = sandbox.Limits(timeout_s=self.timeout, cpu_s=max(1, int(self.timeout)), memory_mb=1024,
                                max_processes=64, file_size_mb=64)
        result = sandbox.default_pool().sandbox.run_shell(
            command, mounts=(sandbox.Mount(self.work, self.task.workdir, writable=True),), cwd=self.task.workdir,
            env=self.task.env, shell="/bin/bash", limits=limits)
        out = (result.stdout + result.stderr).strip()
        if result.timed_out:
            out += f"\n(the command ran past {self.timeout:g} s and was stopped)"
        elif result.exit_code:
            out += f"\n(exit status {result.exit_code})"
        out = out or "(no output)"
        return out if len(out) <= self.max_output else out[: self.max_output] + " …(cut)"

    def _verify(self) -> StepResult:
        logs = os.path.join(self.root, "logs")
        shutil.rmtree(logs, ignore_errors=True)  # a fresh /logs: nothing the policy could have left there
        os.makedirs(os.path.join(logs, "verifier"))
        _open_to_all(logs)
        tests = os.path.join(self.root, "tests")
        shutil.copytree(self.task.path / "tests", tests, dirs_exist_ok=True)
        limits = sandbox.Limits(timeout_s=self.task.verifier_timeout, cpu_s=max(1, int(self.task.verifier_timeout)),
                                memory_mb=2048, max_processes=128, file_size_mb=64)
        result = sandbox.default_pool().sandbox.run_shell(
            "bash /tests/test.sh > /logs/verifier/test-stdout.txt 2>&1",
            mounts=(sandbox.Mount(self.work, self.task.workdir, writable=True), sandbox.Mount(tests, "/tests"),
                    sandbox.Mount(logs, "/logs", writable=True)),
            cwd=self.task.workdir, env={**self.task.env, **self.task.verifier_env}, limits=limits)
        if result.timed_out:
            raise InfrastructureError(f"{self.task.name}: tests/test.sh ran past its {self.task.verifier_timeout:g} s")
        rewards = _reward_files(Path(logs) / "verifier", self.task.name)
        reward = rewards.pop("reward")
        return StepResult(reward=reward, done=True, metrics={f"verifier/{k}": v for k, v in rewards.items()})

    def close(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


def _reward_files(folder: Path, name: str) -> dict[str, float]:
    """reward.json's numbers (its "reward" the reward), else reward.txt's one number, as Harbor reads
    them; none, or one that cannot be read, is no verdict (InfrastructureError)."""
    json_file, text_file = folder / "reward.json", folder / "reward.txt"
    try:
        if json_file.exists():
            data = json.loads(json_file.read_text())
            if not isinstance(data, dict) or "reward" not in data:
                raise ValueError(f"reward.json has no \"reward\" (it has {sorted(data) if isinstance(data, dict) else data})")
            values = {str(k): float(v) for k, v in data.items() if isinstance(v, int | float) and not isinstance(v, bool)}
        elif text_file.exists():
            values = {"reward": float(text_file.read_text().strip())}
        else:
            log = folder / "test-stdout.txt"
            said = log.read_text()[-500:] if log.exists() else ""
            raise ValueError(f"tests/test.sh wrote no reward.txt or reward.json; its output ended: {said!r}")
        if not all(math.isfinite(v) for v in values.values()):
            raise ValueError(f"a reward that is not finite: {values}")
    except (ValueError, OSError) as e:
        raise InfrastructureError(f"{name}: no verdict from the verifier: {e}") from e
    return values


def _commands(action: str) -> list[str]:
    """The commands of a turn: ```bash / ```sh / ```shell blocks, and JSON calls to `bash`."""
    blocks = re.findall(r"```(?:bash|sh|shell|console)?[ \t]*\n(.*?)(?:```|$)", action, re.S)
    calls = [c.arguments.get("command") for c in parse_tool_calls(action) if c.name == "bash" and not c.error]
    return [b.strip() for b in blocks if b.strip()] + [c for c in calls if isinstance(c, str) and c.strip()]


def _open_to_all(folder: str) -> None:
    """Let the sandbox's own user (uid 60000 + slot when rlvr runs as root) write the folder."""
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777)
        for f in files:
            os.chmod(os.path.join(root, f), os.stat(os.path.join(root, f)).st_mode | 0o666)
