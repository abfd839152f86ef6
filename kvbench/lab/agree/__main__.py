import sys

from kvbench.lab.agree.main import cli

sys.exit(cli())
