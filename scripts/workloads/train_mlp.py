"""Deterministic training of a small MLP on synthetic data, on the CPU or on cuda:0.

Prints ``device <name>`` first, ``step <i> loss <loss>`` after every step and
``final digest <sha256>`` of all parameters at the end. Same arguments (and, with
``--device cuda``, the same GPU model and software stack) give bit-identical output;
CPU and CUDA runs differ from each other.
"""

import argparse
import hashlib
import os
import sys
import time

# cuBLAS is only deterministic with a fixed workspace, and reads this when it initialises.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, RandomSampler

IN_FEATURES = 32
OUT_FEATURES = 4


class SyntheticDataset(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Each sample is derived from (seed, index) alone, so workers agree."""

    def __init__(self, size: int, seed: int) -> None:
        self.size = size
        self.seed = seed
        gen = torch.Generator().manual_seed(seed)
        self.mix = torch.randn(IN_FEATURES, OUT_FEATURES, generator=gen)

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        x = torch.randn(IN_FEATURES, generator=gen)
        y = torch.tanh(x @ self.mix) + 0.05 * torch.randn(OUT_FEATURES, generator=gen)
        return x, y


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--step-time", type=float, default=0.1, help="sleep per step (s)")
    parser.add_argument("--workers", type=int, default=0, help="DataLoader workers")
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args()

    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("train_mlp: --device cuda given but CUDA is not available", file=sys.stderr)
            sys.exit(2)
        device = torch.device("cuda:0")
        torch.use_deterministic_algorithms(True)
        torch.backends.cudnn.benchmark = False
        print(f"device {device} {torch.cuda.get_device_name(device)}", flush=True)
    else:
        device = torch.device("cpu")
        # One intra-op thread: a BLAS free to pick its thread count by load (MKL_DYNAMIC) rounds
        # differently from run to run, and a test comparing digests would see a different model.
        torch.set_num_threads(1)
        print("device cpu", flush=True)

    torch.manual_seed(args.seed)
    dataset = SyntheticDataset(size=1024, seed=args.seed)
    loader = DataLoader(
        dataset,
        batch_size=32,
        # Own generator for the shuffle order: the loader's generator (worker
        # seeds) is drawn a different number of times with and without workers.
        sampler=RandomSampler(dataset, generator=torch.Generator().manual_seed(args.seed)),
        num_workers=args.workers,
        persistent_workers=args.workers > 0,
        generator=torch.Generator().manual_seed(args.seed + 1),
    )
    # Built on the CPU from the seeded CPU generator, then moved: same initial weights on every device.
    model = nn.Sequential(
        nn.Linear(IN_FEATURES, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, OUT_FEATURES),
    ).to(device)
    # Created after the move, so Adam's state lives on the device too.
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()

    step = 0
    while step < args.steps:
        for x_cpu, y_cpu in loader:
            # Workers (if any) only ever make CPU tensors; only this process touches the GPU.
            x, y = x_cpu.to(device), y_cpu.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            optimizer.step()
            print(f"step {step} loss {loss.item():.6f}", flush=True)
            time.sleep(args.step_time)
            step += 1
            if step == args.steps:
                break

    digest = hashlib.sha256()
    for param in model.parameters():
        raw = param.detach().cpu().contiguous().view(torch.uint8).flatten()
        digest.update(bytes(raw.tolist()))
    print(f"final digest {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
