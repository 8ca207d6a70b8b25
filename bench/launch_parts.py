"""Host microseconds of each part of one codec kernel launch on a GPU (a tiny tensor, so the
GPU keeps up): the codec call, the direct launcher, Triton's compiled ``run`` with tensors or
with raw addresses as pointer arguments, and the launcher's own Python pieces. A tuning aid:
``python bench/launch_parts.py [--compare OLD_DIRECT_LAUNCH.py]`` (another version of
``cgx2/codecs/direct_launch.py``, e.g. from ``git show REV:...``, timed beside the tree's)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch
import triton

from cgx2.codecs import ChunkedLayout, direct_launch
from cgx2.codecs import maxmin_triton as tri

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from launch_overhead import per_call_us


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--compare", default="", help="another direct_launch.py to time beside")
    cli = p.parse_args()
    x = torch.randn(4096, device="cuda")
    layout = ChunkedLayout.split(4096, 1, 4, 512, False)
    out = tri.encode_chunks(x, layout, 1)
    launcher = tri._launch_encode
    ((compiled, _tail),) = launcher.variants.values()
    launch = tri._launch("encode", 512, torch.float32)
    grid = (tri._programs(-(-8 // launch["BUCKETS"])), 1)
    k0, k1, keys, in_memory = tri._key_args(1, out)
    args = (x, out, 4096, 4096, out.shape[1], k0, k1, keys, 0, -1)
    consts = dict(
        BITS=4, B=512, SKIP_INCOMPLETE=False, ALIGN=16, KEYS_IN_MEMORY=in_memory, **launch
    )
    values = list(args) + [
        consts[n] if n in consts else launcher.defaults[n] for n in launcher.names[len(args) :]
    ]
    addresses = [v.data_ptr() if isinstance(v, torch.Tensor) else v for v in values]
    stream = torch._C._cuda_getCurrentRawStream(0)
    run = compiled.run
    fn, meta = compiled.function, compiled.packed_metadata
    rows = {
        "encode_chunks (codec call)": lambda: tri.encode_chunks(x, layout, 1, out=out),
        "direct Launcher call": lambda: launcher(grid, *args, **consts),
        "compiled.run, tensors": lambda: run(
            grid[0], 1, 1, stream, fn, meta, None, None, None, *values
        ),
        "compiled.run, addresses": lambda: run(
            grid[0], 1, 1, stream, fn, meta, None, None, None, *addresses
        ),
        "launcher key (_spec of every arg)": lambda: (
            0,
            tuple(consts.items()),
            tuple(map(direct_launch._spec, args)),
        ),
        "torch.cuda.current_device()": torch.cuda.current_device,
        "_cuda_getCurrentRawStream": lambda: torch._C._cuda_getCurrentRawStream(0),
        "triton.knobs hooks, read": lambda: (
            triton.knobs.runtime.launch_enter_hook,
            triton.knobs.runtime.launch_exit_hook,
        ),
        "triton.knobs.runtime.interpret": lambda: triton.knobs.runtime.interpret,
        "tensor.data_ptr()": x.data_ptr,
        "out.view(torch.float32)": lambda: out.view(torch.float32),
        "x.reshape(-1)": lambda: x.reshape(-1),
        "torch.empty(2, 4096, uint8)": lambda: torch.empty(
            2, 4096, dtype=torch.uint8, device="cuda"
        ),
    }
    if cli.compare:
        spec = importlib.util.spec_from_file_location("compared_direct_launch", cli.compare)
        other = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(other)
        old_launcher = other.Launcher(tri._encode_kernel)
        old_launcher(grid, *args, **consts)  # its first launch goes through Triton
        rows[f"direct Launcher call, {cli.compare}"] = lambda: old_launcher(grid, *args, **consts)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}")
    for name, fn_ in rows.items():
        print(f"  {name:40s} {per_call_us(fn_, 4000):7.2f} us")


if __name__ == "__main__":
    main()
