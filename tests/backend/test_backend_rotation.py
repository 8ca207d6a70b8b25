"""The ``cgx`` backend with ``CGX2_ROTATION=hadamard``: its quantized all_reduce is the rotated
reference's bytes on every rank, a bucket size the block does not divide is refused before
anything is sent, and ranks whose variable differs are told so."""

import pytest
import torch
import torch.distributed as dist
from env_vars import setenv

import cgx2
from cgx2.collectives import reference_allreduce
from cgx2.collectives.agreement import DisagreementError
from cgx2.config import TuningConfig
from cgx2.seeding import call_seed


def _all_reduce(rotation: str, bucket: str = "128") -> torch.Tensor | str:
    rank = dist.get_rank()
    env = {"CGX_COMPRESSION_QUANTIZATION_BITS": "2", "CGX_COMPRESSION_BUCKET_SIZE": bucket}
    with setenv(**env, CGX2_ROTATION=rotation, CGX2_CROSSOVER_BYTES="0"):
        group = dist.new_group(backend="cgx")
        try:
            x = torch.randn(1024, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
            x[::37] *= 30
            cgx2.manual_seed(3)
            dist.all_reduce(x, group=group)
            return x
        except (ValueError, DisagreementError) as e:
            return f"{type(e).__name__}: {e}"
        finally:
            dist.destroy_process_group(group)


def test_the_backend_rotates_as_the_variable_says(dist2):
    inputs = []
    for rank in range(2):
        x = torch.randn(1024, generator=torch.Generator().manual_seed(rank)) * (rank + 1)
        x[::37] *= 30
        inputs.append(x)
    seed = call_seed(3, 0)
    rotated = dist2.run(_all_reduce, "hadamard")
    model = reference_allreduce(inputs, 2, 128, seed, rotation="hadamard")
    assert all(torch.equal(r, model) for r in rotated)
    plain = dist2.run(_all_reduce, "none")
    assert all(torch.equal(r, reference_allreduce(inputs, 2, 128, seed)) for r in plain)
    assert not torch.equal(rotated[0], plain[0])


def test_a_bucket_the_block_does_not_divide_is_refused_alike_on_every_rank(dist2):
    messages = dist2.run(_all_reduce, "hadamard", "100")
    assert messages[0] == messages[1]
    assert (
        "ValueError: CGX2_ROTATION's block: rotation block 128 must divide bucket_size 100"
        in (messages[0])
    )


def _mismatched() -> str:
    return _all_reduce("hadamard" if dist.get_rank() == 0 else "none")


def test_ranks_whose_rotation_differs_are_told(dist2):
    for message in dist2.run(_mismatched):
        assert message.startswith("DisagreementError") and "rotation=[rank 0: hadamard" in message


def test_the_variable_is_read_and_checked():
    assert TuningConfig.from_env({"CGX2_ROTATION": "Hadamard"}).rotation == "hadamard"
    assert TuningConfig.from_env({}).rotation == "none"
    with pytest.raises(ValueError, match="CGX2_ROTATION='fft' is invalid"):
        TuningConfig.from_env({"CGX2_ROTATION": "fft"})
