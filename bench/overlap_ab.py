"""``python -m cgx2.bench`` with a one-piece allreduce's collectives asynchronous again (the
code before 2026-11-23 08:30), when ``CGX2_EXP_ASYNC_ONE_PIECE=1``: to time the change.
``CGX2_EXP_ASYNC_ONE_PIECE=1 torchrun --nproc-per-node 2 bench/overlap_ab.py --sizes 256M``.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from cgx2 import collectives
from cgx2.bench.__main__ import main

if os.environ.get("CGX2_EXP_ASYNC_ONE_PIECE") == "1":
    collectives._ALL_GATHER_OPTIONS[False] = collectives._ALL_GATHER_OPTIONS[True]
    collectives._ALL_TO_ALL_OPTIONS[False] = collectives._ALL_TO_ALL_OPTIONS[True]
sys.exit(main(sys.argv[1:]))
