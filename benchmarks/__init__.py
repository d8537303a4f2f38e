"""hvdtrain's benchmarks: the drivers behind its claims, their workers and their harness.

The drivers run as scripts (``.venv/bin/python benchmarks/overhead.py``) and import one another by
their file names; a package only so that ``python -m benchmarks.index`` and the unit tests reach the
index generator (``benchmarks/index.py``). Not shipped in the wheel (``hvdtrain*`` only).
"""
