# Sourced by every job script (which has already set -euo pipefail). It provides:
#   settings read from the environment (documented in jobs/README.md),
#   p2p ...      one benchmark step, started by the launcher (srun --mpi=pmix or mpirun)
#   matrix ...   the link matrix step (kvbench matrix: every ordered pair, fitted and judged)
#   fit_all      the fit of everything this run measured, armed with the declared link
#   need_cuda    stop with one line and exit 2 when no CUDA GPU is visible
#   a fresh output folder for this run, never reused, and --dry-run / KVBENCH_DRY_RUN=1,
#   which prints the exact commands instead of running them.

kvb_die() { echo "kvbench job ${SLURM_JOB_NAME:-$(basename "$0")}: error: $*" >&2; exit 2; }

KVBENCH_ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
KVBENCH_PY=${KVBENCH_PY:-$KVBENCH_ROOT/.venv/bin/python}
KVBENCH_LAUNCH=${KVBENCH_LAUNCH:-srun}
KVBENCH_DRY_RUN=${KVBENCH_DRY_RUN:-0}
KVBENCH_P2P_ARGS=${KVBENCH_P2P_ARGS:-}
for _arg in "$@"; do
    case $_arg in
        --dry-run) KVBENCH_DRY_RUN=1 ;;
        *) kvb_die "unknown argument $_arg (the only one is --dry-run)" ;;
    esac
done
case $KVBENCH_LAUNCH in
    srun | mpirun) ;;
    *) kvb_die "KVBENCH_LAUNCH must be srun or mpirun, got '$KVBENCH_LAUNCH'" ;;
esac
[[ $KVBENCH_DRY_RUN == 1 || -x $KVBENCH_PY ]] \
    || kvb_die "no Python at $KVBENCH_PY: run 'make venv' in $KVBENCH_ROOT or set KVBENCH_PY"
# kvbench from this checkout, whatever the folder the job was submitted from.
export PYTHONPATH=$KVBENCH_ROOT${PYTHONPATH:+:$PYTHONPATH}

# The pip Open MPI wheel finds its own files through OPAL_PREFIX; its mpirun sets it, but
# ranks started by srun directly need it too.
_venv=$(cd "$(dirname "$KVBENCH_PY")/.." 2>/dev/null && pwd -P || true)
if [[ -z ${OPAL_PREFIX:-} && -n $_venv && -x $_venv/bin/opal_wrapper ]]; then
    export OPAL_PREFIX=$_venv
fi
# Open MPI refuses to start as root unless told; test clusters (and CI) run jobs as root.
if [[ $(id -u) == 0 ]]; then
    export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

# The declared link: arms the fit's line-rate check and its link check (which path NCCL,
# UCX or the MPI library says carried the bytes). KVBENCH_LINK names one of
# `python -m kvbench.links.linkpath links`; KVBENCH_LINE_RATE_GBPS / KVBENCH_EXPECT_LINK override.
KVBENCH_LINK=${KVBENCH_LINK:-$KVBENCH_DEFAULT_LINK}
if [[ -z ${KVBENCH_LINE_RATE_GBPS:-} || -z ${KVBENCH_EXPECT_LINK:-} ]]; then
    _declared=$("$KVBENCH_PY" -m kvbench.links.linkpath declared "$KVBENCH_LINK") || exit 2
    KVBENCH_EXPECT_LINK=${KVBENCH_EXPECT_LINK:-${_declared% *}}
    KVBENCH_LINE_RATE_GBPS=${KVBENCH_LINE_RATE_GBPS:-${_declared#* }}
fi

# A folder of its own for every run: job ids restart when a cluster is rebuilt, so the id
# alone could name an old run's folder.
KVBENCH_OUT_ROOT=${KVBENCH_OUT_ROOT:-$KVBENCH_ROOT/results/slurm}
_name=${SLURM_JOB_NAME:-$(basename "$0" .sbatch)}
OUT=""
kvb_make_out() {  # on the first step, so a job that stops before measuring leaves nothing
    if [[ $KVBENCH_DRY_RUN == 1 ]]; then
        OUT="$KVBENCH_OUT_ROOT/$_name-${SLURM_JOB_ID:-local}-YYYYmmddTHHMMSSZ-XXXX"
        return
    fi
    mkdir -p "$KVBENCH_OUT_ROOT"
    OUT=$(mktemp -d "$KVBENCH_OUT_ROOT/$_name-${SLURM_JOB_ID:-local}-$(date -u +%Y%m%dT%H%M%SZ)-XXXX")
    echo "kvbench job $_name: writing to $OUT" >&2
}

# Ranks per node, for the srun limit below.
_per_node=${SLURM_NTASKS_PER_NODE:-${SLURM_TASKS_PER_NODE:-1}}
_per_node=${_per_node%%[(,]*}  # "4(x2)" or "4,2" -> 4

kvb_quote() {  # a word as a shell would need it typed (globs left to expand)
    if [[ $1 =~ ^[][A-Za-z0-9_./:=,+@%*-]+$ ]]; then printf '%s' "$1"
    else printf "'%s'" "${1//\'/\'\\\'\'}"; fi
}

kvb_run() {  # print the command, re-runnable as printed, then run it unless dry
    local w line="+"
    for w in "$@"; do line+=" $(kvb_quote "$w")"; done
    echo "$line"
    [[ $KVBENCH_DRY_RUN == 1 ]] || "$@"
}

KVB_ENV=()  # VAR=value words a step needs in its ranks' environment (printed with it)

launch() {
    local pre=()
    ((${#KVB_ENV[@]} == 0)) || pre=(env "${KVB_ENV[@]}")
    if [[ $KVBENCH_LAUNCH == srun ]]; then
        # Measured with the pip Open MPI 5 wheel under Slurm 22.05's PMIx 4.2: a rank with
        # node-local rank >= 2 dies in MPI_Init. mpirun inside the allocation has no limit.
        if [[ ${_per_node:-1} =~ ^[0-9]+$ ]] && ((_per_node > 2)); then
            echo "kvbench job $_name: warning: srun --mpi=pmix with $_per_node ranks per node;" \
                "with the pip Open MPI wheel only 2 per node start: use KVBENCH_LAUNCH=mpirun" >&2
        fi
        kvb_run "${pre[@]}" srun --mpi=pmix --kill-on-bad-exit=1 "$@"
    else
        local mpirun
        mpirun=$(dirname "$KVBENCH_PY")/mpirun
        [[ -x $mpirun ]] || mpirun=mpirun
        kvb_run "${pre[@]}" "$mpirun" -n "${SLURM_NTASKS:-2}" "$@"
    fi
}

kvb_bench() {  # MODULE ARGS...: one benchmark step of kvbench.MODULE, records into $OUT
    local module=$1
    shift
    [[ -n $OUT ]] || kvb_make_out
    # At least KVBENCH_MIN_ITERS (10) rounds per step: fewer support no interval in the fit,
    # and the largest size's time budget alone would stop a token sweep at 9. Left out when
    # KVBENCH_P2P_ARGS sets the iterations itself.
    local rounds=(--min-iters "${KVBENCH_MIN_ITERS:-10}")
    [[ " $KVBENCH_P2P_ARGS " =~ [[:space:]]--(min-)?iters([[:space:]=]) ]] && rounds=()
    # shellcheck disable=SC2086  # KVBENCH_P2P_ARGS is a list of words by design
    launch "$KVBENCH_PY" -m "kvbench.$module" "$@" "${rounds[@]}" $KVBENCH_P2P_ARGS --out "$OUT"
}

p2p() { kvb_bench p2p "$@"; }  # one benchmark step: p2p ARGS...

matrix() {  # the link matrix: every ordered pair, fitted; the verdict checks the declared link
    local expect=(--expect-link "$KVBENCH_EXPECT_LINK")
    [[ -z ${KVBENCH_EXPECT_LOCAL_LINK:-} ]] || expect+=(--expect-local-link "$KVBENCH_EXPECT_LOCAL_LINK")
    kvb_bench matrix "$@" "${expect[@]}"
}

fit_all() {
    kvb_run "$KVBENCH_PY" -m kvbench.fit "$OUT"/kvbench-p2p-*.jsonl --out "$OUT/fit.json" \
        --plot "$OUT/fit.png" --line-rate-gbps "$KVBENCH_LINE_RATE_GBPS" \
        --expect-link "$KVBENCH_EXPECT_LINK"
}

need_cuda() {  # GPU jobs: one line and exit 2 on a node without a CUDA GPU, before any launch
    kvb_run "$KVBENCH_PY" -m kvbench.p2p.gpu_select --require-cuda
}

words() { echo "${1//,/ }"; }  # "a,b" -> "a b", for loops over comma lists
