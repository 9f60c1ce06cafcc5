"""Benchmarks: not tests. They time the worker against baselines measured in the same run.

``bench.cpu`` (``make bench``) runs the CPU scenarios against the local broker and
Redis; ``bench.identity`` is a do-nothing model for measuring the worker's own cost.
"""
