"""`python -m kvbench.matrix`: see kvbench.matrix.cli."""

import sys

from kvbench.matrix.cli import cli

sys.exit(cli())
