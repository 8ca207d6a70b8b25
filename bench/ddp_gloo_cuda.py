"""A DDP training step over a gloo group, timed per communication hook: what a user without
NCCL feels (CUDA tensors on gloo), or, with ``--device cpu``, the same on the CPU; with
``--backend nccl``, one GPU a rank over NCCL (bench/nccl_hosts.sh: GPU hosts in netlab).

Run one process per host under ``torchrun --nnodes 2 --nproc-per-node 1 --node-rank $HOST
--master-addr $MASTER_ADDR``, e.g. in cgx2.testing.netlab's hosts (bench/gloo_cuda_ddp.sh runs
every hook). The model is a decoder-only transformer, about 134M parameters by default; the
tokens are synthetic but learnable (each is a fixed function of the one before). ``--model mlp``
is a stack of ``--layers`` square linear layers ``--dim`` wide (8 of 4096: 134M parameters) on
``--batch-size`` rows a rank: nearly all communication. ``--optimizer-in-backward``: AdamW steps
each bucket in the hook as its gradient arrives (``cgx2.ddp.compress``'s ``optimizer``), not
after the backward pass. Rank 0 writes a JSON file into ``--out`` and prints one line.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import os
import platform
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel as DDP

import cgx2
from cgx2.bench.report import add_choice, add_number
from cgx2.ddp import CGXState, cgx_hook, compress

try:
    from cgx2.ddp import optimizer_in_hook
except ImportError:  # a cgx2 from before it, run for comparison
    optimizer_in_hook = None

# The model of examples/train_ddp.py, with a vocabulary of this script's.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from train_ddp import CharTransformer

try:
    from cgx2.collectives import policy
except ImportError:  # a cgx2 from before the policy, run for comparison
    policy = None


class MLP(nn.Sequential):
    """``layers`` linear layers ``dim`` wide, GELU between them."""

    def __init__(self, dim: int, layers: int) -> None:
        blocks: list[nn.Module] = []
        for i in range(layers):
            blocks += [nn.Linear(dim, dim)] + ([nn.GELU()] if i < layers - 1 else [])
        super().__init__(*blocks)


def synthetic_batch(
    args: argparse.Namespace, gen: torch.Generator, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences where each token is ``(5 * previous + 3) % vocab`` from a random start: a rule
    the model can learn, so that the loss shows whether the gradients still carry it. For the
    MLP, random rows and the same rows rotated by one: a map it can learn."""
    if args.model == "mlp":
        x = torch.randn(args.batch_size, args.dim, generator=gen).to(device)
        return x, x.roll(1, dims=1)
    start = torch.randint(0, args.vocab, (args.batch_size, 1), generator=gen)
    seq = [start]
    for _ in range(args.context):
        seq.append((5 * seq[-1] + 3) % args.vocab)
    tokens = torch.cat(seq, dim=1).to(device)
    return tokens[:, :-1], tokens[:, 1:]


def token_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten())


def register_hook(
    ddp: DDP,
    hook: str,
    bits: int,
    rank: int = 4,
    adamw: dict | None = None,
    lower_bits: dict | None = None,
) -> CGXState | None:
    """``plain``: DDP's own allreduce; ``cgx``: cgx2's hook at ``bits``, routed by the policy
    (``CGX2_CROSSOVER_BYTES`` overrides it); ``compress``: ``cgx2.ddp.compress`` at ``bits``
    (the hook only where the policy compresses a bucket); ``allreduce``: torch's
    ``allreduce_hook`` (DDP's allreduce through a hook: what the hook machinery alone costs);
    ``bf16``: torch's ``bf16_compress_hook``; ``powersgd``: torch's PowerSGD at ``rank``,
    compressing from the third step on. ``adamw``: AdamW's arguments, where it steps each
    bucket in the hook (compress's ``optimizer``, ``cgx2.ddp.optimizer_in_hook`` around the
    others, DDP's ``_register_fused_optim`` for plain DDP). ``lower_bits``: ``rotation``,
    ``adaptive_bits`` and ``average_bits`` for ``cgx`` and ``compress``, as their own."""
    lower_bits = lower_bits or {}
    if hook == "compress":
        # None where DDP's own allreduce was kept
        if adamw is None:
            return compress(ddp, bits=bits, **lower_bits)
        return compress(
            ddp, bits=bits, optimizer=torch.optim.AdamW, optimizer_kwargs=adamw, **lower_bits
        )
    if hook == "plain":
        if adamw is not None:
            ddp._register_fused_optim(torch.optim.AdamW, **adamw)
        return None
    state, fn = None, None
    if hook == "allreduce":
        fn = default_hooks.allreduce_hook
    elif hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(
            None, matrix_approximation_rank=rank, start_powerSGD_iter=2
        )
        fn = powerSGD_hook.powerSGD_hook
    elif hook == "cgx":
        state = CGXState(None, compression_params={"bits": bits}, **lower_bits)
        fn = cgx_hook
    elif hook == "bf16":
        fn = default_hooks.bf16_compress_hook
        if not torch.cuda.is_available():
            fn = _bf16_compress_hook_cpu
    ddp.register_comm_hook(
        state, fn if adamw is None else optimizer_in_hook(fn, torch.optim.AdamW, adamw)
    )
    return state if hook == "cgx" else None


def _bf16_compress_hook_cpu(process_group, bucket):  # DDP checks real annotations, not strings
    """torch's ``bf16_compress_hook`` under another name: DDP refuses that name on builds
    without NCCL, though gloo reduces bf16 CPU tensors."""
    return default_hooks.bf16_compress_hook(process_group, bucket)


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run(args: argparse.Namespace) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.device == "cuda":
        # On gloo every rank on the first visible GPU: ranks of one machine share it. On NCCL
        # one GPU a rank, the launcher's local rank.
        local = int(os.environ.get("LOCAL_RANK", 0)) if args.backend == "nccl" else 0
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
        torch.set_float32_matmul_precision("high")
    else:
        device = torch.device("cpu")
    torch.manual_seed(args.seed)  # the same initial weights everywhere
    if args.model == "mlp":
        model, loss_fn = MLP(args.dim, args.layers), nn.functional.mse_loss
    else:
        model = CharTransformer(args.context, args.dim, args.layers, args.heads, args.vocab)
        loss_fn = token_loss
    model = model.to(device)
    params = sum(p.numel() for p in model.parameters())
    ddp = DDP(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        bucket_cap_mb=args.bucket_cap_mb,
    )
    in_backward = args.optimizer_in_backward
    adamw = {"lr": args.lr} if in_backward else None
    lower_bits = {
        "rotation": args.rotation,
        "adaptive_bits": args.adaptive_bits,
        "average_bits": args.average_bits,
    }
    state = register_hook(ddp, args.hook, args.bits, args.powersgd_rank, adamw, lower_bits)
    # With AdamW in the backward pass this one only clears the gradients in the timed steps,
    # and stands in for the hook's steps where no hook runs (no_sync, below), with the hook's
    # arithmetic: torch's default foreach, as the hook decides it.
    opt = torch.optim.AdamW(ddp.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # each rank its own batches
    times, sent = [], (0, 0)
    total = args.warmup + args.steps + int(args.profile)
    for step in range(total):
        if step == args.warmup and state is not None:
            sent = (state.bytes_sent, state.bytes_uncompressed)
        x, y = synthetic_batch(args, gen, device)
        sync(device)
        # The last step profiled on rank 0, where asked: where a step's host time goes.
        profiled = args.profile and step == total - 1
        profiler = torch.profiler.profile() if profiled and rank == 0 else contextlib.nullcontext()
        t0 = time.perf_counter()
        with profiler:
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            loss.backward()
            if not in_backward:
                opt.step()
            sync(device)
        if step >= args.warmup and not profiled:
            times.append(time.perf_counter() - t0)
        if profiled and rank == 0:
            table = profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=25)
            print(f"profile of step {step + 1} (not timed), by self CPU time:\n{table}", flush=True)
        if rank == 0:
            phase = "warmup" if step < args.warmup else "timed"
            print(
                f"  step {step + 1}/{total} ({phase}) {(time.perf_counter() - t0) * 1e3:.0f} ms",
                flush=True,
            )
    # The step without communication (DDP's no_sync: no bucket leaves the rank), the compute
    # half of the step's speed of light (bench/nccl_hosts_summary.py adds the link's half).
    compute = []
    for _ in range(args.compute_steps):
        x, y = synthetic_batch(args, gen, device)
        sync(device)
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        with ddp.no_sync():
            loss_fn(ddp(x), y).backward()
        opt.step()
        sync(device)
        compute.append(time.perf_counter() - t0)
    # The same steps timed phase by phase (a sync between them): DDP sends gradients only
    # during the backward pass, so the forward pass and the optimizer's step add to the
    # link's time (bench/nccl_hosts_summary.py's "of DDP's light"), unless the optimizer
    # steps in the backward pass: then its step counts in the backward pass's compute.
    phases: dict[str, list[float]] = {"forward_ms": [], "backward_ms": [], "optimizer_ms": []}
    for _ in range(args.compute_steps):
        x, y = synthetic_batch(args, gen, device)
        sync(device)
        marks = [time.perf_counter()]
        opt.zero_grad(set_to_none=True)
        with ddp.no_sync():
            phase_loss = loss_fn(ddp(x), y)
            sync(device)
            marks.append(time.perf_counter())
            phase_loss.backward()
            sync(device)
            marks.append(time.perf_counter())
        opt.step()
        sync(device)
        marks.append(time.perf_counter())
        for times_of, start, end in zip(phases.values(), marks, marks[1:], strict=False):
            times_of.append(end - start)
    timed = {k: statistics.median(v) * 1e3 if v else None for k, v in phases.items()}
    # In the backward pass the optimizer leaves nothing after it: its step, timed here by
    # the stand-in, is the part of the backward pass's compute that the hook adds.
    timed["optimizer_in_backward_ms"] = timed["optimizer_ms"] if in_backward else 0.0
    if in_backward:
        timed["optimizer_ms"] = 0.0
    mean_loss = loss.detach().float()  # on the rank's device: NCCL reduces no CPU tensor
    dist.all_reduce(mean_loss)
    ratio = None
    if state is not None and state.bytes_uncompressed > sent[1]:
        ratio = (state.bytes_sent - sent[0]) / (state.bytes_uncompressed - sent[1])
    regime = crossover = None
    if policy is not None:
        regime = policy.group_regime(device)
        crossover = policy.crossover_bytes(device, torch.float32, dist.group.WORLD)
    registered = ddp._get_ddp_logging_data().get("comm_hook")  # None: DDP's own allreduce
    del ddp, state, opt  # DDP's reducer must be gone before the group is destroyed
    gc.collect()
    dist.barrier()
    step_ms = [t * 1e3 for t in times]
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": device_name(device),
        "torch": torch.__version__,
        "cgx2": getattr(cgx2, "__version__", None),
        "world_size": world,
        "backend": dist.get_backend(),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if args.backend == "nccl" else None,
        "hosts": os.environ.get("NHOSTS"),  # netlab's, where it ran there
        "gpus_per_host": os.environ.get("GPUS_PER_HOST"),
        "model": args.model,
        "hook": args.hook,
        "bits": args.bits if args.hook in ("cgx", "compress") else None,
        "comm_hook": registered,
        "run": args.name or args.hook,
        "rate": args.rate,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("CGX2_", "CGX_"))},
        "command": os.environ.get("HOSTS_COMMAND") or shlex.join(sys.orig_argv),
        "args": vars(args),
        "params": params,
        "regime": regime,
        "crossover_bytes": crossover,
        "bytes_sent_ratio": ratio,
        "step_ms": step_ms,
        "median_ms": statistics.median(step_ms),
        "compute_ms": statistics.median(compute) * 1e3 if compute else None,
        "optimizer_in_backward": in_backward,
        **timed,
        "loss": mean_loss.cpu().item() / world,
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    add_choice(
        p,
        "--hook",
        ("plain", "cgx", "compress", "allreduce", "bf16", "powersgd"),
        "plain DDP, cgx2's cgx_hook, cgx2.ddp.compress (the hook where it pays), "
        "torch's allreduce_hook, bf16_compress_hook or its PowerSGD",
    )
    add_number(p, "--bits", 4, "cgx_hook's bits")
    add_number(p, "--powersgd-rank", 4, "PowerSGD's rank")
    add_number(
        p,
        "--bucket-cap-mb",
        25.0,
        "DDP's bucket size (its default): fewer, larger buckets pay a link's per-call "
        "latency fewer times",
    )
    add_choice(p, "--device", ("cuda", "cpu"))
    add_choice(
        p,
        "--backend",
        ("gloo", "nccl"),
        "gloo: a machine's ranks on its first GPU; nccl: a GPU a rank",
    )
    add_choice(
        p,
        "--model",
        ("transformer", "mlp"),
        "mlp: --layers linear layers --dim wide, --batch-size rows",
    )
    add_number(p, "--dim", 1024, "model width")
    add_number(p, "--layers", 10, "transformer blocks")
    add_number(p, "--heads", 16)
    add_number(p, "--vocab", 4096)
    add_number(p, "--context", 256, "tokens per sequence")
    add_number(p, "--batch-size", 8, "sequences per rank and step")
    add_number(p, "--lr", 3e-4)
    p.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="AdamW steps each bucket in the hook as its gradient arrives, overlapping the "
        "backward pass and the bytes (compress's optimizer=; DDP's _register_fused_optim for "
        "plain); its phase is then timed as part of the backward pass",
    )
    p.add_argument(
        "--rotation",
        choices=("hadamard", "hadamard-clipped"),
        help="cgx/compress: rotated buckets (blocks of 128); clipped: over each range's middle",
    )
    p.add_argument(
        "--adaptive-bits",
        type=lambda s: tuple(int(b) for b in s.split(",")),
        help="cgx/compress: widths to choose per layer by its error, e.g. 2,3,4,8",
    )
    p.add_argument(
        "--average-bits",
        type=float,
        help="cgx/compress, with --adaptive-bits: the least error within this many payload "
        "bits a value",
    )
    add_number(p, "--warmup", 3, "untimed steps first")
    add_number(p, "--steps", 5, "timed steps")
    add_number(
        p,
        "--compute-steps",
        3,
        "steps timed after the rest under DDP's no_sync (no communication): the compute "
        "half of the step's speed of light",
    )
    add_number(p, "--seed", 0)
    p.add_argument(
        "--profile",
        action="store_true",
        help="profile one more step on rank 0 and print where its time went",
    )
    p.add_argument(
        "--rate",
        default=os.environ.get("LINK_RATE"),
        help="the link's rate, for the record (netlab exports it)",
    )
    p.add_argument(
        "--name", default=None, help="run name for the file and table (default: the hook)"
    )
    p.add_argument("--out", default="cgx2-results", help="folder for the JSON result")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.compute_steps < 0:
        p.error("--steps must be >= 1, --warmup and --compute-steps >= 0")
    if args.backend == "nccl" and args.device != "cuda":
        p.error("--backend nccl needs --device cuda")
    if args.optimizer_in_backward and optimizer_in_hook is None:
        p.error("--optimizer-in-backward: this cgx2 has no cgx2.ddp.optimizer_in_hook")
    if args.hook == "powersgd" and args.warmup < 2:
        p.error("--hook powersgd compresses from the third step: --warmup must be >= 2")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if "RANK" not in os.environ:
        sys.exit("ddp_gloo_cuda.py: run it under torchrun (one process per host)")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("ddp_gloo_cuda.py: no CUDA device; --device cpu runs on the CPU")
    if args.backend == "nccl":  # the rank's GPU before the group, as NCCL wants
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(args.backend, timeout=datetime.timedelta(minutes=5))
    if dist.get_world_size() < 2:
        sys.exit("ddp_gloo_cuda.py: one process: start it on 2 hosts (torchrun --nnodes 2)")
    try:
        result = run(args)
    finally:
        dist.destroy_process_group()
    if result and int(os.environ["RANK"]) == 0:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
        name = f"ddp_{args.backend}_{args.device}_{result['run']}_{args.rate or 'link'}_{stamp}"
        path = out / f"{name}.json"
        path.write_text(json.dumps(result, indent=1) + "\n")
        ratio = result["bytes_sent_ratio"]
        print(
            f"ddp_gloo_cuda: {result['run']} ({args.hook}) on {result['device']}, "
            f"{result['params'] / 1e6:.1f}M params, rate {args.rate}, regime {result['regime']}: "
            f"median step {result['median_ms']:.1f} ms, loss {result['loss']:.4f}"
            + (f", sent {ratio:.3f} of plain's bytes" if ratio is not None else "")
            + f" -> {path}",
            flush=True,
        )


if __name__ == "__main__":
    main()
