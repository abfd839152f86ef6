"""The tutorial's hypothetical values in one place, and the labels printed beside them.

kvbench implements a tutorial whose worked examples use made-up numbers: a 70B-class GQA
geometry (the `seed-70b-gqa` preset), a 1 ms setup, links of 100, 25 and 10 GB/s, a 20 ms
handoff budget, a 300-token short prompt, and for routing 2 ms of local prefill interference
against a baseline ITL P95 of 35 ms and a 50 ms target. A command that prints one of them
(`kvbench model` by default, `kvbench plan` and `plan route` with the worked example's flags)
says so beside it, so that a reader never takes an assumption for a measurement. Values given
on the command line that are not the tutorial's are labelled as given, not measured: only
`kvbench p2p` and `kvbench fit` measure a link (docs/decision.md).
"""

from __future__ import annotations

from collections.abc import Sequence

SEED_MODEL = "seed-70b-gqa"
LINKS_GB_S = (100.0, 25.0, 10.0)
SETUP_MS = 1.0
BUDGET_MS = 20.0
SHORT_PROMPT_TOKENS = 300
# plan route's worked example: the short prompt over the slowest link
ROUTE_LOCAL_INTERFERENCE_MS = 2.0
ROUTE_ITL_P95_MS = 35.0
ROUTE_ITL_TARGET_MS = 50.0

ASSUMED = "the tutorial's assumption, not a measurement"


def _nums(values: Sequence[float]) -> str:
    return ", ".join(f"{v:g}" for v in values)


def _label(what: str, is_tutorial: bool, flag: str) -> str:
    return f"{what}: {ASSUMED}" if is_tutorial else f"{what}: given ({flag}), not measured"


def model_label(name: str) -> str | None:
    """The seed preset is the tutorial's geometry; any other model is a real config."""
    if name != SEED_MODEL:
        return None
    return (f"model {SEED_MODEL} (80 layers, 8 KV heads, head_dim 128: a hypothetical "
            f"70B-class geometry, not a published model's config): {ASSUMED}")


def link_labels(gbps: Sequence[float], setup_ms: float | None, flag: str = "--gbps",
                us_per_desc: float | None = None) -> list[str]:
    """Labels for links given as numbers (never for a fit: a fit is measured)."""
    tutorial_rates = all(g in LINKS_GB_S for g in gbps)
    out = [_label(f"link rate(s) {_nums(gbps)} GB/s", tutorial_rates, flag)]
    if setup_ms is not None:
        out.append(_label(f"setup {setup_ms:g} ms", setup_ms == SETUP_MS, "--setup-ms"))
    if us_per_desc is not None:  # the tutorial has no per-descriptor cost
        out.append(_label(f"{us_per_desc:g} us per descriptor", False, "--us-per-desc"))
    return out


def budget_label(budget_ms: float) -> str:
    return _label(f"budget {budget_ms:g} ms", budget_ms == BUDGET_MS, "--budget-ms")


def floor_table_labels(model: str, links: Sequence[float], setup_ms: float, budget_ms: float,
                       short_prompt_tokens: int) -> list[str]:
    """Every value `kvbench model` prints that it did not measure."""
    out = [lbl for lbl in [model_label(model)] if lbl]
    out += link_labels(links, setup_ms, "--links-gbps")
    out.append(budget_label(budget_ms))
    out.append(_label(f"short prompt {short_prompt_tokens} tokens at the slowest link",
                      short_prompt_tokens == SHORT_PROMPT_TOKENS, "--short-prompt-tokens"))
    return out


def plan_labels(model: str, gbps: Sequence[float] | None, setup_ms: float | None,
                us_per_desc: float | None, budget_ms: float) -> list[str]:
    """`kvbench plan`'s inputs that kvbench did not measure (gbps None: the link is a fit)."""
    out = [lbl for lbl in [model_label(model)] if lbl]
    if gbps is not None:
        out += link_labels(gbps, setup_ms, us_per_desc=us_per_desc)
    return out + [budget_label(budget_ms)]


def route_labels(model: str, gbps: Sequence[float] | None, setup_ms: float | None,
                 us_per_desc: float | None, interference_ms: float, itl_p95_ms: float,
                 itl_target_ms: float) -> list[str]:
    """`plan route`'s inputs that kvbench did not measure (gbps None: the link is a fit)."""
    out = [lbl for lbl in [model_label(model)] if lbl]
    if gbps is not None:
        out += link_labels(gbps, setup_ms, us_per_desc=us_per_desc)
    out.append(_label(f"local prefill interference {interference_ms:g} ms",
                      interference_ms == ROUTE_LOCAL_INTERFERENCE_MS, "--local-interference-ms"))
    out.append(_label(f"baseline ITL P95 {itl_p95_ms:g} ms", itl_p95_ms == ROUTE_ITL_P95_MS,
                      "--itl-p95-ms"))
    out.append(_label(f"ITL target {itl_target_ms:g} ms", itl_target_ms == ROUTE_ITL_TARGET_MS,
                      "--itl-target-ms"))
    return out
