"""`kvbench lab agree`: vLLM's own NIXL metrics against kvbench's predictions (main), from the
engine's histograms and trace (engine), the p2p runs on the engine's shape (p2p), the
statistics (stats, sim), where the transfer time goes (remainder) and the report (report).

May import lab.sweep, lab.stack, lab.load, lab.venv and the lab's planfile; never the lab CLI.
"""
