"""`rlvr tinker` against the real `tinker` client (PyPI 0.38): every call the cookbook makes, each
loss's gradient against the formula Tinker's docs give (written out here, on a model scored by
plain Hugging Face code), a bit-exact save/load round trip, concurrent and killed clients, and
malformed requests answered in the API's own shapes."""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker")
pytest.importorskip("fastapi")
pytest.importorskip("peft")

from tinker import types  # noqa: E402

from rlvr.tinker.losses import tinker_loss  # noqa: E402
from rlvr.tinker.wire import Datum  # noqa: E402

pytestmark = pytest.mark.dtype_independent  # every service here pins its dtype

BUILTIN = "builtin:smollm2-135m-instruct"


_SERVERS: list[Any] = []
"""The module's services: each test's sessions end when it does, so that the training models it
made (a model copy each: a float64 one is 1 GB) do not pile up over the module."""


@pytest.fixture(autouse=True)
def _end_sessions() -> Iterator[None]:
    yield
    for srv in _SERVERS:
        for session_id in list(srv.service.sessions):
            srv.service.end_session(session_id, "its test is over")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from rlvr.tinker.server import BackgroundTinker

    os.environ.setdefault("TINKER_TELEMETRY", "0")
    with BackgroundTinker([BUILTIN], tmp_path_factory.mktemp("tinker"), dtype="float32",
                          session_timeout=600) as srv:
        _SERVERS.append(srv)
        yield srv
        _SERVERS.remove(srv)


@pytest.fixture(scope="module")
def server64(tmp_path_factory: pytest.TempPathFactory, tiny_dir: Path) -> Any:
    """The service in float64, on the tiny test model: its gradients can be held to an exact
    reference (and a float64 copy per training client stays small)."""
    from rlvr.tinker.server import BackgroundTinker

    with BackgroundTinker([str(tiny_dir)], tmp_path_factory.mktemp("tinker64"), dtype=torch.float64) as srv:
        _SERVERS.append(srv)
        yield srv
        _SERVERS.remove(srv)


@pytest.fixture
def client(server: Any) -> Any:
    """A client of its own for each test (its session ends with the test)."""
    return tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")


def _base_name(server: Any) -> str:
    return next(iter(server.service.bases))


# --- the losses, against Tinker's documented snippets ----------------------------------------

LP = [-1.0, -0.5, -2.0]
SAMPLER = [-1.2, -0.4, -2.0]
ADV = [1.0, -1.0, 0.5]
WEIGHTS = [0.0, 1.0, 1.0]
RATIO_MASK = [0.0, 1.0, 1.0]


def _docs(loss_fn: str, lp: torch.Tensor, cfg: dict[str, float]) -> torch.Tensor:
    """The loss as Tinker's docs write it (https://tinker-docs.thinkingmachines.ai/tinker/losses/)."""
    s, a, w = torch.tensor(SAMPLER, dtype=torch.float64), torch.tensor(ADV, dtype=torch.float64), \
        torch.tensor(WEIGHTS, dtype=torch.float64)
    if loss_fn == "cross_entropy":
        return (-lp * w).sum()
    ratio = torch.exp(lp - s)
    if loss_fn == "importance_sampling":
        return -(ratio * a).sum()
    if loss_fn == "ppo":
        clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -torch.min(ratio * a, clipped * a).sum()
    if loss_fn == "cispo":
        clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
        return -(clipped.detach() * lp * a).sum()
    if loss_fn == "dro":
        return -(lp * a - 0.5 * cfg["beta"] * (lp - s) ** 2).sum()
    assert loss_fn == "gspo"
    in_ratio = torch.tensor(RATIO_MASK) != 0
    log_ratio = (lp.detach() - s)[in_ratio].mean()
    ratio = torch.exp(log_ratio + lp - lp.detach())
    clipped = torch.clamp(ratio, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -torch.min(ratio * a, clipped * a).sum()


CASES = [
    ("cross_entropy", {}, {}, 2.5),
    ("importance_sampling", {}, {}, -0.8165653401242102),
    ("ppo", {}, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, -0.7951625819640403),
    ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}, {"clip_low_threshold": 0.9,
                                                                        "clip_high_threshold": 1.1}, None),
    ("cispo", {}, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}, 1.76898404914219),
    ("cispo", {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, {"clip_low_threshold": 0.8,
                                                                          "clip_high_threshold": 1.2}, 1.74758129098202),
    ("dro", {"beta": 0.05}, {"beta": 0.05}, 1.50125),
    ("gspo", {}, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}, -0.475614712250357),
]


@pytest.mark.parametrize("loss_fn,config,docs_cfg,hand", CASES)
def test_each_loss_matches_the_docs_formula_value_and_gradient(loss_fn: str, config: dict[str, float],
                                                               docs_cfg: dict[str, float], hand: float | None) -> None:
    """float64 throughout, so the two agree to summation order; ``hand`` is the value worked out
    from the docs' snippet with Python's math (not torch)."""
    inputs = {"target_tokens": np.array([5, 6, 7]), "logprobs": np.array(SAMPLER), "advantages": np.array(ADV),
              "weights": np.array(WEIGHTS), "sequence_ratio_mask": np.array(RATIO_MASK)}
    if loss_fn != "gspo":
        inputs.pop("sequence_ratio_mask")
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    loss, metrics, outputs = tinker_loss(loss_fn, [lp], [Datum([1, 2, 3], inputs)], dict(config))
    (grad,) = torch.autograd.grad(loss, lp)
    ref_lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    ref = _docs(loss_fn, ref_lp, docs_cfg)
    (ref_grad,) = torch.autograd.grad(ref, ref_lp)
    # float64 on both sides: they differ by summation order only
    assert metrics["loss:sum"] == pytest.approx(float(ref.detach()), abs=1e-12)
    if hand is not None:
        assert metrics["loss:sum"] == pytest.approx(hand, abs=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-12, atol=1e-12)
    assert outputs[0]["logprobs"].tolist() == pytest.approx(LP)


def test_ppo_clips_the_token_whose_ratio_leaves_the_range() -> None:
    """The hand-worked gradient: token 0's ratio 1.221 > 1.2 with A > 0, so it gets none."""
    lp = torch.tensor(LP, dtype=torch.float64, requires_grad=True)
    inputs = {"target_tokens": np.array([5, 6, 7]), "logprobs": np.array(SAMPLER), "advantages": np.array(ADV)}
    loss, _, _ = tinker_loss("ppo", [lp], [Datum([1, 2, 3], inputs)], {})
    (grad,) = torch.autograd.grad(loss, lp)
    assert grad.tolist() == pytest.approx([0.0, math.exp(-0.1), -0.5])


def test_stable_reinforce_and_unknown_config_are_refused_with_reasons() -> None:
    from rlvr.tinker.losses import LossError, check_inputs

    d = Datum([1, 2], {"target_tokens": np.array([2, 3]), "logprobs": np.zeros(2), "advantages": np.ones(2)})
    with pytest.raises(LossError, match="not public"):
        check_inputs("stable_reinforce", [d], None, 100, 10)
    with pytest.raises(LossError, match="unknown key"):
        tinker_loss("ppo", [torch.zeros(2, requires_grad=True)], [d], {"clip_ratio": 0.2})
    with pytest.raises(LossError, match="has no 'logprobs'"):
        check_inputs("ppo", [Datum([1, 2], {"target_tokens": np.array([2, 3])})], None, 100, 10)
    with pytest.raises(LossError, match="outside the vocabulary"):
        check_inputs("cross_entropy", [Datum([1, 200], {"target_tokens": np.array([2, 3])})], None, 100, 10)


# --- the client end to end --------------------------------------------------------------

def _hf_logprobs(model: Any, tokens: list[int], targets: list[int]) -> torch.Tensor:
    """Targets' log-probs by plain Hugging Face code: the independent side of the gradient check."""
    logits = model(input_ids=torch.tensor([tokens])).logits[0]
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(targets)[:, None])[:, 0]


@pytest.mark.parametrize("loss_fn", ["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo"])
def test_forward_backward_gradient_equals_the_docs_loss_on_the_model(server64: Any, loss_fn: str) -> None:
    """Through the client and the wire: the LoRA gradient the service accumulates equals the
    gradient of the docs' loss on log-probs scored by plain HF code. Both in float64, so they
    differ only by summation order; the wire's float32 inputs are the same numbers on both sides."""
    server = server64
    client = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
    tc = client.create_lora_training_client(base_model=_base_name(server), rank=4, seed=3).result()
    tok = tc.get_tokenizer()
    ids = tok.encode("Two plus two is four, and three plus three is six.")
    n = len(ids) - 1
    rng = np.random.default_rng(0)
    inputs: dict[str, Any] = {"target_tokens": ids[1:], "weights": [0.0] * 3 + [1.0] * (n - 3)}
    if loss_fn != "cross_entropy":
        inputs = {"target_tokens": ids[1:], "logprobs": (rng.normal(size=n) * 0.3 - 2.0).astype(np.float32),
                  "advantages": rng.normal(size=n).astype(np.float32)}
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = np.array([0.0] * 3 + [1.0] * (n - 3), dtype=np.float32)
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]), loss_fn_inputs=inputs)
    config = {"beta": 0.1} if loss_fn == "dro" else None
    result = tc.forward_backward([datum], loss_fn, config).result()

    trainer = server.service.trainers[tc.model_id]
    got = {n_: p.grad.detach().clone() for n_, p in trainer.model.named_parameters() if p.requires_grad}
    ref_model = trainer.model  # same weights; the reference recomputes from scratch with HF's own forward
    ref_model.zero_grad(set_to_none=True)
    lp = _hf_logprobs(ref_model, ids[:-1], ids[1:])
    f32 = np.float32  # what the wire carried
    s = torch.tensor(np.asarray(inputs.get("logprobs", np.zeros(n)), dtype=f32), dtype=torch.float64)
    a = torch.tensor(np.asarray(inputs.get("advantages", np.zeros(n)), dtype=f32), dtype=torch.float64)
    w = torch.tensor(np.asarray(inputs.get("weights", np.zeros(n)), dtype=f32), dtype=torch.float64)
    ratio = torch.exp(lp - s)
    if loss_fn == "cross_entropy":
        loss = (-lp * w).sum()
    elif loss_fn == "importance_sampling":
        loss = -(ratio * a).sum()
    elif loss_fn == "ppo":
        loss = -torch.min(ratio * a, torch.clamp(ratio, 0.8, 1.2) * a).sum()
    elif loss_fn == "cispo":
        loss = -(torch.clamp(ratio, 0.0, 4.0).detach() * lp * a).sum()
    elif loss_fn == "dro":
        loss = -(lp * a - 0.5 * 0.1 * (lp - s) ** 2).sum()
    else:
        m = torch.tensor(inputs["sequence_ratio_mask"]) != 0
        r = torch.exp((lp.detach() - s)[m].mean() + lp - lp.detach())
        loss = -torch.min(r * a, torch.clamp(r, 0.8, 1.2) * a).sum()
    loss.backward()
    # the metric and the outputs travel as float32: their own rounding (6e-8 relative)
    assert result.metrics["loss:sum"] == pytest.approx(float(loss.detach()), rel=1e-6, abs=1e-6)
    assert len(result.loss_fn_outputs) == 1
    np.testing.assert_allclose(result.loss_fn_outputs[0]["logprobs"].to_numpy(), lp.detach().numpy(), rtol=1e-6)
    for name, g in got.items():
        ref = dict(ref_model.named_parameters())[name].grad
        # float64 (unit roundoff 1e-16) through ~1e3-deep sums: 1e-10 leaves room and still fails
        # at any real difference (a wrong sign, a missed stop-gradient or clip moves it by O(1))
        assert float((g - ref).norm()) <= 1e-10 * float(ref.norm()) + 1e-15, name
    ref_model.zero_grad(set_to_none=True)


def test_training_lowers_the_loss_and_sampling_follows_the_new_weights(server: Any, client: Any) -> None:
    tc = client.create_lora_training_client(base_model=_base_name(server), rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    prompt = tok.encode("The secret word is")
    answer = tok.encode(" zebra.")
    ids = prompt + answer
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:],
                                        "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})
    before = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    for _ in range(6):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3))
    after = tc.forward([datum], "cross_entropy").result().metrics["loss:sum"]
    assert after < 0.3 * before
    sampler = tc.save_weights_and_get_sampling_client()
    out = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=3,
                         sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert len(out.sequences) == 3
    assert all(tok.decode(s.tokens).startswith(" zebra") for s in out.sequences)
    # the sampled tokens' log-probs are the trained model's: prompt log-probs agree with forward
    full = prompt + list(out.sequences[0].tokens)
    lps = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
    assert lps[0] is None and len(lps) == len(full)
    fwd = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                  loss_fn_inputs={"target_tokens": full[1:]})], "cross_entropy").result()
    np.testing.assert_allclose(lps[1:], fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), atol=1e-4)
    # greedy samples carry their tokens' log-probs under the model
    np.testing.assert_allclose(out.sequences[0].logprobs, lps[len(prompt):], atol=1e-4)


def test_sampling_options(server: Any, client: Any) -> None:
    sampler = client.create_sampling_client(base_model=_base_name(server))
    tok = sampler.get_tokenizer()
    prompt = types.ModelInput.from_ints(tok.encode("Count: one, two, three,"))
    seeded = types.SamplingParams(max_tokens=6, temperature=1.0, seed=7)
    a = sampler.sample(prompt=prompt, num_samples=2, sampling_params=seeded).result()
    b = sampler.sample(prompt=prompt, num_samples=2, sampling_params=seeded).result()
    assert [s.tokens for s in a.sequences] == [s.tokens for s in b.sequences]
    assert all(s.stop_reason == "length" and len(s.tokens) == 6 for s in a.sequences)
    # a stop token: the sample ends on it, and it is returned
    comma = tok.encode(",")[0]
    greedy = sampler.sample(prompt=prompt, num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=20, temperature=0.0)).result()
    first = list(greedy.sequences[0].tokens)
    stopped = sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=20, temperature=0.0, stop=[comma])).result().sequences[0]
    if comma in first:
        assert list(stopped.tokens) == first[: first.index(comma) + 1] and stopped.stop_reason == "stop"
    # a stop string
    text = sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(
        max_tokens=20, temperature=0.0, stop=[" five"])).result().sequences[0]
    assert " five" not in tok.decode(text.tokens[:-1]) and len(text.tokens) <= 20
    # prompt log-probs of only the last n tokens
    with_lp = sampler.sample(prompt=prompt, num_samples=1, sampling_params=types.SamplingParams(max_tokens=1),
                             include_prompt_logprobs=True, prompt_logprobs_last_n=2).result()
    assert with_lp.prompt_logprobs[:-2] == [None] * (prompt.length - 2)
    assert all(v is not None and v < 0 for v in with_lp.prompt_logprobs[-2:])


def test_save_and_load_state_resume_bit_exactly(server: Any, client: Any) -> None:
    """A model saved with its optimizer and loaded into a new client takes the next step exactly
    as the original does."""
    base = _base_name(server)
    tc = client.create_lora_training_client(base_model=base, rank=4, seed=1).result()
    tok = tc.get_tokenizer()
    ids = tok.encode("Checkpoints must resume exactly where they stopped.")
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
    adam = types.AdamParams(learning_rate=1e-3, weight_decay=0.01, grad_clip_norm=1.0)
    for _ in range(2):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(adam)
    path = tc.save_state("resume").result().path
    assert path.startswith("tinker://") and path.endswith("/weights/resume")
    info = tinker.RestClient(base_url=server.base_url, api_key="tml-test") \
        .get_weights_info_by_tinker_path(path).result()
    assert info.is_lora and info.lora_rank == 4 and info.base_model == base
    resumed = client.create_training_client_from_state_with_optimizer(path).result()
    assert resumed.model_id != tc.model_id
    fresh = client.create_training_client_from_state(path).result()  # weights only: a new Adam
    outs = []
    for c in (tc, resumed, fresh):
        c.forward_backward([datum], "cross_entropy")
        c.optim_step(adam)
        outs.append(c.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy())
    assert np.array_equal(outs[0], outs[1])
    assert not np.array_equal(outs[0], outs[2])  # the optimizer state mattered
    # load_state into the original client rewinds it
    tc.load_state_with_optimizer(path).result()
    tc.forward_backward([datum], "cross_entropy")
    tc.optim_step(adam)
    assert np.array_equal(tc.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy(),
                          outs[0])


def test_named_sampler_weights_are_a_plain_model_folder(server: Any, client: Any, tmp_path: Path) -> None:
    tc = client.create_lora_training_client(base_model=_base_name(server), rank=2, seed=0).result()
    path = tc.save_weights_for_sampler("s1").result().path
    assert path.endswith("/sampler_weights/s1")
    folder = server.service._path(path)[2]
    assert (folder / "config.json").is_file() and (folder / "tokenizer_config.json").is_file()
    sampler = client.create_sampling_client(model_path=path)
    out = sampler.sample(prompt=types.ModelInput.from_ints([1, 2, 3]), num_samples=1,
                         sampling_params=types.SamplingParams(max_tokens=2)).result()
    assert len(out.sequences[0].tokens) >= 1


def test_concurrent_clients_train_independently(server: Any) -> None:
    base = _base_name(server)
    results: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def train(k: int) -> None:
        try:
            c = tinker.ServiceClient(base_url=server.base_url, api_key="tml-test")
            tc = c.create_lora_training_client(base_model=base, rank=2, seed=k).result()
            ids = list(range(10 + k, 30 + k))
            d = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                            loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})
            losses = []
            for _ in range(3):
                losses.append(tc.forward_backward([d], "cross_entropy").result().metrics["loss:sum"])
                tc.optim_step(types.AdamParams(learning_rate=2e-3)).result()
            results[k] = losses
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=train, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2]
    assert all(v[-1] < v[0] for v in results.values()), results


def test_malformed_requests_get_the_api_error_shapes(server: Any, client: Any) -> None:
    import httpx

    url, headers = server.base_url, {"X-API-Key": "tml-test"}
    r = httpx.post(f"{url}/api/v1/create_model", content=b"{not json", headers=headers)
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = httpx.post(f"{url}/api/v1/create_model", json={"session_id": "x", "model_seq_id": 0}, headers=headers)
    assert r.status_code == 400 and "base_model" in r.json()["detail"]
    r = httpx.post(f"{url}/api/v1/forward_backward", content=b"\xff\x00garbage",
                   headers={**headers, "Content-Type": "application/x-protobuf"})
    assert r.status_code == 400 and "protobuf" in r.json()["detail"]
    r = httpx.post(f"{url}/api/v1/retrieve_future", json={"request_id": "nope"}, headers=headers)
    assert r.status_code == 404
    with pytest.raises(tinker.APIStatusError, match="not served here"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=2).result()
    tc = client.create_lora_training_client(base_model=_base_name(server), rank=2).result()
    bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]), loss_fn_inputs={"target_tokens": [2, 3, 4]})
    with pytest.raises(tinker.RequestFailedError, match="needs") as err:
        tc.forward_backward([bad], "ppo").result()
    assert err.value.category == types.RequestErrorCategory.User
    with pytest.raises(tinker.RequestFailedError, match="not public"):
        tc.forward_backward([bad], "stable_reinforce").result()
    # the client is poisoned after a failed request (its own rule); a new one works
    tc2 = client.create_lora_training_client(base_model=_base_name(server), rank=2).result()
    good = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                       loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    assert tc2.forward([good], "cross_entropy").result().metrics["loss:sum"] > 0


def test_api_key_is_enforced(tmp_path: Path, tiny_dir: Path) -> None:
    import httpx

    from rlvr.tinker.server import BackgroundTinker

    with BackgroundTinker([str(tiny_dir)], tmp_path, api_key="tml-secret", dtype="float32") as srv:
        assert httpx.get(f"{srv.base_url}/api/v1/healthz").status_code == 200
        r = httpx.post(f"{srv.base_url}/api/v1/create_session", json={}, headers={"X-API-Key": "tml-wrong"})
        assert r.status_code == 401 and "API key" in r.json()["detail"]
        c = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-secret")
        assert c.create_sampling_client(base_model=next(iter(srv.service.bases))) is not None


def test_a_killed_client_leaves_the_service_healthy_and_its_session_ends(server: Any, client: Any) -> None:
    script = textwrap.dedent(f"""
        import os, time
        os.environ["TINKER_TELEMETRY"] = "0"
        import tinker
        from tinker import types
        c = tinker.ServiceClient(base_url={server.base_url!r}, api_key="tml-test")
        tc = c.create_lora_training_client(base_model={_base_name(server)!r}, rank=2).result()
        print("ready", tc.model_id, flush=True)
        d = types.Datum(model_input=types.ModelInput.from_ints(list(range(5, 200))),
                        loss_fn_inputs={{"target_tokens": list(range(6, 201)), "weights": [1.0] * 195}})
        while True:
            tc.forward_backward([d], "cross_entropy").result()
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    assert line.startswith("ready"), line
    model_id = line.split()[1]
    time.sleep(1.0)
    proc.send_signal(signal.SIGKILL)
    proc.wait(30)
    # the service still answers, trains and samples for others
    tc = client.create_lora_training_client(base_model=_base_name(server), rank=2).result()
    d = types.Datum(model_input=types.ModelInput.from_ints([1, 2, 3]),
                    loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [1.0, 1.0, 1.0]})
    assert tc.forward_backward([d], "cross_entropy").result().metrics["loss:sum"] > 0
    # without heartbeats its session ends and its model is dropped
    service = server.service
    saved, service.session_timeout = service.session_timeout, 0.5
    try:
        client_session = client.holder.get_session_id()
        service.heartbeat(client_session)
        deadline = time.monotonic() + 30
        while model_id in service.trainers and time.monotonic() < deadline:
            service.heartbeat(client_session)  # the live client keeps its own session
            service.expire_sessions()
            time.sleep(0.2)
        assert model_id not in service.trainers
        assert tc.model_id in service.trainers
    finally:
        service.session_timeout = saved


def test_forward_backward_custom_gradient_is_the_custom_loss_gradient(server64: Any) -> None:
    """The client runs the custom loss on the forward's log-probs and sends back its gradient as
    cross_entropy weights: the service's gradient must be the custom loss's, exactly (float64)."""
    client = tinker.ServiceClient(base_url=server64.base_url, api_key="tml-test")
    tc = client.create_lora_training_client(base_model=_base_name(server64), rank=2, seed=5).result()
    ids = tc.get_tokenizer().encode("A custom loss runs in the client.")
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:], "weights": [1.0] * (len(ids) - 1)})

    def squared(data: list[Any], logprobs: list[torch.Tensor]) -> tuple[torch.Tensor, dict[str, float]]:
        loss = sum((lp ** 2).sum() for lp in logprobs)
        return loss, {"squared": float(loss)}

    result = tc.forward_backward_custom([datum], squared).result()
    trainer = server64.service.trainers[tc.model_id]
    got = {n: p.grad.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    trainer.model.zero_grad(set_to_none=True)
    lp = _hf_logprobs(trainer.model, ids[:-1], ids[1:])
    ref_loss = (lp ** 2).sum()
    ref_loss.backward()
    assert result.metrics["loss:sum"] == pytest.approx(float(ref_loss.detach()), rel=1e-6)
    for name, g in got.items():
        ref = dict(trainer.model.named_parameters())[name].grad
        # the log-probs and the loss's gradient cross the wire as float32: 6e-8 relative each
        assert float((g - ref).norm()) <= 1e-6 * float(ref.norm()) + 1e-15, name
    trainer.model.zero_grad(set_to_none=True)


def test_micro_batches_leave_the_gradient_and_metrics_unchanged(server64: Any) -> None:
    """A request split into micro-batches (bounded memory) adds up to the same sum: float64, so
    only the summation order differs."""
    client = tinker.ServiceClient(base_url=server64.base_url, api_key="tml-test")
    tc = client.create_lora_training_client(base_model=_base_name(server64), rank=2, seed=9).result()
    rng = np.random.default_rng(1)
    data = []
    for n in (9, 14, 6):
        ids = rng.integers(5, 250, size=n + 1).tolist()
        data.append(types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                                loss_fn_inputs={"target_tokens": ids[1:], "logprobs": rng.normal(size=n) - 3.0,
                                                "advantages": rng.normal(size=n)}))
    service, trainer = server64.service, server64.service.trainers[tc.model_id]
    runs = []
    saved = service.micro_batch_tokens
    try:
        for budget in (10_000, 12):  # one pass; one datum per pass
            service.micro_batch_tokens = budget
            result = tc.forward_backward(data, "ppo").result()
            runs.append((result, {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.requires_grad}))
            trainer.model.zero_grad(set_to_none=True)
    finally:
        service.micro_batch_tokens = saved
    (one, g1), (split, g2) = runs
    assert split.metrics["loss:sum"] == pytest.approx(one.metrics["loss:sum"], rel=1e-6)
    assert split.metrics["clip_fraction:mean"] == pytest.approx(one.metrics["clip_fraction:mean"], abs=1e-7)
    for a, b in zip(one.loss_fn_outputs, split.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-6)
    for name in g1:
        assert float((g1[name] - g2[name]).norm()) <= 1e-10 * float(g1[name].norm()) + 1e-15, name


def teach_zebra(client: Any, name: str) -> tuple[Any, Any, list[int], Any, Any]:
    """A LoRA model on ``name`` taught, in 6 steps, that the secret word is zebra; (its training
    client, tokenizer, the prompt, a sampler of it, two greedy samples), checked to say so."""
    tc = client.create_lora_training_client(base_model=name, rank=8, seed=0).result()
    tok = tc.get_tokenizer()
    prompt, answer = tok.encode("The secret word is"), tok.encode(" zebra.")
    ids = prompt + answer
    datum = types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                        loss_fn_inputs={"target_tokens": ids[1:],
                                        "weights": [0.0] * (len(prompt) - 1) + [1.0] * len(answer)})
    for _ in range(6):
        tc.forward_backward([datum], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=5e-3))
    sampler = tc.save_weights_and_get_sampling_client()
    out = sampler.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=2,
                         sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result()
    assert all(tok.decode(s.tokens).startswith(" zebra") for s in out.sequences)
    return tc, tok, prompt, sampler, out


def test_full_fine_tuning_trains_saves_and_loads(server64: Any) -> None:
    """A create_model without lora_config (the raw API; the client always sends one) trains every
    weight, and its checkpoint holds the whole model. On the tiny model: a full model's optimizer
    state is twice its weights."""
    server = server64
    service = server.service
    session = service.create_session()
    trainer = service.create_model(session, _base_name(server), None)
    assert all(p.requires_grad for p in trainer.model.parameters())
    ids = list(range(200, 230))
    datum = Datum(ids[:-1], {"target_tokens": np.array(ids[1:]), "weights": np.ones(len(ids) - 1, dtype=np.float32)})
    first = service.forward_backward(trainer.model_id, [datum], "cross_entropy", {}, False)[1]["loss:sum"]
    service.optim_step(trainer.model_id, {"learning_rate": 1e-3})
    path = service.save_state(trainer.model_id, "full")
    assert (service._path(path)[2] / "model" / "config.json").is_file()
    second = service.forward_backward(trainer.model_id, [datum], "cross_entropy", {}, True)[1]["loss:sum"]
    assert second < first
    other = service.create_model(session, _base_name(server), None)
    service.load_state(other.model_id, path, optimizer=True)
    again = service.forward_backward(other.model_id, [datum], "cross_entropy", {}, True)[1]["loss:sum"]
    assert again == pytest.approx(second, rel=1e-9)
    assert service.end_session(session, "test") and trainer.model_id not in service.trainers


def test_sampling_runs_in_ray_rollout_workers_and_follows_the_training(tmp_path: Path) -> None:
    """`rlvr tinker --ray-workers 1`: the service's sampling runs in rlvr's Ray rollout worker
    actors (rlvr.scaleout), which each session's weights are broadcast to; the client changes
    nothing. Their samples' log-probs equal the learner's forward to fp32 rounding."""
    pytest.importorskip("ray")
    from rlvr.rollout.probe import tolerance
    from rlvr.tinker.server import BackgroundTinker

    with BackgroundTinker([BUILTIN], tmp_path, dtype="float32", ray_workers=1,
                          ray_overrides=["dist.ray.timeout_s=120"]) as srv:
        client = tinker.ServiceClient(base_url=srv.base_url, api_key="tml-test")
        name = _base_name(srv)
        tc, tok, prompt, sampler, out = teach_zebra(client, name)
        full = prompt + list(out.sequences[0].tokens)
        fwd = tc.forward([types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                      loss_fn_inputs={"target_tokens": full[1:]})], "cross_entropy").result()
        learner = fwd.loss_fn_outputs[0]["logprobs"].to_numpy()[len(prompt) - 1:]
        gap = float(np.mean(np.abs(np.asarray(out.sequences[0].logprobs) - learner)))
        assert gap <= tolerance(torch.float32), gap  # sampled in the actor, scored here
        lps = sampler.compute_logprobs(types.ModelInput.from_ints(full)).result()
        np.testing.assert_allclose(lps[len(prompt):], learner, atol=1e-4)
        base = client.create_sampling_client(base_model=name)
        again = base.sample(prompt=types.ModelInput.from_ints(prompt), num_samples=1,
                            sampling_params=types.SamplingParams(max_tokens=4, temperature=0.0)).result()
        assert not tok.decode(again.sequences[0].tokens).startswith(" zebra")  # the workers went back to base
