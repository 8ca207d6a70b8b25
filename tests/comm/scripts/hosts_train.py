"""Run by tests/comm/test_hosts.py under torchrun on two hosts: DDP with CGX's hook, a step
every 0.2 s, printing ``STEP <n>``, under a 10 s group timeout, until a peer dies."""

import datetime
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from cgx2.ddp import CGXState, cgx_hook

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=10))
rank = dist.get_rank()
torch.manual_seed(0)
ddp = DDP(nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 8)))
ddp.register_comm_hook(CGXState(None, 1024, {"bits": 4}, start_iter=0), cgx_hook)
opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
for step in range(600):
    x = torch.randn(32, 64, generator=torch.Generator().manual_seed(step + 1000 * rank))
    opt.zero_grad()
    ddp(x).square().mean().backward()
    opt.step()
    print(f"STEP {step}", flush=True)
    time.sleep(0.2)
