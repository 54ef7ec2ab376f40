"""A CPU training job whose live state (weights, gradients, Adam's two moments) is S GiB.

Prints ``ready <params>`` once the optimizer state exists, then ``step <i> t=<unix time>``
after every step, for the benchmark to measure the gap a migration leaves. With
``--save PATH`` it writes a checkpoint (``torch.save`` of model, optimizer and step)
at the first step boundary after SIGUSR1 and exits; ``--resume PATH`` starts from
one: the checkpoint-restart baseline of scripts/bench_migrate.py.
"""

import argparse
import math
import signal
import sys
import time

import torch
from torch import nn

#: fp32 weights, gradients and Adam's exp_avg and exp_avg_sq: 16 bytes per parameter.
BYTES_PER_PARAM = 16


def build(gib: float, width: int, device: str = "cpu") -> nn.Sequential:
    layers = max(1, math.ceil(gib * (1 << 30) / BYTES_PER_PARAM / (width * width)))
    return nn.Sequential(*(nn.Linear(width, width, bias=False, device=device) for _ in range(layers)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--gib", type=float, default=1.0, help="live training state in GiB")
    p.add_argument("--width", type=int, default=2048, help="width of each square linear layer")
    p.add_argument("--steps", type=int, default=1_000_000)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    p.add_argument("--save", default="", help="on SIGUSR1: torch.save here at the next step boundary, exit")
    p.add_argument("--resume", default="", help="start from a checkpoint written by --save")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    if args.resume:
        # As generous to checkpoint-restart as it gets: no initialisation of weights that
        # are overwritten anyway, and the loaded tensors adopted without another copy.
        model = build(args.gib, args.width, device="meta")
        state = torch.load(args.resume, map_location="cpu", weights_only=True)
        model.load_state_dict(state["model"], assign=True)
        for prm in model.parameters():
            prm.grad = torch.zeros_like(prm)
        opt = torch.optim.Adam(model.parameters(), lr=1e-5)
        opt.load_state_dict(state["opt"])
        start = int(state["step"]) + 1
    else:
        model = build(args.gib, args.width)
        opt = torch.optim.Adam(model.parameters(), lr=1e-5)
        start = 0
    x = torch.randn(args.batch, args.width, generator=torch.Generator().manual_seed(1))

    stop = False

    def on_usr1(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGUSR1, on_usr1)
    params = sum(prm.numel() for prm in model.parameters())
    print(f"ready {params} params", flush=True)
    for i in range(start, args.steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: part of the live state
        print(f"step {i} t={time.time():.6f} loss {loss.item():.6g}", flush=True)
        if stop and args.save:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": i}, args.save)
            print(f"saved {i} t={time.time():.6f}", flush=True)
            sys.exit(0)


if __name__ == "__main__":
    main()
