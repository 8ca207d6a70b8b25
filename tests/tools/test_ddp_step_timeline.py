"""bench/ddp_step_timeline.py: its analysis on synthetic timelines (interval union, the link's
gaps, what ran in them on the GPU and on each host thread, the step cut into its parts), and a
real run on two gloo ranks under torchrun."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
from test_bench_cli import ROOT, _torchrun


def _load() -> ModuleType:
    path = ROOT / "bench" / "ddp_step_timeline.py"
    spec = importlib.util.spec_from_file_location("ddp_step_timeline", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up
    spec.loader.exec_module(module)
    return module


tl = _load()
Span = tl.Span


def test_union_gaps_and_coverage() -> None:
    busy = tl.union([(50, 60), (0, 10), (5, 20), (20, 30), (100, 101), (30.02, 40)])
    # Overlapping and touching intervals merge; the order given does not matter.
    assert busy == [(0, 30), (30.02, 40), (50, 60), (100, 101)]
    assert tl.idle_gaps(busy, threshold=5) == [(40, 50), (60, 100)]
    assert tl.idle_gaps(busy, threshold=0) == [(30, 30.02), (40, 50), (60, 100)]
    assert tl.idle_gaps(busy[:1], threshold=0) == []
    assert tl.covered([(0, 10), (5, 20), (50, 60)], 8, 55) == 12 + 5
    assert tl.overlap(0, 10, 20, 30) == 0


def test_self_times_subtract_children_on_their_own_thread_only() -> None:
    spans = [
        Span("parent", 0, 100, lane=1),
        Span("child", 10, 30, lane=1),
        Span("grandchild", 15, 20, lane=1),
        Span("child", 40, 101, lane=1),  # ends past its parent: clipped to it
        Span("other thread", 0, 100, lane=2),
    ]
    assert tl.self_times(spans, 0, 100) == pytest.approx([100 - 20 - 60, 15, 5, 60, 100])
    # Within a window: only what lies in it.
    assert tl.self_times(spans, 25, 50) == pytest.approx([10, 5, 0, 10, 25])


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("ncclDevKernel_SendRecv(ncclDevKernelArgsStorage<4096ul>)", "nccl"),
        ("_decode_sum_encode_kernel", "cgx dse"),
        ("_encode_kernel", "cgx encode"),
        ("_decode_kernel", "cgx decode"),
        ("Memcpy DtoD (Device -> Device)", "memcpy"),
        ("sm90_xmma_gemm_f32f32_tf32f32", "compute"),
    ],
)
def test_gpu_kinds(name: str, kind: str) -> None:
    assert tl.gpu_kind(name) == kind


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        (tl.HOOK, "cgx_hook Python"),
        (tl.BACKWARD, "Python or waiting"),
        ("cudaStreamSynchronize", "sync"),
        ("cudaEventSynchronize", "sync"),
        ("cudaMemcpyAsync", "memcpy"),
        ("cuLaunchKernel", "launch"),
        ("cudaLaunchKernelExC", "launch"),
        ("cudaStreamWaitEvent", "CUDA API other"),
        ("nccl:all_to_all", "collective calls"),
        ("autograd::engine::evaluate_function: MmBackward0", "autograd engine"),
        ("aten::copy_", "torch ops"),
        ("cudnnConvolution", "torch ops"),  # not a CUDA API call
    ],
)
def test_host_kinds(name: str, kind: str) -> None:
    assert tl.host_kind(name) == kind


def test_what_ran_in_a_gap_on_the_gpu_and_each_thread() -> None:
    gpu = [
        Span("ncclDevKernel_SendRecv", 50, 100, lane=20),  # the link's: not counted
        Span("_encode_kernel", 90, 130, lane=21),
        Span("sm90_gemm", 120, 170, lane=7),
        Span("_decode_sum_encode_kernel", 160, 180, lane=21),
        Span("Memcpy DtoD (Device -> Device)", 190, 260, lane=7),
    ]
    host = [
        Span(tl.STEP, 0, 300, lane=1),
        Span(tl.BACKWARD, 50, 250, lane=1),
        Span("autograd::engine::evaluate_function: AccumulateGrad", 95, 190, lane=2),
        Span(tl.HOOK, 110, 180, lane=2),
        Span("cuLaunchKernel", 115, 125, lane=2),
        Span("cudaStreamSynchronize", 130, 170, lane=2),
        Span("aten::copy_", 182, 188, lane=2),
    ]
    labels = tl.lane_labels(host, main=1)
    assert labels == {1: "main", 2: "autograd"}
    seen = tl.meanwhile((100, 200), gpu, host, labels)
    # Kernels overlap on their streams; idle is where none ran: 180-190.
    assert seen["gpu"] == pytest.approx(
        {"cgx encode": 30, "compute": 50, "cgx dse": 20, "memcpy": 10, "idle": 10}
    )
    assert list(seen["kernels"]) == [
        "sm90_gemm",
        "_encode_kernel",
        "_decode_sum_encode_kernel",
        "Memcpy DtoD",
    ]
    assert seen["host"]["main"] == pytest.approx({"Python or waiting": 100, "untraced": 0})
    autograd = seen["host"]["autograd"]
    assert autograd == pytest.approx(
        {
            "autograd engine": 90 - 70 - 6,
            "cgx_hook Python": 70 - 10 - 40,
            "launch": 10,
            "sync": 40,
            "torch ops": 6,
            "untraced": 10,  # 190-200: the thread was in no op
        }
    )
    assert sum(autograd.values()) == pytest.approx(100)  # a thread's times fill the window


MARKS = {
    tl.STEP: (1000, 2000),
    tl.FORWARD: (1010, 1100),
    tl.BACKWARD: (1100, 1500),
    tl.OPTIMIZER: (1500, 1550),
}
KERNELS = [
    Span("sm90_gemm", 1020, 1200, lane=7, launch=1030),
    Span("ncclDevKernel_Broadcast_RING_LL", 1015, 1025, lane=20, launch=1012),  # buffers
    Span("sm90_gemm_backward", 1200, 1400, lane=7, launch=1110),
    Span("ncclDevKernel_SendRecv", 1300, 1400, lane=20, launch=1200),
    Span("ncclDevKernel_AllGather_RING_LL", 1420, 1500, lane=20, launch=1210),
    # Launched in the backward, run after the optimizer's host start: still the backward's.
    Span("_decode_kernel", 1550, 1580, lane=21, launch=1450),
    Span("ncclDevKernel_SendRecv", 1600, 1700, lane=20, launch=1300),
    Span("Memcpy DtoD (Device -> Device)", 1700, 1750, lane=7, launch=1490),
    Span("multi_tensor_apply_kernel", 1760, 1900, lane=7, launch=1510),
    Span("elementwise_kernel", 1950, 1960, lane=7),  # no launch known: by its start
]


def test_a_step_cut_into_its_parts() -> None:
    got = tl.breakdown(MARKS, KERNELS, threshold=50)
    assert got["step"] == 1000
    assert got["host"] == {"forward": 90, "backward": 400, "optimizer": 50}
    # Forward to its GPU end (1200), backward and link to the last NCCL end (1700), the tail
    # to the optimizer's first kernel (1760), the optimizer to the step's end: the step.
    assert got["parts"] == {
        "forward": 200,
        "backward and link": 500,
        "tail": 60,
        "optimizer": 240,
    }
    assert sum(got["parts"].values()) == got["step"]
    assert got["backward_end"] == 750
    link = got["link"]
    assert link["kernels"] == 3 and link["busy"] == 100 + 80 + 100
    assert (link["first_start"], link["last_end"]) == (300, 700)
    assert link["idle_between"] == 400 - 280
    assert link["gaps"] == [(1500, 1600)]  # 1400-1420 is under the threshold
    assert link["forward_nccl"] == 10


def test_a_step_without_nccl_has_no_link() -> None:
    got = tl.breakdown(MARKS, [], threshold=50)
    assert got["link"] is None
    assert got["parts"] == {"forward": 100, "backward and link": 400, "tail": 0, "optimizer": 500}


def test_the_gaps_analysed_in_ms() -> None:
    host = [
        Span(tl.STEP, 1000, 2000, lane=1),
        Span(tl.FORWARD, 1010, 1100, lane=1),
        Span(tl.BACKWARD, 1100, 1500, lane=1),
        Span(tl.OPTIMIZER, 1500, 1550, lane=1),
        Span("cudaDeviceSynchronize", 1560, 2000, lane=1),
    ]
    got = tl.analyse(MARKS, KERNELS, host, threshold=50)
    assert got["parts"]["tail"] == pytest.approx(0.06)
    (gap,) = got["link"]["gaps"]
    assert (gap["start"], gap["length"]) == pytest.approx((0.5, 0.1))
    assert gap["gpu"] == pytest.approx({"cgx decode": 0.03, "idle": 0.07})
    assert gap["host"]["main"] == pytest.approx(
        {"Python or waiting": 0.06, "sync": 0.04, "untraced": 0}
    )
    assert got["link"]["gaps_total"]["gpu"] == pytest.approx(gap["gpu"])


def test_the_report_of_a_step_with_nccl(capsys) -> None:
    host = [Span(tl.STEP, 1000, 2000, lane=1), Span(tl.HOOK, 1200, 1250, lane=2)]
    host += [Span("cudaStreamSynchronize", 1210, 1240, lane=2)]  # inside the hook, on its thread
    host += [Span(name, *MARKS[name], lane=1) for name in (tl.FORWARD, tl.BACKWARD, tl.OPTIMIZER)]
    step = tl.analyse(MARKS, KERNELS, host, threshold=50) | {"wall_ms": 1.1, "bytes_sent": 250_000}
    assert step["hook"]["calls"] == 1 and step["hook"]["host_ms"] == pytest.approx(0.05)
    (call,) = step["hook"]["each"]
    assert (call["start"], call["length"]) == pytest.approx((0.2, 0.05))
    assert call["host"] == pytest.approx({"cgx_hook Python": 0.02, "sync": 0.03})
    everyone = [{"steps": [step], "unprofiled_ms": [0.9]}] * 2
    what = {"model": "transformer", "params": 10**6, "what": "4-bit cgx_hook", "backend": "nccl"}
    args = tl.parse_args(["--link-gbps", "10", "--device", "cpu"])
    tl.report(everyone, what, args)
    out = capsys.readouterr().out
    assert (
        "rank 0: step 1.00 ms = forward 0.20 + (backward and link) 0.50 [link busy 0.28, idle "
        "0.12] + tail after the last NCCL kernel 0.06 + optimizer 0.24"
    ) in out
    # 250 kB at 10 Gbit/s: 0.2 ms.
    assert "sent 0.25 MB this step: 0.20 ms at 10 Gbit/s (the link's light)" in out
    assert "rank 0: 1 link gaps over 0.05 ms, 0.10 ms in all" in out
    assert "at     0.50 for   0.10: GPU idle 0.07, cgx decode 0.03" in out
    row = next(line for line in out.splitlines() if "link busy (NCCL union)" in line)
    assert row.split()[-2:] == ["0.28", "0.28"]  # a column a rank
    assert "rank 0: cgx_hook's calls (of 1; ms from the step's start), the host:" in out
    assert "at     0.20 for   0.05: sync 0.03, cgx_hook Python 0.02" in out


def _event(name: str, start: float, end: float, cuda: bool = False, **more: object) -> object:
    """A stand-in for the profiler's FunctionEvent, with the fields the script reads."""
    device = torch.autograd.DeviceType.CUDA if cuda else torch.autograd.DeviceType.CPU
    fields = {"id": 0, "thread": 1, "device_resource_id": 0, "is_async": False}
    fields |= {"is_user_annotation": False, **more}
    return SimpleNamespace(
        name=name, time_range=SimpleNamespace(start=start, end=end), device_type=device, **fields
    )


def test_kernels_get_their_launch_time_by_correlation_id() -> None:
    events = [
        _event(tl.STEP, 0, 100),
        _event("aten::mm", 10, 20, id=7),  # an op's id is no launch's
        _event("cudaLaunchKernel", 12, 14, id=5, thread=2),
        _event("cuLaunchKernel", 30, 31, id=6),
        _event("sm90_gemm", 15, 40, cuda=True, id=5, device_resource_id=7),
        _event("_encode_kernel", 35, 50, cuda=True, id=6, device_resource_id=21),
        _event("Memset (Device)", 60, 61, cuda=True, id=7),  # its launch was not seen
        _event(tl.STEP, 0, 100, cuda=True, is_user_annotation=True),  # GPU-side ranges
        _event("nccl:all_to_all", 40, 90, cuda=True),
        _event("Optimizer.step#AdamW.step", 60, 99, is_user_annotation=True),
        _event("Optimizer.step#AdamW.step", 61, 98, cuda=True),  # a copy, unflagged
        _event("Stream Wait Event", 61, 61, cuda=True),  # CUDA's sync records
    ]
    steps, kernels, host = tl.spans_of(SimpleNamespace(events=lambda: events))
    assert steps == [Span(tl.STEP, 0, 100, lane=1)]
    assert kernels == [
        Span("sm90_gemm", 15, 40, lane=7, launch=12),
        Span("_encode_kernel", 35, 50, lane=21, launch=30),
        Span("Memset (Device)", 60, 61, lane=0, launch=None),
    ]
    names = [s.name for s in host]
    assert names == [tl.STEP, "aten::mm", "cudaLaunchKernel", "cuLaunchKernel", names[-1]]
    assert host[2].lane == 2


@pytest.mark.slow
def test_two_gloo_ranks_profile_their_steps(tmp_path: Path) -> None:
    args = ["--dim", "32", "--layers", "1", "--heads", "2", "--context", "16"]
    args += ["--batch-size", "2", "--steps", "2", "--warmup", "2", "--timed", "1"]
    args += ["--text-bytes", "100000", "--device", "cpu", "--link-gbps", "10"]
    trace = tmp_path / "trace" / "rank0.json"
    script = str(ROOT / "bench" / "ddp_step_timeline.py")
    proc = _torchrun([script, *args, "--out", str(tmp_path), "--trace", str(trace)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "4-bit cgx_hook" in proc.stdout and "no NCCL kernels" in proc.stdout
    assert "ms at 10 Gbit/s (the link's light)" in proc.stdout
    (path,) = tmp_path.glob("ddp_step_timeline_*.json")
    report = json.loads(path.read_text())
    assert "ddp_step_timeline.py" in report["env"]["command"]
    assert report["params"] > 0 and report["backend"] == "gloo"
    assert [r["rank"] for r in report["rows"]] == [0, 1]
    for rank in report["rows"]:
        assert len(rank["steps"]) == 2
        for step in rank["steps"]:
            host = step["host"]
            assert min(host.values()) > 0
            assert step["step"] >= sum(host.values()) - 1e-3
            assert sum(step["parts"].values()) == pytest.approx(step["step"])
            assert step["wall_ms"] >= step["step"] * 0.9
            assert step["link"] is None and step["bytes_sent"] > 0
            # The hook ran in the backward, marked: its host time is seen.
            main = step["backward_and_link_meanwhile"]["host"]["main"]
            assert main["cgx_hook Python"] > 0
    assert "traceEvents" in json.loads(trace.read_text())
