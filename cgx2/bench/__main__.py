"""``python -m cgx2.bench [allreduce|kernels] ...``: see :mod:`cgx2.bench`."""

import sys

from .allreduce import main as allreduce_main


def main(argv: list[str]) -> int:
    if argv and argv[0] == "kernels":
        from .kernels import main as kernels_main

        return kernels_main(argv[1:])
    if argv and argv[0] == "allreduce":
        argv = argv[1:]
    return allreduce_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
