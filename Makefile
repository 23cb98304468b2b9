# Two entry points (see README): `make demo` and `make test`. Both install everything first.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: install demo test lint bench clean docs bench-docs

install: $(STAMP)

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch, pinned: an unpinned torch pulls a multi-GB CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	# The stacks' extras (docs/stacks/): their tests skip, saying so, where they are missing.
	$(PY) -m pip install -q -e '.[test,hf,lightning]'
	@command -v dot >/dev/null 2>&1 || ./.ci/install-graphviz
	touch $(STAMP)

demo: install
	$(VENV)/bin/shardlang
	$(VENV)/bin/torchrun --standalone --nproc-per-node 4 examples/train_gpt.py --steps 8

test: install
	$(VENV)/bin/ruff check .
	$(PY) -m pytest -q

# The docs site into site/; --strict (set in mkdocs.yml) fails on a broken link, a page missing
# from the nav, or a docstring mkdocstrings cannot render. Its packages go into the same venv.
DOCS_STAMP := $(VENV)/.docs-installed

$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The benchmark pages under docs/benchmarks/ (every stored run, with its command, commit, date and
# machine), their SVG plots, and the <!-- bench:NAME --> blocks of README.md and the docs pages
# that quote measurements, rendered from the runs stored under docs/benchmarks/data/ (each written
# by a bench/ script's --json) by bench/render_docs.py. It runs no benchmark. The tests run
# `bench/render_docs.py --check` and fail on a page that is not what the data gives, or on a
# measured number typed outside a block (tests/test_bench_docs.py).
bench-docs: install
	$(PY) bench/render_docs.py

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

clean:
	rm -rf $(VENV) build *.egg-info site
