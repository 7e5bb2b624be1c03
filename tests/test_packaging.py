"""rlvr as a user who installed it (not cloned it) has it: the wheel ships the example configs,
their data and the example agent, and `rlvr train --config NAME` runs a packaged example from a
folder that holds nothing of rlvr's."""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from rlvr.config.files import PACKAGED, packaged_configs

ROOT = Path(__file__).resolve().parents[1]


def test_every_packaged_config_loads_by_name() -> None:
    from rlvr.config import load_config

    names = packaged_configs()
    assert {"demo", "math_jsonl", "openai_agent", "sft"} <= set(names)
    for name in names:
        command = "sft" if name.endswith("sft") or name == "sft" else "train"
        load_config(name, command=command)


def test_a_relative_data_path_is_read_beside_the_config_unless_it_is_here(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from rlvr.config import ConfigError, load_config

    monkeypatch.chdir(tmp_path)
    cfg = load_config("math_jsonl")
    assert cfg.task.path == str((PACKAGED / "data" / "word_problems.jsonl").resolve())
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "word_problems.jsonl").write_text("{}\n")  # the user's own file wins
    assert load_config("math_jsonl").task.path == "data/word_problems.jsonl"
    with pytest.raises(ConfigError, match="packaged examples are .*demo"):
        load_config("demoo")


@pytest.mark.dtype_independent
def test_the_wheel_ships_the_examples_and_runs_one_from_a_fresh_venv(tmp_path: Path, tiny_dir: Path) -> None:
    source = tmp_path / "source"  # a copy: a build leaves build/ and *.egg-info beside the sources
    shutil.copytree(ROOT, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv*", "runs", "build", "*.egg-info", "__pycache__", ".*cache", "docs"))
    setuptools = tuple(int(x) for x in importlib.metadata.version("setuptools").split(".")[:2])
    isolation = ["--no-build-isolation"] if setuptools >= (68, 0) else []  # else pip fetches the build's setuptools
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path / "dist"),
                    *isolation, str(source)], check=True)
    wheel = next((tmp_path / "dist").glob("rlvr-*.whl"))
    names = set(zipfile.ZipFile(wheel).namelist())
    for shipped in ("rlvr/configs/demo.toml", "rlvr/configs/math_jsonl.toml", "rlvr/configs/data/word_problems.jsonl",
                    "rlvr/configs/data/corpus.txt", "rlvr/configs/agents_sdk_calculator.py", "rlvr/assets/report.html",
                    "rlvr/py.typed"):
        assert shipped in names, shipped

    # a venv of its own for rlvr, reading the other packages from this one (no downloads): the
    # path line of a .pth file adds this venv's site-packages without its .pth files (this
    # checkout's editable install among them)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = Path(subprocess.run([python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                               capture_output=True, text=True, check=True).stdout.strip())
    (site / "others.pth").write_text(sysconfig.get_path("purelib") + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
                   check=True)
    user = tmp_path / "elsewhere"
    user.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    where = subprocess.run([python, "-c", "import rlvr; print(rlvr.__file__)"], cwd=user, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(venv)), where

    overrides = [f"model={tiny_dir}", f"output_dir={tmp_path / 'runs'}", "name=packaged", "train.steps=1",
                 "train.prompts_per_step=2", "algo.group_size=2", "task.size=8", "task.eval_size=0",
                 "sampling.max_new_tokens=8", "train.eval_every=0"]
    run = subprocess.run([venv / "bin" / "rlvr", "train", "--config", "math_jsonl", *overrides], cwd=user, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "runs" / "packaged" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 1
    assert "word_problems.jsonl" in (tmp_path / "runs" / "packaged" / "config.toml").read_text()
