"""Prompt sources and prompt rendering."""

from rlvr.data.tasks import (
    Example,
    jsonl_examples,
    list_tasks,
    reasoning_gym_examples,
    render_example,
    render_prompt,
)

__all__ = ["Example", "jsonl_examples", "list_tasks", "reasoning_gym_examples", "render_example", "render_prompt"]
