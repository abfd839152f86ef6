"""kvbench: measure KV-cache handoff between prefill and decode workers, fit it, plan with it."""

__version__ = "0.1.0"
