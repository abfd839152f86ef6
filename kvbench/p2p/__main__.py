"""`mpirun -n 2 python -m kvbench.p2p ...` (= `kvbench p2p`)."""

import sys

from kvbench.p2p.cli import cli

sys.exit(cli())
