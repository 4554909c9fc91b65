# make demo   runs the main job (small end-to-end MTraining run)
# make test   runs the whole test suite
# Both create .venv on first use (scripts/setup_env.sh) and rebuild the extension when csrc/ changes.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.mtraining-installed

.PHONY: setup demo test test-gpu bench-kernel tables clean

setup: $(STAMP)

$(STAMP): scripts/setup_env.sh setup.py pyproject.toml $(wildcard csrc/*)
	bash scripts/setup_env.sh $(VENV)
	touch $(STAMP)

# All GPUs when there are any, else 2 CPU processes with gloo (counted after setup, in the recipe).
COUNT_PROCS := import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 2)

demo: setup
	OMP_NUM_THREADS=1 $(PY) -m torch.distributed.run --standalone \
		--nproc_per_node=$${NPROC:-$$($(PY) -c "$(COUNT_PROCS)")} examples/demo/demo.py

# The suite on TEST_WORKERS pytest-xdist workers, a whole file per worker at a time (module-level
# caches and fixtures are built once), the longest files first (tests/conftest.py orders them).
# One thread per worker: 2 workers with torch's default 2 OpenMP threads each oversubscribe the
# 2 cores (measured slower than 1 worker). Serial where pytest-xdist is missing (setup_env.sh
# installs it; on GPU hosts it may have failed).
TEST_WORKERS ?= 2
XDIST = $$($(PY) -c "import xdist" 2>/dev/null && echo "-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder")

test: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} $(PY) -m pytest -q $(XDIST) tests

test-gpu: setup
	$(PY) -m pytest -q -m gpu tests

# The kernel benchmark needs a CUDA GPU; elsewhere it says so and runs the script's smoke mode
# (tiny fp32 shapes, seconds: it checks the script, its figures mean nothing).
bench-kernel: setup
	@if $(PY) -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then \
		$(PY) benchmarks/kernel.py; \
	else \
		echo "make bench-kernel: no CUDA GPU here, and the benchmark needs one (it would run for minutes on" \
		     "the CPU and measure nothing). Running its smoke mode instead: benchmarks/kernel.py --smoke"; \
		$(PY) benchmarks/kernel.py --smoke; \
	fi

tables: setup
	$(PY) benchmarks/make_tables.py

clean:
	rm -rf $(VENV) build *.egg-info megatron_mtraining/_C*.so
