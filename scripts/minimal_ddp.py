"""A complete DDP training program in one file: chapter 02 without the course's package.

Taught in notebooks/02_ddp.ipynb. One process per GPU with NCCL, or CPU processes with gloo:

    torchrun --standalone --nproc-per-node 2 scripts/minimal_ddp.py --epochs 3
"""

import argparse
import os
import sys

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main(epochs: int, batch_size: int, lr: float) -> None:
    local_rank = int(os.environ["LOCAL_RANK"])  # torchrun sets it, with RANK, WORLD_SIZE, …
    cuda = torch.cuda.device_count() >= int(os.environ["LOCAL_WORLD_SIZE"])  # a GPU per rank
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    x, y = load_digits(return_X_y=True)  # 1,797 8×8 images; the first 1,792 = 28 × 64 are used
    dataset = TensorDataset(
        torch.tensor(x[:1792] / 16, dtype=torch.float32), torch.tensor(y[:1792])
    )
    sampler = DistributedSampler(dataset, shuffle=True, seed=0)  # this rank's share of every epoch
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)  # batch_size: per rank
    torch.manual_seed(0)  # the same initial weights on every rank (DDP also broadcasts rank 0's)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10)).to(device)
    model = DDP(model, device_ids=[local_rank] if cuda else None)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for epoch in range(epochs):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        total = torch.zeros(2, device=device)  # sum of this rank's step losses, number of steps
        for X, Y in loader:
            X, Y = X.to(device), Y.to(device)
            optimizer.zero_grad()
            loss = loss_fn(model(X), Y)
            loss.backward()  # DDP all-reduces (averages) the gradients here
            optimizer.step()
            total += torch.stack([loss.detach(), torch.ones((), device=device)])
        dist.all_reduce(total)  # one extra all-reduce per epoch, not per step
        if dist.get_rank() == 0:
            print(
                f"epoch {epoch + 1}/{epochs}: mean loss {total[0] / total[1]:.4f} "
                f"({dist.get_world_size()} ranks × batch {batch_size})",
                flush=True,
            )
    dist.barrier()  # every rank is done before the group is torn down
    dist.destroy_process_group()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=32, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.05)
    main(**vars(p.parse_args()))
    # Leave without the interpreter's teardown of C++ objects: gloo's threads torn down there can
    # abort a rank that has finished ("terminate called without an active exception", reported in
    # pytorch/pytorch#190489, shown in notebook 06a, 1.7), which torchrun reports as a failed job.
    sys.stdout.flush()
    os._exit(0)
