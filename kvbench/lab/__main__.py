import sys

from kvbench.lab import cli

sys.exit(cli())
