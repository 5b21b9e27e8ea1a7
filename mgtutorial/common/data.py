"""Datasets and distributed data loading.

Taught in notebooks/01_single_device.ipynb (the data) and notebooks/02_ddp.ipynb
(DistributedSampler and ``set_epoch``). Follows
https://pytorch.org/docs/stable/data.html#torch.utils.data.distributed.DistributedSampler.

Datasets (all images ``(3, 32, 32)`` float, standardised; labels int64 in 0…9):

* ``"digits"`` — scikit-learn's bundled handwritten digits: 1,797 real 8×8 scans, upscaled to
  32×32 and copied to 3 channels; a fixed, stratified 1,437 / 360 train / test split. No download.
* ``"cifar10"`` — CIFAR-10 via torchvision (50,000 / 10,000), from disk; downloaded only when
  asked (``download=True`` or ``python -m mgtutorial data cifar10``).
* ``"auto"`` — CIFAR-10 if it is on disk, else digits.
* ``"synthetic"`` — seeded Gaussian images with random labels, for tests that need exact control.
"""

from __future__ import annotations

import os
import shlex
import shutil
import socket
import time
import urllib.parse
from pathlib import Path
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, DistributedSampler, Subset, TensorDataset

from mgtutorial.common.config import check_writable_folder

DatasetName = Literal["auto", "digits", "cifar10", "synthetic"]
"""The data sets by name (see the module's docstring); the type of a config's ``dataset``."""
DATASETS = get_args(DatasetName)
CIFAR10_URL = "https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz"
"""Where torchvision downloads CIFAR-10 from (``torchvision.datasets.CIFAR10.url``)."""
CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
CIFAR_STD = (0.2470, 0.2435, 0.2616)


def data_root() -> Path:
    """Where datasets live: ``$MGTUTORIAL_DATA``, else ``~/.cache/mgtutorial/data``."""
    return Path(os.environ.get("MGTUTORIAL_DATA", Path.home() / ".cache" / "mgtutorial" / "data"))


def cifar10_on_disk(root: str | os.PathLike | None = None) -> bool:
    """True if torchvision's CIFAR-10 files are under ``root`` (default :func:`data_root`)."""
    return (Path(root or data_root()) / "cifar-10-batches-py" / "data_batch_1").exists()


def check_available(
    name: str, root: str | os.PathLike | None = None, download: bool = False
) -> None:
    """Refuse a data set that is neither on disk nor allowed to download (only CIFAR-10 can be).

    Called by the configs' ``validate`` (before any rank starts) and by :func:`load_cifar10`.

    Raises:
        FileNotFoundError: the message says how to fetch it.
        ValueError: ``download`` into a folder that cannot be written.
        ConnectionError: ``download``, but the server cannot be reached (offline, a proxy).
    """
    if name != "cifar10" or cifar10_on_disk(root):
        return
    if download:
        check_writable_folder(root or data_root(), "data_root (--data-root, --root)")
        check_reachable(CIFAR10_URL)
        return
    where = Path(root or data_root())
    # the data command's --root when it is not the default, or the download lands elsewhere
    to = "" if where.absolute() == data_root().absolute() else f" --root {shlex.quote(str(where))}"
    raise FileNotFoundError(
        f"CIFAR-10 is not in {where}. Fetch it once (170 MB) with\n"
        f"    .venv/bin/python -m mgtutorial data cifar10{to}\n"
        "or pass download=True (--download on the command line); set MGTUTORIAL_DATA to keep "
        "it elsewhere. dataset='digits' (or 'auto') trains offline on real handwritten digits."
    )


def check_reachable(url: str, timeout_s: float = 5.0) -> None:
    """Raise ``ConnectionError`` unless a TCP connection to ``url``'s host and port opens within
    ``timeout_s`` seconds: a download is refused before it starts, not half-way in a rank."""
    parts = urllib.parse.urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as exc:
        raise ConnectionError(
            f"cannot reach {parts.hostname} to download {url.rsplit('/', 1)[-1]} ({exc}): "
            "connect to the network (or set https_proxy), copy cifar-10-batches-py/ into the "
            "data folder by hand, or train offline with dataset='digits'."
        ) from None


def fetch_cifar10(root: str | os.PathLike | None = None) -> Path:
    """Download CIFAR-10 into ``root`` (default :func:`data_root`) once; returns the folder.

    Checks first that ``root`` can be written and the server reached; if the download fails
    anyway, the folders this call created are removed again (nothing half-made is left).

    Raises:
        ValueError: ``root`` is a file or cannot be written. ConnectionError: offline.
        OSError, RuntimeError: the download or its checksum failed.
    """
    root = Path(root or data_root()).absolute()
    check_available("cifar10", root, download=True)
    created = [p for p in (root, *root.parents) if not p.exists()]
    try:
        load_cifar10(root, download=True)
    except BaseException:
        if created:
            shutil.rmtree(created[-1], ignore_errors=True)  # the outermost folder it made
        raise
    return root


def load_digits(test_fraction: float = 0.2, seed: int = 0) -> tuple[TensorDataset, TensorDataset]:
    """scikit-learn's handwritten digits as ``(3, 32, 32)`` images; a fixed stratified split.

    Returns (train, test) TensorDatasets of ``(x: float32 (3,32,32), y: int64)``.
    """
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    bunch = sk_digits()
    x = torch.tensor(bunch.images, dtype=torch.float32).unsqueeze(1) / 16.0  # (N,1,8,8) in [0,1]
    x = F.interpolate(x, size=(32, 32), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    y = torch.tensor(bunch.target, dtype=torch.int64)
    idx_train, idx_test = train_test_split(
        list(range(len(y))), test_size=test_fraction, random_state=seed, stratify=bunch.target
    )
    mean, std = x[idx_train].mean(), x[idx_train].std()
    x = (x - mean) / std
    return TensorDataset(x[idx_train], y[idx_train]), TensorDataset(x[idx_test], y[idx_test])


def load_cifar10(root: str | os.PathLike | None = None, download: bool = False):
    """CIFAR-10 train and test sets from torchvision, normalised.

    Raises:
        FileNotFoundError: not on disk and ``download`` is False; the message says how to fetch it.
    """
    import torchvision
    from torchvision import transforms

    root = Path(root or data_root())
    if download and os.environ.get("LOCAL_RANK", "0") != "0":
        # one download per machine: local rank 0 fetches, the other ranks wait for complete files
        wait_for_cifar10(root)
        download = False
    else:
        check_available("cifar10", root, download)
    tf = transforms.Compose([transforms.ToTensor(), transforms.Normalize(CIFAR_MEAN, CIFAR_STD)])
    train = torchvision.datasets.CIFAR10(str(root), train=True, download=download, transform=tf)
    test = torchvision.datasets.CIFAR10(str(root), train=False, download=download, transform=tf)
    return train, test


def wait_for_cifar10(
    root: str | os.PathLike, timeout_s: float = 3600.0, period_s: float = 2.0
) -> None:
    """Block until CIFAR-10 under ``root`` is complete (torchvision's checksums pass).

    Ranks other than local rank 0 call it while local rank 0 downloads (:func:`load_cifar10` with
    ``download=True``), so that one machine downloads once, not once per rank.

    Raises:
        TimeoutError: the files were not complete after ``timeout_s`` seconds.
    """
    import torchvision

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            for train in (True, False):
                torchvision.datasets.CIFAR10(str(root), train=train, download=False)
            return
        except RuntimeError:  # "Dataset not found or corrupted": still downloading or extracting
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"CIFAR-10 in {root} was still incomplete after {timeout_s:g} s: did "
                    "local rank 0's download fail? See its .err file."
                ) from None
            time.sleep(period_s)


def load_synthetic(
    n_train: int = 256, n_test: int = 64, shape=(3, 32, 32), num_classes: int = 10, seed: int = 0
) -> tuple[TensorDataset, TensorDataset]:
    """Seeded Gaussian inputs of ``shape`` with uniform random labels (exactly reproducible)."""
    g = torch.Generator().manual_seed(seed)
    n = n_train + n_test
    x = torch.randn(n, *shape, generator=g)
    y = torch.randint(0, num_classes, (n,), generator=g)
    return TensorDataset(x[:n_train], y[:n_train]), TensorDataset(x[n_train:], y[n_train:])


def resolve_dataset(name: str, root: str | os.PathLike | None = None) -> str:
    """``"auto"`` → "cifar10" when it is on disk, else "digits"; other names are checked and
    returned.

    Raises:
        ValueError: a name that is not one of :data:`DATASETS`.
    """
    if name not in DATASETS:
        raise ValueError(f"dataset={name!r} is not one of {DATASETS}.")
    if name == "auto":
        return "cifar10" if cifar10_on_disk(root) else "digits"
    return name


def load_dataset(
    name: str = "auto", root: str | os.PathLike | None = None, download: bool = False, seed: int = 0
) -> tuple[Dataset, Dataset]:
    """(train, test) datasets by name: "auto" | "digits" | "cifar10" | "synthetic" (see module doc).

    Raises:
        ValueError: unknown name. FileNotFoundError: CIFAR-10 missing and ``download`` is False.
    """
    name = resolve_dataset(name, root)
    if name == "digits":
        return load_digits(seed=seed)
    if name == "cifar10":
        return load_cifar10(root, download)
    return load_synthetic(seed=seed)


def train_loader(
    dataset: Dataset,
    batch_size: int,
    rank: int = 0,
    world_size: int = 1,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
) -> DataLoader:
    """A loader that gives this rank its own 1/world_size of the data each epoch.

    Uses :class:`~torch.utils.data.distributed.DistributedSampler`: every epoch the index list is
    shuffled with ``seed + epoch`` (identically on every rank), padded to a multiple of
    ``world_size`` (by repeating indices from its start) and dealt out rank by rank, so the ranks'
    shards together cover the data and overlap only in the few repeated samples. **Call**
    ``loader.sampler.set_epoch(epoch)`` **every epoch**, or every epoch repeats epoch 0's order.

    ``batch_size`` is per rank: the effective (global) batch is ``batch_size × world_size``.
    """
    sampler = DistributedSampler(
        dataset, num_replicas=world_size, rank=rank, shuffle=shuffle, seed=seed, drop_last=drop_last
    )
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler)


def eval_shard(dataset: Dataset, rank: int = 0, world_size: int = 1) -> Subset:
    """Rank ``rank``'s part of an evaluation set: indices ``rank, rank + world_size, …``.

    Unlike DistributedSampler (which pads with repeats so all ranks get equal counts), every
    sample is in exactly one shard, so summed correct counts give the exact accuracy.
    """
    return Subset(dataset, range(rank, len(dataset), world_size))
