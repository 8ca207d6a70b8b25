"""FSDP2 in torchtitan's style, with cgx2: a ``parallelize(model, mesh)`` that compiles and
shards each transformer block (``fully_shard`` per block, then the root; bf16 parameters with
fp32 gradient reduction; HSDP on a 2-D mesh), followed by ``cgx2.fsdp.compress``, the one line
a torchtitan user adds. Reports the bytes sent and whether the ranks agree on the parameters:

    torchrun --nproc-per-node 8 examples/torchtitan_fsdp.py --compile                 # GPUs
    torchrun --nproc-per-node 8 examples/torchtitan_fsdp.py --compile --replicas 2    # HSDP 2 x 4
    torchrun --nproc-per-node 2 examples/torchtitan_fsdp.py --steps 5                 # 2 CPUs

No torchtitan dependency: the model is a small Llama-like transformer defined here, the text
Python's own standard library (nothing to download).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cli import add_recipe_options
from recipe_parts import fsdp_bytes_uncompressed
from recipe_report import report
from train_ddp import load_text

import cgx2.fsdp


class Attention(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.wqkv = nn.Linear(dim, 3 * dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.wqkv(x).view(b, t, 3, self.heads, d // self.heads).unbind(2)
        out = nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        return self.wo(out.transpose(1, 2).reshape(b, t, d))


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(nn.functional.silu(self.w1(x)) * self.w3(x))  # SwiGLU


class TransformerBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attention = Attention(dim, heads)
        self.feed_forward = FeedForward(dim, 4 * dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    """torchtitan's layout: ``tok_embeddings``, ``layers`` (a ModuleDict), ``norm``, ``output``."""

    def __init__(self, vocab: int, dim: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(context, dim) * 0.02)
        self.layers = nn.ModuleDict({str(i): TransformerBlock(dim, heads) for i in range(layers)})
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) + self.pos[: tokens.shape[1]]
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


def parallelize(
    model: Transformer, mesh: DeviceMesh, *, compile: bool = False, bf16: bool = True
) -> Transformer:
    """torchtitan's order: compile each block, then ``fully_shard`` each block and the root
    over ``mesh`` (1-D: FSDP; 2-D (replicate, shard): HSDP). The last block stays gathered
    after forward: backward needs it first."""
    if compile:
        for layer_id, block in model.layers.named_children():
            model.layers.register_module(layer_id, torch.compile(block, fullgraph=True))
    policy = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16 if bf16 else None, reduce_dtype=torch.float32
    )
    last = len(model.layers) - 1
    for i, block in enumerate(model.layers.values()):
        fully_shard(block, mesh=mesh, mp_policy=policy, reshard_after_forward=i < last)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    return model


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", type=int, default=4, help="32: FSDP2's own reduce-scatter")
    p.add_argument("--param-bits", type=int, default=None, help="quantized all-gather (1..8)")
    p.add_argument("--replicas", type=int, default=1, help="HSDP replicas (divides the ranks)")
    p.add_argument("--compile", action="store_true", help="torch.compile each block")
    p.add_argument("--fp32", action="store_true", help="fp32 parameters (default: bf16)")
    add_recipe_options(p)
    args = p.parse_args(argv)

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda" if cuda else "cpu")
    if world % args.replicas:
        raise SystemExit(f"--replicas {args.replicas} does not divide {world} ranks")
    if args.replicas > 1:
        shape, names = (args.replicas, world // args.replicas), ("dp_replicate", "dp_shard")
    else:
        shape, names = (world,), ("dp_shard",)
    mesh = init_device_mesh(device.type, shape, mesh_dim_names=names)

    torch.manual_seed(0)
    model = Transformer(256, args.dim, args.layers, args.heads, args.context).to(device)
    model = parallelize(model, mesh, compile=args.compile, bf16=not args.fp32)
    comms = []
    if args.bits != 32:  # the line cgx2 adds
        comms = cgx2.fsdp.compress(model, bits=args.bits, param_bits=args.param_bits)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)

    text = load_text(1 << 20)
    gen = torch.Generator().manual_seed(rank)
    for step in range(args.steps):
        starts = torch.randint(
            0, text.numel() - args.context - 1, (args.batch_size,), generator=gen
        )
        seq = text[starts[:, None] + torch.arange(args.context + 1)].long().to(device)
        loss = nn.functional.cross_entropy(
            model(seq[:, :-1]).flatten(0, 1).float(), seq[:, 1:].flatten()
        )
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if rank == 0 and (step % 10 == 0 or step == args.steps - 1):
            print(f"step {step + 1}/{args.steps}  loss {loss.item():.4f}", flush=True)

    shards = world // args.replicas
    numel = sum(p.numel() for p in model.parameters())
    report(
        args.json,
        model,
        bits=args.bits,
        replicas=args.replicas,
        steps=args.steps,
        bytes_sent=sum(c.bytes_sent for c in comms),
        bytes_uncompressed=fsdp_bytes_uncompressed(args.steps, shards, numel),
    )
    # The model and optimizer go while the process group lives (they hold its mesh and
    # collectives); destroyed after it, or left to the interpreter's exit, gloo's teardown
    # could abort the process.
    del model, opt, comms
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
