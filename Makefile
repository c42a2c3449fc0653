# dedupe-worker: `make demo` and `make test` work on a fresh machine (they install what they need).
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BROKER ?= rabbitmq
PYTEST_ARGS ?=

export DEDUPE_DATABASE_URL ?= postgresql://dedupe:dedupe@127.0.0.1:5432/dedupe

.PHONY: help install services services-down services-status browser demo test test-unit chaos lint format clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[dev]'
	@touch $(STAMP)

install: $(STAMP)  ## create .venv and install the package with its dev tools

services:  ## install (apt, Maven) and start PostgreSQL, RabbitMQ and Kafka on 127.0.0.1
	bash scripts/services.sh up

services-down:  ## stop the local services
	bash scripts/services.sh down

services-status:  ## show which local services are up
	bash scripts/services.sh status

browser:  ## install headless Chromium and chromedriver (Debian packages) for the status page test
	bash scripts/browser.sh

demo: install services  ## the main job end to end: duplicates, a crash, a summary (BROKER=rabbitmq|kafka)
	$(BIN)/python scripts/demo.py --broker $(BROKER)

# `make test` in two phases (README.md, "Development"): the tests that tolerate company on
# TEST_WORKERS pytest-xdist workers, then the disruptive and timing-sensitive ones
# (tests/conftest.py's SERIAL) alone. The second runs even when tests of the first failed
# (status 1), not after an interrupt or a usage error (2-4); either failing fails the target. A
# phase that PYTEST_ARGS leaves empty (pytest's status 5) is no failure unless both are.
# PYTEST_ARGS go to both phases; phase 2 appends `-n 0` after them, so it stays serial whatever
# they say (PYTEST_ARGS='-n 4' parallelises phase 1 only; TEST_WORKERS is the usual knob).
TEST_WORKERS ?= 2

test: install services browser  ## the whole suite against the real services (parallel, then serial)
	rm -f .services/chaos-report-small.md
	@export CHAOS_REPORT=$(CURDIR)/.services/chaos-report-small.md; \
	echo "== phase 1: the tests that tolerate company, -n $(TEST_WORKERS)"; \
	$(BIN)/python -m pytest --phase parallel -n $(TEST_WORKERS) --dist loadgroup $(PYTEST_ARGS); \
	one=$$?; \
	if [ $$one -ge 2 ] && [ $$one -le 4 ]; then exit $$one; fi; \
	echo "== phase 2: the disruptive and timing-sensitive tests, one at a time"; \
	$(BIN)/python -m pytest --phase serial $(PYTEST_ARGS) -n 0; \
	two=$$?; \
	echo "== phase 1 exited $$one, phase 2 exited $$two (5: nothing selected)"; \
	if [ $$one -eq 5 ] && [ $$two -eq 5 ]; then exit 5; fi; \
	for status in $$one $$two; do \
		if [ $$status -ne 0 ] && [ $$status -ne 5 ]; then exit $$status; fi; \
	done

test-unit: install  ## only the tests that need no service
	$(BIN)/python -m pytest tests/unit $(PYTEST_ARGS)

chaos: install services  ## the large chaos run: N=100,000 messages, 50 faults per scenario (long)
	rm -f .services/chaos-report.md
	CHAOS_N=$${CHAOS_N:-100000} CHAOS_FAULTS=$${CHAOS_FAULTS:-50} CHAOS_RESTART_FAULTS=$${CHAOS_RESTART_FAULTS:-10} \
	CHAOS_LEADER_FAULTS=$${CHAOS_LEADER_FAULTS:-50} \
	CHAOS_REPORT=$(CURDIR)/.services/chaos-report.md \
	$(BIN)/python -m pytest tests/chaos -q --timeout=0 $(PYTEST_ARGS)
	@echo; echo "table rows (.services/chaos-report.md):"; cat .services/chaos-report.md

BENCH_N ?= 20000
BENCH_RESULTS ?= bench/results
.PHONY: bench bench-memory bench-core bench-one-transaction bench-report

bench: install services  ## every target beside its baseline, tables and PNG plots (BENCH_N=20000; ~18 min)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	BENCH_N=$(BENCH_N) BENCH_RESULTS=$(BENCH_RESULTS) $(BIN)/python -m bench.run
	$(BIN)/python -m bench.http_api --requests $${BENCH_HTTP_N:-3000}
	$(BIN)/python -m bench.receiver --requests $${BENCH_RECEIVER_N:-3000} --paced-s 10 --time-limit-s 60

# The last run's tables and Targets with the memory run merged in, and its plots again; no run.
bench-report: install  ## tables, Targets and plots of bench/results/latest.json + memory.json again (no run)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.report $(BENCH_RESULTS)/latest.json $(wildcard $(BENCH_RESULTS)/memory.json)
	$(BIN)/python -m bench.plots $(BENCH_RESULTS)/latest.json $(wildcard $(BENCH_RESULTS)/memory.json)

bench-core: install services  ## CPU per message in the pipeline alone (no broker; PostgreSQL)
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.core --n $(BENCH_N)

bench-one-transaction: install services  ## one_transaction=True against False: CPU, msg/s and commits per message
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	$(BIN)/python -m bench.one_transaction --batch 100 --batches 4 --n 5000 --rounds 3
	$(BIN)/python -m bench.one_transaction --batch 1 --batches 1 --n 1000 --rounds 3

bench-memory: install services  ## resident memory of one worker over 1,000,000 messages
	$(BIN)/python -m pip install --quiet -e '.[bench]'
	BENCH_RESULTS=$(BENCH_RESULTS) $(BIN)/python -m bench.run --memory --n $${BENCH_MEMORY_N:-1000000}

lint: install  ## ruff format check, ruff lint, mypy --strict
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy

format: install  ## apply ruff format and the safe fixes
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:  ## remove the virtualenv and caches (not the services' data)
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache *.egg-info
