import shlex, sys
from mpi4py import MPI  # MPI is this driver's: each p2p.cli call leaves it up for the next
from kvbench.p2p import cli as p2p

for line in open(sys.argv[1]):
    p2p.cli(shlex.split(line))
