"""Probe: does the bundled model use a Python tool on the demo sums? 32 tool_math episodes (8 prompts × 4),
3 turns of up to 96 tokens, temperature 1; prints endings, mean return, tool calls and errors, and
four transcripts. Behind the tool_math probe in docs/LOG.md.

    .venv/bin/python bench/probe_tool_math.py
"""
import collections, time
from rlvr.config import load_config
from rlvr.train.data import load_examples
from rlvr.models import load_model, load_tokenizer, eos_token_ids, resolve_dtype
from rlvr.rollout.engine import EmbeddedEngine
from rlvr.rewards import build_rewards
from rlvr.agents.envs import ToolMath
from rlvr.agents.runner import run_episodes, ChatDelta, Limits
from rlvr.data import render_prompt
from rlvr.types import SamplingParams
cfg = load_config("configs/demo.toml", ['task.instruction=""'])
tr, _ = load_examples(cfg)
tok = load_tokenizer(cfg.model); model = load_model(cfg.model, resolve_dtype("auto"))
eng = EmbeddedEngine(model, tok, eos_token_ids=eos_token_ids(model, tok), seed=0)
rewards = build_rewards(cfg.reward_specs())
envs = [ToolMath(tr[i % 8], rewards) for i in range(32)]
prompts = [render_prompt(tok, e.initial_observation()) for e in envs]
t=time.time()
eps = run_episodes(eng, tok, envs, prompts, SamplingParams(temperature=1.0, max_new_tokens=96), Limits(max_turns=3, max_turn_tokens=96), ChatDelta(tok), eos_token_ids(model, tok))
print("seconds", time.time()-t)
print(collections.Counter(e.ending for e in eps))
print("reward", sum(e.reward for e in eps)/len(eps), "tool_calls", sum(e.metrics.get("tool_calls",0) for e in eps)/len(eps), "errors", sum(e.metrics.get("tool_errors",0) for e in eps))
for e in eps[:4]:
    print("-----", e.ending, e.reward, e.metrics); print(e.completion.text[:600])
