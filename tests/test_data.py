"""Datasets and the distributed sampler's arithmetic (no process group needed)."""

from __future__ import annotations

import pytest
import torch

from mgtutorial.common import data


def test_digits_are_real_offline_and_fixed():
    train, test = data.load_digits()
    assert len(train) == 1437 and len(test) == 360
    x, y = train[0]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert set(test.tensors[1].tolist()) == set(range(10))
    train2, _ = data.load_digits()
    assert torch.equal(train.tensors[0], train2.tensors[0])


def test_auto_is_digits_without_cifar_and_cifar_error_says_how(tmp_path, monkeypatch):
    monkeypatch.setenv("MGTUTORIAL_DATA", str(tmp_path))
    assert data.resolve_dataset("auto") == "digits"
    with pytest.raises(FileNotFoundError, match="python -m mgtutorial data cifar10"):
        data.load_dataset("cifar10")
    (tmp_path / "cifar-10-batches-py").mkdir()
    (tmp_path / "cifar-10-batches-py" / "data_batch_1").write_bytes(b"")
    assert data.resolve_dataset("auto") == "cifar10"
    with pytest.raises(ValueError, match="imagenet"):
        data.load_dataset("imagenet")


def _orders(n, world_size, seed, epoch, shuffle=True):
    ds = torch.utils.data.TensorDataset(torch.arange(n))
    out = []
    for r in range(world_size):
        loader = data.train_loader(
            ds, batch_size=4, rank=r, world_size=world_size, seed=seed, shuffle=shuffle
        )
        loader.sampler.set_epoch(epoch)
        out.append([int(i) for (b,) in loader for i in b])
    return out


def test_sampler_disjoint_complete_reshuffled_and_seeded():
    e0, e1 = _orders(100, 2, seed=0, epoch=0), _orders(100, 2, seed=0, epoch=1)
    for orders in (e0, e1):
        assert not set(orders[0]) & set(orders[1])
        assert sorted(orders[0] + orders[1]) == list(range(100))
    assert e0[0] != e1[0] and e0[1] != e1[1]  # set_epoch gives a new order each epoch
    assert e0 == _orders(100, 2, seed=0, epoch=0)  # same seed, same orders
    assert e0 != _orders(100, 2, seed=1, epoch=0)


def test_sampler_pads_uneven_but_eval_shard_counts_each_once():
    orders = _orders(101, 2, seed=0, epoch=0)
    assert len(orders[0]) == len(orders[1]) == 51  # DistributedSampler repeats one sample
    ds = torch.utils.data.TensorDataset(torch.arange(101))
    shards = [data.eval_shard(ds, r, 2) for r in range(2)]
    seen = sorted(int(s[i][0]) for s in shards for i in range(len(s)))
    assert seen == list(range(101))


def test_synthetic_is_reproducible():
    a, _ = data.load_synthetic(seed=3)
    b, _ = data.load_synthetic(seed=3)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])


@pytest.mark.slow
def test_only_local_rank_0_downloads_cifar10_the_others_wait(tmp_path, monkeypatch):
    import torchvision

    calls = []

    class FakeCIFAR10:  # incomplete for the first two checks (as while local rank 0 downloads)
        def __init__(self, root, train=True, download=False, transform=None):
            calls.append(download)
            if download or len(calls) <= 2:
                if download:
                    raise AssertionError("a rank other than local rank 0 downloaded")
                raise RuntimeError("Dataset not found or corrupted.")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", FakeCIFAR10)
    monkeypatch.setenv("LOCAL_RANK", "1")
    data.wait_for_cifar10(tmp_path, period_s=0)
    assert calls == [False, False, False, False]  # two failed checks, then train and test complete
    calls.clear()
    data.load_cifar10(tmp_path, download=True)
    assert calls and not any(calls), "local rank 1 must never download"


def test_waiting_for_cifar10_gives_up_with_a_reason(tmp_path, monkeypatch):
    import torchvision

    def never_complete(*args, **kwargs):
        raise RuntimeError("Dataset not found or corrupted.")

    monkeypatch.setattr(torchvision.datasets, "CIFAR10", never_complete)
    with pytest.raises(TimeoutError, match="local rank 0's download"):
        data.wait_for_cifar10(tmp_path, timeout_s=0, period_s=0)
