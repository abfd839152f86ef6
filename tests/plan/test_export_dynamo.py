"""Dynamo's own offline replay, without and with `kvbench plan export --to dynamo`'s numbers.

The wheels are installed with `--no-deps` into a throw-away venv (the full dependency set
asks for a package PyPI does not serve). Marked `network`. Where the package index cannot be
reached (pip reports a connection error) or the install outlasts its 600 s limit, the test
skips and says why; any other install failure (a wheel gone, a resolver error) fails it. `dynamo._core.run_mocker_synthetic_trace_replay` runs one prefill and one decode
worker on its fixed timing model; the only difference between the two runs is the
exported `kv_transfer_bandwidth` / `kv_transfer_bytes_per_token` (the run without them sets
the bandwidth to 0, which Dynamo documents as "disable KV transfer delay"). The predicted
TTFT must rise by exactly what the export says Dynamo will predict (its bandwidth term, or
the setup folded in at the stated prompt length) at 500, 2,000 and 8,000 prompt tokens,
within 0.01 ms; and in fold mode, by kvbench's own model at the fold length.
"""

from __future__ import annotations

import json
import subprocess
import sys
import venv

import pytest

from tests.conftest import ROOT, pip_failure
from tests.plan.helpers import fit_file

WHEELS = ("ai-dynamo==1.6.1", "ai-dynamo-runtime==1.6.1", "msgspec", "pyzmq")
TOKENS = (500, 2000, 8000)
PIP_TIMEOUT_S = 600

REPLAY = r'''
import json, sys
from dynamo._core import run_mocker_synthetic_trace_replay

exported = json.loads(sys.argv[1])

def ttft(isl, engine):
    args = lambda role: {"engine": {"worker_type": role, **engine}}
    r = run_mocker_synthetic_trace_replay(isl, 4, 2, prefill_engine_args=args("prefill"),
                                          decode_engine_args=args("decode"), num_prefill_workers=1,
                                          num_decode_workers=1, replay_concurrency=1)
    return r.summary["mean_ttft_ms"]

out = {}
for isl in json.loads(sys.argv[2]):
    out[isl] = {"without": ttft(isl, {"kv_transfer_bandwidth": 0.0}), "with": ttft(isl, exported)}
print(json.dumps(out))
'''


@pytest.fixture(scope="module")
def dynamo_python(tmp_path_factory):
    where = tmp_path_factory.mktemp("dynamo-venv")
    venv.create(where, with_pip=True)
    py = where / "bin" / "python"
    what = f"pip install --no-deps {' '.join(WHEELS)}"
    try:
        res = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", *WHEELS],
                             capture_output=True, text=True, timeout=PIP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.skip(f"{what} took over {PIP_TIMEOUT_S} s: the package index is too slow here")
    if res.returncode != 0:
        verdict = pip_failure(res.stderr)
        if verdict == "unreachable":
            tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
            pytest.skip(f"the package index is unreachable from here ({what}): {tail}")
        pytest.fail(f"{what} failed (not a network error):\n{res.stderr[-3000:]}")
    return py


def exported(capsys, fit, *args) -> tuple[dict, dict]:
    from kvbench.plan import cli as kvplan

    assert kvplan.cli(["export", "--fit", fit, "--to", "dynamo", *args]) == 0
    text = capsys.readouterr().out
    body = json.loads("".join(ln for ln in text.splitlines(True) if not ln.startswith("#")))
    assert kvplan.cli(["export", "--fit", fit, "--to", "json", *args]) == 0
    return body["engine"], json.loads(capsys.readouterr().out)


@pytest.mark.network
@pytest.mark.parametrize("setup_as", ["fold", "drop"])
def test_dynamo_replay_ttft_rises_by_the_exported_model(dynamo_python, tmp_path, capsys, setup_as):
    fit = fit_file(tmp_path, setup_ms=1.5, effective_gb_s=25.0)  # a measured-looking link: 1.5 ms + 25 GB/s
    engine, doc = exported(capsys, fit, "--tp", "2", "--setup-as", setup_as, "--fold-at-tokens", "2000")
    res = subprocess.run([str(dynamo_python), "-c", REPLAY, json.dumps(engine), json.dumps(TOKENS)],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    ttft = {int(k): v for k, v in json.loads(res.stdout).items()}
    predicted = doc["tools"]["dynamo"]["predicted_handoff_ms"]
    for t in TOKENS:
        rise = ttft[t]["with"] - ttft[t]["without"]
        assert rise == pytest.approx(predicted[str(t)], abs=0.01), (t, rise, predicted[str(t)])
        print(f"{setup_as} {t} tokens: TTFT {ttft[t]['without']:.4f} -> {ttft[t]['with']:.4f} ms, "
              f"rise {rise:.4f} ms, export says {predicted[str(t)]:.4f}, kvbench model "
              f"{doc['handoff_ms'][str(t)]:.4f}", file=sys.stderr)
    rise_2000 = ttft[2000]["with"] - ttft[2000]["without"]
    if setup_as == "fold":  # exact at the stated length: the whole model, setup included
        assert rise_2000 == pytest.approx(doc["handoff_ms"]["2000"], abs=0.01)
    else:  # the bandwidth term only: short by the setup at every length
        assert doc["handoff_ms"]["2000"] - rise_2000 == pytest.approx(1.5, abs=0.01)


def test_pip_failures_are_told_apart():
    """An offline index skips; a missing wheel or resolver error is a failure (pip 24's words)."""
    offline = ("WARNING: Retrying (Retry(total=4, connect=None, read=None, redirect=None, "
               "status=None)) after connection broken by 'NewConnectionError('<pip._vendor.urllib3."
               "connection.HTTPSConnection object>: Failed to establish a new connection: "
               "[Errno -3] Temporary failure in name resolution')': /simple/ai-dynamo/\n"
               "ERROR: Could not find a version that satisfies the requirement ai-dynamo==1.6.1")
    gone = ("ERROR: Could not find a version that satisfies the requirement ai-dynamo==1.6.1 "
            "(from versions: 1.7.0)\nERROR: No matching distribution found for ai-dynamo==1.6.1")
    assert pip_failure(offline) == "unreachable"
    assert pip_failure(gone) == "error"
