"""`kvbench p2p`'s flags, parsed, bounded and checked before any rank allocates or measures
(the run itself is kvbench.p2p.cli; what the command does, as `--help` says it: DESCRIPTION).
Every default is declared once, here, and the help prints it from there.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from kvbench.cli import (
    EXIT_USAGE,
    ArgumentParser,
    OldSpelling,
    UsageError,
    arg_float,
    arg_int,
    one_line,
    parse_positive_ints,
)
from kvbench.kv.cut import (
    BLOCK_IDS,
    KV_PAGES,
    Cut,
    block_table,
    count_pieces,
    declared_cuts,
    layer_blocks,
    page_layout,
)
from kvbench.kv.shards import ShardError
from kvbench.model import DEFAULT_MODEL, PRESETS, KVSizing, get_dtype, resolve_model
from kvbench.p2p import patterns, transports
from kvbench.p2p.helpview import ChosenHelp, add_owned, summary
from kvbench.p2p.patterns.base import Point
from kvbench.p2p.watchdog import PHASES, slug
from kvbench.records.schema.read import path_kind
from kvbench.records.schema.types import MAX_BYTES, MAX_TOKENS
from kvbench.units import parse_bytes

PROG = "kvbench p2p"
P2P_DTYPES = ("bf16", "fp16", "fp32", "fp8_e4m3", "fp8_e5m2", "int8")
DEFAULT_SIZES = "300,2000,8192"
DEFAULT_TIMEOUT = 120.0
DEFAULT_MIN_ITERS = 5
CASES = "--cases"  # many runs in one job (kvbench.p2p.cases)
# Old spellings, refused with a one-line hint naming the new one (issue 41: aliases go).
RENAMED = {"--nixl-kv": "--kv-pages", "--nixl-blocks": "--block-ids"}

DESCRIPTION = f"""\
The point-to-point KV handoff benchmark. Run it under MPI:

    mpirun -n 2 python -m kvbench.p2p --sizes {DEFAULT_SIZES}

Rank 0 plays the prefill worker, rank 1 the decode worker (patterns with more ranks say
how they split them). For each size it allocates a real KV cache, hands it over again and
again, checks every element once, and reports p50/p95/p99 handoff times and GB/s."""
MAX_ITERS = 10**6
MAX_SECONDS = 86_400.0  # a day: a --timeout or --seconds-per-point beyond it is a typo
MAX_SIZES = 256  # sizes in one run
MAX_POINTS = 1024  # sizes x cuts in one run
MAX_PIECES = 1 << 22  # pieces one handoff posts (8,192 tokens in blocks of 1, 80 layers: 1.3 M)

_EPILOG = f"""\
how it times:
  The receiver pre-posts every receive; both ranks meet at a barrier; the sender takes t0,
  (packs and) posts every send; the receiver waits for every byte (on GPU: synchronises its
  stream), unpacks into its own cache, and sends a 1-byte completion notice; the sender
  takes t1 when the notice arrives. Samples are t1 - t0 on the sender's clock. The notice's
  one-way latency is measured separately and recorded as notice_ms. The first handoff of
  each point is reported as cold_ms (lazy connection set-up, registration) and kept out of
  the samples; --warmup more handoffs follow, then the timed ones. After timing, the
  receiver wipes its copy, one more handoff runs, and every element is checked.

examples:
  mpirun -n 2 python -m kvbench.p2p                               # {DEFAULT_SIZES} tokens
  mpirun -n 2 python -m kvbench.p2p --transport gloo --granularity layer
  mpirun -n 2 python -m kvbench.p2p --layout paged --block-size 16 --granularity block --sizes 512
  mpirun -n 2 python -m kvbench.p2p --layout paged --granularity block --sizes 256,1024 \\
      --block-size 1,2,4,8,16,32,64 --block-ids scattered,contiguous   # descriptor sweep
  mpirun -n 2 python -m kvbench.p2p --bytes 4K,1M,64M             # raw link sweep
  mpirun -n 2 python -m kvbench.p2p -b 1M -e 256M -f 4 --baseline # vs bare mpi4py Send/Recv
  mpirun -n 2 python -m kvbench.p2p --cases FILE   # each line of FILE (these flags) in turn, one job
"""


def add_job_flags(p: ArgumentParser) -> None:
    """--cases (kvbench.p2p.cases runs it), and the old spellings, hidden, each a hint."""
    jobs = p.add_argument_group("many runs in one job")
    jobs.add_argument(CASES, default=None, metavar="FILE",
                      help="run each line of FILE in turn, in this one MPI job: one line per "
                           "run, holding that run's flags (shell-quoted; blank lines and # "
                           "comments skipped); nothing else goes on the command line "
                           "(docs/p2p.md)")
    for old, new in RENAMED.items():
        p.add_argument(old, nargs="?", action=OldSpelling, help=argparse.SUPPRESS,
                       hint=lambda flag, _value, new=new: f"{flag} is now {new}")


USAGE = ("mpirun -n 2 python -m kvbench.p2p [--sizes TOKENS | --bytes SIZES] [--model NAME] "
         "[--transport NAME] [--pattern NAME] [options]\n"
         "       mpirun -n 2 python -m kvbench.p2p [--cases FILE]")


def build_parser(rank: int = 0) -> ArgumentParser:
    class _Parser(ArgumentParser, ChosenHelp):
        def error(self, message):  # only rank 0 speaks; every rank exits the same way
            if rank == 0:
                print(f"{self.prog}: error: {one_line(message)} (see --help)", file=sys.stderr)
            raise SystemExit(EXIT_USAGE)

        def print_help(self, file=None):
            if rank == 0:
                super().print_help(file)

    p = _Parser(prog=PROG, description=DESCRIPTION, epilog=_EPILOG, usage=USAGE)
    what = p.add_argument_group("what moves")
    what.add_argument("--sizes", default=None, metavar="TOKENS",
                      help=f"prompt lengths in tokens, comma-separated (default {DEFAULT_SIZES})")
    what.add_argument("--bytes", default=None, metavar="SIZES",
                      help="raw message sizes instead of tokens, e.g. 4K,1M,64M (binary suffixes)")
    what.add_argument("-b", "--minbytes", default=None, help="raw sweep start, e.g. 1M (with -e, -f)")
    what.add_argument("-e", "--maxbytes", default=None, help="raw sweep end, e.g. 256M")
    what.add_argument("-f", "--stepfactor", type=arg_int(2, 1024), default=2,
                      help="raw sweep multiplier (default %(default)s)")
    what.add_argument("--model", default=None,
                      help=f"model preset (default {DEFAULT_MODEL}): {', '.join(PRESETS)}")
    what.add_argument("--model-config", metavar="PATH", help="a local Hugging Face config.json instead")
    what.add_argument("--dtype", default="bf16", help=f"KV dtype: {', '.join(P2P_DTYPES)} (FP8 moves as bytes)")
    what.add_argument("--layout", choices=("contiguous", "paged"), default="contiguous",
                      help="contiguous per-layer tensors, or paged blocks scattered in a pool")
    what.add_argument("--block-size", default="16", metavar="TOKENS",
                      help="paged block size in tokens (default %(default)s); a list (1,2,4,...,256) "
                           "measures every size under each block size (--pattern sequential)")
    cut = p.add_argument_group(
        "how the KV is cut (the page plan: --layout paged --granularity block; docs/descriptors.md)")
    cut.add_argument("--kv-pages", dest="kv_pages", default=None, metavar="KV",
                     help=f"joint: K and V of a block in one page, one region per layer (vLLM "
                          f"0.32; default {KV_PAGES[0]}); split: K and V as separate regions; a "
                          "list (joint,split) measures both")
    cut.add_argument("--block-ids", dest="block_ids", default=None, metavar="IDS",
                     help=f"the request's block ids: contiguous (a fresh allocator; default "
                          f"{BLOCK_IDS[0]}), "
                          "scattered (nothing adjacent), merged (contiguous, and consecutive "
                          "pages posted as one piece), or file:PATH (JSON {\"prefill\": [...], "
                          "\"decode\": [...]}); a list measures each")
    cut.add_argument("--tp-pair", default=None, metavar="P:D",
                     help="prefill TP : decode TP, seen from one decode rank: P > D splits every "
                          "block into P/D head groups from P/D prefill ranks (default 1:1); a "
                          "list (1:1,2:1,4:1) measures each")
    what.add_argument("--pack-kernel", choices=("torch", "cuda"), default="torch",
                      help="how a paged KV is packed for layer/whole messages on a GPU: torch "
                           "index ops (default) or the CUDA kernels in cuda/kv_pack.cu (needs CuPy)")
    what.add_argument("--device", choices=("auto", "cpu", "cuda", "cpu-async"), default="auto",
                      help="where the KV lives (default: cuda when a GPU is visible, else cpu); "
                           "cpu-async: CPU memory with a CUDA-stream-like queue, to test the "
                           "protocol's device ordering without a GPU (its times mean nothing)")
    how = p.add_argument_group("how it moves")
    how.add_argument("--transport", default="auto",
                     help="auto (nccl on GPU, mpi otherwise), or one of: "
                          + ", ".join(f"{n} ({c.description})" for n, c in transports.available().items()))
    how.add_argument("--pattern", default="sequential",
                     help="comma-separated handoff patterns: " + ", ".join(patterns.available()))
    how.add_argument("--allow-shared-gpu", action="store_true",
                     help="let two ranks of a node use one GPU (refused by default: a handoff "
                          "inside one device measures no link)")
    how.add_argument("--granularity", choices=("whole", "layer", "block"), default="whole",
                     help="one packed message, one per layer tensor, or one per paged block")
    timing = p.add_argument_group("timing")
    timing.add_argument("--order", choices=("rounds", "blocks"), default="rounds",
                        help="rounds (default): each round times every size and variant once, in "
                             "a rotating order, so drifting load falls on all alike; blocks: all "
                             "samples of one size back to back (less memory: one size at a time)")
    timing.add_argument("--clock", choices=("auto", "pingpong"), default="auto",
                        help="one timeline for every rank: auto = shared perf_counter on one "
                             "host, ping-pong offset estimates across hosts; pingpong = always "
                             "estimate (records the offsets and their uncertainty)")
    timing.add_argument("--warmup", type=arg_int(0, MAX_ITERS), default=2,
                        help="untimed handoffs after the cold one (default %(default)s)")
    timing.add_argument("--iters", type=arg_int(1, MAX_ITERS), default=20,
                        help="timed handoffs per point (default %(default)s; p95 needs >= 20, "
                             "p99 >= 100)")
    timing.add_argument("--min-iters", type=arg_int(1, MAX_ITERS), default=None,
                        help=f"never fewer timed handoffs (default {DEFAULT_MIN_ITERS}, or "
                             "--iters if smaller)")
    timing.add_argument("--seconds-per-point", type=arg_float(0, MAX_SECONDS, lo_open=True),
                        default=5.0,
                        help="cut --iters so the timed handoffs take about this long per point "
                             "(default %(default)g; with --order rounds the budget of all points is "
                             "shared, so 300,2000,8192 tokens get all 20 rounds on a 5 GB/s link)")
    timing.add_argument("--check", action=argparse.BooleanOptionalAction, default=True,
                        help="verify every received element after timing (default on)")
    timing.add_argument("--timeout", type=arg_float(0, MAX_SECONDS, lo_open=True), default=DEFAULT_TIMEOUT,
                        help="seconds any wait on another rank may take before the job is "
                             "aborted, in every phase from MPI start-up to tear-down (default "
                             "%(default)g)")
    timing.add_argument("--baseline", action="store_true",
                        help="also time a yardstick on the same bytes and print the ratio: bare "
                             "mpi4py Send/Recv (host memory), same-GPU and GPU-to-GPU copies (cuda)")
    out = p.add_argument_group("output")
    out.add_argument("--out", default="results",
                     help="directory for the .jsonl/.csv records (default %(default)s/)")
    out.add_argument("--no-write", action="store_true", help="print the table only, write no files")
    out.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    add_job_flags(p)
    # Fault injection for the test suite: proves the data check and the timeout really bite.
    p.add_argument("--debug-corrupt-elements", type=arg_int(0, 1 << 40), default=0, help=argparse.SUPPRESS)
    p.add_argument("--debug-stall-rank", type=arg_int(0, 1 << 20), default=None, help=argparse.SUPPRESS)
    # SIGSTOP one rank as it enters a phase (RANK:PHASE, phases as in kvbench.watchdog.PHASES)
    p.add_argument("--debug-stop", type=stop_spec, default=None, help=argparse.SUPPRESS)
    # each transport's and pattern's own flags: parsed always, listed once chosen (helpview)
    groups = len(p._action_groups)
    p.owned = {**add_owned(p, "transport", transports.available()),
               **add_owned(p, "pattern", patterns.available())}
    p.add_argument_group("each transport's and pattern's own flags (listed once it is chosen)",
                         summary(p.owned, PROG))
    p._action_groups.insert(groups, p._action_groups.pop())
    return p


def _reads_as(token: str, flag: str, longs: list[str]) -> bool:
    """Whether the parser reads `token` (NAME or NAME=VALUE) as `flag`: the flag itself or
    the one long option a prefix expands to (argparse's abbreviations)."""
    name = token.split("=", 1)[0]
    if not name.startswith("--") or len(name) < 3 or name in longs:
        return name == flag
    return [s for s in longs if s.startswith(name)] == [flag]


def _long_options() -> list[str]:
    return [s for a in build_parser(rank=1)._actions for s in a.option_strings if s.startswith("--")]


def asks_for_cases(argv: Sequence[str]) -> bool:
    """Whether the command line asks for a --cases job (any token the parser reads as it)."""
    longs = _long_options()
    for tok in argv:
        if tok == "--":
            break
        if _reads_as(tok, CASES, longs):
            return True
    return False


def cases_file(argv: Sequence[str]) -> str | None:
    """FILE when the command line is `--cases FILE` (or `--cases=FILE`) and nothing else;
    None otherwise (the caller refuses it: the flags go on FILE's lines)."""
    longs = _long_options()
    if len(argv) == 2 and "=" not in argv[0] and _reads_as(argv[0], CASES, longs):
        return argv[1]
    if len(argv) == 1 and "=" in argv[0] and _reads_as(argv[0], CASES, longs):
        return argv[0].split("=", 1)[1]
    return None


CASES_ALONE = f"{CASES} takes one FILE and nothing else (the flags go on each of its lines)"


# ---------------------------------------------------------------------------
# validation: computed identically on every rank, then agreed collectively


def stop_spec(text: str) -> tuple[int, str]:
    """--debug-stop RANK:PHASE (a test hook: that rank SIGSTOPs itself entering PHASE)."""
    rank, _, phase = str(text).partition(":")
    phases = [slug(p) for p in PHASES]
    if not (rank.isascii() and rank.isdigit() and len(rank) < 8) or phase not in phases:
        raise argparse.ArgumentTypeError(f"expects RANK:PHASE with PHASE one of "
                                         f"{', '.join(phases)}, got {text!r}")
    return int(rank), phase


def prescan(argv: Sequence[str]) -> tuple[float, tuple[int, str] | None]:
    """(--timeout, --debug-stop) read before MPI starts, so the start-up is bounded too. A value
    that does not parse is left to the full parse, which refuses it once MPI is up."""
    found: dict[str, str] = {}
    for i, arg in enumerate(argv):
        for flag in ("--timeout", "--debug-stop"):
            if arg == flag and i + 1 < len(argv):
                found[flag] = argv[i + 1]
            elif arg.startswith(flag + "="):
                found[flag] = arg.split("=", 1)[1]
    timeout, stop = DEFAULT_TIMEOUT, None
    try:
        if "--timeout" in found:
            timeout = arg_float(0, MAX_SECONDS, lo_open=True)(found["--timeout"])
        if "--debug-stop" in found:
            stop = stop_spec(found["--debug-stop"])
    except argparse.ArgumentTypeError:
        pass
    return timeout, stop


def _byte_size(text: str, what: str) -> int:
    try:
        n = parse_bytes(text)
    except ValueError as exc:
        raise UsageError(f"{what}: {exc}") from None
    if not 1 <= n <= MAX_BYTES:
        raise UsageError(f"{what}: byte sizes must be positive and at most 2^53 - 1, got {text!r}")
    return n


def raw_sizes(args) -> list[int] | None:
    """The --bytes list or the -b/-e/-f sweep (None: token sizes). Every size is 1 .. 2^53-1
    bytes, so a sweep ends (-b 0 used to repeat size 0 forever) after at most 53 steps."""
    if args.bytes is not None:
        items = [t.strip() for t in args.bytes.split(",")]
        if not any(items):
            raise UsageError("--bytes: empty list")
        sizes = [_byte_size(t, "--bytes") for t in items]
    elif args.minbytes is not None or args.maxbytes is not None:
        lo = _byte_size(args.minbytes if args.minbytes is not None else args.maxbytes, "-b/--minbytes")
        hi = _byte_size(args.maxbytes if args.maxbytes is not None else args.minbytes, "-e/--maxbytes")
        if hi < lo:
            raise UsageError("-e/--maxbytes must not be below -b/--minbytes")
        sizes, s = [], lo
        while s <= hi:
            sizes.append(s)
            s *= args.stepfactor
    else:
        return None
    if len(sizes) > MAX_SIZES:
        raise UsageError(f"--bytes: at most {MAX_SIZES} sizes in one run, got {len(sizes)}")
    return sizes


def token_sizes(args) -> list[int]:
    text = DEFAULT_SIZES if args.sizes is None else args.sizes
    tokens = parse_positive_ints(text, "--sizes", hi=MAX_TOKENS)
    if len(tokens) > MAX_SIZES:
        raise UsageError(f"--sizes: at most {MAX_SIZES} sizes in one run, got {len(tokens)}")
    return tokens


def iteration_counts(args) -> None:
    """--min-iters defaults to 5, or to --iters when that is smaller (--iters 3 runs 3); an
    explicit --min-iters above --iters is refused rather than silently winning."""
    if args.min_iters is None:
        args.min_iters = min(DEFAULT_MIN_ITERS, args.iters)
    elif args.min_iters > args.iters:
        raise UsageError(f"--min-iters {args.min_iters} is above --iters {args.iters}: the run "
                         "would time more handoffs than asked; lower --min-iters or raise --iters")


def resolve_device(requested: str) -> str:
    import torch

    if requested == "cpu-async":
        return requested
    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda but no CUDA GPU is visible (torch.cuda.is_available() is False)")
    return requested


def validate(args, world_size: int):
    """Everything that can be checked before allocating. Raises UsageError."""
    if getattr(args, "cases", None) is not None:  # a cases job is kvbench.p2p.cases's
        raise UsageError(CASES_ALONE)
    raws = (args.bytes, args.minbytes, args.maxbytes)
    if args.sizes is not None and any(v is not None for v in raws):
        raise UsageError("give either --sizes (tokens) or --bytes/-b/-e (raw bytes), not both")
    iteration_counts(args)
    raw = raw_sizes(args)
    tokens = None if raw else token_sizes(args)
    if args.model_config and path_kind(args.model_config) not in ("file", "missing"):
        raise UsageError(f"--model-config {args.model_config}: not a regular file (a folder, "
                         "FIFO, socket or device); every rank reads it on its own")
    model = resolve_model(args.model, args.model_config)
    if args.dtype not in P2P_DTYPES:
        raise UsageError(f"unknown dtype {args.dtype!r}; choose from {', '.join(P2P_DTYPES)}")
    dtype = get_dtype(args.dtype)
    block_sizes = block_sizes_of(args)
    for t in tokens or ():  # refuses a KV beyond 2^53 bytes before anything is sized
        for bs in block_sizes:
            KVSizing(model, dtype, t, block_size=bs if args.layout == "paged" else None)
    if raw and args.granularity != "whole":
        raise UsageError("--bytes sweeps move one message per handoff: use --granularity whole")
    for tc in transports.available().values():  # each transport's own cross-checks
        tc.check_arguments(args, world_size)
    cuts = cuts_of(args, block_sizes, model, dtype, tokens)
    device = resolve_device(args.device)
    if args.pack_kernel == "cuda":
        from kvbench.p2p.cuda_kernels import unavailable_reason

        reason = unavailable_reason()
        if reason:
            raise UsageError(reason)
        if device != "cuda" or args.layout != "paged":
            raise UsageError("--pack-kernel cuda packs paged blocks on a GPU: use it with "
                             "--device cuda --layout paged")
    tcls = transport_class(args.transport, device)
    pclasses = pattern_classes(args, world_size, model)
    points = ([Point(raw_bytes=b) for b in raw] if raw else
              [Point(prompt_tokens=t, cut=c) for t in tokens for c in cuts])
    if len(points) > MAX_POINTS:
        raise UsageError(f"{len(points)} points (sizes x cuts) in one run; at most {MAX_POINTS}")
    check_distinct(points)
    return model, dtype, device, tcls, pclasses, points


def block_sizes_of(args) -> list[int]:
    """The --block-size list; args.block_size becomes its first (what every plan but a
    block-size sweep uses). A list needs a paged KV: a contiguous one has no blocks, and each
    size would measure the same point."""
    block_sizes = parse_positive_ints(str(args.block_size), "--block-size", hi=1 << 20)
    args.block_size = block_sizes[0]
    if len(block_sizes) > 1 and args.layout != "paged":
        raise UsageError(f"--block-size {','.join(map(str, block_sizes))} sweeps paged block "
                         "sizes: add --layout paged (a contiguous KV has no blocks)")
    return block_sizes


def check_distinct(points: list[Point]) -> None:
    """A point declared twice is refused: two records of one spec id, the second measuring
    nothing new (--sizes 64,64, --bytes 4K,4096, --block-size 16,16)."""
    seen: set[str] = set()
    for pt in points:
        if pt.label in seen:
            raise UsageError(f"the point {pt.label} is declared twice (a value repeated in "
                             "--sizes, --bytes or --block-size)")
        seen.add(pt.label)


def cuts_of(args, block_sizes: list[int], model, dtype, tokens: list[int] | None) -> list[Cut]:
    """The declared cuts (kvbench.kv.cut), each checked against the model and the flags."""
    engine = any(tc.page_plan(args) for tc in transports.available().values())
    try:
        cuts = declared_cuts(block_sizes, args.kv_pages, args.block_ids, args.tp_pair, engine)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    for c in cuts if cuts[0].pages else ():
        try:  # a TP pair that cannot shard the model's heads is refused here
            page_layout(model, dtype, c)
        except ShardError as exc:
            raise UsageError(f"--tp-pair {c.tp[0]}:{c.tp[1]}: {exc}") from None
        check_pieces(model, dtype, tokens or (), c)
        need = max((layer_blocks(model, t, c.block_size, 0) for t in tokens or ()), default=1)
        for side in ("prefill", "decode") if c.blocks.startswith("file:") else ():
            block_table(c.blocks, need, side)  # a block-id file holds the largest request's ids
    sweep = len(cuts) > 1
    if args.layout == "paged" and args.granularity == "block" and not cuts[0].pages:
        for c in cuts:
            check_pieces(model, dtype, tokens or (), c)
    if not (sweep or cuts[0].pages):
        return cuts
    if not tokens:
        raise UsageError("--bytes moves a raw buffer: a block-size or cut sweep needs --sizes (tokens)")
    if args.pattern.strip() != "sequential":
        raise UsageError("a sweep of block sizes or cuts runs with --pattern sequential (one "
                         "prefill rank, one decode rank)")
    if cuts[0].pages and (args.layout != "paged" or args.granularity != "block"):
        raise UsageError("--kv-pages, --block-ids and --tp-pair cut a paged KV into pages: add "
                         "--layout paged --granularity block")
    for tc in transports.available().values():  # cuts a transport's flags cannot measure
        tc.check_cuts(args, cuts)
    return cuts


def check_pieces(model, dtype, tokens, cut: Cut | None) -> None:
    """Refuse, before any table is built, a handoff that would post more than MAX_PIECES
    pieces (each is a message, a view and a descriptor: 10^9 tokens in blocks of 1 built a
    block table id by id and died in a MemoryError on every rank). Counted by formula:
    kvbench.kv.cut.count_pieces for the page plan, layers x parts x blocks for the paged
    message plan."""
    for t in tokens:
        if cut is not None and cut.pages:
            n = count_pieces(model, dtype, t, cut)
        else:
            n = sum(model.parts * layer_blocks(model, t, cut.block_size, layer) for layer in range(model.layers))
        if n > MAX_PIECES:
            raise UsageError(f"--sizes {t} with --block-size {cut.block_size}: one handoff would post "
                             f"{n:,} pieces; at most {MAX_PIECES:,} (raise --block-size or lower "
                             "--sizes)")


def transport_class(name: str, device: str):
    if name == "auto":
        name = "nccl" if device == "cuda" else "mpi"
    try:
        tcls = transports.get(name)
    except KeyError as exc:
        raise UsageError(str(exc.args[0])) from None
    if tcls.gpu_only and device != "cuda":
        raise UsageError(f"transport {name} needs a GPU: --device cuda (no GPU here?)")
    reason = tcls.unavailable_reason(device)
    if reason:
        raise UsageError(f"transport {name}: {reason}")
    return tcls


def pattern_classes(args, world_size: int, model) -> list:
    pnames = [p.strip() for p in args.pattern.split(",") if p.strip()]
    if not pnames:
        raise UsageError(f"--pattern: empty list; choose from {', '.join(patterns.available())}")
    pclasses = []
    for pn in pnames:
        try:
            pclasses.append(patterns.get(pn))
        except KeyError as exc:
            raise UsageError(str(exc.args[0])) from None
    if world_size < 2:
        raise UsageError("run under MPI with at least 2 ranks, e.g. mpirun -n 2 python -m kvbench.p2p")
    for pc in pclasses:
        err = pc.layout_error(args, world_size, model)
        if err:
            raise UsageError(err)
    return pclasses
