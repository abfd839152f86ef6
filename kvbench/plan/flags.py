"""The argument groups `kvbench plan`, `plan route` and `plan export` share, each built by one
function, so a flag the commands have in common has one spelling, one help and one check.

The link: a fit (`--fit`, `--where`, `--pair`) or rates typed in (`--gbps` ...: plan and route
only; export writes a fit). The payload: the model (`--model`, `--model-config`, `--dtype`),
the prompt lengths (`--prompt-tokens`, also spelt `--sizes` as in `kvbench p2p`; plan and
route) and the block size. The cut: `--kv-pages`, `--block-ids` (and `--tp-pair`, which
export leaves out: it writes one rank's model with `--tp`).
"""

from __future__ import annotations

import argparse
from typing import Protocol

from kvbench.cli import ArgumentParser, arg_int
from kvbench.model import (
    DEFAULT_MODEL,
    DEFAULT_PROMPT_TOKENS,
    DTYPES,
    PRESETS,
    RATE_FLAGS,
    SCALE_DTYPES,
    SCALE_MODES,
    TOKENS_FLAGS,
)

MAX_BLOCK_SIZE = 1 << 20


class Group(Protocol):
    """A parser or one of its argument groups (what add_argument is called on)."""

    def add_argument(self, *args, **kwargs) -> argparse.Action: ...


def add_fit_flags(g: Group, required: bool = False) -> None:
    """The fitted link: the fit file, its group and (for a matrix) its pair."""
    g.add_argument("--fit", required=required, metavar="FITTED.json", help="output of kvbench fit")
    g.add_argument("--where", action="append", metavar="KEY=VALUE",
                   help="with --fit: only groups whose KEY equals VALUE (repeatable)")
    g.add_argument("--pair", default=None, metavar="slowest|I,J",
                   help="with --fit of a kvbench matrix file: plan with the slowest pair a route "
                        "may take (default) or with pair I,J (sender rank I, receiver rank J)")


def add_rate_flags(g: Group) -> None:
    """A link typed in: its rate, setup and per-descriptor cost."""
    g.add_argument(*RATE_FLAGS, dest="gbps", metavar="R[,R...]",
                   help="sustained effective rate(s) in decimal GB/s")
    g.add_argument("--setup-ms", default=None, metavar="MS", help="with --gbps: setup per handoff")
    g.add_argument("--includes-setup", action="store_true",
                   help="with --gbps: the rate was measured end to end and already contains "
                        "setup (setup is then never added)")
    g.add_argument("--us-per-desc", default=None, metavar="US",
                   help="with --gbps: the cost of one descriptor in microseconds (a fit of "
                        "several cuts carries its own: docs/descriptors.md)")


def add_link_group(p: ArgumentParser) -> None:
    """plan and route: a fit, or rates typed in."""
    g = p.add_argument_group("link (one of)")
    add_fit_flags(g)
    add_rate_flags(g)


def add_model_flags(g: Group) -> None:
    """Which model's KV, in which element type."""
    g.add_argument("--model", default=None, help=f"preset (default {DEFAULT_MODEL}): "
                   f"{', '.join(PRESETS)}")
    g.add_argument("--model-config", metavar="PATH", help="a local Hugging Face config.json")
    g.add_argument("--dtype", default="bf16", help=f"KV element type: {', '.join(DTYPES)}")


def add_tokens_flag(g: Group, required: bool) -> None:
    """The prompt lengths (`--sizes` as kvbench p2p spells them)."""
    g.add_argument(*TOKENS_FLAGS, dest="prompt_tokens", metavar="N[,N...]", required=required,
                   default=None if required else str(DEFAULT_PROMPT_TOKENS),
                   help="prompt length(s) in tokens" + ("" if required else
                                                        f" (default {DEFAULT_PROMPT_TOKENS})"))


def add_block_size_flag(g: Group) -> None:
    g.add_argument("--block-size", type=arg_int(1, MAX_BLOCK_SIZE), default=None,
                   help="paged block size in tokens (allocation rounded up to whole blocks; "
                        "with a per-descriptor term, the blocks a handoff posts)")


def add_cut_group(p: ArgumentParser, tp_pair: bool = True) -> None:
    """The deployment's cut, for links with a per-descriptor term."""
    c = p.add_argument_group("the cut (links with a per-descriptor term: docs/descriptors.md)")
    c.add_argument("--kv-pages", default=None, choices=("joint", "split"),
                   help="K and V of a block in one page (joint, default) or in two regions")
    c.add_argument("--block-ids", default=None, metavar="IDS",
                   help="contiguous (default), scattered or merged block ids")
    if tp_pair:
        c.add_argument("--tp-pair", default=None, metavar="P:D",
                       help="prefill TP : decode TP (default 1:1): P > D cuts each block into "
                            "P/D pieces; bytes are then one decode rank's share")


def add_payload_group(p: ArgumentParser, tokens_required: bool) -> None:
    """plan and route: the model, the prompt lengths, scales and block size."""
    g = p.add_argument_group("payload")
    add_model_flags(g)
    add_tokens_flag(g, tokens_required)
    g.add_argument("--scale-mode", default="none", choices=SCALE_MODES,
                   help="FP8/INT8 scale overhead (default none)")
    g.add_argument("--scale-dtype", default="fp32", choices=list(SCALE_DTYPES))
    add_block_size_flag(g)
    add_cut_group(p)
