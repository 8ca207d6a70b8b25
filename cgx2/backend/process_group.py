"""The ``cgx`` torch.distributed backend's process group: ``dist.init_process_group("cgx")``.

Every collective goes to gloo (CPU tensors) or NCCL (CUDA tensors); ``all_reduce`` of floats
with SUM or AVG is quantized when ``CGX_COMPRESSION_QUANTIZATION_BITS`` < 32, and coalesced
allreduces are fused into buffers of at most ``CGX_FUSION_BUFFER_SIZE_MB``. When the job spans
several nodes, the world group quantizes between nodes only (:mod:`cgx2.collectives.hierarchical`;
``CGX_INTRA_BROADCAST`` picks CGX's variant).

Collectives of CPU tensors made during a backward pass (DDP's buckets) run on the group's worker
thread (:mod:`cgx2.comm.worker`), as DDP's hooks do: gloo would hold autograd's thread until
their bytes have crossed, and their coding competes with the backward pass for the cores.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator, Sequence

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore
from torch.distributed.device_mesh import DeviceMesh

from ..checks import UNCOMPRESSED_BITS, reduce_op_name
from ..collectives import CallSettings, agreement, policy
from ..collectives.fusion import allreduce_fused_, fusion_batches, padded_numel, ring_bytes_sent
from ..collectives.hierarchical import hierarchical_allreduce_fused_, node_mesh
from ..collectives.rotations import DEFAULT_BLOCK, check_rotation
from ..comm import CompletedWork, coding_stream, shm, worker
from ..config import CGXConfig, compression_from_env, tuning

__all__ = ["BACKEND_NAME", "CGXProcessGroup", "register_backend"]

BACKEND_NAME = "cgx"
COMPRESSIBLE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
"""What the backend quantizes; other dtypes (integers, float64) are reduced exactly."""

_BackendType = dist.ProcessGroup.BackendType


class _Works(dist.Work):
    """Several transport works seen as one (coalesced collectives)."""

    def __init__(self, works: list[dist.Work], outputs: list[torch.Tensor]) -> None:
        super().__init__()
        self._works, self._outputs = works, outputs

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        for work in self._works:
            work.wait()
        return True

    def get_future(self) -> torch.futures.Future[list[torch.Tensor]]:
        futures = [work.get_future() for work in self._works]
        return torch.futures.collect_all(futures).then(lambda _: self._outputs)


def _rotation(bits: int, bucket_size: int) -> str | None:
    """``CGX2_ROTATION`` (None for ``none``), checked against the call's bucket size before
    anything is sent: every rank reads the same variables and raises the same ``ValueError``."""
    if bits == UNCOMPRESSED_BITS:
        return None
    return check_rotation(
        tuning().rotation, DEFAULT_BLOCK, bucket_size, "CGX2_ROTATION", "CGX2_ROTATION's block"
    )


class CGXProcessGroup(dist.ProcessGroup):
    """A process group whose allreduce is quantized (see the module doc).

    ``config`` holds the ``CGX_*`` variables read when the group is made, except bits and
    bucket size, which are read again at every allreduce (CGX lets scripts change them).
    ``bytes_sent`` / ``bytes_uncompressed`` count what this rank's allreduces sent and what a
    ring allreduce of the same tensors would have sent. ``cuda_on_nccl`` says whether CUDA
    tensors' collectives go to NCCL, whose launches :mod:`cgx2.collectives.graphs` may capture.
    """

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        size: int,
        timeout: datetime.timedelta,
        nccl_options: object | None = None,
    ) -> None:
        super().__init__(rank, size)
        self.config = CGXConfig.from_env()
        self.bytes_sent = 0
        self.bytes_uncompressed = 0
        self._backends: dict[str, dist.Backend] = {}
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._meshes: dict[str, DeviceMesh | None] = {}
        gloo = dist.ProcessGroupGloo(PrefixStore("gloo/", store), rank, size, timeout)
        self._add_backend("cpu", _BackendType.GLOO, gloo)
        default = _BackendType.GLOO
        if torch.cuda.is_available() and dist.is_nccl_available():
            options = nccl_options
            if not isinstance(options, dist.ProcessGroupNCCL.Options):
                options = dist.ProcessGroupNCCL.Options()
                options.is_high_priority_stream = False
            options._timeout = timeout
            nccl = dist.ProcessGroupNCCL(PrefixStore("nccl/", store), rank, size, options)
            self._add_backend("cuda", _BackendType.NCCL, nccl)
            default = _BackendType.NCCL
        self._set_default_backend(default)
        self.cuda_on_nccl = default == _BackendType.NCCL

    def _add_backend(self, device: str, kind: _BackendType, backend: dist.Backend) -> None:
        # Registered backends serve every collective this class does not override.
        self._register_backend(torch.device(device), kind, backend)
        self._backends[device] = backend

    def getBackendName(self) -> str:  # the C++ method name, which the binding looks up
        return BACKEND_NAME

    def backend_for(self, tensor: torch.Tensor) -> dist.Backend:
        """The gloo or NCCL backend that carries ``tensor``'s collectives."""
        try:
            return self._backends[tensor.device.type]
        except KeyError:
            raise RuntimeError(
                f"the cgx backend has no {tensor.device.type} transport here (it has "
                f"{', '.join(self._backends)})"
            ) from None

    # -- allreduce ---------------------------------------------------------------------------

    def _issue(self, tensors: Sequence[torch.Tensor], call: Callable[[], dist.Work]) -> dist.Work:
        """``call()``'s work; for CPU tensors during a backward pass, ``call()`` on the group's
        worker, which leaves a collective running and goes on (its future follows the
        collective's). Every collective of the pass goes there, in the order made: one made
        on autograd's thread meanwhile could start before one still queued, on some ranks."""
        if (
            not tensors
            or tensors[0].is_cuda
            or torch._C._current_graph_task_id() == -1
            or not policy.runs_on_worker(tensors[0], self)
        ):
            return call()
        future = worker.submit(self, lambda: call().get_future(), list(tensors))
        return torch._C._distributed_c10d._create_work_from_future(future)

    def allreduce(
        self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions | None = None
    ) -> dist.Work:
        opts = dist.AllreduceOptions() if opts is None else opts
        return self._issue(tensors, lambda: self._allreduce(tensors, opts))

    def _allreduce(self, tensors: list[torch.Tensor], opts: dist.AllreduceOptions) -> dist.Work:
        op = reduce_op_name(opts.reduceOp)
        bits, bucket_size = compression_from_env()
        rotation = _rotation(bits, bucket_size)
        if len(tensors) != 1:
            return self._delegate(tensors, opts.reduceOp)
        t = tensors[0]
        compressible = self._compressible(t, op, bits)
        # What cannot be compressed takes the plain route without asking where compression
        # would pay (which may measure it, at the first call of a dtype).
        route = policy.route(
            t,
            self,
            bits if compressible else UNCOMPRESSED_BITS,
            bucket_size,
            padded_numel(t.numel(), bucket_size),
        )
        compress = compressible and route.compress
        agreed = None
        if route.check:  # before either path: ranks that disagree would take different ones
            fields = {
                "reduce_op": op,
                "bits": bits,
                "bucket_size": bucket_size,
                "minimal_size": self.config.minimal_size,
                "rotation": rotation,
                "compressed": compress,
            }
            agreed = agreement.check(
                self,
                "all_reduce on the cgx backend",
                t,
                fields,
                deferred=route.check == "deferred",
                route=route,
            )
        if compress:
            with self._side_stream(tensors):
                self._compress(tensors, CallSettings.of(bits, bucket_size, op, rotation=rotation))
                agreement.settle(agreed, t, self)
                return CompletedWork(tensors)
        work = self._delegate(tensors, opts.reduceOp)
        if agreed is None:
            return work
        work.wait()  # NCCL's: the current stream waits, not the host
        agreement.settle(agreed, t, self)
        return CompletedWork(tensors)

    def allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: dist.AllreduceCoalescedOptions | None = None
    ) -> dist.Work:
        opts = dist.AllreduceCoalescedOptions() if opts is None else opts

        def call() -> dist.Work:
            with self._side_stream(tensors):
                return self._allreduce_coalesced(tensors, opts)

        return self._issue(tensors, call)

    def _allreduce_coalesced(
        self, tensors: list[torch.Tensor], opts: dist.AllreduceCoalescedOptions
    ) -> dist.Work:
        op = reduce_op_name(opts.reduceOp)
        bits, bucket_size = compression_from_env()
        rotation = _rotation(bits, bucket_size)
        fused = [t for t in tensors if self._compressible(t, op, bits)]
        for t in tensors:
            if not any(t is f for f in fused):
                self._delegate([t], opts.reduceOp).wait()
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
        for t in fused:
            groups.setdefault((t.device, t.dtype), []).append(t)
        limit = self.config.fusion_buffer_size_mb << 20
        settings = CallSettings.of(bits, bucket_size, op, rotation=rotation)
        for (_, dtype), same in groups.items():
            sizes = [t.numel() for t in same]
            for batch in fusion_batches(sizes, dtype.itemsize, bucket_size, limit):
                padded = sum(padded_numel(sizes[i], bucket_size) for i in batch)
                if policy.compresses(same[batch[0]], self, bits, bucket_size, padded):
                    self._compress([same[i] for i in batch], settings)
                else:  # too small to pay on this interconnect: exact, in place
                    for i in batch:
                        self._delegate([same[i]], opts.reduceOp).wait()
        return CompletedWork(list(tensors))

    def allreduce_exact(self, tensor: torch.Tensor, reduce_op: str) -> dist.Work:
        """The uncompressed allreduce (``"sum"``/``"avg"``) of ``tensor`` in place, whatever
        the variables say: for layers a DDP hook keeps exact."""
        op = dist.ReduceOp.AVG if reduce_op == "avg" else dist.ReduceOp.SUM
        return self._delegate([tensor], op)

    @contextlib.contextmanager
    def _side_stream(self, tensors: Sequence[torch.Tensor]) -> Iterator[None]:
        """Code CUDA tensors on a side stream, as cgx_hook does: DDP's reducer calls
        all_reduce from the backward pass, which then goes on computing instead of waiting.
        The work's future carries the side stream's event to whoever waits on it."""
        cuda = [t for t in tensors if t.is_cuda]
        if not cuda:
            yield
            return
        device = cuda[0].device
        if device not in self._streams:
            self._streams[device] = coding_stream(device)
        side = self._streams[device]
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            yield
        for t in cuda:
            t.record_stream(side)

    def _compressible(self, t: torch.Tensor, op: str | None, bits: int) -> bool:
        return (
            bits != UNCOMPRESSED_BITS
            and op is not None
            and self.size() > 1
            and t.dtype in COMPRESSIBLE_DTYPES
            and t.layout == torch.strided
            and t.device.type in self._backends
            and t.numel() >= self.config.minimal_size
        )

    def node_mesh(self, device_type: str, bits: int = 4) -> DeviceMesh | None:
        """The ("inter", "intra") mesh when the policy reduces this group hierarchically at
        ``bits`` (:func:`cgx2.collectives.policy.hierarchical`), else None. Made at the first
        compressed allreduce, which every rank reaches in the same order (the default group
        must exist to make it, so it cannot be made with this group)."""
        if device_type not in self._meshes:
            several = policy.hierarchical(self, bits)
            self._meshes[device_type] = node_mesh(device_type) if several else None
        return self._meshes[device_type]

    def _compress(self, tensors: Sequence[torch.Tensor], settings: CallSettings) -> None:
        numel = sum(t.numel() for t in tensors)
        self.bytes_uncompressed += ring_bytes_sent(numel * tensors[0].element_size(), self.size())
        mesh = self.node_mesh(tensors[0].device.type, settings.bits)
        intra_broadcast = self.config.intra_broadcast
        if mesh is None or not policy.by_node_mesh(
            tensors[0], self, mesh, settings, intra_broadcast, numel
        ):
            self.bytes_sent += allreduce_fused_(tensors, self, settings)
        else:
            self.bytes_sent += hierarchical_allreduce_fused_(
                list(tensors), mesh, settings, intra_broadcast
            )

    def _rides_shared_memory(
        self, tensors: list[torch.Tensor], op: dist.ReduceOp, floats: bool
    ) -> bool:
        """Whether a plain allreduce goes through shared memory (the policy's transport for
        the tensor, a group on one host): one contiguous tensor, summed or averaged (floats)."""
        if len(tensors) != 1 or not tensors[0].is_contiguous() or tensors[0].numel() == 0:
            # Shared memory hands an empty tensor back to the group's exact allreduce, which
            # is this method's caller: gloo's own returns it, as it does on a gloo group.
            return False
        if op != dist.ReduceOp.SUM and not (op == dist.ReduceOp.AVG and floats):
            return False
        return policy.transport(tensors[0].device, self) is shm and shm.serves(self)

    def _delegate(self, tensors: list[torch.Tensor], op: dist.ReduceOp) -> dist.Work:
        """The backend's own allreduce, exact; AVG on gloo (which lacks it) divides and sums,
        as DDP does (:func:`cgx2.comm.process_group.allreduce_plain_`)."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        self.bytes_uncompressed += ring_bytes_sent(nbytes, self.size())
        self.bytes_sent += ring_bytes_sent(nbytes, self.size())
        backend = self.backend_for(tensors[0])
        floats = all(t.is_floating_point() for t in tensors)
        if self._rides_shared_memory(tensors, op, floats):
            shm.allreduce_plain_(tensors[0], self, "avg" if op == dist.ReduceOp.AVG else "sum")
            return CompletedWork(tensors)
        if op == dist.ReduceOp.AVG and tensors[0].device.type == "cpu" and floats:
            for t in tensors:
                t.div_(self.size())
            return backend.allreduce(tensors, dist.AllreduceOptions())  # SUM
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        return backend.allreduce(tensors, opts)

    # -- every other collective: the transport's own ----------------------------------------
    # Overridden rather than inherited: PyProcessGroup runs an inherited collective while
    # holding the GIL, which deadlocks when gloo's worker thread frees a Python-owned tensor.
    # The transports' bindings release the GIL. Both torch 2.11 and 2.13 names are given.

    def broadcast(self, tensors: list[torch.Tensor], opts: dist.BroadcastOptions) -> dist.Work:
        return self._issue(tensors, lambda: self.backend_for(tensors[0]).broadcast(tensors, opts))

    def allgather(
        self,
        outputs: list[list[torch.Tensor]],
        inputs: list[torch.Tensor],
        opts: dist.AllgatherOptions,
    ) -> dist.Work:
        return self._issue(
            inputs, lambda: self.backend_for(inputs[0]).allgather(outputs, inputs, opts)
        )

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: dist.AllgatherOptions
    ) -> dist.Work:
        return self._issue(
            [input], lambda: self.backend_for(input)._allgather_base(output, input, opts)
        )

    all_gather_single = _allgather_base

    def allgather_into_tensor_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: dist.AllgatherOptions
    ) -> dist.Work:
        works = [self._allgather_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        return _Works(works, outputs)

    all_gather_single_coalesced = allgather_into_tensor_coalesced

    def reduce_scatter(
        self,
        outputs: list[torch.Tensor],
        inputs: list[list[torch.Tensor]],
        opts: dist.ReduceScatterOptions,
    ) -> dist.Work:
        return self._issue(
            outputs, lambda: self.backend_for(outputs[0]).reduce_scatter(outputs, inputs, opts)
        )

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: dist.ReduceScatterOptions
    ) -> dist.Work:
        return self._issue(
            [input], lambda: self.backend_for(input)._reduce_scatter_base(output, input, opts)
        )

    reduce_scatter_single = _reduce_scatter_base

    def reduce_scatter_tensor_coalesced(
        self,
        outputs: list[torch.Tensor],
        inputs: list[torch.Tensor],
        opts: dist.ReduceScatterOptions,
    ) -> dist.Work:
        works = [
            self._reduce_scatter_base(o, i, opts) for o, i in zip(outputs, inputs, strict=True)
        ]
        return _Works(works, outputs)

    reduce_scatter_single_coalesced = reduce_scatter_tensor_coalesced

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        opts: dist.AllToAllOptions,
    ) -> dist.Work:
        return self._issue(
            [input],
            lambda: self.backend_for(input).alltoall_base(
                output, input, out_splits, in_splits, opts
            ),
        )

    all_to_all_single = alltoall_base

    def barrier(self, opts: dist.BarrierOptions) -> dist.Work:
        # dist.barrier names the device: the CPU for a group with a CPU backend, as this one,
        # unless init_process_group(device_id=...) bound it to a GPU. CPU ranks on a GPU host
        # would otherwise meet on NCCL, every rank on the same GPU.
        device = opts.device
        backend = self._backends.get(device.type) if device is not None else None
        if backend is None:
            backend = self._backends.get("cuda", self._backends["cpu"])
        return backend.barrier(opts)

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        return self.backend_for(tensors[0]).send(tensors, dst, tag)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        return self.backend_for(tensors[0]).recv(tensors, src, tag)


def _create(
    options: dist.distributed_c10d._DistributedBackendOptions, backend_options: object | None
) -> CGXProcessGroup:
    return CGXProcessGroup(
        options.store, options.group_rank, options.group_size, options.timeout, backend_options
    )


def register_backend() -> None:
    """Make ``"cgx"`` a ``torch.distributed`` backend (idempotent; ``import cgx2`` does it)."""
    if BACKEND_NAME.upper() in dist.Backend._plugins:
        return
    dist.Backend.register_backend(BACKEND_NAME, _create, extended_api=True, devices=["cpu", "cuda"])
