# Shared by the job scripts: the Python to use, where results go, and the launcher.
set -euo pipefail
KVBENCH_PY=${KVBENCH_PY:-$PWD/.venv/bin/python}
OUT=${OUT:-results/slurm-${SLURM_JOB_ID:-local}}
mkdir -p "$OUT"
# srun starts one task per rank; mpi4py picks the world up from PMIx.
launch() { srun --mpi=pmix "$@"; }
