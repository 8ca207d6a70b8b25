r"""Where one DDP training step's time goes, under torchrun: examples/train_ddp.py's model (or
bench/ddp_gloo_cuda.py's MLP), its forward, backward and optimizer spans, the link's busy time
(the NCCL kernels), and what ran on the GPU and the host while the link sat idle:

    torchrun --nproc-per-node 2 bench/ddp_step_timeline.py --dim 1024 --layers 10 --heads 16 \
        --context 256 --batch-size 8 --bits 4 [--amp bf16] [--compile] [--link-gbps 10]

Every rank profiles its own steps (torch.profiler, CPU and CUDA); rank 0 prints them all and
writes the JSON (``--out``). Times are from the host's start of the step. The step is cut into
forward (to the GPU's end of it), backward and link together (to the last NCCL kernel's end),
the tail after that (until the optimizer's first kernel) and the optimizer (to the end of the
step's sync): the four add up to the step. ``--bits 32`` is plain DDP. On gloo there are no
NCCL kernels to see: the spans are all it reports.

An NCCL kernel runs from the moment its stream lets it until its data has crossed, so the
link's busy time includes waiting for a late peer (compare the ranks). The profiler costs
host time: the unprofiled steps timed before it say how much.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import re
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.profiler import ProfilerActivity, record_function

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))

from allreduce_timeline import _on_rank_0  # noqa: E402
from cli import add_model_options  # noqa: E402
from common import write_results  # noqa: E402
from nccl_hosts_summary import bits_per_second  # noqa: E402
from train_ddp import CharTransformer, batch, load_text  # noqa: E402

from cgx2.bench.report import (  # noqa: E402
    HelpFormatter,
    add_bucket_size_argument,
    add_choice,
    add_number,
    add_out_argument,
    refused_single_process,
)
from cgx2.collectives.fusion import ring_bytes_sent  # noqa: E402
from cgx2.ddp import CGXState, cgx_hook, optimizer_in_hook  # noqa: E402

STEP, FORWARD, BACKWARD, OPTIMIZER = (f"timeline:{m}" for m in ("step", "fwd", "bwd", "opt"))
HOOK = "timeline:cgx_hook"
MARKS = (STEP, FORWARD, BACKWARD, OPTIMIZER, HOOK)
PHASES = {"forward": FORWARD, "backward": BACKWARD, "optimizer": OPTIMIZER}


# -- the analysis: plain intervals in microseconds, no profiler needed ---------------------


@dataclass(frozen=True)
class Span:
    """A host event (``lane``: its thread) or GPU kernel (``lane``: its stream), in us;
    ``launch``: a kernel's host launch time, where the profiler linked it."""

    name: str
    start: float
    end: float
    lane: int = 0
    launch: float | None = None


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """``intervals`` merged where they overlap or touch, in order."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def idle_gaps(busy: Sequence[tuple[float, float]], threshold: float) -> list[tuple[float, float]]:
    """The gaps longer than ``threshold`` between consecutive intervals of ``busy`` (a
    :func:`union`'s result)."""
    return [(a[1], b[0]) for a, b in itertools.pairwise(busy) if b[0] - a[1] > threshold]


def overlap(start: float, end: float, lo: float, hi: float) -> float:
    """How much of ``[start, end]`` lies in ``[lo, hi]``."""
    return max(0.0, min(end, hi) - max(start, lo))


def covered(intervals: Iterable[tuple[float, float]], lo: float, hi: float) -> float:
    """How much of ``[lo, hi]`` at least one of ``intervals`` covers."""
    return sum(overlap(s, e, lo, hi) for s, e in union(intervals))


def self_times(spans: Sequence[Span], lo: float, hi: float) -> list[float]:
    """Each span's own time within ``[lo, hi]``: its overlap less its children's (the spans
    nested in it on its lane), so that a thread's times add up to no more than the window."""
    own = [overlap(s.start, s.end, lo, hi) for s in spans]
    by_lane: dict[int, list[int]] = {}
    for i, s in enumerate(spans):
        by_lane.setdefault(s.lane, []).append(i)
    for members in by_lane.values():
        members.sort(key=lambda i: (spans[i].start, -spans[i].end))
        stack: list[int] = []
        for i in members:
            while stack and spans[stack[-1]].end <= spans[i].start:
                stack.pop()
            if stack:  # a child: clipped to its parent, whose timestamps may be rounder
                parent = spans[stack[-1]]
                start, end = max(spans[i].start, parent.start), min(spans[i].end, parent.end)
                own[stack[-1]] -= overlap(start, end, lo, hi)
            stack.append(i)
    return [max(0.0, t) for t in own]


_CGX_KERNEL = re.compile(r"(decode_sum_encode|encode|decode|rotate|piece_keys)_kernel")
_CUDA_API = re.compile(r"^cu(da)?[A-Z]")
_CUDA_SYNC = re.compile(r"^(Stream|Event|Context|Device) (Sync|Wait)")


def gpu_kind(name: str) -> str:
    """A GPU event's kind: nccl, cgx2's coding kernels by name (encode, dse, decode, rotate,
    keys), memcpy, memset or compute."""
    if name.startswith(("ncclDevKernel", "ncclKernel")):
        return "nccl"
    found = _CGX_KERNEL.search(name)
    if found:
        short = {"decode_sum_encode": "dse", "piece_keys": "keys"}
        return f"cgx {short.get(found.group(1), found.group(1))}"
    if name.startswith("Memcpy"):
        return "memcpy"
    if name.startswith("Memset"):
        return "memset"
    return "compute"


def is_cuda_api(name: str) -> bool:
    """Whether ``name`` is a CUDA runtime or driver call (cudaLaunchKernel, cuLaunchKernel)."""
    return bool(_CUDA_API.match(name))


def host_kind(name: str) -> str:
    """A host event's kind, for its own time (:func:`self_times`)."""
    if name == HOOK:
        return "cgx_hook Python"
    if name in MARKS or name.startswith("ProfilerStep"):
        return "Python or waiting"
    if is_cuda_api(name):
        if "Synchronize" in name:
            return "sync"
        if "Memcpy" in name or "Memset" in name:
            return "memcpy"
        if "Launch" in name:
            return "launch"
        return "CUDA API other"
    if name.startswith(("nccl:", "gloo:", "c10d", "record_param_comms")):
        return "collective calls"
    if name.startswith("autograd::engine"):
        return "autograd engine"
    return "torch ops"


def lane_labels(host: Sequence[Span], main: int) -> dict[int, str]:
    """A name for each host thread: main (the step's), autograd (where the backward ran
    off the main thread), else thread N."""
    labels = {}
    for s in host:
        if s.lane == main:
            labels[s.lane] = "main"
        elif s.name.startswith("autograd::engine::evaluate_function"):
            labels[s.lane] = "autograd"
        else:
            labels.setdefault(s.lane, f"thread {s.lane}")
    return labels


def _add(into: dict[str, float], key: str, value: float) -> None:
    into[key] = into.get(key, 0.0) + value


def meanwhile(
    window: tuple[float, float],
    gpu: Sequence[Span],
    host: Sequence[Span],
    labels: dict[int, str],
) -> dict:
    """What ran in ``window`` besides the NCCL kernels, us: on the GPU the kernels' time by
    kind (streams may overlap) and ``idle`` (no kernel at all); on the host each thread's own
    time by kind (:func:`self_times`), with ``untraced`` where it was in no op; the 20 longest
    kernels by name, with their time."""
    lo, hi = window
    others = [k for k in gpu if gpu_kind(k.name) != "nccl"]
    kinds: dict[str, float] = {}
    names: dict[str, float] = {}
    for k in others:
        t = overlap(k.start, k.end, lo, hi)
        if t > 0:
            _add(kinds, gpu_kind(k.name), t)
            _add(names, k.name.split("(")[0].strip()[:60], t)
    if gpu:  # a CPU step has no GPU to be idle
        kinds["idle"] = (hi - lo) - covered(((k.start, k.end) for k in others), lo, hi)
    threads: dict[str, dict[str, float]] = {}
    for s, t in zip(host, self_times(host, lo, hi), strict=True):
        if t > 0:
            _add(threads.setdefault(labels.get(s.lane, str(s.lane)), {}), host_kind(s.name), t)
    for lane, label in labels.items():
        mine = [(s.start, s.end) for s in host if s.lane == lane]
        if label in threads:
            _add(threads[label], "untraced", (hi - lo) - covered(mine, lo, hi))
    return {
        "gpu": kinds,
        "host": threads,
        "kernels": dict(sorted(names.items(), key=lambda kv: -kv[1])[:20]),
    }


def phase_of(kernel: Span, marks: dict[str, tuple[float, float]]) -> str:
    """The phase that launched ``kernel`` (by its launch time where known, else its start)."""
    t = kernel.start if kernel.launch is None else kernel.launch
    if t < marks[BACKWARD][0]:
        return "forward"
    return "backward" if t < marks[OPTIMIZER][0] else "optimizer"


def breakdown(marks: dict[str, tuple[float, float]], gpu: Sequence[Span], threshold: float) -> dict:
    """One step from its host marks (``STEP`` and the phases: start, end) and GPU kernels, us
    from the step's start: the partition step = forward + backward and link + tail +
    optimizer; the link's busy time (the union of the backward's NCCL kernels), its first
    start, last end and idle gaps longer than ``threshold``; the NCCL kernels the forward
    launched (DDP's buffer broadcast) apart."""
    t0, t1 = marks[STEP]
    by_phase: dict[str, list[Span]] = {p: [] for p in PHASES}
    for k in gpu:
        by_phase[phase_of(k, marks)].append(k)
    nccl = [k for k in by_phase["backward"] if gpu_kind(k.name) == "nccl"]
    busy = union((k.start, k.end) for k in nccl)
    forward_end = max([marks[FORWARD][1]] + [k.end for k in by_phase["forward"]])
    backward_end = max([marks[BACKWARD][1]] + [k.end for k in by_phase["backward"]])
    opt_kernels = by_phase["optimizer"]
    opt_start = min(k.start for k in opt_kernels) if opt_kernels else marks[OPTIMIZER][0]
    points = [t0, forward_end, busy[-1][1] if busy else backward_end, opt_start, t1]
    for i in range(1, len(points)):  # the cuts in order, however the phases overlapped
        points[i] = min(max(points[i], points[i - 1]), t1)
    parts = ("forward", "backward and link", "tail", "optimizer")
    gaps = idle_gaps(busy, threshold)
    fwd_nccl = [k for k in by_phase["forward"] if gpu_kind(k.name) == "nccl"]
    return {
        "step": t1 - t0,
        "host": {p: marks[m][1] - marks[m][0] for p, m in PHASES.items()},
        "parts": {p: b - a for p, a, b in zip(parts, points, points[1:], strict=False)},
        "cuts": [p - t0 for p in points],
        "forward_gpu_end": forward_end - t0,
        "backward_end": backward_end - t0,
        "link": None
        if not busy
        else {
            "kernels": len(nccl),
            "busy": sum(e - s for s, e in busy),
            "first_start": busy[0][0] - t0,
            "last_end": busy[-1][1] - t0,
            "idle_between": busy[-1][1] - busy[0][0] - sum(e - s for s, e in busy),
            "gaps": gaps,
            "forward_nccl": sum(k.end - k.start for k in fwd_nccl),
        },
    }


def analyse(
    marks: dict[str, tuple[float, float]],
    gpu: Sequence[Span],
    host: Sequence[Span],
    threshold: float,
) -> dict:
    """:func:`breakdown`, with :func:`meanwhile` of each link gap, of them all summed, and of
    the backward-and-link part as a whole, and the cgx_hook calls' count and host time; times
    in ms from the step's start."""
    main = next(s.lane for s in host if s.name == STEP)
    labels = lane_labels(host, main)
    result = breakdown(marks, gpu, threshold)
    t0 = marks[STEP][0]
    link = result["link"]
    gaps = []
    total: dict = {"gpu": {}, "host": {}}
    for lo, hi in link["gaps"] if link else ():
        seen = meanwhile((lo, hi), gpu, host, labels)
        gaps.append({"start": (lo - t0) / 1e3, "length": (hi - lo) / 1e3, **_ms(seen)})
        for kind, t in seen["gpu"].items():
            _add(total["gpu"], kind, t)
        for label, kinds in seen["host"].items():
            for kind, t in kinds.items():
                _add(total["host"].setdefault(label, {}), kind, t)
    cuts = [t0 + c for c in result["cuts"]]
    whole = meanwhile((cuts[1], cuts[2]), gpu, host, labels)
    out = _ms(result)
    if link:
        out["link"]["gaps"] = gaps
        out["link"]["gaps_total"] = _ms(total)
    out["backward_and_link_meanwhile"] = _ms(whole)
    hooks = sorted((s for s in host if s.name == HOOK), key=lambda s: s.start)
    out["hook"] = {
        "calls": len(hooks),
        "host_ms": sum(s.end - s.start for s in hooks) / 1e3,
        "each": [_hook_call(s, t0, host, labels) for s in hooks],
    }
    return out


def _hook_call(call: Span, t0: float, host: Sequence[Span], labels: dict[int, str]) -> dict:
    """A cgx_hook call, ms: its start from ``t0``, its length, and its thread's own time in
    it by kind (what it waits on or launches, beside its Python)."""
    mine = [s for s in host if s.lane == call.lane]
    seen = meanwhile((call.start, call.end), [], mine, labels)["host"]
    kinds = seen.get(labels.get(call.lane, str(call.lane)), {})
    return {
        "start": (call.start - t0) / 1e3,
        "length": (call.end - call.start) / 1e3,
        "host": {kind: t / 1e3 for kind, t in kinds.items() if t > 0},
    }


def _ms(value: object) -> object:
    """``value``'s numbers, us, as ms (in dicts, lists and tuples; counts stay)."""
    if isinstance(value, dict):
        return {k: v if k == "kernels" and isinstance(v, int) else _ms(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_ms(v) for v in value]
    return value / 1e3 if isinstance(value, int | float) else value


# -- the profile ----------------------------------------------------------------------------


def spans_of(prof: torch.profiler.profile) -> tuple[list, list[Span], list[Span]]:
    """The profile's step marks (host), GPU kernels (launch times linked by correlation id)
    and host events, in us."""
    cpu, gpu = torch.autograd.DeviceType.CPU, torch.autograd.DeviceType.CUDA
    events = prof.events()
    launches = {
        e.id: e.time_range.start
        for e in events
        if e.device_type == cpu
        and is_cuda_api(e.name)
        and re.search("Launch|Memcpy|Memset", e.name)
    }
    # The GPU's copies of the host's ranges (record_function's) and CUDA's sync records are no
    # kernels: known by their flag, or by a host range's name.
    scopes = {e.name for e in events if getattr(e, "is_user_annotation", False)}
    kernels, host = [], []
    for e in events:
        r = e.time_range
        if e.device_type == gpu:
            if getattr(e, "is_user_annotation", False) or e.name in scopes or e.name in MARKS:
                continue
            if e.name.startswith(("nccl:", "gloo:", "ProfilerStep")) or _CUDA_SYNC.match(e.name):
                continue
            stream = getattr(e, "device_resource_id", 0) or 0
            kernels.append(Span(e.name, r.start, r.end, stream, launches.get(e.id)))
        elif e.device_type == cpu and not getattr(e, "is_async", False):
            host.append(Span(e.name, r.start, r.end, e.thread))
    steps = sorted((s for s in host if s.name == STEP), key=lambda s: s.start)
    return steps, kernels, host


def marks_of(step: Span, host: Sequence[Span]) -> dict[str, tuple[float, float]]:
    """``step``'s phase marks (host start and end), the last of each name within it."""
    marks = {STEP: (step.start, step.end)}
    for s in host:
        if s.name in PHASES.values() and step.start <= s.start and s.end <= step.end:
            marks[s.name] = (s.start, s.end)
    return marks


def analyse_profile(prof: torch.profiler.profile, threshold: float) -> list[dict]:
    """:func:`analyse` of each profiled step."""
    steps, kernels, host = spans_of(prof)
    out = []
    for step in steps:
        inside = [s for s in host if step.start <= s.end and s.start <= step.end]
        # By their start: the GPU's clock, aligned to the host's, may end one past the step.
        mine = [k for k in kernels if step.start <= k.start <= step.end]
        out.append(analyse(marks_of(step, host), mine, inside, threshold * 1e3))
    return out


# -- the training step ----------------------------------------------------------------------


def _marked(hook: Callable) -> Callable:
    def marked_hook(state, bucket):  # DDP checks real annotations, not strings: none
        with record_function(HOOK):
            return hook(state, bucket)

    return marked_hook


class Trainer:
    """train_ddp.py's model (or ddp_gloo_cuda.py's MLP) under DDP, compiled where asked, with
    train_ddp.py's cgx_hook (``--bits 32``: none, plain DDP), AdamW and its batches."""

    def __init__(self, args: argparse.Namespace, device: torch.device) -> None:
        self.args, self.device = args, device
        torch.manual_seed(args.seed)  # the same weights everywhere
        if args.model == "mlp":
            from ddp_gloo_cuda import MLP

            model = MLP(args.dim, args.layers)
        else:
            model = CharTransformer(args.context, args.dim, args.layers, args.heads)
            self.text = load_text(args.text_bytes)
        self.params = sum(p.numel() for p in model.parameters())
        self.ddp = DDP(model.to(device), bucket_cap_mb=args.bucket_cap_mb)
        self.state = None
        # AdamW: stepped after the backward pass, or in it, each bucket as it is averaged.
        adamw, in_backward = {"lr": args.lr}, args.optimizer_in_backward
        if args.bits != 32:
            params = {"bits": args.bits, "bucket_size": args.bucket_size}
            mesh = None if args.flat else "auto"
            self.state = CGXState(None, args.layer_min_size, params, mesh=mesh)
            hook = _marked(cgx_hook)
            if in_backward:
                hook = optimizer_in_hook(hook, torch.optim.AdamW, adamw)
            self.ddp.register_comm_hook(self.state, hook)
        elif in_backward:
            self.ddp._register_fused_optim(torch.optim.AdamW, **adamw)  # torch's allreduce_hook
        self.forward = torch.compile(self.ddp) if args.compile else self.ddp
        self.opt = None if in_backward else torch.optim.AdamW(self.ddp.parameters(), **adamw)
        self.gen = torch.Generator().manual_seed(args.seed * 1000 + dist.get_rank())

    def loss(self) -> torch.Tensor:
        """The forward pass of a fresh batch, and its loss."""
        args, device = self.args, self.device
        if args.model == "mlp":
            x = torch.randn(args.batch_size, args.dim, generator=self.gen).to(device)
            with torch.autocast(device.type, torch.bfloat16, enabled=args.amp == "bf16"):
                return nn.functional.mse_loss(self.forward(x), x.roll(1, dims=1))
        x, y = batch(self.text, args.batch_size, args.context, self.gen, str(device))
        with torch.autocast(device.type, torch.bfloat16, enabled=args.amp == "bf16"):
            logits = self.forward(x)
        return nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    def step(self) -> tuple[float, int]:
        """One training step, the ranks lined up and the GPU idle first: its ms (to its
        GPU work's end) and the bytes this rank sent (plain DDP: its fp32 ring's)."""
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if cuda:
            torch.cuda.synchronize()
        sent = self.state.bytes_sent if self.state is not None else 0
        t0 = time.perf_counter()
        with record_function(STEP):
            self.ddp.zero_grad(set_to_none=True)
            with record_function(FORWARD):
                loss = self.loss()
            with record_function(BACKWARD):
                loss.backward()
            with record_function(OPTIMIZER):
                if self.opt is not None:  # else stepped in the backward pass
                    self.opt.step()
            if cuda:
                torch.cuda.synchronize()
        ms = (time.perf_counter() - t0) * 1e3
        if self.state is None:
            return ms, ring_bytes_sent(4 * self.params, dist.get_world_size())
        return ms, self.state.bytes_sent - sent


def profiled(trainer: Trainer, args: argparse.Namespace) -> dict:
    """The warm-up steps, the timed ones, then the profiled ones analysed; rank 0's chrome
    trace exported where asked."""
    unprofiled = [trainer.step()[0] for _ in range(args.warmup + args.timed)][args.warmup :]
    activities = [ProfilerActivity.CPU]
    if trainer.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    # The profiler's first step pays its start: a warm-up step it throws away.
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=args.steps, repeat=1)
    timed = []
    with torch.profiler.profile(activities=activities, schedule=schedule) as prof:
        for i in range(args.steps + 1):
            ms, nbytes = trainer.step()
            if i:
                timed.append((ms, nbytes))
            prof.step()
    # The last ones: where the profiler kept its warm-up step's events too, that one is first.
    steps = analyse_profile(prof, args.threshold_ms)[-len(timed) :]
    for s, (ms, nbytes) in zip(steps, timed, strict=True):
        s["wall_ms"], s["bytes_sent"] = ms, nbytes
    if args.trace and dist.get_rank() == 0:
        Path(args.trace).parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(args.trace)
    return {"steps": steps, "unprofiled_ms": unprofiled}


def run(args: argparse.Namespace) -> None:
    cuda = args.device == "cuda"
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    trainer = Trainer(args, device)
    everyone = _on_rank_0(profiled(trainer, args))
    what = {
        "model": args.model,
        "params": trainer.params,
        "what": "plain DDP" if args.bits == 32 else f"{args.bits}-bit cgx_hook",
        "backend": dist.get_backend(),
    }
    # DDP's reducer must be gone, and every rank done, before the process group is destroyed.
    del trainer
    gc.collect()
    dist.barrier()
    if everyone is None:
        return
    report(everyone, what, args)
    ranks = [{"rank": r, **e} for r, e in enumerate(everyone)]
    if args.out:
        write_results("ddp_step_timeline", device, ranks, args.out, args=vars(args), **what)


# -- the report -----------------------------------------------------------------------------


def _kinds(kinds: dict[str, float], least: float = 0.005) -> str:
    shown = sorted(((k, t) for k, t in kinds.items() if t >= least), key=lambda kv: -kv[1])
    return ", ".join(f"{k} {t:.2f}" for k, t in shown) or "-"


def _host(threads: dict[str, dict[str, float]]) -> str:
    return "; ".join(f"{label}: {_kinds(kinds)}" for label, kinds in sorted(threads.items()))


def report(everyone: list[dict], what: dict, args: argparse.Namespace) -> None:
    """Rank 0's print of every rank's profiled steps; the gaps of its own median step."""
    amp = "bf16 autocast" if args.amp == "bf16" else "fp32"
    print(
        f"DDP step timeline: {what['model']} {what['params'] / 1e6:.2f}M params, "
        f"{len(everyone)} ranks on {what['backend']}, {what['what']}, {amp}, "
        f"{'compiled' if args.compile else 'eager'}; {args.steps} profiled step(s) a rank "
        f"(ms from the step's host start)"
    )
    cols = [(r, i, s) for r, e in enumerate(everyone) for i, s in enumerate(e["steps"])]
    head = "".join(f"  r{r} s{i + 1}".rjust(9) for r, i, _ in cols)
    rows: list[tuple[str, Callable[[dict], float | None]]] = [
        ("step, wall (perf_counter)", lambda s: s["wall_ms"]),
        ("step, profiled", lambda s: s["step"]),
        ("forward, host mark", lambda s: s["host"]["forward"]),
        ("backward, host mark", lambda s: s["host"]["backward"]),
        ("optimizer, host mark", lambda s: s["host"]["optimizer"]),
        ("forward done, GPU too", lambda s: s["forward_gpu_end"]),
        ("backward done, GPU too", lambda s: s["backward_end"]),
        ("NCCL kernels, backward", lambda s: s["link"] and s["link"]["kernels"]),
        ("first NCCL kernel start", lambda s: s["link"] and s["link"]["first_start"]),
        ("last NCCL kernel end", lambda s: s["link"] and s["link"]["last_end"]),
        ("link busy (NCCL union)", lambda s: s["link"] and s["link"]["busy"]),
        ("link idle, first to last", lambda s: s["link"] and s["link"]["idle_between"]),
        ("NCCL in the forward", lambda s: s["link"] and s["link"]["forward_nccl"]),
        ("= forward", lambda s: s["parts"]["forward"]),
        ("+ backward and link", lambda s: s["parts"]["backward and link"]),
        ("+ tail (to the optimizer)", lambda s: s["parts"]["tail"]),
        ("+ optimizer", lambda s: s["parts"]["optimizer"]),
        ("cgx_hook calls", lambda s: s["hook"]["calls"] or None),
        ("cgx_hook host time", lambda s: s["hook"]["host_ms"] if s["hook"]["calls"] else None),
        ("MB sent by this rank", lambda s: s["bytes_sent"] / 1e6),
    ]
    print(f"{'':28s}{head}")
    for label, get in rows:
        cells = []
        for _, _, s in cols:
            v = get(s)
            if isinstance(v, int | float):
                cells.append(f"{v:9d}" if isinstance(v, int) else f"{v:9.2f}")
            else:
                cells.append(f"{'-':>9s}")
        print(f"  {label:26s}{''.join(cells)}")
    unprofiled = [statistics.median(e["unprofiled_ms"]) for e in everyone if e["unprofiled_ms"]]
    if unprofiled:
        said = ", ".join(f"{ms:.2f}" for ms in unprofiled)
        print(f"  unprofiled steps before (median, ms, by rank): {said}")
    mine = sorted(everyone[0]["steps"], key=lambda s: s["step"])
    s = mine[len(mine) // 2]
    parts = s["parts"]
    link = s["link"]
    busy = f" [link busy {link['busy']:.2f}, idle {link['idle_between']:.2f}]" if link else ""
    print(
        f"rank 0: step {s['step']:.2f} ms = forward {parts['forward']:.2f} + (backward and "
        f"link) {parts['backward and link']:.2f}{busy} + tail "
        f"{'after the last NCCL kernel ' if link else ''}{parts['tail']:.2f} + optimizer "
        f"{parts['optimizer']:.2f}"
    )
    sent = f"sent {s['bytes_sent'] / 1e6:.2f} MB this step"
    if args.link_gbps:
        light = s["bytes_sent"] * 8 / (args.link_gbps * 1e9) * 1e3
        sent += f": {light:.2f} ms at {args.link_gbps:g} Gbit/s (the link's light)"
    print(f"rank 0: {sent}" + (f", against the link busy {link['busy']:.2f} ms" if link else ""))
    if not link:
        print(
            f"no NCCL kernels: on {what['backend']} the collectives run on the host, so the "
            f"link's timeline cannot be seen here; the spans above still hold"
        )
    else:
        gaps = link["gaps"]
        print(
            f"rank 0: {len(gaps)} link gaps over {args.threshold_ms} ms, "
            f"{sum(g['length'] for g in gaps):.2f} ms in all; in them (ms) GPU: "
            f"{_kinds(link['gaps_total']['gpu'])}; host {_host(link['gaps_total']['host'])}"
        )
        for g in gaps[: args.show_gaps]:
            top = ", ".join(f"{n} {t:.2f}" for n, t in list(g["kernels"].items())[:3])
            print(f"  at {g['start']:8.2f} for {g['length']:6.2f}: GPU {_kinds(g['gpu'])}")
            print(f"  {'':25s}kernels {top or '-'}")
            print(f"  {'':25s}host {_host(g['host'])}")
        if len(gaps) > args.show_gaps:
            print(f"  ... {len(gaps) - args.show_gaps} more in the JSON")
    whole = s["backward_and_link_meanwhile"]
    gpu = f"GPU besides NCCL {_kinds(whole['gpu'])}; " if whole["gpu"] else ""
    print(f"rank 0, backward and link as a whole (ms): {gpu}host {_host(whole['host'])}")
    calls = s["hook"]["each"]
    if calls:
        shown = calls[: args.show_hooks]
        longest = max(calls, key=lambda c: c["length"])
        if longest not in shown:
            shown.append(longest)
        print(f"rank 0: cgx_hook's calls (of {len(calls)}; ms from the step's start), the host:")
        for c in shown:
            print(f"  at {c['start']:8.2f} for {c['length']:6.2f}: {_kinds(c['host'])}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    add_choice(p, "--model", ("transformer", "mlp"), "mlp: bench/ddp_gloo_cuda.py's")
    add_model_options(p, batch_size=16, context=64, dim=128, layers=2, heads=4, lr=3e-3)
    add_number(p, "--text-bytes", 2_000_000, "bytes of training text")
    p.add_argument("--bits", type=int, default=4, help="cgx_hook's, 1-8; 32 for plain DDP")
    add_bucket_size_argument(p)
    add_number(p, "--layer-min-size", 1024, "smaller layers are sent uncompressed")
    p.add_argument("--flat", action="store_true", help="the flat allreduce across nodes")
    add_number(p, "--bucket-cap-mb", 25.0, "DDP's bucket size")
    add_choice(p, "--amp", ("none", "bf16"), "bf16 autocast")
    p.add_argument(
        "--optimizer-in-backward",
        action="store_true",
        help="AdamW steps each bucket in the hook as it is averaged (cgx2.ddp.optimizer_in_hook; "
        "plain DDP: DDP._register_fused_optim)",
    )
    p.add_argument("--compile", action="store_true", help="torch.compile the model under DDP")
    add_choice(p, "--device", ("auto", "cpu", "cuda"), "auto: cuda if available (NCCL)")
    add_number(p, "--warmup", 5, "unprofiled steps first")
    add_number(p, "--timed", 3, "unprofiled steps timed after the warm-up, for comparison")
    add_number(p, "--steps", 1, "profiled steps")
    add_number(p, "--threshold-ms", 0.05, "link gaps shorter than this are not listed")
    add_number(p, "--show-gaps", 30, "link gaps printed (all go to the JSON)")
    add_number(p, "--show-hooks", 3, "cgx_hook calls printed, the first ones and the longest")
    rate = bits_per_second(os.environ.get("LINK_RATE", ""))  # netlab's hosts say theirs
    p.add_argument(
        "--link-gbps",
        type=float,
        default=rate / 1e9 if rate else 0.0,
        help="the link's rate, Gbit/s (netlab's LINK_RATE where set): the time of the bytes "
        "sent at that rate, the link's light, beside its busy time",
    )
    p.add_argument("--trace", help="export rank 0's chrome trace to this file (large)")
    add_out_argument(p)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (1 <= args.bits <= 8 or args.bits == 32):
        p.error("--bits must be in 1..8, or 32")
    if args.steps < 1 or args.warmup < 1 or args.timed < 0:
        p.error("--steps and --warmup must be >= 1, --timed >= 0")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if refused_single_process("bench/ddp_step_timeline.py"):
        sys.exit(2)
    if args.device == "cuda":  # the rank's GPU before the group, as NCCL wants
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    try:
        run(args)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
