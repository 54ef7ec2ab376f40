"""A small data-parallel PyTorch training loop (gloo, CPU), launched by torchrun.

    torchrun --standalone --nproc_per_node=2 train_ddp.py --steps N [--step-time S]

Every rank builds the same model from a fixed seed and trains on its own deterministic shard;
DistributedDataParallel averages the gradients over gloo each step. Rank 0 prints "step I
loss L" each step and, at the end, a digest of the parameters and optimizer state: a run
moved mid-way must print the same as one left alone.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="how many training steps")
    p.add_argument("--step-time", type=float, default=0.1, help="sleep per step (s)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = DistributedDataParallel(nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1000 + rank)
    for step in range(args.steps):
        x = torch.randn(64, 32, generator=gen)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if rank == 0:
            print(f"step {step} loss {loss.item():.6f}", flush=True)
        time.sleep(args.step_time)
    h = hashlib.sha256()
    for t in [
        *model.parameters(),
        *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
    ]:
        h.update(t.detach().contiguous().numpy().tobytes())
    if rank == 0:
        print(f"final digest {h.hexdigest()[:16]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
