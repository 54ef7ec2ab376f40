"""A small data-parallel PyTorch training loop (gloo, CPU), launched by torchrun.

    torchrun --standalone --nproc_per_node=2 train_ddp.py --steps N [--step-time S]
    RANK=R WORLD_SIZE=W MASTER_ADDR=A MASTER_PORT=P python train_ddp.py --every-rank --stamp


Every rank builds the same model from a fixed seed and trains on its own deterministic shard;
DistributedDataParallel averages the gradients over gloo each step. Rank 0 prints "step I
loss L" each step and, at the end, a digest of the parameters and optimizer state: a run
moved mid-way must print the same as one left alone. --every-rank: every rank prints its
steps, its digest and, once at its start, "rank R pid P" (a restarted rank would say it
twice); --stamp: each step line ends with the wall time, to measure what a move cost peers.

For the distributed bench's checkpoint-restart (scripts/bench_ranks.py): --ballast-mb holds
that much more live state per rank (a tensor the loop updates, saved and digested with the
rest); --save-at I writes each rank's checkpoint after step I into --save-dir; --exit-at I
ends the rank abruptly after step I (the failure); --resume starts from the checkpoint there.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="how many training steps")
    p.add_argument("--step-time", type=float, default=0.1, help="sleep per step (s)")
    p.add_argument("--every-rank", action="store_true", help="every rank prints, not only rank 0")
    p.add_argument("--stamp", action="store_true", help="end each step line with the wall time")
    p.add_argument("--ballast-mb", type=int, default=0, help="MiB of extra live state per rank")
    p.add_argument(
        "--hidden",
        type=int,
        default=64,
        help="the hidden layer's width: 34 parameters each, so each step's allreduce carries "
        "136 bytes per unit (262144: 34 MiB, long enough on the wire that a freeze meets it)",
    )
    p.add_argument("--save-dir", type=Path, help="where each rank writes its checkpoint")
    p.add_argument("--save-at", type=int, help="write the checkpoint after this step")
    p.add_argument("--exit-at", type=int, help="end abruptly after this step (a failure)")
    p.add_argument("--resume", action="store_true", help="start from the checkpoint in --save-dir")
    args = p.parse_args()
    if (args.save_at is not None or args.resume) and args.save_dir is None:
        p.error("--save-at and --resume need --save-dir")
    return args


def main() -> int:
    args = parse()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    speaks = args.every_rank or rank == 0
    if args.every_rank:
        print(f"rank {rank} pid {os.getpid()} of {dist.get_world_size()}", flush=True)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    model = DistributedDataParallel(
        nn.Sequential(nn.Linear(32, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1000 + rank)
    ballast = torch.randn(args.ballast_mb * 2**18, generator=torch.Generator().manual_seed(rank))
    first = 0
    ckpt = args.save_dir / f"rank{rank}.pt" if args.save_dir else None
    if args.resume:
        assert ckpt is not None
        state = torch.load(ckpt)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        gen.set_state(state["gen"])
        ballast = state["ballast"]
        first = state["step"] + 1
        print(f"resumed at step {first} from {ckpt}", flush=True)
    for step in range(first, args.steps):
        x = torch.randn(64, 32, generator=gen)
        y = x.sum(dim=1, keepdim=True).sin()
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if ballast.numel():
            ballast[(step * 4096) % ballast.numel()] += loss.detach()
        if speaks:
            stamp = f" at {time.time():.3f}" if args.stamp else ""
            print(f"step {step} loss {loss.item():.6f}{stamp}", flush=True)
        if step == args.save_at and ckpt is not None:
            state = {"model": model.module.state_dict(), "opt": opt.state_dict()}
            torch.save({**state, "gen": gen.get_state(), "ballast": ballast, "step": step}, ckpt)
            print(f"saved step {step} to {ckpt}", flush=True)
        if step == args.exit_at:
            os._exit(3)  # a failure: no cleanup, no goodbye to the peers
        time.sleep(args.step_time)
    h = hashlib.sha256()
    for t in [
        *model.parameters(),
        *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
        *([ballast] if ballast.numel() else []),
    ]:
        h.update(t.detach().contiguous().numpy().tobytes())
    if speaks:
        print(f"final digest {h.hexdigest()[:16]}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
