# Entry points a newcomer needs: `make bench` (the default handoff benchmark on two local MPI
# ranks), `make check` (the fast tier, a few minutes) and `make test` (the full default suite,
# what CI runs). All create and reuse ./.venv.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.kvbench-installed
# CPU torch from the local wheel; an unpinned torch would pull a multi-GB CUDA build.
TORCH  ?= torch==2.13.0
NP     ?= 2
SIZES  ?= 300,2000,8192
ARGS   ?=

# Open MPI refuses to run as root unless told it is fine (containers, CI).
export OMPI_ALLOW_RUN_AS_ROOT := 1
export OMPI_ALLOW_RUN_AS_ROOT_CONFIRM := 1
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)

.PHONY: bench check test test-lab bench-self bench-self-baseline lint venv clean-venv gpu-check

# pytest exits 5 when a selection holds no test (e.g. a group with nothing to run on this
# machine): said in one line, not a failure. Every other status is passed on.
PYTEST = rc=0; $(PY) -m pytest $(1) || rc=$$?; \
	if [ $$rc = 5 ]; then echo "make: pytest selected no test here: nothing to run" >&2; rc=0; fi; \
	exit $$rc

# The fast tier: every in-process test plus the few real mpirun jobs marked `check` (one per
# installed transport, a corrupted-data run, a stalled peer, one sharded run). Leaves out the
# rest of the mpirun jobs, slow tests, the network, Slurm and the lab.
CHECK_SELECT := not lab and not slurm and not slow and not network and (not mpi or check)
# Two workers (pytest-xdist): the tier is mostly fresh interpreters and small jobs, one core each.
CHECK_WORKERS ?= 2

venv: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test,p2p,mpi,nixl,plot,mooncake]"
	touch $(STAMP)

bench: $(STAMP)
	mpirun -n $(NP) $(PY) -m kvbench.p2p --sizes $(SIZES) $(ARGS)

# What ruff lints: the package, the tests, the benchmarks and scripts/ (its Python programs
# have no .py suffix: pyproject's extend-include names them)
LINT_PATHS = kvbench tests benchmarks scripts

check: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	@$(call PYTEST,-q -ra -n $(CHECK_WORKERS) -m "$(CHECK_SELECT)")

# The full default suite (CI). Its Slurm tests install Debian packages and link a library in
# a system folder only where CI is set or KVBENCH_ALLOW_SYSTEM_INSTALL=1; otherwise they skip
# and name the variable.
# In two runs: the tests that stay in their own process (slow ones included) on two workers, as
# make check runs them; then every mpirun job and the Slurm cluster one at a time (each job
# takes both cores).
test: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)
	@$(call PYTEST,-q -ra -n $(CHECK_WORKERS) -m "not lab and not mpi and not slurm")
	@$(call PYTEST,-q -ra -m "not lab and (mpi or slurm)")

# The real-vLLM group (docs/lab.md section 8): the lab's own venv and the AIPerf and GuideLLM
# venvs first (a few minutes, once; cached after), then the example plan's tiny model (built on
# first use, in the log: CI removes it first so that every run builds it from nothing).
test-lab: $(STAMP)
	$(PY) -m kvbench lab install --clients
	$(PY) -m kvbench lab model examples/lab-plan.yaml
	@$(call PYTEST,-q -ra -m lab)

# kvbench's own hot paths (benchmarks/test_*.py, pytest-benchmark) in short mode, compared with
# the committed baseline; prints ratios and regressions, never fails on timing alone.
BENCH_JSON ?= /tmp/kvbench-bench-self.json
BENCH_SELF = KVBENCH_BENCH_SHORT=1 $(PY) -m pytest benchmarks --benchmark-only -q -p no:cacheprovider \
	--benchmark-min-rounds=2 --benchmark-max-time=0.2
bench-self: $(STAMP)
	$(BENCH_SELF) --benchmark-json=$(BENCH_JSON)
	$(PY) benchmarks/compare.py benchmarks/baseline/baseline-1.json \
		benchmarks/baseline/baseline-2.json $(BENCH_JSON)

# A new baseline: two runs in the same (short) mode as bench-self, on a quiet machine.
bench-self-baseline: $(STAMP)
	$(BENCH_SELF) --benchmark-json=benchmarks/baseline/baseline-1.json
	$(BENCH_SELF) --benchmark-json=benchmarks/baseline/baseline-2.json

# On a GPU machine (docs/gpu.md): needs a CUDA torch in the venv (make clean-venv; make venv
# TORCH=torch), installs the CuPy that matches torch's CUDA major, then runs scripts/gpu-check.
# GPU_CHECK_ARGS=--one-gpu for the short check on one GPU, --two-gpu on two.
GPU_CHECK_ARGS ?=
gpu-check: $(STAMP)
	@major=$$($(PY) -c 'import torch; print((torch.version.cuda or "").split(".")[0])'); \
	if [ -z "$$major" ]; then echo "make gpu-check: error: the venv's torch has no CUDA ($(TORCH)); make clean-venv, then make venv TORCH=torch" >&2; exit 2; fi; \
	$(PY) -c 'import cupy' 2>/dev/null || $(PY) -m pip install -q "cupy-cuda$${major}x"
	$(PY) scripts/gpu-check $(GPU_CHECK_ARGS)

lint: $(STAMP)
	$(PY) -m ruff check $(LINT_PATHS)

clean-venv:
	rm -rf $(VENV)
