"""`python -m kvbench.summary` = `kvbench report`."""

import sys

from kvbench.summary import cli

sys.exit(cli())
