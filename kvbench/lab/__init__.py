"""A real vLLM (CPU build) lab: local deployments, a rate sweep judged by kvbench.slo,
and fault injection into the KV handoff with a per-request audit. docs/lab.md.

Kept import-light on purpose: modules here also run inside the lab's own venv
(the proxy, the connector, the model builder), which does not have kvbench's deps.
"""


def cli(argv=None):
    import sys

    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["agree"]:  # its own parser and modules (kvbench.lab.agree)
        from kvbench.lab.agree import cli as _agree

        return _agree(args[1:])
    from kvbench.lab.cli import cli as _cli

    return _cli(args)
