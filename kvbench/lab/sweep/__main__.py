import sys

from kvbench.lab.sweep.main import cli

sys.exit(cli())
