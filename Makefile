# The project's front door. `make demo` runs the demo trainer on an embedded store;
# `make test` runs the linters (ruff, mypy) then pytest. Both create .venv and install the project first.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: demo test test-envs lint typecheck bench bench-quick compat install clean

# The editable install puts the repository's root on sys.path (setuptools' "compat" mode) instead of
# its default import hook, whose module and imports cost each new interpreter some 30 ms at startup:
# a Ray cluster starts a few hundred (every worker, its agents, the CLI).
EDITABLE := --config-settings editable_mode=compat

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --disable-pip-version-check $(EDITABLE) -e '.[dev]'
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(BIN)/rlplane demo

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@$(MAKE) --no-print-directory typecheck

# mypy over every package (strict for the product; workers and bench checked, not strict); what is
# checked and how: [tool.mypy] in pyproject.toml. Its cache lives in build/mypy (a cold run takes some
# 6-7 s of CPU, a warm one under 1 s).
typecheck: $(STAMP)
	$(BIN)/mypy

# The suite runs on TEST_WORKERS pytest-xdist workers, each with a Ray of its own (tests/conftest.py),
# a module's tests on one worker (--dist loadfile; the first-hour tests that share one newcomer's machine
# go together, tests/conftest.py), in the order tests/conftest.py gives (slow first).
TEST_WORKERS ?= 2

test: lint
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# A quick subset under RAY_TMPDIR, RAY_ADDRESS with another Ray running, the fork server off
# (RLT_FORK_SERVER=0) and a user that is not root (scripts/test_envs.sh; some 4-5 minutes).
test-envs: $(STAMP)
	scripts/test_envs.sh

# Benchmarks need the `bench` extra (matplotlib, transferqueue==0.1.11 for side-by-side runs).
$(BENCH_STAMP): $(STAMP)
	$(BIN)/pip install --quiet --disable-pip-version-check $(EDITABLE) -e '.[dev,bench]'
	touch $(BENCH_STAMP)

bench: $(BENCH_STAMP)
	$(BIN)/rlplane bench all

# Controller bypass in under a minute (64 MiB, 2 workers): build/bench/bypass.json and bypass.png.
bench-quick: $(BENCH_STAMP)
	$(BIN)/rlplane bench bypass --quick --out build/bench

# verl 0.9.1's TransferQueue code and TransferQueue 0.1.11's own tests, unchanged, against dataplane.tq
# and against the real TransferQueue (both installed into a temp dir; needs PyPI; some 15-30 minutes).
# Prints passed / failed per file and per implementation. IMPLS=dataplane runs ours only.
compat: $(STAMP)
	scripts/tq_compat.sh

clean:
	rm -rf $(VENV) build .pytest_cache
