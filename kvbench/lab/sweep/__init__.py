"""`kvbench sweep`: a rate sweep of a plan's deployments (main), judged by kvbench.slo and
written as a report (report, fmt).

May import lab.stack, lab.load, the lab's planfile and config; never the lab CLI.
"""
