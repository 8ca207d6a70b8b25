"""Benchmarks: ``python -m cgx2.bench`` (allreduce, under torchrun) and ``... kernels``.

Each prints a table and writes raw results as JSON under ``bench/results/``.
"""
