"""`rlvr rm`: train reward models. Outcome reward models by Bradley–Terry from preference pairs,
process reward models from step labels; each saved as a Hugging Face folder that plugs straight
into ``[[rewards]] fn = "reward_model"`` (an outcome RM) or ``algo.kwargs = {prm = ...}`` (a PRM),
with a held-out report of how often it ranks right and how well calibrated it is.

**Outcome (Bradley–Terry).** A sequence classifier with one output, r(x, y), on top of the given
causal LM (its head is new), trained on pairs (x, y⁺, y⁻) with the loss
``−log σ(r(x, y⁺) − r(x, y⁻) − m)`` (Bradley and Terry, Biometrika 1952; as InstructGPT trains its
reward model, Ouyang et al., arXiv:2203.02155), where m is the row's ``margin`` (0 without one)
(Llama 2's margin, Touvron et al., arXiv:2307.09288), plus ``center · (r⁺ + r⁻)²``, which keeps the
rewards near 0 (as TRL's ``center_rewards_coefficient``). The model reads `rm_text` (the
conversation through the chat template), exactly what the ``reward_model`` reward scores.

Rows (JSONL or Parquet) are rlvr's and ``rlvr dpo``'s: ``{"prompt" or "messages", "chosen",
"rejected"}`` with answers as strings; or TRL's conversational layouts: ``chosen`` and
``rejected`` as message lists, with an explicit ``prompt`` (a list of messages) or an implicit one
(the two conversations' shared turns). A row may carry ``margin``.

**Process (PRM).** A token classifier with two labels, trained in TRL's PRM layout: ``{"prompt",
"completions": [steps], "labels": [bool per step]}``. The input is the prompt's tokens, then each
step followed by the separator; a step's label sits on its separator's last token
(`rlvr.rewards.process.ClassifierPRM.layout`, which scores the same way), with cross-entropy
there only. (Lightman et al., "Let's Verify Step by Step", arXiv:2305.20050.)

**The report** (``report.json`` in the output folder, and printed), on held-out rows: for an
outcome RM, pairwise accuracy (ties count half), the mean margin r⁺ − r⁻, and calibration of
P(y⁺ ≻ y⁻) = σ(r⁺ − r⁻): log loss, Brier score and the expected calibration error over 10 bins of
confidence (Guo et al., arXiv:1706.04599); for a PRM, step accuracy, solution accuracy (a solution
is right when every step is, and is predicted right when every step's probability is over ½),
and the same calibration of the step probabilities. Held-out rows are those of ``eval_data``, or
an ``eval_fraction`` of the prompts (every row of a prompt on one side: pairs drawn from one
prompt's samples share text, and splitting them would leak).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rlvr.data.chat import ChatDataError, read_rows
from rlvr.models import load_tokenizer, resolve_dtype, resolve_model_path, write_folder
from rlvr.rewards.reward_model import rm_batch, rm_text
from rlvr.rewards.process import ClassifierPRM

Messages = list[dict[str, str]]


@dataclass(frozen=True)
class Pair:
    """One preference: the conversation so far, and the preferred and dispreferred answers."""

    context: tuple[tuple[str, str], ...]
    chosen: str
    rejected: str
    margin: float = 0.0

    @property
    def messages(self) -> Messages:
        return [{"role": role, "content": content} for role, content in self.context]


@dataclass(frozen=True)
class Labelled:
    """One solution's steps and whether each is right."""

    prompt: str
    steps: tuple[str, ...]
    labels: tuple[bool, ...]


@dataclass
class Options:
    epochs: int = 1
    lr: float = 2e-5
    batch_size: int = 8
    """Pairs (or solutions) per optimizer step."""
    max_length: int = 512
    eval_fraction: float = 0.1
    seed: int = 0
    center: float = 0.01
    separator: str = "\n"
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    precision: str = "auto"
    """"fp32", or "bf16": fp32 weights and AdamW, the products in bfloat16 (torch.autocast);
    "auto" is bf16 where rlvr's "auto" picks it (a CPU with fast bf16, a GPU), else fp32."""

    def __post_init__(self) -> None:
        if self.epochs < 1 or self.batch_size < 1 or self.max_length < 8 or not self.lr > 0:
            raise ValueError(f"rm: need epochs ≥ 1, batch_size ≥ 1, max_length ≥ 8 and lr > 0, got {self}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"rm: eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise ValueError(f"rm: precision must be auto, bf16 or fp32, got {self.precision!r}")

    def autocast(self) -> Any:
        """The context the forward passes run in (see ``precision``)."""
        bf16 = self.precision == "bf16" or (self.precision == "auto" and resolve_dtype("auto") == torch.bfloat16)
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16)


def read_table(path: str | Path) -> list[tuple[str, dict[str, Any]]]:
    """(where, row) for each row of a JSONL or Parquet file; ``where`` is "file:line" (or ":row")."""
    p = Path(path)
    if p.suffix == ".parquet":
        if not p.is_file():
            raise ChatDataError(f"{p}: no such file")
        import pyarrow.parquet as pq

        return [(f"{p}:row {k}", row) for k, row in enumerate(pq.read_table(p).to_pylist())]
    return [(f"{p}:{line}", row) for line, row in read_rows(p)]


def _turns(value: Any, where: str, key: str) -> Messages:
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        raise ChatDataError(f"{where}: \"{key}\" must be a string or a non-empty list of {{role, content}} messages")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def pair_of(row: dict[str, Any], where: str) -> Pair:
    """A preference row in any of the layouts of the module docstring."""
    if "chosen" not in row or "rejected" not in row:
        raise ChatDataError(f"{where}: a preference row needs \"chosen\" and \"rejected\" (has: {sorted(row)})")
    chosen, rejected = row["chosen"], row["rejected"]
    if "messages" in row:
        context = _turns(row["messages"], where, "messages")
    elif isinstance(row.get("prompt"), str):
        context = [{"role": "user", "content": row["prompt"]}]
    elif isinstance(row.get("prompt"), list):
        context = _turns(row["prompt"], where, "prompt")
    elif isinstance(chosen, list) and isinstance(rejected, list):  # TRL's implicit prompt: the shared turns
        c, r = _turns(chosen, where, "chosen"), _turns(rejected, where, "rejected")
        shared = 0
        while shared < min(len(c), len(r)) - 1 and c[shared] == r[shared]:
            shared += 1
        if shared == 0 or len(c) != shared + 1 or len(r) != shared + 1:
            raise ChatDataError(f"{where}: \"chosen\" and \"rejected\" must share every turn but their last (the "
                                "answer), or the row needs \"prompt\"")
        context, chosen, rejected = c[:shared], c[-1], r[-1]
    else:
        raise ChatDataError(f"{where}: a preference row needs \"prompt\" or \"messages\" (plain-text pairs without "
                            "a prompt are not read: give the prompt)")
    answers = []
    for key, answer in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(answer, list):  # TRL's explicit conversational layout: [{"role": "assistant", ...}]
            answer = _turns(answer, where, key)
            if len(answer) != 1 or answer[0]["role"] != "assistant":
                raise ChatDataError(f"{where}: \"{key}\" as messages must be one assistant turn")
            answer = answer[0]["content"]
        elif isinstance(answer, dict):
            answer = answer.get("content")
        if not isinstance(answer, str):
            raise ChatDataError(f"{where}: \"{key}\" must be the assistant's answer, got {answer!r:.100}")
        answers.append(answer)
    margin = row.get("margin", 0.0)
    if isinstance(margin, bool) or not isinstance(margin, int | float) or not math.isfinite(margin):
        raise ChatDataError(f"{where}: \"margin\" must be a finite number, got {margin!r}")
    return Pair(tuple((m["role"], m["content"]) for m in context), answers[0], answers[1], float(margin))


def labelled_of(row: dict[str, Any], where: str) -> Labelled:
    """A row of TRL's PRM layout."""
    prompt, steps, labels = row.get("prompt"), row.get("completions"), row.get("labels")
    if not isinstance(prompt, str) or not isinstance(steps, list) or not isinstance(labels, list):
        raise ChatDataError(f"{where}: a step-labelled row needs \"prompt\" (a string), \"completions\" (the steps) "
                            f"and \"labels\" (one bool per step); has {sorted(row)}")
    if not steps or len(steps) != len(labels) or not all(isinstance(s, str) for s in steps) \
            or not all(isinstance(x, bool) for x in labels):
        raise ChatDataError(f"{where}: \"completions\" must be strings and \"labels\" as many bools "
                            f"({len(steps)} steps, {len(labels)} labels)")
    return Labelled(prompt, tuple(steps), tuple(labels))


def kind_of(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """"outcome" for preference rows, "process" for step-labelled ones."""
    where, first = rows[0]
    if "chosen" in first:
        return "outcome"
    if "labels" in first and "completions" in first:
        return "process"
    raise ChatDataError(f"{where}: neither a preference row (chosen, rejected) nor a step-labelled one "
                        f"(prompt, completions, labels); has {sorted(first)}")


def split(items: list[Any], key: Callable[[Any], str], fraction: float, seed: int) -> tuple[list[Any], list[Any]]:
    """(train, held out): a ``fraction`` of the distinct keys (prompts) held out, by a seeded hash."""
    if fraction == 0:
        return items, []
    def held(k: str) -> bool:
        digest = hashlib.sha256(f"{seed}:{k}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < fraction
    train = [x for x in items if not held(key(x))]
    test = [x for x in items if held(key(x))]
    if not train or not test:
        raise ValueError(f"rm: holding out {fraction:.0%} of {len({key(x) for x in items})} prompts left "
                         f"{len(train)} training and {len(test)} held-out rows; change eval_fraction or give eval_data")
    return train, test


# --- metrics ---------------------------------------------------------------------------------

def calibration(probs: Sequence[float], outcomes: Sequence[bool], bins: int = 10) -> dict[str, float]:
    """Log loss, Brier score and expected calibration error (ECE, over ``bins`` equal bins of the
    confidence max(p, 1 − p), each weighted by its share) of probabilities ``probs`` of events
    ``outcomes``."""
    eps = 1e-12
    n = len(probs)
    log_loss = -sum(math.log(max(p if o else 1 - p, eps)) for p, o in zip(probs, outcomes)) / n
    brier = sum((p - float(o)) ** 2 for p, o in zip(probs, outcomes)) / n
    buckets: list[list[tuple[float, bool]]] = [[] for _ in range(bins)]
    for p, o in zip(probs, outcomes):
        confidence = max(p, 1 - p)
        right = (p >= 0.5) == o
        buckets[min(bins - 1, int((confidence - 0.5) * 2 * bins))].append((confidence, right))
    ece = sum(len(b) / n * abs(sum(c for c, _ in b) / len(b) - sum(r for _, r in b) / len(b)) for b in buckets if b)
    return {"log_loss": log_loss, "brier": brier, "ece": ece}


def pairwise_report(deltas: Sequence[float]) -> dict[str, float]:
    """The outcome RM's held-out report from each pair's r⁺ − r⁻ (see the module docstring)."""
    accuracy = sum(1.0 if d > 0 else 0.5 if d == 0 else 0.0 for d in deltas) / len(deltas)
    probs = [1 / (1 + math.exp(-max(-50.0, min(50.0, d)))) for d in deltas]
    return {"pairs": float(len(deltas)), "accuracy": accuracy, "mean_margin": sum(deltas) / len(deltas),
            **calibration(probs, [True] * len(deltas))}


def step_report(probs: Sequence[Sequence[float]], labels: Sequence[Sequence[bool]]) -> dict[str, float]:
    """The PRM's held-out report from each solution's step probabilities and labels."""
    flat_p = [p for ps in probs for p in ps]
    flat_y = [y for ys in labels for y in ys]
    step_accuracy = sum((p > 0.5) == y for p, y in zip(flat_p, flat_y)) / len(flat_p)
    solution_accuracy = sum(all(p > 0.5 for p in ps) == all(ys) for ps, ys in zip(probs, labels)) / len(probs)
    return {"solutions": float(len(probs)), "steps": float(len(flat_p)), "step_accuracy": step_accuracy,
            "solution_accuracy": solution_accuracy, **calibration(flat_p, flat_y)}


# --- training --------------------------------------------------------------------------------

def _batches(items: list[Any], size: int, rng: random.Random) -> list[list[Any]]:
    order = items[:]
    rng.shuffle(order)
    return [order[i : i + size] for i in range(0, len(order), size)]


def _fit(model: torch.nn.Module, items: list[Any], opts: Options, loss_of: Callable[[list[Any]], torch.Tensor],
         say: Callable[[str], None]) -> None:
    """``opts.epochs`` shuffled passes over ``items`` in batches, each an AdamW step on
    ``loss_of(batch)`` with the gradient's norm clipped, reporting progress."""
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=opts.lr,
                                  weight_decay=opts.weight_decay)
    rng = random.Random(opts.seed)
    epochs = [_batches(items, opts.batch_size, rng) for _ in range(opts.epochs)]
    progress = _Progress(sum(len(e) for e in epochs), say)
    for batches in epochs:
        for chunk in batches:
            loss = loss_of(chunk)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), opts.max_grad_norm)
            optimizer.step()
            progress.step(float(loss.detach()))
    model.eval()


class _Progress:
    def __init__(self, total: int, say: Callable[[str], None]) -> None:
        self.total, self.say, self.start, self.done, self.last = total, say, time.perf_counter(), 0, 0.0

    def step(self, loss: float) -> None:
        self.done += 1
        now = time.perf_counter()
        if now - self.last >= 10 or self.done == self.total:
            self.last = now
            rate = (now - self.start) / self.done
            self.say(f"step {self.done}/{self.total}  loss {loss:.4f}  {rate:.1f} s/step  "
                     f"about {rate * (self.total - self.done) / 60:.1f} min left")


def _score_texts(model: Any, tokenizer: Any, texts: list[str], opts: Options) -> torch.Tensor:
    batch = rm_batch(tokenizer, texts, opts.max_length)
    with opts.autocast():
        return model(**batch).logits[:, 0].float()


def outcome_deltas(model: Any, tokenizer: Any, pairs: Sequence[Pair], opts: Options) -> list[float]:
    """r(x, y⁺) − r(x, y⁻) for each pair, without gradients."""
    out: list[float] = []
    with torch.no_grad():
        for i in range(0, len(pairs), opts.batch_size):
            chunk = pairs[i : i + opts.batch_size]
            r = _score_texts(model, tokenizer, [rm_text(tokenizer, p.messages, a) for p in chunk
                                                for a in (p.chosen, p.rejected)], opts)
            out += (r[0::2] - r[1::2]).tolist()
    return out


def train_outcome(model_spec: str, train: list[Pair], held: list[Pair], opts: Options, output: Path,
                  say: Callable[[str], None] = print) -> dict[str, Any]:
    """Train a Bradley–Terry reward model and save it to ``output``; returns the report."""
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(opts.seed)
    tokenizer = load_tokenizer(model_spec)
    tokenizer.truncation_side = "left"
    model = AutoModelForSequenceClassification.from_pretrained(resolve_model_path(model_spec), num_labels=1,
                                                               dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    before = pairwise_report(outcome_deltas(model.eval(), tokenizer, held, opts)) if held else {}

    def loss_of(chunk: list[Pair]) -> torch.Tensor:
        texts = [rm_text(tokenizer, p.messages, a) for p in chunk for a in (p.chosen, p.rejected)]
        r = _score_texts(model, tokenizer, texts, opts)
        chosen, rejected = r[0::2], r[1::2]
        margin = torch.tensor([p.margin for p in chunk])
        return -F.logsigmoid(chosen - rejected - margin).mean() + opts.center * ((chosen + rejected) ** 2).mean()

    _fit(model, train, opts, loss_of, say)
    report = {"kind": "outcome", "model": model_spec, "train_pairs": len(train), "options": asdict(opts),
              "held_out_before": before,
              "held_out": pairwise_report(outcome_deltas(model, tokenizer, held, opts)) if held else {}}
    _save(model, tokenizer, report, output)
    return report


def _prm_rows(prm: ClassifierPRM, chunk: Sequence[Labelled], max_length: int) -> tuple[
        torch.Tensor, torch.Tensor, list[list[int]]]:
    """(input ids, attention mask, each row's label positions) of a batch, right-padded; a row
    longer than ``max_length`` is an error (cutting it would drop labels)."""
    items = [prm.layout(x.prompt, x.steps) for x in chunk]
    too_long = [len(ids) for ids, _ in items if len(ids) > max_length]
    if too_long:
        raise ValueError(f"rm: a step-labelled row has {too_long[0]} tokens, over max_length {max_length}")
    ids_BT, mask_BT = prm.padded([ids for ids, _ in items])
    return ids_BT, mask_BT, [positions for _, positions in items]


def train_process(model_spec: str, train: list[Labelled], held: list[Labelled], opts: Options, output: Path,
                  say: Callable[[str], None] = print) -> dict[str, Any]:
    """Train a token-classification PRM and save it to ``output``; returns the report."""
    from transformers import AutoModelForTokenClassification

    torch.manual_seed(opts.seed)
    tokenizer = load_tokenizer(model_spec)
    model = AutoModelForTokenClassification.from_pretrained(resolve_model_path(model_spec), num_labels=2,
                                                            dtype=torch.float32)
    model.config.pad_token_id = tokenizer.pad_token_id
    prm = ClassifierPRM(model, tokenizer, opts.separator, batch_size=opts.batch_size)

    def evaluate() -> dict[str, float]:
        if not held:
            return {}
        with opts.autocast():
            probs = prm.score([x.prompt for x in held], [list(x.steps) for x in held], [{}] * len(held))
        return step_report(probs, [list(x.labels) for x in held])

    before = evaluate()

    def loss_of(chunk: list[Labelled]) -> torch.Tensor:
        ids_BT, mask_BT, positions = _prm_rows(prm, chunk, opts.max_length)
        with opts.autocast():
            logits_BTC = model(input_ids=ids_BT, attention_mask=mask_BT).logits.float()
        picked = torch.cat([logits_BTC[row, pos] for row, pos in enumerate(positions)])
        return F.cross_entropy(picked, torch.tensor([int(y) for x in chunk for y in x.labels]))

    _fit(model, train, opts, loss_of, say)
    report = {"kind": "process", "model": model_spec, "train_solutions": len(train), "options": asdict(opts),
              "held_out_before": before, "held_out": evaluate()}
    _save(model, tokenizer, report, output)
    return report


def _save(model: Any, tokenizer: Any, report: dict[str, Any], output: Path) -> None:
    def fill(folder: Path) -> None:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        (folder / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    write_folder(output, fill)


def train_reward_model(data: str, model_spec: str, output: str | Path, opts: Options, *, eval_data: str | None = None,
                       kind: str = "auto", say: Callable[[str], None] = print) -> dict[str, Any]:
    """Read ``data`` (and ``eval_data``), train the kind of reward model its rows call for (or
    ``kind``), save it to ``output`` and return the report (the module docstring)."""
    rows = read_table(data)
    found = kind_of(rows)
    if kind not in ("auto", found):
        raise ValueError(f"rm: {data} holds {found} rows, but kind = {kind!r}")
    held_rows = read_table(eval_data) if eval_data else []
    if found == "outcome":
        pairs = [pair_of(row, where) for where, row in rows]
        if held_rows:
            train, held = pairs, [pair_of(row, where) for where, row in held_rows]
        else:
            train, held = split(pairs, lambda p: json.dumps(p.context), opts.eval_fraction, opts.seed)
        say(f"rm: a Bradley-Terry reward model on {model_spec}: {len(train)} training pairs, {len(held)} held out")
        return train_outcome(model_spec, train, held, opts, Path(output), say)
    items = [labelled_of(row, where) for where, row in rows]
    if held_rows:
        train_items, held_items = items, [labelled_of(row, where) for where, row in held_rows]
    else:
        train_items, held_items = split(items, lambda x: x.prompt, opts.eval_fraction, opts.seed)
    say(f"rm: a process reward model on {model_spec}: {len(train_items)} training solutions, {len(held_items)} held out")
    return train_process(model_spec, train_items, held_items, opts, Path(output), say)
