"""A hardware-design reward: compile the model's Verilog with the task's testbench and simulate it
with Icarus Verilog (``iverilog`` and ``vvp``, Debian's package ``iverilog``), in rlvr's sandbox.

A data row carries ``testbench``: Verilog source that instantiates the design, drives it and
prints VerilogEval's verdict line, ``Mismatches: N in M samples`` (Liu et al., "VerilogEval:
Evaluating Large Language Models for Verilog Code Generation", arXiv:2309.07544). The design is
the completion's last fenced block (```verilog, ```systemverilog, ```v, or untagged), else its
last ``<answer>`` tag. ``mode = "all"`` scores 1 when the last verdict line says 0 mismatches in
at least one sample, else 0; ``"fraction"`` scores 1 − N/M. A design that does not compile, a
simulation that runs past ``timeout_s`` (a combinational loop) or prints no verdict scores 0;
each completion also reports ``verilog/compiled``.

The threat model: the policy writes the design and will print a verdict itself if it can. A
design and its testbench share one simulation, so the design is refused (scored 0, never run)
when it could reach the testbench or the run's output (`refusal`): a system task other than a
few pure functions ($display, $finish, $fopen, $value$plusargs, $root ...), a hierarchical name
(``tb.errors``, ``defparam``; also, conservatively, a generate block's or a struct's member),
SystemVerilog's ``bind``, ``force``/``release`` (forcing its own input port forces the testbench's
signal too: a review, session 35, passed every testbench so), an escaped identifier, a lone
carriage return (Icarus ends a ``//`` comment there, which would hide the code after it from the
check), or a compiler directive other than ``timescale``, ``default_nettype`` and the
conditionals (``include``; ``define``, whose token pasting could spell a refused name). So only
the testbench prints, and it sees the design through its ports alone; a testbench should still
compute what it expects from its own copy of the inputs (rlvr.data.domains' do). The testbench
comes first on the command line, so no macro of the design reaches it. The sandbox holds the run
to its time, memory and processes. A run the sandbox could not carry out is an
InfrastructureError (excluded from the update, never a 0); a testbench that does not compile with
a reference design is the task's fault, which ``check_testbench`` finds before training.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable
from typing import Any

from rlvr.errors import InfrastructureError, SandboxUnavailable
from rlvr.rewards.extract import extract_fenced
from rlvr.rewards.styles import with_info
from rlvr.sandbox import Limits, Result, Sandbox, SandboxError, default_pool

_LANGUAGES = ("verilog", "systemverilog", "v", "sv", "")
_VERDICT = re.compile(r"Mismatches:\s*(\d+)\s+in\s+(\d+)\s+samples")
_PURE = frozenset({"$signed", "$unsigned", "$clog2", "$bits", "$size", "$high", "$low", "$left", "$right",
                   "$increment", "$countones", "$onehot", "$onehot0", "$isunknown", "$ln", "$log10", "$exp",
                   "$sqrt", "$pow", "$floor", "$ceil", "$rtoi", "$itor", "$realtobits", "$bitstoreal"})
"""System functions a design may call: they compute a value and touch nothing else."""
_DIRECTIVES = frozenset({"timescale", "default_nettype", "ifdef", "ifndef", "else", "elsif", "endif", "undef",
                         "resetall"})
"""Directives a design may use; ``define is not one (SystemVerilog's token pasting could spell out
a name the checks look for), nor ``include``."""
_COMMENTS_AND_STRINGS = re.compile(r"//[^\n]*|/\*.*?(?:\*/|\Z)|\"(?:\\.|[^\"\\\n])*\"?", re.S)
_SYSTEM_NAME = re.compile(r"(?<![A-Za-z0-9_$])\$[A-Za-z0-9_$]+")  # not the $ inside an identifier (my$sig)
_HIERARCHICAL = re.compile(r"[A-Za-z_][A-Za-z0-9_$]*\s*(?:\[[^\]]*\]\s*)*\.\s*[A-Za-z_]")
_DIRECTIVE = re.compile(r"`\s*([A-Za-z_][A-Za-z0-9_]*)")
_SIMULATE = ("iverilog -g2012 -Wno-timescale {top}-o /tmp/sim /sandbox/testbench.v /sandbox/design.v > /tmp/compile.log 2>&1; "
             "head -c 4000 /tmp/compile.log; test -f /tmp/sim || exit 3; echo @compiled; exec vvp -n /tmp/sim")
"""The compiler's messages go to a file first: piped through ``head``, a compiler with more than
4 KB of warnings was killed by the broken pipe before it wrote the simulation (a review, session 35)."""
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def extract_verilog(text: str) -> str | None:
    """The last ```verilog (systemverilog, v, sv or untagged) fenced block, else the last <answer>
    tag; an unclosed last fence counts (a completion cut off by its token budget)."""
    design = extract_fenced(text, _LANGUAGES)
    return design.replace("\r\n", "\n") if design else None


def refusal(design: str) -> str | None:
    """Why a design may not run beside the testbench (the module docstring), or None."""
    if "\r" in design:  # Icarus ends a // comment at a lone carriage return, which would hide what follows it
        return "a carriage return outside a line break"
    code = _COMMENTS_AND_STRINGS.sub(" ", design)
    calls = set(_SYSTEM_NAME.findall(code)) - _PURE
    if calls:
        return f"system task {sorted(calls)[0]}"
    if _HIERARCHICAL.search(code):
        return f"hierarchical name {_HIERARCHICAL.search(code).group(0)!r}"  # type: ignore[union-attr]
    if re.search(r"\b(bind|defparam)\b", code):
        return "bind or defparam"
    if re.search(r"\b(force|release|deassign)\b", code):  # forcing its own input port forces the testbench's signal
        return "force or release"
    if "\\" in code:
        return "an escaped identifier"
    directives = set(_DIRECTIVE.findall(code)) - _DIRECTIVES
    if directives:
        return f"compiler directive `{sorted(directives)[0]}"
    return None


def _require_iverilog() -> None:
    if not (shutil.which("iverilog") and shutil.which("vvp")):
        raise SandboxUnavailable("the verilog reward needs Icarus Verilog (iverilog and vvp): apt-get install iverilog "
                                 "(`make setup` does it where it can), or brew install icarus-verilog")


def _verdict(result: Result | SandboxError, mode: str) -> Any:
    if isinstance(result, SandboxError):
        return result
    compiled = "@compiled" in result.stdout
    found = _VERDICT.findall(result.stdout.split("@compiled", 1)[-1]) if compiled else []
    if not found:
        return with_info(0.0, {"compiled": float(compiled), "refused": 0.0})
    mismatches, samples = (int(v) for v in found[-1])
    if samples == 0:
        score = 0.0
    elif mode == "fraction":
        score = max(0.0, 1.0 - mismatches / samples)
    else:
        score = float(mismatches == 0)
    return with_info(score, {"compiled": 1.0, "refused": 0.0})


def verilog_group_reward(prompt: str, completions: list[str], *, testbench: str | None = None, mode: str = "all",
                         timeout_s: float = 10.0, top: str | None = None, **_: Any) -> list[Any]:
    """Each completion's design simulated against the row's ``testbench`` (the module docstring);
    ``top`` names the testbench's top module where it has helper modules of its own (VerilogEval's
    is "tb": ``iverilog -s tb``)."""
    if mode not in ("all", "fraction"):
        raise ValueError(f"verilog reward: mode must be 'all' or 'fraction', got {mode!r}")
    if not isinstance(testbench, str) or not testbench.strip():
        raise ValueError("verilog reward: the row needs 'testbench', Verilog that prints "
                         "'Mismatches: N in M samples'")
    if top is not None and not _NAME.fullmatch(top):
        raise ValueError(f"verilog reward: top must be a module name, got {top!r}")
    _require_iverilog()
    command = _SIMULATE.format(top=f"-s {top} " if top else "")
    scores: list[Any] = []
    runs: dict[int, str] = {}
    for k, completion in enumerate(completions):
        design = extract_verilog(completion)
        refused = refusal(design) if design is not None else None
        scores.append(with_info(0.0, {"compiled": 0.0, "refused": float(refused is not None)}))
        if design is not None and refused is None:
            runs[k] = design
    limits = Limits(timeout_s=timeout_s, cpu_s=max(1, int(timeout_s)), memory_mb=1024)
    def simulate(design: str) -> Callable[[Sandbox, int], Result]:
        files = {"testbench.v": str(testbench), "design.v": design}
        return lambda sandbox, slot: sandbox.run_shell(command, files=files, limits=limits, slot=slot)

    for k, result in zip(runs, default_pool().map([simulate(d) for d in runs.values()], errors="return")):
        scores[k] = _verdict(result, mode)
    return scores


def check_testbench(testbench: str, reference: str) -> None:
    """Raise ValueError unless ``reference`` (a correct design) passes ``testbench``: a task whose
    testbench fails its own reference would score every design 0."""
    (score,) = verilog_group_reward("", [f"```verilog\n{reference}\n```"], testbench=testbench)
    if isinstance(score, InfrastructureError):
        raise score
    if float(score) != 1.0:
        raise ValueError(f"verilog: the reference design does not pass its testbench (score {float(score)}, "
                         f"{getattr(score, 'info', {})})")


# rlvr train checks the sandbox before it trains when a reward runs code (rlvr.train.setup)
verilog_group_reward.runs_code = True  # type: ignore[attr-defined]
