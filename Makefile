# hvdtrain: `make demo` and `make test` work on a fresh machine; both set up first (idempotent).
VENV := .venv
BIN := $(VENV)/bin
NP ?= 2
# Open MPI refuses to run as root without these; harmless for other users.
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1

.PHONY: setup demo test test-unit bench clean

setup:
	bash scripts/setup.sh

demo: setup
	$(BIN)/horovodrun -np $(NP) --gloo $(BIN)/hvdtrain train configs/digits_torch.yaml log.overwrite=true

test: setup
	bash scripts/slurm_local.sh start
	$(BIN)/python -m pytest tests

test-unit:
	$(BIN)/python -m pytest tests/unit

bench: setup
	$(BIN)/python scripts/bench/overhead.py --framework torch
	$(BIN)/python scripts/bench/overhead.py --framework tensorflow
	$(BIN)/python scripts/bench/frameworks.py

clean:
	rm -rf runs .pytest_cache
