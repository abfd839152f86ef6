"""`python -m kvbench.fit ...` (= `kvbench fit`)."""

import sys

from kvbench.fit.cli import cli

sys.exit(cli())
