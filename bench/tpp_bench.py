"""``python -m cgx2.bench`` with the strided codec kernels walking another number of tiles a
program (``CGX2_EXP_TILES_PER_PROGRAM``, in place of ``maxmin_triton._TILES_PER_PROGRAM``),
to time it inside the allreduce, beside NCCL's kernels. A tuning aid:
``CGX2_EXP_TILES_PER_PROGRAM=1 torchrun --nproc-per-node 2 bench/tpp_bench.py --sizes 256M``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cgx2.bench.__main__ import main
from cgx2.codecs import maxmin_triton

maxmin_triton._TILES_PER_PROGRAM = int(os.environ["CGX2_EXP_TILES_PER_PROGRAM"])
sys.exit(main(sys.argv[1:]))
