"""What runs inside the lab's own vLLM venv: the proxies, the connector and its NIXL trace,
the load client and the tiny-model builder.

That venv has vLLM's pinned packages and not kvbench's, so these modules import the standard
library, aiohttp, vLLM and NIXL only, never another kvbench module (tests/test_layout.py
checks it). The rest of the lab may import them (config reads TinyModelSpec).
"""
