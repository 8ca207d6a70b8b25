"""``python -m cgx2.bench [allreduce|kernels|calibrate|plot] ...``: see :mod:`cgx2.bench`."""

import sys


def main(argv: list[str]) -> int:
    commands = ("allreduce", "kernels", "calibrate", "plot")
    command = argv[0] if argv and argv[0] in commands else None
    rest = argv[1:] if command else argv
    if command == "plot":  # no process group: it draws saved results
        from .allreduce import plot_main

        return plot_main(rest)
    if command == "kernels":
        from .kernels import main as kernels_main

        return kernels_main(rest)
    if command == "calibrate":
        from .calibrate import main as calibrate_main

        return calibrate_main(rest)
    from .allreduce import main as allreduce_main

    return allreduce_main(rest)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
