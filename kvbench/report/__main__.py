"""`python -m kvbench.report RESULTS_DIR` (= `kvbench report`)."""

import sys

from kvbench.report.cli import cli

sys.exit(cli())
