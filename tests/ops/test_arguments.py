"""Every public function refuses what it cannot handle before communicating, with a TypeError or
ValueError naming the argument, and handles every dense layout as a contiguous copy of it."""

import warnings

import pytest
import torch
import torch.distributed as dist
from torch import nn

import cgx2
import cgx2.fsdp
from cgx2.dtensor import QuantizedPartial


@pytest.mark.parametrize(
    "dtype",
    [torch.int32, torch.int64, torch.uint8, torch.bool, torch.complex64, torch.float8_e4m3fn],
)
def test_dequantize_refuses_output_dtypes_it_cannot_decode_into(dtype):
    payload = cgx2.quantize(torch.randn(100), 4, seed=1)
    with pytest.raises(TypeError, match="dtype must be float32"):
        cgx2.dequantize(payload, 100, 4, dtype=dtype)
    with pytest.raises(TypeError, match="dtype must be float32"):
        torch.ops.cgx.dequantize(payload, 100, 4, 512, dtype)


def _sparse_and_nested() -> dict[str, torch.Tensor]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # nested tensors are a prototype
        nested = torch.nested.nested_tensor([torch.randn(3), torch.randn(4)])
    return {
        "sparse_coo": torch.randn(10, 10).to_sparse(),
        "sparse_csr": torch.randn(10, 10).to_sparse_csr(),
        "nested": nested,
    }


@pytest.mark.parametrize("layout", ["sparse_coo", "sparse_csr", "nested"])
def test_codec_refuses_tensors_without_flat_values(layout):
    x = _sparse_and_nested()[layout]
    with pytest.raises(TypeError, match=f"x must be a dense .* got a {layout}"):
        cgx2.quantize(x, 4)
    with pytest.raises(TypeError, match="x must be a dense"):
        torch.ops.cgx.quantize(x, 4)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda p: cgx2.dequantize(p, 100.0, 4), TypeError, "numel must be an int"),
        (lambda p: cgx2.dequantize(p, True, 4), TypeError, "numel must be an int"),
        (lambda p: cgx2.dequantize(p, 100, 4, dtype="float32"), TypeError, "dtype must be a"),
        (lambda p: cgx2.dequantize([1, 2], 1, 4), TypeError, "payload must be a torch.Tensor"),
        (lambda p: cgx2.dequantize(p.to_sparse(), 100, 4), TypeError, "payload must be a dense"),
        (lambda p: cgx2.dequantize(p, 100, 4, skip_incomplete=1), TypeError, "skip_incomplete"),
        (lambda p: cgx2.quantize(torch.randn(9), 4, seed=1.5), TypeError, "seed must be an int"),
        (lambda p: cgx2.quantize(torch.randn(9), 4, seed=2**64), ValueError, "seed must be in"),
        (
            lambda p: cgx2.quantize(torch.randn(9), 4, skip_incomplete="no"),
            TypeError,
            "skip_incomplete must be a bool",
        ),
    ],
)
def test_codec_arguments_of_the_wrong_kind_are_named(call, error, match):
    payload = cgx2.quantize(torch.randn(100), 4, seed=1)
    with pytest.raises(error, match=match):
        call(payload)


def test_functions_without_a_process_group_say_so():
    if dist.is_initialized():
        pytest.skip("this test process has a default group")
    for call in (
        lambda: cgx2.quantized_allreduce(torch.randn(10), 4),
        lambda: cgx2.quantized_allreduce_(torch.randn(10), 4),
        lambda: cgx2.quantized_reduce_scatter(torch.randn(10), 4),
    ):
        with pytest.raises(ValueError, match="init_process_group"):
            call()


@pytest.mark.parametrize(
    "fn", [cgx2.quantized_allreduce, cgx2.quantized_allreduce_, cgx2.quantized_reduce_scatter]
)
def test_collectives_refuse_a_non_tensor_first(fn):
    with pytest.raises(TypeError, match=r"tensor must be a torch\.Tensor, got list"):
        fn([1.0, 2.0], 4)


def test_dtensor_and_fsdp_arguments_are_named():
    with pytest.raises(ValueError, match="reduce_op must be 'sum' or 'avg'"):
        QuantizedPartial(4, 512, dist.ReduceOp.SUM)
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        cgx2.fsdp.compress("model")
    with pytest.raises(ValueError, match="bucket_size must be in"):
        cgx2.fsdp.compress(nn.Linear(2, 2), bits=4, bucket_size=0)  # before looking for FSDP
    with pytest.raises(TypeError, match="min_size must be an int"):
        cgx2.fsdp.compress(nn.Linear(2, 2), bits=4, min_size="1k")
    with pytest.raises(TypeError, match=r"model must be a torch\.nn\.Module"):
        cgx2.fsdp.compression_state_dict(None)
    with pytest.raises(TypeError, match="state must be a Mapping"):
        cgx2.fsdp.load_compression_state_dict(nn.Linear(2, 2), [])
    with pytest.raises(ValueError, match="state lacks 'reduce_scatters'"):
        cgx2.fsdp.load_compression_state_dict(nn.Linear(2, 2), {})
    with pytest.raises(TypeError, match="seed must be an int"):
        cgx2.manual_seed("7")
    with pytest.raises(TypeError, match="skip_incomplete_buckets must be a bool"):
        cgx2.CGXConfig(skip_incomplete_buckets="no")
    with pytest.raises(TypeError, match="intra_broadcast must be a bool"):
        cgx2.CGXConfig(intra_broadcast="yes")
    with pytest.raises(TypeError, match="minimal_size must be an int"):
        cgx2.CGXConfig(minimal_size="16")
    with pytest.raises(TypeError, match="mesh must be a DeviceMesh"):
        cgx2.hierarchical_allreduce(torch.randn(4), 4, mesh="inter")
    with pytest.raises(TypeError, match="t must be a dense"):
        cgx2.hierarchical_allreduce(torch.randn(4, 4).to_sparse(), 4)


# On two ranks: each refusal comes before any communication, so the group stays usable (a
# refusal inside the transport, as the meta tensor's was, left the next calls waiting).


def _refusals() -> list[str]:
    sparse_and_nested = _sparse_and_nested()
    calls = {
        "meta": lambda: cgx2.quantized_allreduce(torch.empty(10, device="meta"), 4),
        "meta_": lambda: cgx2.quantized_allreduce_(torch.empty(10, device="meta"), 4),
        "meta_rs": lambda: cgx2.quantized_reduce_scatter(torch.empty(10, device="meta"), 4),
        "seed_negative": lambda: cgx2.quantized_allreduce(torch.randn(10), 4, seed=-3),
        "seed_huge": lambda: cgx2.quantized_allreduce(torch.randn(10), 4, seed=2**63),
        "seed_float": lambda: cgx2.quantized_allreduce_(torch.randn(10), 4, seed=1.0),
        "skip_incomplete": lambda: cgx2.quantized_allreduce(
            torch.randn(10), 4, skip_incomplete=None
        ),
        "group_name": lambda: cgx2.quantized_allreduce(torch.randn(10), 4, group="0"),
        "group_ranks": lambda: cgx2.quantized_reduce_scatter(torch.randn(10), 4, group=[0, 1]),
        "expanded_": lambda: cgx2.quantized_allreduce_(torch.randn(1, 30).expand(40, 30), 4),
        "aliased_": lambda: cgx2.quantized_allreduce_(
            torch.randn(10).as_strided((5, 4), (1, 1)), 4
        ),
        "inference_": lambda: cgx2.quantized_allreduce_(_inference_tensor(), 4),
        "out_type": lambda: cgx2.quantized_reduce_scatter(torch.randn(10), 4, out=[0.0] * 5),
        "out_device": lambda: cgx2.quantized_reduce_scatter(
            torch.randn(10), 4, out=torch.empty(5, device="meta")
        ),
        **{
            name: (lambda t=t: cgx2.quantized_allreduce(t, 4))
            for name, t in sparse_and_nested.items()
        },
        **{
            name + "_rs": (lambda t=t: cgx2.quantized_reduce_scatter(t, 4))
            for name, t in sparse_and_nested.items()
        },
    }
    messages = []
    with cgx2.config.tuned(crossover_bytes=0):
        for name, call in calls.items():
            try:
                call()
                messages.append(f"{name}: no error")
            except (TypeError, ValueError) as e:
                messages.append(f"{name}: {type(e).__name__}: {e}")
            except Exception as e:  # refused late: the message says by what
                messages.append(f"{name}: late {type(e).__name__}: {e}")
        x = torch.full((1000,), float(dist.get_rank() + 1))
        usable = torch.equal(cgx2.quantized_allreduce(x, 32), torch.full((1000,), 3.0))
    return [*messages, f"usable after: {usable}"]


def _inference_tensor() -> torch.Tensor:
    with torch.inference_mode():
        return torch.randn(10)


EXPECTED = {
    "meta": "ValueError: tensor is on the meta device",
    "meta_": "ValueError: tensor is on the meta device",
    "meta_rs": "ValueError: tensor is on the meta device",
    "seed_negative": "ValueError: seed must be in 0..2**63-1",
    "seed_huge": "ValueError: seed must be in 0..2**63-1",
    "seed_float": "TypeError: seed must be None or an int",
    "skip_incomplete": "TypeError: skip_incomplete must be a bool",
    "group_name": "TypeError: group must be a torch.distributed.ProcessGroup or None, got str",
    "group_ranks": "TypeError: group must be a torch.distributed.ProcessGroup or None, got list",
    "expanded_": "ValueError: tensor has elements that share memory",
    "aliased_": "ValueError: tensor has elements that share memory",
    "inference_": "ValueError: tensor is an inference tensor",
    "out_type": "TypeError: out must be a torch.Tensor",
    "out_device": "ValueError: out must be on the input's device",
    "sparse_coo": "TypeError: tensor must be a dense (torch.strided) tensor, got a sparse_coo",
    "sparse_csr": "TypeError: tensor must be a dense (torch.strided) tensor, got a sparse_csr",
    "nested": "TypeError: tensor must be a dense (torch.strided) tensor, got a nested",
    "sparse_coo_rs": "TypeError: tensor must be a dense (torch.strided) tensor, got a sparse_coo",
    "sparse_csr_rs": "TypeError: tensor must be a dense (torch.strided) tensor, got a sparse_csr",
    "nested_rs": "TypeError: tensor must be a dense (torch.strided) tensor, got a nested",
}


def test_collectives_refuse_up_front_and_the_group_stays_usable(dist2):
    for messages in dist2.run(_refusals):
        got = dict(m.split(": ", 1) for m in messages)
        assert got.pop("usable after") == "True", messages
        for name, want in EXPECTED.items():
            assert got[name].startswith(want), f"{name}: {got[name]}"


# Every dense layout is the contiguous tensor's reduction, bit for bit, as torch's functional
# collectives (which copy a non-contiguous input) give it: the functional form returns a
# contiguous tensor, the in-place form writes into the view.


def _layouts() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(dist.get_rank())
    base = torch.randn(3000, generator=g)
    return {
        "transposed": base[:1200].view(40, 30).t(),
        "channels_last": base[:1200].view(2, 6, 10, 10).to(memory_format=torch.channels_last),
        "expanded": base[:30].view(1, 30).expand(40, 30),
        "negative_view": base[:1000].clone()._neg_view(),
        "offset": base[7:],
        "strided": base[::3],
        "sliced_2d": base.view(30, 100)[3:27, 5:90],
        "zero_dim": base[5].clone(),
        "empty": base[:0].view(0, 5),
        "half_transposed": base[:1200].half().view(40, 30).t(),
        "bf16_negative": base[:1000].bfloat16()._neg_view(),
    }


def _layout_results(bits: int) -> dict[str, tuple[bool, bool | None]]:
    out = {}
    with cgx2.config.tuned(crossover_bytes=0):
        for name, t in _layouts().items():
            dense = t.clone(memory_format=torch.contiguous_format).resolve_neg()
            want = cgx2.quantized_allreduce(dense, bits, bucket_size=64, seed=3)
            got = cgx2.quantized_allreduce(t, bits, bucket_size=64, seed=3)
            functional = torch.equal(got, want) and got.is_contiguous()
            in_place = None
            if name != "expanded":
                target = _layouts()[name]
                cgx2.quantized_allreduce_(target, bits, bucket_size=64, seed=3)
                in_place = torch.equal(target, want) and target.stride() == t.stride()
            out[name] = (functional, in_place)
    return out


@pytest.mark.parametrize("bits", [4, 32])
def test_every_dense_layout_reduces_as_its_contiguous_copy(dist2, bits):
    for results in dist2.run(_layout_results, bits):
        wrong = {k: v for k, v in results.items() if v[0] is not True or v[1] is False}
        assert not wrong, wrong


def _reduce_scatter_layouts() -> list[bool]:
    g = torch.Generator().manual_seed(dist.get_rank())
    base = torch.randn(40, 30, generator=g)
    ok = []
    with cgx2.config.tuned(crossover_bytes=0):
        for t in (base.t(), base.clone()._neg_view(), base[::2]):
            want = cgx2.quantized_reduce_scatter(t.contiguous().resolve_neg(), 4, seed=5)
            ok.append(torch.equal(cgx2.quantized_reduce_scatter(t, 4, seed=5), want))
    return ok


def test_reduce_scatter_of_any_dense_layout_is_its_contiguous_copys(dist2):
    assert dist2.run(_reduce_scatter_layouts) == [[True] * 3] * 2


# A rank outside the group: torch's functional collectives raise a ValueError there, and
# dist.all_reduce warns and leaves the tensor as it is; cgx2's functional ops do the first and
# its in-place allreduce the second.


def _outside_the_group() -> list[str]:
    rank = dist.get_rank()
    only_zero = dist.new_group([0])
    x = torch.full((2000,), 5.0)
    messages = []
    for call in (
        lambda: cgx2.quantized_allreduce(x, 4, group=only_zero),
        lambda: cgx2.quantized_reduce_scatter(x, 4, group=only_zero),
    ):
        try:
            out = call()
            messages.append(f"returned {out.shape}")
        except ValueError as e:
            messages.append(str(e))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = x.clone()
        returned = cgx2.quantized_allreduce_(y, 4, group=only_zero)
    unchanged = returned is y and torch.equal(y, x)
    warned = any("does not belong to the given group" in str(w.message) for w in caught)
    messages.append(f"in place: unchanged {unchanged}, warned {warned if rank else None}")
    return messages


def test_a_rank_outside_the_group_is_told_so(dist2):
    member, outsider = dist2.run(_outside_the_group)
    assert member == [
        "returned torch.Size([2000])",
        "returned torch.Size([2000])",
        "in place: unchanged True, warned None",
    ]
    for message in outsider[:2]:
        assert message.startswith("group: this rank (global rank 1) is not a member of the group")
    assert outsider[2] == "in place: unchanged True, warned True"
