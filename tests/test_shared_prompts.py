"""Shared prompts in the learner (rlvr.train.logprobs.shared_prompt_logprobs): each distinct
prompt of a micro-batch is encoded once and its rows' completions run on its key/value cache.
Everything here is held against the plain computation, one whole row per sample.

Exactness: in float64 (conftest keeps Llama's RMSNorm in float64 for float64 models) the two
differ only in summation order, ~1e-15 relative; the tolerances of test_learner.py apply
(rtol 1e-8, atol 1e-12). A wrong position, a missing mask or a dropped gradient path moves
log-probs by ~1e-1 and gradients by ~1e-2 (checked below by breaking the positions)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from rlvr.algos import LOSSES
from rlvr.train import batches
from rlvr.train import logprobs as logprobs_module
from rlvr.train import update as update_module
from rlvr.train.batches import micro_batches, run_cost, shared_tokens, shares_prompts
from rlvr.train.logprobs import can_share_prompts, shared_prompt_logprobs, token_logprobs
from rlvr.train.settings import KLSettings, LossSettings, Passes, UpdateSettings
from rlvr.train.update import update_policy
from rlvr.types import Completion, Group, Sample
from tests.test_learner import GradRecorder, SGDRecorder, assert_grads_close, exact_model, make_groups
from tests.tiny import make_tiny_model

PROMPTS = [[5, 17, 99, 3], [40, 41, 42, 43, 44, 45, 46, 47], [7, 8, 9]]
COMPLETIONS = [[11, 12, 13, 14, 2], [20], [30, 31], [50, 51, 52, 53, 54, 55, 56], [60, 61, 62], [70, 71]]
ROW_PROMPT = [0, 0, 1, 1, 1, 2]  # prompt 2 has a single row


COST = batches.SHARED_TOKEN_COST


@pytest.fixture(autouse=True)
def share_wherever_prompts_repeat(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests hold the shared computation against whole rows, so they share every prompt that
    repeats, cheaper or not (a token of a shared micro-batch costing next to nothing); the one
    test of when sharing pays restores the real cost."""
    monkeypatch.setattr(batches, "SHARED_TOKEN_COST", 1e-6)


def whole_rows(prompts: list[list[int]], completions: list[list[int]], row_prompt: list[int],
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plain layout: right-padded prompt + completion rows, the completion tokens marked."""
    rows = [prompts[p] + c for p, c in zip(row_prompt, completions)]
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    attention = torch.zeros_like(ids)
    target = torch.zeros((len(rows), width), dtype=torch.bool)
    for b, (row, p) in enumerate(zip(rows, row_prompt)):
        ids[b, : len(row)] = torch.tensor(row)
        attention[b, : len(row)] = 1
        target[b, len(prompts[p]) : len(row)] = True
    return ids, attention, target


def grads_of(model: torch.nn.Module, value: torch.Tensor) -> dict[str, torch.Tensor]:
    value.backward()
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [3, 256])
def test_shared_prompt_logprobs_equal_whole_rows(temperature: float, chunk_size: int) -> None:
    model = exact_model()
    ids, attention, target = whole_rows(PROMPTS, COMPLETIONS, ROW_PROMPT)
    lp_BT, ent_BT = token_logprobs(model, ids, attention, target, temperature=temperature, chunk_size=chunk_size)
    lp_N, ent_N = shared_prompt_logprobs(model, PROMPTS, COMPLETIONS, ROW_PROMPT, 0, temperature=temperature,
                                         chunk_size=chunk_size)
    assert lp_N.shape == (sum(map(len, COMPLETIONS)),)
    torch.testing.assert_close(lp_N, lp_BT[target], atol=1e-12, rtol=1e-8)
    torch.testing.assert_close(ent_N, ent_BT[target], atol=1e-12, rtol=1e-8)
    # gradients of an arbitrary weighted sum of both outputs, with respect to every parameter
    w = torch.randn(len(lp_N), generator=torch.Generator().manual_seed(1), dtype=lp_N.dtype)
    whole = grads_of(model, (lp_BT[target] * w).sum() + 0.3 * ent_BT[target].sum())
    lp_N, ent_N = shared_prompt_logprobs(model, PROMPTS, COMPLETIONS, ROW_PROMPT, 0, temperature=temperature,
                                         chunk_size=chunk_size)
    assert_grads_close([grads_of(model, (lp_N * w).sum() + 0.3 * ent_N.sum())], [whole])


def test_a_wrong_prompt_position_is_caught() -> None:
    """The check above can fail: scoring each completion as if its prompt were one token shorter
    (a wrong offset between the prompt pass and the completion pass) moves the log-probs far
    outside its tolerance."""
    model = exact_model()
    ids, attention, target = whole_rows(PROMPTS, COMPLETIONS, ROW_PROMPT)
    lp_BT, _ = token_logprobs(model, ids, attention, target)
    shorter = [p[:-1] for p in PROMPTS]
    lp_N, _ = shared_prompt_logprobs(model, shorter, COMPLETIONS, ROW_PROMPT, 0)
    assert float((lp_N - lp_BT[target]).detach().abs().max()) > 1e-2


def test_one_token_completions_and_single_rows() -> None:
    """Completions of one token need no completion pass (the prompt's last state scores them);
    a prompt with one row is the plain computation."""
    model = exact_model()
    completions = [[20], [21], [22]]
    ids, attention, target = whole_rows(PROMPTS, completions, [0, 0, 2])
    lp_BT, _ = token_logprobs(model, ids, attention, target)
    lp_N, _ = shared_prompt_logprobs(model, PROMPTS, completions, [0, 0, 2], 0)
    torch.testing.assert_close(lp_N, lp_BT[target], atol=1e-12, rtol=1e-8)


def test_completion_lanes_pack_a_prompts_completions_up_to_the_longest() -> None:
    """First-fit, longest first, within each prompt; a sample with nothing to feed in no lane."""
    from rlvr.train.logprobs import completion_lanes

    # COMPLETIONS feed 4, 0, 1, 6, 2, 1 tokens: prompt 1's 6 alone, its 2 and 1 together
    assert completion_lanes([4, 0, 1, 6, 2, 1], ROW_PROMPT, 6) == [[0], [3], [4, 2], [5]]
    assert completion_lanes([3, 3, 3, 3], [0, 0, 1, 1], 6) == [[0, 1], [2, 3]]  # never across prompts
    assert completion_lanes([5, 1, 4, 2, 3], [0] * 5, 5) == [[0], [2, 1], [4, 3]]
    assert completion_lanes([0, 0], [0, 0], 0) == []


def test_packed_completions_see_their_own_tokens_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test above runs COMPLETIONS packed into 4 lanes for 6 rows (prompt 1's completions of 2
    and 1 fed tokens share one). The check can fail: letting a lane's completions attend to each
    other moves the log-probs of the second far outside its tolerance."""
    model = exact_model()
    ids, attention, target = whole_rows(PROMPTS, COMPLETIONS, ROW_PROMPT)
    lp_BT, _ = token_logprobs(model, ids, attention, target)
    lanes: list[int] = []
    lane_inputs = logprobs_module._lane_inputs

    def counted(lanes_: list[list[int]], *args: object) -> tuple[torch.Tensor, ...]:
        lanes.append(len(lanes_))
        return lane_inputs(lanes_, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(logprobs_module, "_lane_inputs", counted)
    lp_N, _ = shared_prompt_logprobs(model, PROMPTS, COMPLETIONS, ROW_PROMPT, 0)
    assert lanes == [4]
    torch.testing.assert_close(lp_N, lp_BT[target], atol=1e-12, rtol=1e-8)

    def leaky(*args: object) -> tuple[torch.Tensor, ...]:
        ids_LC, mask_LKC, positions_LC, starts = lane_inputs(*args)  # type: ignore[arg-type]
        width = ids_LC.shape[1]
        mask_LKC = mask_LKC.clone()
        mask_LKC[..., -width:] |= torch.ones(width, width, dtype=torch.bool).tril()  # the whole lane, causally
        return ids_LC, mask_LKC, positions_LC, starts

    monkeypatch.setattr(logprobs_module, "_lane_inputs", leaky)
    lp_N, _ = shared_prompt_logprobs(model, PROMPTS, COMPLETIONS, ROW_PROMPT, 0)
    assert float((lp_N - lp_BT[target]).detach().abs().max()) > 1e-2


def test_eager_attention_runs_a_row_per_completion(monkeypatch: pytest.MonkeyPatch) -> None:
    """Eager attention adds its mask to the scores as floats, so a boolean lane mask would be
    wrong there: only SDPA packs completions, and an eager model's shared pass, one row per
    completion, still equals whole rows."""
    model = exact_model()
    model.set_attn_implementation("eager")
    assert not logprobs_module.packs_completions(model)
    monkeypatch.setattr(logprobs_module, "_lane_inputs", lambda *args: pytest.fail("packed under eager attention"))
    ids, attention, target = whole_rows(PROMPTS, COMPLETIONS, ROW_PROMPT)
    lp_BT, _ = token_logprobs(model, ids, attention, target)
    lp_N, _ = shared_prompt_logprobs(model, PROMPTS, COMPLETIONS, ROW_PROMPT, 0)
    torch.testing.assert_close(lp_N, lp_BT[target], atol=1e-12, rtol=1e-8)


def test_only_transformers_own_model_classes_pack_completions() -> None:
    """Remote code that says SDPA may still build its masks its own way: lanes only for model
    classes of transformers itself (a PEFT-wrapped one is judged by the model inside)."""
    model = exact_model()
    assert logprobs_module.packs_completions(model)

    class Remote(type(model)):  # type: ignore[misc, valid-type]
        pass

    model.__class__ = Remote
    assert not logprobs_module.packs_completions(model)


def test_a_windowed_model_runs_whole_rows() -> None:
    """A sliding window counts cache columns: a shared prompt's padding would count as tokens, and
    a lane's mask would replace the window. So such a model runs every row whole, shared prompts
    on or not: rows of up to 13 tokens here against a window of 3, where attending past the
    window moves the log-probs."""
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    config = MistralConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, sliding_window=3, pad_token_id=0,
                           bos_token_id=1, eos_token_id=2)
    model = MistralForCausalLM(config).to(torch.float64)

    def grads(share: bool) -> list[dict[str, torch.Tensor]]:
        recorder = GradRecorder(copy.deepcopy(model))
        settings = UpdateSettings(passes=Passes(micro_batch_size=8, share_prompts=share))
        update_policy(recorder, make_groups(GROUPS), settings,  # type: ignore[arg-type]
                      pad_token_id=0, generator=torch.Generator().manual_seed(0))
        return recorder.grads

    assert_grads_close(grads(True), grads(False))


GROUPS = [[1.0, 0.0, 0.0, 1.0], [0.0, 1.0, 0.5, 0.0]]


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("offpolicy", ["none", "tis"])
def test_every_loss_gets_the_per_sample_gradient(loss: str, offpolicy: str) -> None:
    """The whole update, shared prompts against one row per sample, with the micro-batch cut held
    fixed (one micro-batch per mini-batch, so BAPO's per-micro-batch search sees the same rows):
    two mini-batches with an SGD step between them, so the second is off-policy and ratios,
    clipping and importance weights are exercised; KL to a reference and an entropy bonus on."""
    def grads(share: bool) -> list[dict[str, torch.Tensor]]:
        recorder = SGDRecorder(exact_model(), lr=0.1 if loss == "r2vpo" else 1.0)  # see test_learner.py
        settings = UpdateSettings(loss=LossSettings(name=loss, offpolicy=offpolicy, entropy_coef=0.01),
                                  kl=KLSettings(coef=0.05), passes=Passes(micro_batch_size=8, share_prompts=share),
                                  mini_batches=2)
        update_policy(recorder, make_groups(GROUPS), settings, pad_token_id=0,  # type: ignore[arg-type]
                      ref_model=make_tiny_model(seed=1, dtype=torch.float64),
                      generator=torch.Generator().manual_seed(0))
        return recorder.grads

    assert_grads_close(grads(True), grads(False))


def test_in_fp32_the_difference_is_rounding() -> None:
    """The product's own precision: fp32 weights, Hugging Face's modules as they are. The two
    computations round in different places (the prompt pass sums G rows' gradients before its
    backward; the float32 RMSNorm rounds that sum once instead of each row), so they agree to
    fp32 rounding amplified by two layers' backward: per tensor, in norm, within 1e-5 relative
    (fp32's unit roundoff is 6e-8; a formula error is ~1e-2, test_a_wrong_prompt_position_is_caught)."""
    def grads(share: bool) -> dict[str, torch.Tensor]:
        recorder = GradRecorder(make_tiny_model())
        settings = UpdateSettings(loss=LossSettings(entropy_coef=0.01),
                                  passes=Passes(micro_batch_size=8, share_prompts=share))
        update_policy(recorder, make_groups(GROUPS), settings, pad_token_id=0,  # type: ignore[arg-type]
                      generator=torch.Generator().manual_seed(0))
        return recorder.grads[0]

    shared, whole = grads(True), grads(False)
    for name, g in whole.items():
        assert float((shared[name] - g).norm()) <= 1e-5 * float(g.norm()), name


def groups_of(prompt_len: int, completion_lengths: list[list[int]]) -> list[Group]:
    groups = []
    for p, lengths in enumerate(completion_lengths):
        prompt = tuple(range(3 + p, 3 + p + prompt_len))
        samples = [Sample(prompt, Completion(tuple(range(3, 3 + n)), (-1.0,) * n, "stop", ""), float(k % 2), {}, p)
                   for k, n in enumerate(lengths)]
        groups.append(Group(f"prompt {p}", tuple(samples)))
    return groups


def test_micro_batches_keep_a_prompt_together_where_that_runs_fewer_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    """Long prompts, completions of similar lengths: a group's rows go together (one prompt pass
    each). Short prompts, completions from 1 to 30 tokens: by completion length (little
    padding), prompts shared only where rows of one land together. Either way the cut is the
    cheaper of the two, counted as `shared_tokens` does."""
    monkeypatch.setattr(batches, "SHARED_TOKEN_COST", COST)
    def cuts_of(groups: list[Group]) -> tuple[list[Sample], list[list[int]]]:
        samples = [x for g in groups for x in g.samples]
        cuts = micro_batches(list(range(len(samples))), samples, 4, by_prompt=True)
        assert sorted(i for cut in cuts for i in cut) == list(range(len(samples)))
        return samples, cuts

    samples, cuts = cuts_of(groups_of(20, [[3, 4, 3, 4], [4, 3, 3, 4]]))
    assert all(len({samples[i].prompt_ids for i in cut}) == 1 for cut in cuts)
    assert sum(shared_tokens([samples[i] for i in cut]) for cut in cuts) == 2 * (20 + 4 * 3)
    samples, cuts = cuts_of(groups_of(2, [[1, 30, 1, 30], [30, 1, 30, 1]]))
    assert [sorted(len(samples[i].completion.token_ids) for i in cut) for cut in cuts] == [[1] * 4, [30] * 4]
    assert sum(shared_tokens([samples[i] for i in cut]) for cut in cuts) == (2 * 2 + 4 * 0) + (2 * 2 + 4 * 29)


def count_fed_tokens(model: torch.nn.Module) -> list[int]:
    counts: list[int] = []
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: counts.append(args[0].numel()))
    return counts


def test_the_prompt_runs_once_per_micro_batch() -> None:
    """What the saving is: with groups of 4 on prompts of 3-6 tokens, the shared update feeds each
    prompt once and every completion but its last token, packed into lanes as long as the
    group's longest; the plain one feeds 4 padded whole rows."""
    groups: list[Group] = make_groups(GROUPS)

    def fed(share: bool) -> int:
        recorder = GradRecorder(exact_model())
        counts = count_fed_tokens(recorder.model)
        update_policy(recorder, groups,  # type: ignore[arg-type]
                      UpdateSettings(passes=Passes(micro_batch_size=4, share_prompts=share)), pad_token_id=0)
        return sum(counts)

    prompts = [len(g.samples[0].prompt_ids) for g in groups]
    completions = [[len(x.completion.token_ids) for x in g.samples] for g in groups]
    assert prompts == [3, 6] and completions == [[2, 4, 2, 5], [2, 1, 6, 5]]
    # fed 1, 3, 1, 4 in lanes of 4: (4), (3 + 1), (1); fed 1, 0, 5, 4 in lanes of 5: (5), (4 + 1);
    # the 3-token prompt alone in its pass runs as 4 (rlvr.models.FEWEST_ROWS)
    assert fed(True) == (4 + 3 * 4) + (6 + 2 * 5)
    samples = [x for g in groups for x in g.samples]
    shared = micro_batches(list(range(len(samples))), samples, 4, by_prompt=True)
    assert fed(True) == sum(shared_tokens([samples[i] for i in cut]) for cut in shared)  # the cost model counts it
    samples = [x for g in groups for x in g.samples]
    cuts = micro_batches(list(range(len(samples))), samples, 4)  # by length across groups
    assert fed(False) == sum(len(cut) * max(samples[i].num_tokens for i in cut) for cut in cuts)
    assert fed(True) < 0.7 * fed(False)


def test_activation_checkpointing_runs_rows_whole() -> None:
    """Hugging Face turns the key/value cache off under activation checkpointing in training
    mode, so the update falls back to whole rows, with the same gradient."""
    model = exact_model()
    assert can_share_prompts(model)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    assert not can_share_prompts(model)
    recorder = GradRecorder(model)
    update_policy(recorder, make_groups(GROUPS), UpdateSettings(passes=Passes(micro_batch_size=8)),  # type: ignore[arg-type]
                  pad_token_id=0)
    plain = GradRecorder(exact_model())
    update_policy(plain, make_groups(GROUPS),  # type: ignore[arg-type]
                  UpdateSettings(passes=Passes(micro_batch_size=8, share_prompts=False)), pad_token_id=0)
    assert_grads_close(recorder.grads, plain.grads)


def test_a_model_without_a_cache_is_an_error_not_a_wrong_gradient() -> None:
    model = exact_model()
    broken = copy.deepcopy(model)
    broken.config.use_cache = False
    original = broken.model.forward

    def forward(*args: object, **kwargs: object) -> object:
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        return original(*args, **kwargs)

    broken.model.forward = forward  # type: ignore[method-assign]
    with pytest.raises(RuntimeError, match="kept no key/value cache"):
        shared_prompt_logprobs(broken, PROMPTS, COMPLETIONS, ROW_PROMPT, 0)


def test_prompts_are_shared_only_where_that_is_cheaper(monkeypatch: pytest.MonkeyPatch) -> None:
    """A shared micro-batch's tokens cost SHARED_TOKEN_COST whole-row tokens each, so a group of 8
    with a 64-token prompt and 192-token completions runs whole (3,184 tokens shared cost more
    than 4,096 whole), the demo's shape (50 + 24) and a long prompt (448 + 64) run shared, and
    an update on the first feeds every row whole."""
    monkeypatch.setattr(batches, "SHARED_TOKEN_COST", COST)
    assert 1.2 < COST < 1.6  # the measured range (docs/LOG.md); the shapes below sit outside it

    def group(prompt: int, completion: int) -> list[Sample]:
        return [Sample(tuple(range(3, 3 + prompt)), Completion(tuple(range(completion)), (-1.0,) * completion,
                                                               "length", ""), float(k % 2), {}, 0)
                for k in range(8)]

    assert not shares_prompts(group(64, 192))
    assert run_cost(group(64, 192)) == 8 * 256
    assert shares_prompts(group(50, 24)) and shares_prompts(group(448, 64))
    assert run_cost(group(448, 64)) == pytest.approx(COST * (448 + 8 * 63))
    assert not shares_prompts(group(50, 24)[:1])  # nothing repeats
    # an episode's closing observation (untrained, after its last trained token) is never run,
    # so it costs nothing: 8 rows of 64 + 192 whose last 100 tokens are an observation cost as
    # 8 rows of 64 + 92, whole or shared
    closing = [dataclasses.replace(x, completion=dataclasses.replace(x.completion, loss_mask=(1,) * 92 + (0,) * 100))
               for x in group(64, 192)]
    assert run_cost(closing, share=False) == 8 * (64 + 92)
    assert shared_tokens(closing) == 64 + 8 * 91
    untrained = [dataclasses.replace(x, completion=dataclasses.replace(x.completion, loss_mask=(0,) * 192))
                 for x in group(64, 192)]
    assert run_cost(untrained, share=False) == 8 * 64 and shared_tokens(untrained) == 64

    counts: list[int] = []
    model = exact_model()
    model.model.embed_tokens.register_forward_hook(lambda m, args, out: counts.append(args[0].numel()))
    groups = [Group("", tuple(group(6, 30)))]  # 8 × 36 whole = 288 tokens; shared 6 + 8 × 29 = 238, × COST > 288
    update_policy(GradRecorder(model), groups, UpdateSettings(passes=Passes(micro_batch_size=8)),  # type: ignore[arg-type]
                  pad_token_id=0)
    assert sum(counts) == 8 * 36


# Multi-turn rows: tokens an environment injected (loss mask 0) are context, not targets.
SCORED = [[1, 0, 0, 1, 0], [1], [0, 0], [1, 1, 0, 0, 1, 0, 0], [0, 1, 1], [1, 0]]
"""Flags per completion token of COMPLETIONS: injected stretches inside a row, after its last
sampled token (rows 0, 3, 5), a row with nothing to score (2) and a one-token row (1)."""


@pytest.mark.parametrize("chunk_size", [2, 256])
def test_injected_tokens_are_run_but_not_scored(chunk_size: int) -> None:
    """With ``scored``, the flagged tokens' log-probs, entropies and gradients are the whole rows'
    at those tokens, every earlier token still in the context."""
    model = exact_model()
    ids, attention, target = whole_rows(PROMPTS, COMPLETIONS, ROW_PROMPT)
    flags = torch.zeros_like(target)
    for b, (p, row) in enumerate(zip(ROW_PROMPT, SCORED)):
        flags[b, len(PROMPTS[p]) : len(PROMPTS[p]) + len(row)] = torch.tensor(row, dtype=torch.bool)
    lp_BT, ent_BT = token_logprobs(model, ids, attention, target, chunk_size=chunk_size)
    w = torch.randn(int(flags.sum()), generator=torch.Generator().manual_seed(2), dtype=lp_BT.dtype)
    whole = grads_of(model, (lp_BT[flags] * w).sum() + 0.3 * ent_BT[flags].sum())
    counts = count_fed_tokens(model)
    lp_N, ent_N = shared_prompt_logprobs(model, PROMPTS, COMPLETIONS, ROW_PROMPT, 0, chunk_size=chunk_size,
                                         scored=SCORED)
    assert lp_N.shape == (sum(map(sum, SCORED)),)
    # the prompts (width 8) once; each row's completion up to its last flagged token, less the last:
    # rows 0, 3 and 4 feed 3, 4 and 2 tokens (the others none), three lanes of 4 (0 and 3 are
    # another prompt's, and 3 has no room left for 4)
    assert counts == [3 * 8, 3 * 4]
    torch.testing.assert_close(lp_N, lp_BT[flags].detach(), atol=1e-12, rtol=1e-8)
    torch.testing.assert_close(ent_N, ent_BT[flags].detach(), atol=1e-12, rtol=1e-8)
    assert_grads_close([grads_of(model, (lp_N * w).sum() + 0.3 * ent_N.sum())], [whole])
    with pytest.raises(ValueError, match="one flag per completion token"):
        shared_prompt_logprobs(model, PROMPTS, COMPLETIONS, ROW_PROMPT, 0, scored=SCORED[:-1])


def injected(groups: list[Group], every_tail: bool = False) -> list[Group]:
    """Every completion of 3+ tokens with an injected middle and, for every other row (or every
    row), an injected tail: the last sampled token followed by an observation nothing is trained on."""
    out = []
    for g in groups:
        rows = []
        for k, x in enumerate(g.samples):
            n = len(x.completion.token_ids)
            mask = [0 if 0 < t < n - 1 and n >= 3 else 1 for t in range(n)]
            if (every_tail or k % 2) and n >= 2:
                mask[-1] = 0
            rows.append(dataclasses.replace(x, completion=dataclasses.replace(x.completion, loss_mask=tuple(mask))))
        out.append(Group(g.prompt, tuple(rows), g.metadata))
    return out


@pytest.mark.parametrize("loss", ["ppo_clip", "gspo", "gmpo", "cispo"])
@pytest.mark.parametrize("share", [True, False])
def test_episodes_with_injected_tokens_get_the_whole_row_gradient(loss: str, share: bool) -> None:
    """The update on multi-turn rows, scored at their trained tokens only (shared prompts, or whole
    rows cut after the last trained column), against the full computation that scores every
    token and masks the loss: the same gradients, KL to a reference and an entropy bonus on."""
    groups = injected(make_groups(GROUPS))
    assert any(x.completion.loss_mask and x.completion.loss_mask[-1] == 0 for g in groups for x in g.samples)

    def grads(sample_logprobs: object) -> list[dict[str, torch.Tensor]]:
        recorder = SGDRecorder(exact_model(), lr=1.0)
        settings = UpdateSettings(loss=LossSettings(name=loss, entropy_coef=0.01), kl=KLSettings(coef=0.05),
                                  passes=Passes(micro_batch_size=8, share_prompts=share), mini_batches=2)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(update_module, "sample_logprobs", sample_logprobs)
            patch.setattr(batches, "sample_logprobs", sample_logprobs)
            update_policy(recorder, groups, settings, pad_token_id=0,  # type: ignore[arg-type]
                          ref_model=make_tiny_model(seed=1, dtype=torch.float64),
                          generator=torch.Generator().manual_seed(0))
        return recorder.grads

    def every_token(model: object, rows: list[Sample], batch: dict[str, torch.Tensor], s: UpdateSettings,
                    pad: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The reference: each row whole, every completion token scored, injected ones zeroed after."""
        lp_BT, ent_BT = token_logprobs(model, batch["input_ids"], batch["attention_mask"],  # type: ignore[arg-type]
                                       batch["completion_mask"], temperature=s.passes.temperature)
        keep = batch["loss_mask"]
        return torch.where(keep, lp_BT, 0.0), torch.where(keep, ent_BT, 0.0)

    assert_grads_close(grads(batches.sample_logprobs), grads(every_token))


def test_injected_tokens_skip_the_head_and_a_trailing_observation_is_not_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """What the saving is: the LM head scores exactly the trained tokens, and whole rows are fed
    only up to the last trained column."""
    groups = injected(make_groups(GROUPS), every_tail=True)
    samples = [x for g in groups for x in g.samples]
    scored: list[int] = []
    original = logprobs_module._head_logprobs
    monkeypatch.setattr(logprobs_module, "_head_logprobs",
                        lambda lm, h, *rest: scored.append(h.shape[0]) or original(lm, h, *rest))
    for share in (True, False):
        scored.clear()
        model = exact_model()
        counts = count_fed_tokens(model)
        update_policy(GradRecorder(model), groups,  # type: ignore[arg-type]
                      UpdateSettings(passes=Passes(micro_batch_size=8, share_prompts=share)), pad_token_id=0)
        assert sum(scored) == sum(x.completion.trainable() for x in samples)
        if not share:  # micro-batches of 8 rows cut by length: each fed up to its last trained column
            cuts = micro_batches(list(range(len(samples))), samples, 8)
            last = [max(len(samples[i].prompt_ids) + max(t + 1 for t, f in enumerate(
                samples[i].completion.loss_mask or ()) if f) for i in cut) for cut in cuts]
            assert sum(counts) == sum(len(cut) * w for cut, w in zip(cuts, last))
            assert sum(counts) < sum(len(cut) * max(samples[i].num_tokens for i in cut) for cut in cuts)


@pytest.mark.parametrize("share", [True, False])
def test_a_micro_batch_with_nothing_trained_adds_nothing(share: bool) -> None:
    """Rows whose every token was injected (a summarised episode's last segment can be all
    observation) still get an advantage from their group; alone in a micro-batch they score no
    token, and the update goes on with the gradient of the other rows."""
    groups = injected(make_groups(GROUPS))
    first = groups[0].samples[0]
    silent = dataclasses.replace(first, completion=dataclasses.replace(
        first.completion, loss_mask=(0,) * len(first.completion.token_ids)))
    groups[0] = Group(groups[0].prompt, (silent, *groups[0].samples[1:]), groups[0].metadata)

    def grads(size: int) -> list[dict[str, torch.Tensor]]:
        recorder = GradRecorder(exact_model())
        update_policy(recorder, groups,  # type: ignore[arg-type]
                      UpdateSettings(passes=Passes(micro_batch_size=size, share_prompts=share)), pad_token_id=0)
        return recorder.grads

    assert_grads_close(grads(1), grads(8))


def test_a_kl_in_the_reward_is_on_the_sampled_tokens_only() -> None:
    """With the KL in the reward, each episode's penalty sums log π_old − log π_ref (k1) over the
    tokens the policy sampled; an observation is not the policy's choice and adds nothing."""
    groups = injected(make_groups(GROUPS))
    ref = make_tiny_model(seed=1, dtype=torch.float64)
    result = update_policy(GradRecorder(exact_model()), groups, UpdateSettings(  # type: ignore[arg-type]
        kl=KLSettings(coef=0.1, placement="reward", estimator="k1")), pad_token_id=0, ref_model=ref)
    policy = exact_model()
    with torch.no_grad():
        want = []
        for x in (x for g in groups for x in g.samples):
            ids = torch.tensor([x.prompt_ids + x.completion.token_ids])
            p = len(x.prompt_ids)
            k1 = torch.zeros(len(x.completion.token_ids), dtype=torch.float64)
            for m, sign in ((policy, 1.0), (ref, -1.0)):
                lp = torch.log_softmax(m(ids).logits[0, :-1].double(), -1)[p - 1 :].gather(1, ids[0, p:, None])[:, 0]
                k1 += sign * lp
            want.append(float(k1[torch.tensor(x.completion.loss_mask, dtype=torch.bool)].sum()))
    assert result.metrics["kl_reward"] == pytest.approx(sum(want) / len(want), rel=1e-6)


def test_tiny_micro_batches_widened_to_four_tokens_give_each_rows_own_numbers() -> None:
    """Micro-batches of a few short rows, whose passes are padded wider than their longest row
    (rlvr.models.FEWEST_ROWS), lanes included: every scored token's log-prob, entropy and gradient
    equal those of the model's own forward on its row alone (float64: up to summation order), and
    the cost model counts the tokens fed, pads included. Seeded draws: 1-3 prompts of 1-4 tokens,
    1-5 rows of 0-4 completion tokens, some with scored flags."""
    from random import Random

    from rlvr.types import Completion, Sample

    model = exact_model()
    fed = count_fed_tokens(model)
    draw = Random(0)
    for _ in range(40):
        prompts = [tuple(draw.randint(3, 60) for _ in range(draw.randint(1, 4))) for _ in range(draw.randint(1, 3))]
        rows = []
        for _ in range(draw.randint(1, 5)):
            p, n = draw.randrange(len(prompts)), draw.randint(0, 4)
            flags = tuple(draw.randint(0, 1) for _ in range(n)) if draw.random() < 0.4 else None
            completion = Completion(tuple(draw.randint(3, 60) for _ in range(n)), (-1.0,) * n, "stop", "", loss_mask=flags)
            rows.append(Sample(prompts[p], completion, 0.0, {}, p))
        order: dict[object, int] = {}
        row_prompt = [order.setdefault(x.prompt_key, len(order)) for x in rows]
        completions = [list(x.completion.token_ids) for x in rows]
        scored = [list(x.completion.loss_mask or [1] * len(x.completion.token_ids)) for x in rows]
        fed.clear()
        lp_N, entropy_N = shared_prompt_logprobs(model, [list(key[0]) for key in order], completions, row_prompt,  # type: ignore[index]
                                                 0, scored=scored)
        assert sum(fed) == shared_tokens(rows), (prompts, completions)
        grads = grads_of(model, (lp_N + entropy_N).sum()) if lp_N.numel() else {}
        want_lp, want_entropy = [], []
        for x, completion, flags in zip(rows, completions, scored):
            logits = model(torch.tensor([list(x.prompt_ids) + completion])).logits[0, len(x.prompt_ids) - 1 : -1]
            logp = logits.log_softmax(-1)
            picked = torch.tensor(flags, dtype=torch.bool)
            want_lp.append(logp[torch.arange(len(completion)), torch.tensor(completion, dtype=torch.long)][picked])
            want_entropy.append(-(logp.exp() * logp).sum(-1)[picked])
        want_N, want_entropy_N = torch.cat(want_lp), torch.cat(want_entropy)
        torch.testing.assert_close(lp_N, want_N, atol=1e-10, rtol=0)
        torch.testing.assert_close(entropy_N, want_entropy_N, atol=1e-10, rtol=0)
        if want_N.numel():
            for name, want in grads_of(model, (want_N + want_entropy_N).sum()).items():
                torch.testing.assert_close(grads[name], want, atol=1e-10, rtol=0)
