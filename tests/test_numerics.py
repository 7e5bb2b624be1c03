"""rlvr.rollout.numerics: the measured choices a process records, and another follows."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from rlvr import attention
from rlvr.models import resolve_dtype
from rlvr.rollout import numerics, plans
from rlvr.rollout.numerics import Numerics


@pytest.fixture(autouse=True)
def _own_again() -> Iterator[None]:
    yield
    numerics.follow(None)


def test_a_record_goes_through_json_and_is_followed() -> None:
    record = Numerics(cpu="a cpu", torch="0.0", threads=torch.get_num_threads() + 1, auto_dtype="float32",
                      attention={"bfloat16": float("inf"), "float16": 64.0},
                      products={"torch.bfloat16|layers 2x2 x1|head 3x2": {"layers": ["left"] * 7, "head": ["linear"] * 7}})
    again = Numerics.from_dict(json.loads(json.dumps(record.as_dict())))
    assert again == record
    said = numerics.follow(again)
    assert resolve_dtype("auto") == torch.float32 and resolve_dtype("auto", "cpu") == torch.float32
    assert attention._FOLLOWED == {torch.bfloat16: float("inf"), torch.float16: 64.0}
    assert plans._FOLLOWED["torch.bfloat16|layers 2x2 x1|head 3x2"] == plans.Plans(("left",) * 7, ("linear",) * 7)
    # another CPU and torch, and other threads, are said; the choices are followed all the same
    assert any("a cpu" in s and "torch 0.0" in s for s in said) and any("threads" in s for s in said)
    numerics.follow(None)  # a new run: this machine's own again
    assert attention._FOLLOWED == {} and plans._FOLLOWED == {}
    assert numerics.current().cpu != "a cpu"


def test_a_form_this_machine_lacks_is_measured_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    record = Numerics(cpu="x", torch=torch.__version__, threads=torch.get_num_threads(), auto_dtype="float32",
                      products={"torch.float32|layers 2x2 x1|head 3x2": {"layers": ["gone"] * 7, "head": ["left"] * 7}})
    said = numerics.follow(record)
    assert plans._FOLLOWED == {} and any("lacks the product forms gone" in s for s in said)


def test_a_run_records_what_its_engine_decodes_with(tiny_dir: object, tmp_path: object) -> None:
    from pathlib import Path

    from rlvr.config import load_config
    from rlvr.train.checkpoint import latest_checkpoint, load_state
    from rlvr.train.loop import train
    from tests.test_train import overrides

    train(load_config(None, overrides(Path(str(tiny_dir)), Path(str(tmp_path)), "rec", train__steps=1)), quiet=True)
    last = latest_checkpoint(Path(str(tmp_path)) / "rec")
    assert last is not None
    record = Numerics.from_dict(load_state(last)["numerics"])
    dtype = resolve_dtype("auto")
    assert record.auto_dtype == str(dtype).removeprefix("torch.")
    # the tiny model's decoder plans, decided before the first checkpoint (step 0's has them too)
    assert any(shape.startswith(str(dtype)) and "head 259x32" in shape for shape in record.products)
