"""`python -m kvbench.plan [route|export] ...` (= `kvbench plan`)."""

import sys

from kvbench.plan.cli import cli

sys.exit(cli())
