"""Benchmarks: ``python -m cgx2.bench`` (the allreduce, under torchrun), ``... kernels`` (the
codec's GPU kernels) and ``... calibrate`` (where compression pays, for the policy).

Each prints a table with a legend and writes its results as JSON (``--out``).
"""
