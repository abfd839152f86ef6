"""`python -m kvbench.slo ...`"""

import sys

from kvbench.slo.cli import cli

if __name__ == "__main__":
    sys.exit(cli())
