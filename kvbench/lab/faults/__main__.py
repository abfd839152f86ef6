import sys

from kvbench.lab.faults.main import cli

sys.exit(cli())
