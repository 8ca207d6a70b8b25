"""``python -m cgx2.bench`` across hosts joined by shaped links (cgx2.testing.netlab): for each
host count and link rate, torchrun across the hosts runs the benchmark (gloo against cgx2 at
each width, and the speed of light), and its JSON lands in --out, named by rate and hosts.

Usage (root): python bench/links.py [--hosts 2,4] [--rates 1gbit,3gbit,10gbit]
[--nproc-per-node 1] [--timeout 1800] [--iproute-root DIR] [--out bench/results] -- [cgx2.bench
args, e.g. --sizes 1M,4M,16M,64M,256M --bits 2,4,8 --dtypes fp32; on one GPU, --backend gloo:
the hosts' ranks share it]. Prints each run's table as it comes.
"""

from __future__ import annotations

import argparse
import os
import sys

from cgx2.testing import netlab


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hosts", default="2", help="host counts, comma-separated")
    p.add_argument("--rates", default="1gbit,3gbit,10gbit", help="link rates, comma-separated")
    p.add_argument("--nproc-per-node", type=int, default=1, help="ranks a host")
    p.add_argument("--timeout", type=float, default=1800, help="seconds a run may take")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--iproute-root", help="where dpkg -x unpacked iproute2 (an image without it)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- cgx2.bench's arguments")
    args = p.parse_args()
    bench_args = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    reason = netlab.unavailable(args.iproute_root)
    if reason:
        print(f"links.py: cannot make hosts here: {reason}", file=sys.stderr)
        return 2
    status, port = 0, 29700
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.nproc_per_node)),
        "LINK_DRIVER": " ".join([sys.executable, *sys.argv]),
    }
    for hosts in (int(h) for h in args.hosts.split(",")):
        for rate in args.rates.split(","):
            port += 1
            print(f"== {hosts} hosts x {args.nproc_per_node} ranks, {rate} links", flush=True)
            command = [
                "bash",
                "-c",
                f"exec {sys.executable} -m torch.distributed.run --nnodes {hosts} "
                f"--nproc-per-node {args.nproc_per_node} --rdzv-backend c10d "
                f"--rdzv-endpoint $MASTER_ADDR:{port} --rdzv-id links "
                f"--rdzv-conf is_host=$((HOST == 0)) --local-addr $HOST_ADDR "
                f"-m cgx2.bench --out {os.path.abspath(args.out)} " + " ".join(bench_args),
            ]
            with netlab.Lab(hosts, netlab.Link(rate), args.iproute_root) as lab:
                results = lab.run(command, env=env, timeout=args.timeout)
            print(results[0].stdout, flush=True)
            failed = [r for r in results if r.returncode != 0]
            if failed:
                print(failed[0].stderr[-3000:], file=sys.stderr)
                status = status or failed[0].returncode
    return status


if __name__ == "__main__":
    sys.exit(main())
