"""The fault-tolerance benchmark's training job (scripts/bench_faults.py), written twice over the
same model, data and seeds: once as users write a data-parallel job (`plain`) and once with the
changes TorchFT requires (`torchft`).

    torchrun ... train_faults.py plain --steps N [--save-every K --save-dir D]
    torchrun ... train_faults.py torchft --steps N     (TORCHFT_LIGHTHOUSE, REPLICA_GROUP_ID set)

Both train a small MLP with Adam over gloo, every rank (replica) on its own batches: the batch of
step S on rank R is drawn from a generator seeded by (R, S), so a job restarted from a
checkpoint, a replica healed from a peer and a process restored by ferry all see the batches an
undisturbed run saw. Each rank also holds --ballast-mb of live state (a tensor the loop updates
from the parameters every step, identical on every rank as they are), so that moving or saving a
rank moves real memory. Every rank prints "rank R pid P of W" when it starts, "step S loss L at
T rank R" after each step (T: the wall time) and, at the end, "final digest D" over its parameters,
optimizer state and ballast.

plain: torch.distributed's DistributedDataParallel, unmodified. With --save-every K, rank 0
writes a checkpoint (model, optimizer, ballast, step) to --save-dir every K steps with
torch.save, as such a job usually does, and every rank starts from the newest one there: what a
restart under `torchrun --max-restarts` resumes from. ferry runs it with no checkpoint at all.

torchft: TorchFT's Manager, DistributedDataParallel and Optimizer wrappers, as its README's
train_ddp.py uses them, with a replica group of one rank per process: a step commits only when
every replica in its quorum finished it, a replica that died drops out at the next quorum and a
new one heals from a peer's state (PGTransport) before it steps. The loop runs until the
manager's committed step count reaches --steps. The changes from plain: the Manager and its
state_dict/load_state_dict callbacks, the two wrappers, the loop's end condition, and the
advertised address (the node's own, MASTER_ADDR: TorchFT defaults to the host name).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import nn

IN, HIDDEN = 32, 64


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=("plain", "torchft"), help="the job as written for DDP or for TorchFT")
    p.add_argument("--steps", type=int, default=100, help="how many training steps")
    p.add_argument("--step-time", type=float, default=0.1, help="sleep per step (s): the rest of a step")
    p.add_argument("--ballast-mb", type=int, default=0, help="MiB of extra live state per rank")
    p.add_argument("--save-every", type=int, default=0, help="plain: a checkpoint every K steps (0: none)")
    p.add_argument("--save-dir", type=Path, help="plain: where checkpoints are written and resumed from")
    p.add_argument(
        "--timeout-s",
        type=float,
        default=30.0,
        help="how long a collective waits for a peer before failing (the process group's timeout)",
    )
    args = p.parse_args(argv)
    if args.save_every and args.save_dir is None:
        p.error("--save-every needs --save-dir")
    return args


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rank's batch for step: the same whoever computes it, whenever."""
    g = torch.Generator().manual_seed(1_000_003 * (rank + 1) + step)
    x = torch.randn(64, IN, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def build() -> nn.Module:
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def ballast_of(mb: int) -> torch.Tensor:
    return torch.randn(mb * 2**18, generator=torch.Generator().manual_seed(7))


def touch(ballast: torch.Tensor, model: nn.Module, step: int) -> None:
    """The ballast's update: from the parameters, which every rank holds alike after a step."""
    if ballast.numel():
        first = next(model.parameters())
        ballast[(step * 4096) % ballast.numel()] += first.detach().sum()


def digest(model: nn.Module, opt: torch.optim.Optimizer, ballast: torch.Tensor) -> str:
    h = hashlib.sha256()
    for t in [
        *model.parameters(),
        *(v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)),
        *([ballast] if ballast.numel() else []),
    ]:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def said(step: int, loss: torch.Tensor, rank: int) -> None:
    print(f"step {step} loss {loss.item():.6f} at {time.time():.3f} rank {rank}", flush=True)


def plain(args: argparse.Namespace) -> int:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout_s))
    rank = dist.get_rank()
    print(f"rank {rank} pid {os.getpid()} of {dist.get_world_size()}", flush=True)
    net = build()
    # find_unused_parameters: DDP then keeps its first gradient buckets instead of rebuilding
    # them after a process's first step, so a rank restarted from a checkpoint sums its
    # gradients in the same order as one that never stopped (bit for bit, as ferry's are).
    model = DistributedDataParallel(net, find_unused_parameters=True)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    ballast = ballast_of(args.ballast_mb)
    first = 0
    newest = args.save_dir / "checkpoint.pt" if args.save_dir else None
    if newest is not None and newest.exists():
        state = torch.load(newest)
        net.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        ballast = state["ballast"]
        first = state["step"] + 1
        print(f"resumed at step {first} from {newest}", flush=True)
    for step in range(first, args.steps):
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        touch(ballast, net, step)
        said(step, loss, rank)
        if newest is not None and args.save_every and (step + 1) % args.save_every == 0 and rank == 0:
            part = newest.with_suffix(".part")  # renamed once whole: a crash mid-write loses nothing
            torch.save(
                {"model": net.state_dict(), "opt": opt.state_dict(), "ballast": ballast, "step": step}, part
            )
            part.rename(newest)
            print(f"saved step {step}", flush=True)
        time.sleep(args.step_time)
    print(f"final digest {digest(net, opt, ballast)}", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


def torchft(args: argparse.Namespace) -> int:
    from torchft import DistributedDataParallel, Manager, Optimizer, ProcessGroupGloo
    from torchft.checkpointing.pg_transport import PGTransport

    replica = int(os.environ["REPLICA_GROUP_ID"])
    print(f"rank {replica} pid {os.getpid()} of {os.environ.get('NUM_REPLICA_GROUPS', '?')}", flush=True)
    net = build()
    ballast = ballast_of(args.ballast_mb)
    inner = torch.optim.Adam(net.parameters(), lr=1e-2)

    def state_dict() -> dict[str, Any]:
        return {"model": net.state_dict(), "opt": inner.state_dict(), "ballast": ballast}

    def load_state_dict(state: dict[str, Any]) -> None:
        net.load_state_dict(state["model"])
        inner.load_state_dict(state["opt"])
        ballast.copy_(state["ballast"])

    timeout = timedelta(seconds=args.timeout_s)
    pg = ProcessGroupGloo(timeout=timeout)
    manager = Manager(
        pg=pg,
        min_replica_size=1,
        load_state_dict=load_state_dict,
        state_dict=state_dict,
        replica_id=f"train_faults_{replica}",
        timeout=timeout,
        hostname=os.environ["MASTER_ADDR"],
        checkpoint_transport=PGTransport(pg, timeout=timeout, device=torch.device("cpu")),
    )
    model = DistributedDataParallel(manager, net)
    opt = Optimizer(manager, inner)
    while (step := manager.current_step()) < args.steps:
        opt.zero_grad()  # starts the step's quorum
        x, y = batch(replica, step)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()  # only if every replica in the quorum finished the step
        if (now := manager.current_step()) > step:
            # A replica that healed this step took a peer's state and step count in its quorum:
            # the step it committed is the manager's, not the one it read before.
            touch(ballast, net, now - 1)
            said(now - 1, loss, replica)
        time.sleep(args.step_time)
    print(f"final digest {digest(net, inner, ballast)}", flush=True)
    manager.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    return plain(args) if args.mode == "plain" else torchft(args)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
