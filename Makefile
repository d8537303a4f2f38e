# hvdtrain: `make demo` and `make test` work on a fresh machine; both set up first (idempotent).
VENV := .venv
BIN := $(VENV)/bin
NP ?= 2
# Open MPI refuses to run as root without these; harmless for other users.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export HOROVOD_TESTS

.PHONY: setup demo lint test test-long test-unit test-horovod bench clean

setup:
	bash scripts/setup.sh

# Workers write to horovodrun's pipes, never to a terminal: the bar is asked for when make's is one.
demo: setup
	if [ -t 1 ]; then progress=bar; else progress=lines; fi; \
	$(BIN)/horovodrun -np $(NP) --gloo $(BIN)/hvdtrain train configs/digits_torch.yaml log.overwrite=true \
		log.progress=$$progress
	$(BIN)/hvdtrain report runs/digits_torch

# Every tracked Python file (ruff honours .gitignore), and the types of the package; the rules of
# both are in pyproject.toml, so the result does not depend on the machine's ruff or mypy set-up.
# mypy runs even when ruff found something, so that one run shows every finding.
lint: setup
	status=0; $(BIN)/ruff check . || status=1; $(BIN)/mypy || status=1; exit $$status

# The gates first (lint), in seconds, before the clusters start and the tiers run for minutes.
# The TensorFlow tests that start Horovod in pytest's own process get a process of their own: Horovod
# for torch and for TensorFlow both started in one process crash it at exit (after the tests passed).
# tests/slurm needs the one-node Slurm cluster, tests/cluster the two-node namespace cluster with
# Slurm over it: all started here and stopped whatever the tests do (the trap), so that the machine is
# left as it was. The unit tier runs on its own, where its conftest checks that it loaded no
# framework. The slowest tests are listed at the end of the longest run (--durations). Every tier
# runs even when one before it failed, so that one run shows every failure; make fails if any did.
test: setup lint
	trap 'bash scripts/cluster_local.sh stop; bash scripts/slurm_local.sh stop' EXIT; \
	bash scripts/slurm_local.sh start && \
	bash scripts/cluster_local.sh start 2 && bash scripts/slurm_local.sh start --nodes || exit 1; \
	status=0; \
	$(BIN)/python -m pytest tests/unit || status=1; \
	$(BIN)/python -m pytest -m "not long" --durations=40 tests --ignore=tests/unit \
		--ignore=tests/tensorflow --ignore=tests/horovod || status=1; \
	$(BIN)/python -m pytest -m "not long" tests/tensorflow || status=1; \
	$(BIN)/python -m pytest -rs tests/horovod || status=1; \
	exit $$status

# The cases marked `long`: the rest of exhaustive matrices (each schedule under each controller, ...)
# whose representative case runs in `make test`, which they would take well past 30 minutes.
# Most are multi-rank runs on this machine; tests/slurm's need the one-node Slurm cluster, started
# here and stopped whatever the tests do. scripts/test_long.py runs the pytest invocations
# (tests/multirank, tests/slurm, then tests/tensorflow in a process of its own) and, only when all
# are green, records the date, commit and counts in docs/testing.md (its marked block).
test-long: setup
	trap 'bash scripts/slurm_local.sh stop' EXIT; \
	bash scripts/slurm_local.sh start || exit 1; \
	$(BIN)/python scripts/test_long.py

# Horovod's own parallel suites (torch, TensorFlow; Gloo and MPI; 2 ranks) against the installed
# build, with a table per suite and controller. HOROVOD_TESTS: a folder with v0.28.1's test/
# (default ../shared/horovod-tests). Known test artifacts: tests/horovod/known_artifacts.txt.
test-horovod: setup
	$(BIN)/python scripts/test_horovod.py

# The tiers a contributor runs without root and without a cluster, in about 5 minutes on 2 cores:
# the unit tier, then PyTorch and TensorFlow in one process (Horovod at size 1), each in a pytest
# process of its own, as in `make test`. The markers select within each folder (setup.cfg lists
# the tiers); the tests that mount a file system skip without root, listed (-rs).
.PHONY: test-fast
test-fast: setup
	$(BIN)/python -m pytest -m unit tests/unit && \
	$(BIN)/python -m pytest -m torch -rs --durations=10 tests/torch && \
	$(BIN)/python -m pytest -m tensorflow --durations=10 tests/tensorflow

test-unit:
	$(BIN)/python -m pytest tests/unit

# Every benchmark of benchmarks/, with round counts that keep the whole under 30 minutes on 2 cores.
bench: setup
	bash benchmarks/all.sh

clean:
	rm -rf runs .pytest_cache
