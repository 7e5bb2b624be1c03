"""Self-Critique (arXiv:2510.09259): the length-penalised cosine by hand, the probe on the tiny
model, and `rlvr contamination` end to end."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from rlvr.eval.contamination import penalized_cosine, self_critique
from rlvr.models import load_model, load_tokenizer
from rlvr.rollout.engine import EmbeddedEngine

PROBLEMS = ["What is 3 + 4?", "Name a prime.", "2 * 5 =", "Spell cat backwards.", "x"]


def test_penalized_cosine_by_hand() -> None:
    # [1, 2] padded to [1, 2, 0]: dot with [1, 2, 2] = 5, norms √5 and 3; length penalty 2/3
    assert penalized_cosine([1.0, 2.0], [1.0, 2.0, 2.0]) == pytest.approx(5 / (math.sqrt(5) * 3) * 2 / 3, abs=1e-12)
    assert penalized_cosine([1.0, 2.0, 2.0], [1.0, 2.0]) == pytest.approx(5 / (math.sqrt(5) * 3) * 2 / 3, abs=1e-12)
    # [3, 0] vs [0, 4]: orthogonal
    assert penalized_cosine([3.0, 0.0], [0.0, 4.0]) == 0.0
    # [1, 1] vs [2, 2, 2, 2]: cos = 4 / (√2 · 4) = 1/√2, times 2/4
    assert penalized_cosine([1.0, 1.0], [2.0, 2.0, 2.0, 2.0]) == pytest.approx(1 / math.sqrt(2) / 2, abs=1e-12)
    assert penalized_cosine([0.5, 1.5, 0.2], torch.tensor([0.5, 1.5, 0.2])) == pytest.approx(1.0, abs=1e-12)
    assert penalized_cosine([0.5, 1.5], [1.0, 3.0]) == pytest.approx(1.0, abs=1e-12)  # scale does not matter
    assert penalized_cosine([], [1.0, 2.0]) == 0.0 and penalized_cosine([1.0], []) == 0.0
    assert penalized_cosine([0.0, 0.0], [1.0, 2.0]) == 0.0  # zero norm


@pytest.fixture
def tiny(tiny_dir: Path) -> tuple[torch.nn.Module, object]:
    return load_model(str(tiny_dir), torch.float32).eval(), load_tokenizer(str(tiny_dir))


def test_self_critique_scores_and_batching(tiny: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    model, tokenizer = tiny
    prompts_seen: list[list[list[int]]] = []
    generate = EmbeddedEngine.generate

    def recording_generate(self: EmbeddedEngine, prompts: list[list[int]], *args: object, **kwargs: object) -> object:
        prompts_seen.append(prompts)
        completions = generate(self, prompts, *args, **kwargs)  # type: ignore[arg-type]
        responses.append([group[0].text for group in completions])
        return completions

    responses: list[list[str]] = []
    monkeypatch.setattr(EmbeddedEngine, "generate", recording_generate)
    template = "Try again, not like {this}: <<{response}>> END"
    batched = self_critique(model, tokenizer, PROBLEMS, max_new_tokens=12, template=template, batch_size=4)
    assert len(batched) == len(PROBLEMS) and all(0.0 <= s <= 1.0 for s in batched)
    # both passes batched: one generate call per pass, with every problem in it
    assert [len(p) for p in prompts_seen] == [len(PROBLEMS), len(PROBLEMS)]
    for problem, r1, ids in zip(PROBLEMS, responses[0], prompts_seen[1]):
        assert f"{problem}\n\nTry again, not like {{this}}: <<{r1}>> END" in tokenizer.decode(ids)
    single = self_critique(model, tokenizer, PROBLEMS, max_new_tokens=12, template=template, batch_size=1)
    assert single == pytest.approx(batched, abs=1e-5)
    # one different response length would change the penalty, so the curves differ between problems
    assert len({round(s, 6) for s in batched}) > 1


def test_self_critique_score_is_the_penalized_cosine_of_the_entropy_curves(tiny: tuple) -> None:
    """Reference loop: generate one problem at a time with HF, then compute each position's
    entropy from the full forward pass."""
    from rlvr.data import render_prompt

    model, tokenizer = tiny
    template = "Another way? {response}"
    problem = PROBLEMS[0]

    def greedy_entropies(ids: list[int], steps: int) -> tuple[list[float], str]:
        x = torch.tensor([ids])
        entropies, new = [], []
        with torch.no_grad():
            for _ in range(steps):
                logp = torch.log_softmax(model(x).logits[0, -1].float(), -1)
                entropies.append(float(-(logp.exp() * logp).sum()))
                token = int(logp.argmax())
                new.append(token)
                x = torch.cat([x, torch.tensor([[token]])], 1)
                if token == tokenizer.eos_token_id:
                    break
        return entropies, tokenizer.decode(new, skip_special_tokens=True)

    e1, r1 = greedy_entropies(render_prompt(tokenizer, problem), 10)
    e2, _ = greedy_entropies(render_prompt(tokenizer, f"{problem}\n\n{template.replace('{response}', r1)}"), 10)
    [score] = self_critique(model, tokenizer, [problem], max_new_tokens=10, template=template)
    assert score == pytest.approx(penalized_cosine(e1, e2), abs=1e-5)
    assert score < 1.0  # two different curves


def test_self_critique_needs_the_response_slot(tiny: tuple) -> None:
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="response"):
        self_critique(model, tokenizer, PROBLEMS, template="Try again.")


def _write_jsonl(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": p, "other": 1}) + "\n" for p in prompts))
    return path


def test_rlvr_contamination_writes_scores_and_auc(tiny_dir: Path, tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    from rlvr.cli import main

    members = _write_jsonl(tmp_path / "members.jsonl", PROBLEMS[:3])
    non_members = _write_jsonl(tmp_path / "non_members.jsonl", PROBLEMS[3:])
    out = tmp_path / "c.json"
    code = main(["contamination", "--model", str(tiny_dir), "--members", str(members), "--non-members",
                 str(non_members), "--max-new-tokens", "8", "--out", str(out)])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["auc"]) == {"self_critique", "min_k"} and all(0 <= a <= 1 for a in result["auc"].values())
    assert result["members"] == 3 and result["non_members"] == 2
    rows = result["samples"]
    assert [r["prompt"] for r in rows] == PROBLEMS and [r["member"] for r in rows] == [True] * 3 + [False] * 2
    assert all(0 <= r["self_critique"] <= 1 for r in rows) and all(r["min_k"] < 0 for r in rows[:4])
    assert rows[4]["min_k"] is None  # "x" is one token: nothing to score, and left out of the means
    assert result["mean"]["min_k"] == pytest.approx({"members": sum(r["min_k"] for r in rows[:3]) / 3,
                                                     "non_members": rows[3]["min_k"]})
    table = capsys.readouterr().out
    assert table.startswith("| method | AUC |") and "| self_critique |" in table and "| min_k |" in table

    # one method, and the default (config) prompts: the first prompts the training sampler draws vs held-out
    code = main(["contamination", "--model", str(tiny_dir), "--method", "min_k", "--prompts", "3", "--out", str(out),
                 "task.eval_size=4", "task.params={min_terms = 2, max_terms = 2, max_digits = 1}"])
    assert code == 0
    result = json.loads(out.read_text())
    assert set(result["auc"]) == {"min_k"} and result["members"] == 3 and result["non_members"] == 3
    assert "self_critique" not in result["samples"][0]


def test_rlvr_contamination_names_the_bad_line(tiny_dir: Path, tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from rlvr.cli import main

    members = _write_jsonl(tmp_path / "members.jsonl", PROBLEMS[:2])
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n\n{"text": "no prompt"}\n')
    assert main(["contamination", "--model", str(tiny_dir), "--members", str(members), "--non-members", str(bad)]) == 2
    assert f"{bad}, line 3" in capsys.readouterr().err
    bad.write_text('{"prompt": "fine"}\nnot json\n')
    assert main(["contamination", "--model", str(tiny_dir), "--members", str(members), "--non-members", str(bad)]) == 2
    assert f"{bad}, line 2: not JSON" in capsys.readouterr().err
