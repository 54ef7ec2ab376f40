"""Deterministic CPU training of a small MLP on synthetic data.

Prints ``step <i> loss <loss>`` after every step and ``final digest <sha256>``
of all parameters at the end. Same arguments give bit-identical output.
"""

import argparse
import hashlib
import time

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
    args = parser.parse_args()

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
    model = nn.Sequential(
        nn.Linear(IN_FEATURES, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, args.hidden),
        nn.ReLU(),
        nn.Linear(args.hidden, OUT_FEATURES),
    )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    loss_fn = nn.MSELoss()

    step = 0
    while step < args.steps:
        for x, y in loader:
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
        raw = param.detach().contiguous().view(torch.uint8).flatten()
        digest.update(bytes(raw.tolist()))
    print(f"final digest {digest.hexdigest()}", flush=True)


if __name__ == "__main__":
    main()
