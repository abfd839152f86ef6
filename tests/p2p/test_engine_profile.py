"""`--nixl-engine-profile`: the engine shape's knobs as shipped profiles (kvbench.p2p.transports.nixl.profile).

What is proven here, without NIXL or MPI (the NIXL transport's `read_options` is the part of
`open()` that turns options into the record's fields; the MPI runs of test_engine_shape.py
run the same profiles through real NIXL):

- every engine-shape configuration the project ran with the old flags (the lab's 2^4
  factorial and what-ifs, the paced and replica runs, the descriptor sweep, the tests' runs)
  gives, in the profile spelling, the transport options the old flags gave: the old values
  were captured from the code before the change (tests/data/p2p/engine_profile_golden.json);
- a committed engine-shape record (results/gpu-h100-20261206, the descriptor sweep on an
  H100) has the spec id the profile spelling of its command gives;
- every old flag is refused in one line that names the new spelling, and that spelling,
  applied, sets what the old flag set;
- profile values are checked with the bounds the flags had, in one line, exit 2.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from kvbench.lab.agree import p2p as agree_p2p
from kvbench.lab.load import handoff
from kvbench.p2p.args import build_parser, cuts_of
from kvbench.p2p.transports.nixl import engine_shape as es
from kvbench.p2p.transports.nixl import profile
from kvbench.p2p.transports.nixl.transport import NIXLTransport
from kvbench.records.schema.p2p import spec_id_of

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests/data/p2p/engine_profile_golden.json").read_text())["cases"]
STEPS = ROOT / "results/lab/agree-20261206-agree2-c/p2p/steps-1rps.json"
H100 = ROOT / "results/gpu-h100-20261206/kvbench-p2p-20261206T094906Z-48720d.jsonl"


def parse(argv: list[str] | str):
    return build_parser(0).parse_args(shlex.split(argv) if isinstance(argv, str) else argv)


def options(args) -> dict:
    """The spec's transport_options the NIXL transport derives from parsed options."""
    t = NIXLTransport.__new__(NIXLTransport)
    t.read_options(args)
    return t.spec_options()


def refused(argv: list[str], capsys) -> str:
    with pytest.raises(SystemExit) as exit_:
        parse(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------
# the same records as the old flags


def _lab_lines() -> dict[str, str]:
    """The lab agree job's lines, built by the lab's own code (repeat 2, one drawn-poll rate,
    one replica rate), as its cases file holds them."""
    base = agree_p2p.base_flags(Path("config.json"), 128, 256, 20, 1000)
    cfgs = agree_p2p.configs({"1": STEPS}, True, {"4": (STEPS, 104.167)})
    return {f"lab:{name}": f"{base} {extra}" for name, extra in agree_p2p.seeded(cfgs, 2).items()}


def test_every_old_configuration_records_the_same_options_through_profiles():
    lab = _lab_lines()
    assert set(lab) == {k for k in GOLDEN if k.startswith("lab:")}  # every lab configuration
    for name, case in GOLDEN.items():
        argv = lab[name] if name in lab else case["new"]
        assert options(parse(argv)) == case["options"], name


def test_the_golden_values_can_tell_configurations_apart():
    """The comparison above would catch a profile that drifted: the captured options differ
    between the configurations one knob apart, and a planted change is seen."""
    lab = _lab_lines()
    assert GOLDEN["lab:engine"]["options"] != GOLDEN["lab:waits-yield"]["options"]
    assert GOLDEN["lab:engine"]["options"] != GOLDEN["lab:delay0"]["options"]
    planted = lab["lab:engine"].replace("--nixl-engine-profile lab", "--nixl-engine-profile vllm-0.32")
    assert options(parse(planted)) != GOLDEN["lab:engine"]["options"]  # the lab's delay lost


def test_a_committed_engine_record_keeps_its_spec_id_through_the_profile():
    """results/gpu-h100-20261206 ran `--nixl-shape engine --nixl-poll busy --nixl-waits spin
    --no-nixl-progress-thread --nixl-threads 0` (commands.txt step 10). Its profile spelling
    gives the same transport options and cut, so every record's spec id (the rest of the
    spec is the record's own: hosts, world, model, device) is the one it was written with."""
    args = parse("--transport nixl --nixl-engine-profile descriptors --no-nixl-progress-thread "
                 "--layout paged --granularity block --model llama-3.1-8b "
                 "--block-size 1,4,16,64 --block-ids scattered,contiguous --sizes 128,512")
    from kvbench.model import get_dtype, resolve_model
    from kvbench.p2p.args import block_sizes_of

    model = resolve_model("llama-3.1-8b", None)
    cuts = [(c.block_size, c.spec()) for c in cuts_of(args, block_sizes_of(args), model,
                                                      get_dtype("bf16"), [128, 512])]
    recs = [json.loads(line) for line in H100.read_text().splitlines()]
    assert len(recs) == 16
    for rec in recs:
        spec = dict(rec["spec"], transport_options=options(args))
        assert (spec["block_size"], spec["cut"]) in cuts
        assert spec_id_of(spec) == rec["spec_id"]
    wrong = dict(recs[0]["spec"], transport_options=options(parse(
        "--transport nixl --nixl-engine-profile vllm-0.32 --no-nixl-progress-thread")))
    assert spec_id_of(wrong) != recs[0]["spec_id"]  # the default profile is another spec


def test_the_lab_reference_job_runs_the_lab_profile():
    cmd = handoff.engine_cmd(Path("c.json"), Path("out"), 1000)
    args = parse(cmd[cmd.index("kvbench.p2p") + 1:])
    assert options(args) == GOLDEN["lab:engine"]["options"]
    cmd = handoff.engine_cmd(Path("c.json"), Path("out"), 250)
    assert options(parse(cmd[cmd.index("kvbench.p2p") + 1:]))["progress_delay_us"] == 250


# ---------------------------------------------------------------------------
# the old flags: one line naming the new spelling, which does what they did


OLD = [("--nixl-per-request", None, "per_request", True),
       ("--no-nixl-per-request", None, "per_request", False),
       ("--nixl-poll", "busy", "poll", "busy"), ("--nixl-waits", "yield", "waits", "yield"),
       ("--nixl-announce", "nixl", "announce", "nixl"),
       ("--nixl-spin-window-ms", "2", "spin_window_ms", 2.0),
       ("--nixl-threads", "0", "threads", 0), ("--nixl-telemetry", None, "telemetry", True),
       ("--no-nixl-telemetry", None, "telemetry", False),
       ("--nixl-progress-delay-us", "1000", "progress_delay_us", 1000),
       ("--nixl-gap-ms", "250", "gap_ms", 250.0), ("--nixl-gaps", "exp", "gaps", "exp"),
       ("--nixl-busy-ms", "3.5", "busy_ms", 3.5), ("--nixl-gap-seed", "7", "gap_seed", 7)]


@pytest.mark.parametrize("flag, value, key, want", OLD, ids=[o[0] for o in OLD])
def test_an_old_flag_names_its_profile_spelling(capsys, flag, value, key, want):
    err = refused(["--transport", "nixl", flag, *([value] if value else [])], capsys)
    assert f"{flag} is now part of an engine profile: --nixl-engine-profile vllm-0.32:" in err
    spelling = err.split("--nixl-engine-profile ", 1)[1].split(" (see --help)")[0]
    args = parse(["--transport", "nixl", "--nixl-engine-profile", spelling])
    assert getattr(args, f"nixl_{key}") == want and args.nixl_shape == "engine"


def test_every_engine_knob_has_an_old_flag_hint():
    assert {key for key, _fixed in profile.OLD_FLAGS.values()} == set(profile.KEYS)


@pytest.mark.parametrize("value, needle", [
    ("engine", "--nixl-shape engine is now --nixl-engine-profile vllm-0.32"),
    ("link", "the link shape is the default"),
])
def test_the_old_shape_flag_names_the_new_spelling(capsys, value, needle):
    assert needle in refused(["--nixl-shape", value], capsys)


def test_the_help_shows_one_engine_flag(capsys):
    with pytest.raises(SystemExit):  # NIXL's own flags are listed once it is chosen
        parse(["--transport", "nixl", "--help"])
    out = capsys.readouterr().out
    group = out.split("nixl engine-shaped handoff", 1)[1].split("\n\n", 1)[0]
    assert [ln.split()[0] for ln in group.splitlines() if ln.strip().startswith("--")] == [
        "--nixl-engine-profile"]
    assert "--nixl-waits" not in out and "--nixl-shape" not in out


# ---------------------------------------------------------------------------
# profiles: shipped, stacked, from a file, checked


def test_the_shipped_profiles_load_and_vllm_holds_every_key():
    files = profile.shipped()
    assert {"vllm-0.32", "lab", "waits-yield", "waits-spin", "announce-nixl", "replica",
            "descriptors"} <= set(files)
    assert set(profile.layer("vllm-0.32")) == set(profile.KEYS)
    for name in files:  # each runs alone: its pacing keys go together
        args = parse(["--transport", "nixl", "--nixl-engine-profile", name])
        assert es._pacing_error(args) is None, name


def test_the_profiles_are_package_data():
    tomllib = pytest.importorskip("tomllib")
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    globs = doc["tool"]["setuptools"]["package-data"]["kvbench.p2p.transports.nixl"]
    base = ROOT / "kvbench/p2p/transports/nixl"
    shipped = {p for g in globs for p in base.glob(g)}
    assert shipped and set(profile.shipped().values()) <= shipped


def test_profiles_stack_in_order_from_vllms_defaults(tmp_path):
    args = parse("--nixl-engine-profile lab --nixl-engine-profile waits-yield")
    assert (args.nixl_progress_delay_us, args.nixl_waits, args.nixl_threads) == (1000, "yield", 4)
    args = parse("--nixl-engine-profile waits-yield --nixl-engine-profile vllm-0.32")
    assert args.nixl_waits == "sleep"  # vllm-0.32 sets every key: it starts over
    f = tmp_path / "mine.json"
    f.write_text(json.dumps({"description": "x", "threads": 2, "poll": "busy"}))
    args = parse(f"--nixl-engine-profile {f}:gap_ms=5")
    assert (args.nixl_threads, args.nixl_poll, args.nixl_gap_ms) == (2, "busy", 5.0)
    assert args.nixl_profile_given == ["gap_ms", "poll", "threads"]
    assert parse([]).nixl_shape == "link" and parse([]).nixl_threads is None


def test_the_lab_writes_specs_the_parser_checks():
    assert profile.spec_text("lab", progress_delay_us=0, per_request=False) == \
        "lab:progress_delay_us=0,per_request=false"
    with pytest.raises(profile.UsageError):
        profile.spec_text(threads=100000)


BAD = [
    ("vllm-0.32:threads=100000", "threads must be a non-negative integer (<= 256), got '100000'"),
    ("vllm-0.32:threads=-1", "threads must be a non-negative integer"),
    ("vllm-0.32:threads=nan", "threads must be"),
    ("vllm-0.32:progress_delay_us=1000001", "progress_delay_us must be"),
    ("vllm-0.32:gap_ms=60001", "gap_ms must be"), ("vllm-0.32:gap_ms=inf", "gap_ms must be"),
    ("vllm-0.32:busy_ms=-1", "busy_ms must be"), ("vllm-0.32:spin_window_ms=1e9", "spin_window_ms"),
    ("vllm-0.32:gap_seed=2147483648", "gap_seed must be"),
    ("vllm-0.32:waits=nap", "waits 'nap': one of sleep, yield, spin, engine"),
    ("vllm-0.32:gaps=poisson", "gaps 'poisson'"), ("vllm-0.32:announce=http", "announce 'http'"),
    ("vllm-0.32:per_request=maybe", "per_request must be true or false"),
    ("vllm-0.32:nixl_threads=4", "'nixl_threads' is not an engine-profile key"),
    ("vllm-0.32:threads", "an override is key=value"), ("vllm-0.32:", "nothing after ':'"),
    ("vllm-0.33", "no engine profile 'vllm-0.33'; shipped: "), (":", "nothing after ':'"),
    ("./missing.json", "no such profile file: missing.json"),
]


@pytest.mark.parametrize("spec, needle", BAD, ids=[b[0] for b in BAD])
def test_a_bad_profile_value_is_one_line(capsys, spec, needle):
    err = refused(["--transport", "nixl", "--nixl-engine-profile", spec], capsys)
    assert "argument --nixl-engine-profile: " in err and needle in err, err


@pytest.mark.parametrize("content, needle", [
    ("[1, 2]", "profile {f}: a JSON object of keys, got list"),
    ("{not json", "{f}: not valid JSON"),
    ('{"threads": true}', "profile {f}: threads must be a number"),
    ('{"threads": 4.5}', "profile {f}: threads must be"),
    ('{"waits": 3}', "profile {f}: waits must be a string"),
    ('{"extends": "lab"}', "profile {f}: 'extends' is not"),
    ('{"threads": 1, "threads": 2}', "{f}"),
    ("x" * (profile.MAX_PROFILE_BYTES + 1), "{f}: larger than 1 MiB"),
])
def test_a_bad_profile_file_is_one_line(capsys, tmp_path, content, needle):
    f = tmp_path / "p.json"
    f.write_text(content)
    err = refused(["--nixl-engine-profile", str(f)], capsys)
    assert needle.format(f=f) in err, err


def test_a_folder_is_not_a_profile(capsys, tmp_path):
    assert "not a regular file" in refused(["--nixl-engine-profile", f"{tmp_path}/"], capsys)
    assert "not a regular file" in refused(["--nixl-engine-profile", "/dev/null"], capsys)


@pytest.mark.parametrize("spec, needle", [
    ("vllm-0.32:spin_window_ms=5", "spin_window_ms is the window of waits=engine"),
    ("vllm-0.32:gaps=exp", "gaps=exp draws gaps with the mean gap_ms"),
    ("vllm-0.32:busy_ms=5", "busy_ms is decode's work inside the gap"),
    ("replica:gap_ms=0", "gaps=exp draws gaps with the mean gap_ms"),
    ("vllm-0.32:poll=fixed:0", "period"), ("vllm-0.32:poll=sometimes", "busy, fixed:MS or draw:FILE"),
])
def test_keys_that_do_not_go_together_are_refused_with_the_other_flags(spec, needle):
    args = parse(["--transport", "nixl", "--layout", "paged", "--granularity", "block",
                  "--nixl-engine-profile", spec])
    why = es.usage_error(args)
    assert why is not None and needle in why and "\n" not in why


def test_the_engine_shapes_own_checks_name_the_profile_flag():
    args = parse(["--transport", "mpi", "--nixl-engine-profile", "vllm-0.32"])
    assert es.usage_error(args) == "--nixl-engine-profile needs --transport nixl"
    ok = parse(["--transport", "nixl", "--layout", "paged", "--granularity", "block",
                "--nixl-engine-profile", "replica"])
    assert es.usage_error(ok) is None


# the hostile values tests/test_flags.py throws at every numeric flag, at every numeric key
HOSTILE = ["１２", "nan", "inf", "-inf", "1e400", "9" * 30, "", " ", "0x10", "1_000", "12abc",
           "1e-320", "٣", "+", "--1", "true"]
NUMERIC = [k for k, spec in profile.KEYS.items() if spec.kind in ("int", "float")]


@pytest.mark.parametrize("key", NUMERIC)
def test_every_numeric_key_refuses_hostile_values_in_one_line(key):
    assert len(NUMERIC) == 6  # threads, progress_delay_us, gap_seed; the three in ms
    for value in HOSTILE:
        with pytest.raises(profile.UsageError) as err:
            profile.value_of(key, value)
        assert "\n" not in str(err.value) and str(err.value).startswith(key), (key, value)
