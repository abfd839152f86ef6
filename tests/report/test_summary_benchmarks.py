"""benchmarks/: the suite `pytest benchmarks` collects, and compare.py's regression rule."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import PY, ROOT

sys.path.insert(0, str(ROOT / "benchmarks"))
import compare  # noqa: E402


def _doc(medians: dict[str, float], floor: dict[str, str] | None = None) -> dict:
    return {"machine_info": {"cpu": {"brand_raw": "test"}, "python_version": "3",
                             "kvbench": {"cpu_count": 2, "load_average_at_start": [0.1]}},
            "benchmarks": [{"name": k, "stats": {"median": v, "iqr": 0.02 * v},
                            "extra_info": {"floor": (floor or {}).get(k)}}
                           for k, v in medians.items()]}


def _verdicts(lines: list[str]) -> dict[str, str]:
    return {line.split()[0]: line.split()[-1] for line in lines if line.startswith("test_")}


def test_a_slowdown_beyond_the_baseline_noise_is_a_regression():
    b1 = _doc({"test_a": 1.00, "test_b": 1.00, "test_c": 1.00})
    b2 = _doc({"test_a": 1.05, "test_b": 1.05, "test_c": 1.05})  # 5% apart: the noise
    new = _doc({"test_a": 1.08, "test_b": 1.20, "test_c": 0.90})
    got = _verdicts(compare.compare([b1, b2], new))
    # 1.08 is within 1.05 x 1.05; 1.20 is beyond it; 0.90 is below 1.00 / 1.05
    assert got == {"test_a": "ok", "test_b": "REGRESSION", "test_c": "faster"}


def test_the_floor_ratio_removes_a_slower_machine():
    floor = {"test_x": "test_floor_x"}
    base = _doc({"test_x": 1.0, "test_floor_x": 0.5}, floor)
    slower_machine = _doc({"test_x": 2.0, "test_floor_x": 1.0}, floor)  # everything 2x
    line = next(x for x in compare.compare([base, base], slower_machine)
                if x.startswith("test_x "))
    assert line.split()[3] == "2.000" and line.split()[5] == "1.000"
    assert line.endswith("ok (floor too)")
    kvbench_only = _doc({"test_x": 2.0, "test_floor_x": 0.5}, floor)  # the floor did not move
    line = next(x for x in compare.compare([base, base], kvbench_only) if x.startswith("test_x "))
    assert line.split()[5] == "2.000" and line.endswith("REGRESSION")


def test_compare_prints_and_exits_0_on_timing(tmp_path):
    paths = []
    for i, d in enumerate((_doc({"test_a": 1.0}), _doc({"test_a": 1.0}), _doc({"test_a": 9.0}))):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(d))
    res = subprocess.run([PY, str(ROOT / "benchmarks/compare.py"), *map(str, paths)],
                         capture_output=True, text=True)
    assert res.returncode == 0 and "REGRESSION" in res.stdout and "1 regression(s)" in res.stdout
    bad = subprocess.run([PY, str(ROOT / "benchmarks/compare.py"), str(paths[0]), str(ROOT)],
                         capture_output=True, text=True)
    assert bad.returncode != 0 and "cannot read" in bad.stderr


def test_pytest_collects_only_the_suite():
    res = subprocess.run([PY, "-m", "pytest", "benchmarks", "--collect-only", "-q",
                          "-p", "no:cacheprovider"], capture_output=True, text=True, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    collected = [line for line in res.stdout.splitlines() if "::" in line]
    assert collected and all(line.startswith("benchmarks/test_hot_paths.py::") for line in collected)
    for name in ("layout_allocate_and_fill", "data_check", "paged_pack_unpack", "write_records",
                 "fit_1e5_samples", "slo_analyze_1e5_requests", "metrics_parser_large_scrape"):
        assert any(name in line for line in collected), name
