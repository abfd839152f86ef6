"""A real vLLM (CPU build) lab: local deployments, a rate sweep judged by kvbench.slo,
and fault injection into the KV handoff with a per-request audit. docs/lab.md.

Kept import-light on purpose: modules here also run inside the lab's own venv
(the proxy, the connector, the model builder), which does not have kvbench's deps.
"""


def cli(argv=None):
    from kvbench.lab.cli import cli as _cli

    return _cli(argv)
