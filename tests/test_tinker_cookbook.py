"""The unmodified tinker-cookbook (0.6.1) recipes against `rlvr tinker` on the bundled model, a
few steps each, with only their command-line options changed: math_rl's arithmetic RL, sl_basic's
supervised learning on a conversations file, and rl_loop on a local stand-in for gsm8k (this
machine has no hub). The full runs are in docs/LOG.md (session 29) and docs/interop.md."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")
pytest.importorskip("chz")

pytestmark = pytest.mark.dtype_independent  # every service here pins its dtype

ALIAS = "Qwen/Qwen3-4B-Instruct-2507"
"""A name the cookbook's model table knows (it picks the qwen3_instruct renderer, whose chat format
is SmolLM2's own ChatML); the service serves the bundled model under it."""


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rlvr.tinker.server import BackgroundTinker
    from rlvr.tinker.service import write_hub_aliases

    root = tmp_path_factory.mktemp("cookbook")
    with BackgroundTinker([f"{ALIAS}=builtin:smollm2-135m-instruct"], root / "ckpt", dtype="float32") as srv:
        assert write_hub_aliases(list(srv.service.bases.values()), root / "hf") == [ALIAS]
        env = {**os.environ, "TINKER_API_KEY": "tml-local", "TINKER_TELEMETRY": "0", "HF_HOME": str(root / "hf"),
               "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
        yield srv, env


def _recipe(module: str, args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    out = subprocess.run([sys.executable, "-m", module, *args], env=env, cwd=cwd, text=True, capture_output=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


def _metrics(log_path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]


def test_math_rl_arithmetic_trains(served: Any, tmp_path: Path) -> None:
    srv, env = served
    log = tmp_path / "math_rl"
    _recipe("tinker_cookbook.recipes.math_rl.train",
            [f"base_url={srv.base_url}", "env=arithmetic", f"model_name={ALIAS}", "group_size=4", "groups_per_batch=4",
             "max_tokens=8", "max_steps=2", "eval_every=0", "save_every=0", "loss_fn=importance_sampling",
             "learning_rate=3e-4", f"log_path={log}", "behavior_if_log_dir_exists=delete"], env, tmp_path)
    steps = [m for m in _metrics(log) if "env/all/reward/total" in m]
    assert len(steps) == 2 and all(m["env/all/total_episodes"] == 16 for m in steps)
    # its final checkpoints are the service's: a training state and a plain model folder
    final = [json.loads(line) for line in (log / "checkpoints.jsonl").read_text().splitlines()][-1]
    assert final["state_path"].startswith("tinker://") and final["sampler_path"].endswith("/sampler_weights/final")
    assert (srv.service._path(final["sampler_path"])[2] / "config.json").is_file()


def test_sl_basic_on_a_conversations_file_lowers_its_loss(served: Any, tmp_path: Path) -> None:
    srv, env = served
    data = tmp_path / "conversations.jsonl"
    with data.open("w") as f:
        for i in range(64):
            a, b = i % 7 + 1, i % 5 + 2
            f.write(json.dumps({"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                                             {"role": "assistant", "content": f"{a} + {b} = {a + b}."}]}) + "\n")
    log = tmp_path / "sl"
    _recipe("tinker_cookbook.recipes.sl_basic",
            [f"base_url={srv.base_url}", f"model_name={ALIAS}", f"log_path={log}",
             "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
             f"dataset_builder.file_path={data}", "dataset_builder.test_size=8",
             f"dataset_builder.common_config.model_name_for_tokenizer={ALIAS}",
             "dataset_builder.common_config.renderer_name=qwen3_instruct",
             "dataset_builder.common_config.max_length=256", "dataset_builder.common_config.batch_size=8",
             "dataset_builder.common_config.train_on_what=all_assistant_messages",
             "max_steps=4", "eval_every=3", "save_every=0"], env, tmp_path)
    nll = [m["train_mean_nll"] for m in _metrics(log) if "train_mean_nll" in m]
    assert len(nll) == 4 and nll[-1] < 0.8 * nll[0], nll
    assert any("test/nll" in k for m in _metrics(log) for k in m)  # its evaluator sampled compute_logprobs


def _gsm8k_stand_in(cwd: Path) -> None:
    """openai/gsm8k's layout and columns, easy questions: `datasets.load_dataset("openai/gsm8k",
    "main")` reads a folder of that name in the working directory before it tries the hub."""
    import pandas as pd

    folder = cwd / "openai" / "gsm8k" / "main"
    folder.mkdir(parents=True)
    rows = [{"question": f"Tom has {a} apples and gets {b} more. How many apples does he have?",
             "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a in range(1, 9) for b in range(1, 9)]
    pd.DataFrame(rows).to_parquet(folder / "train-00000-of-00001.parquet")
    pd.DataFrame(rows[:8]).to_parquet(folder / "test-00000-of-00001.parquet")
    (cwd / "openai" / "gsm8k" / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train-*\n"
        "  - split: test\n    path: main/test-*\n---\n")


def test_rl_loop_runs_its_steps(served: Any, tmp_path: Path) -> None:
    srv, env = served
    _gsm8k_stand_in(tmp_path)
    log = tmp_path / "rl_loop"
    _recipe("tinker_cookbook.recipes.rl_loop",
            [f"base_url={srv.base_url}", f"model_name={ALIAS}", f"log_path={log}", "batch_size=4", "group_size=4",
             "max_tokens=48", "max_steps=2", "save_every=0", "loss_fn=importance_sampling", "learning_rate=1e-4"],
            env, tmp_path)
    steps = _metrics(log)
    assert len(steps) == 2 and all("reward/total" in m or any(k.startswith("reward") for k in m) for m in steps)
    assert json.loads((log / "checkpoints.jsonl").read_text().splitlines()[-1])["state_path"].startswith("tinker://")
