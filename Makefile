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
		--nproc_per_node=$${NPROC:-$$($(PY) -c "$(COUNT_PROCS)")} -m megatron_mtraining.tools.demo

test: setup
	$(PY) -m pytest -q tests

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
