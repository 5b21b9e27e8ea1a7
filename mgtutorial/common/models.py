"""The two networks of the article the course started from, fixed, plus stage splitting.

Taught in notebooks/01_single_device.ipynb (the CNN and its flatten size) and
notebooks/04a_pipeline_gpipe.ipynb (the MLP of sub-networks split into pipeline stages).
Follows https://pytorch.org/docs/stable/generated/torch.nn.Conv2d.html (output size formula).
"""

from __future__ import annotations

import math

import torch
from torch import nn


def conv_out_size(size: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Spatial output size of a conv or pool:
    ``floor((size + 2·padding − kernel) / stride) + 1``."""
    return (size + 2 * padding - kernel) // stride + 1


def cnn_flatten_size(in_shape: tuple[int, int, int], channels: int = 32, kernel: int = 5) -> int:
    """Features entering the CNN's first linear layer for inputs of shape ``(C, H, W)``.

    conv(kernel, stride 1, no padding) then 2×2 max-pool: 3×32×32 → 32×28×28 → 32×14×14 = 6272.
    The article hard-codes 4608 = 32·12·12, which is what a 28×28 input gives (28 → 24 → 12):
    correct for MNIST-sized images, wrong for the 32×32 CIFAR-10 images it trains on.
    """
    _, h, w = in_shape
    h, w = conv_out_size(h, kernel) // 2, conv_out_size(w, kernel) // 2
    if h < 1 or w < 1:
        raise ValueError(
            f"input {in_shape} is too small for a {kernel}×{kernel} conv and a 2×2 pool."
        )
    return channels * h * w


class ArticleCNN(nn.Module):
    """The article's CNN: conv5×5(32) → ReLU → maxpool2 → linear(64) → ReLU → linear(classes).

    Fixed: the flatten size is computed from ``in_shape`` (see :func:`cnn_flatten_size`) instead of
    the article's 4608, and ``flatten(1)`` keeps the batch dimension (the article's
    ``view(-1, 4608)`` silently reshapes a 32×32 batch of B images into a wrong batch size, or
    fails).

    Shapes: input ``(B, C, H, W)`` float; output ``(B, num_classes)`` logits.
    """

    def __init__(
        self,
        in_shape: tuple[int, int, int] = (3, 32, 32),
        num_classes: int = 10,
        flatten_size: int | None = None,
    ):
        super().__init__()
        self.flatten_size = flatten_size or cnn_flatten_size(in_shape)
        self.conv1 = nn.Conv2d(in_shape[0], 32, kernel_size=5)
        self.pool = nn.MaxPool2d(2, 2)
        self.fc1 = nn.Linear(self.flatten_size, 64)
        self.fc2 = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.pool(torch.relu(self.conv1(x)))
        x = x.flatten(1)
        if x.shape[1] != self.flatten_size:
            raise ValueError(
                f"the conv stack produced {x.shape[1]} features per image but fc1 expects "
                f"{self.flatten_size}; build the model with in_shape set to your images' (C, H, W) "
                "and let it compute the flatten size (cnn_flatten_size)."
            )
        return self.fc2(torch.relu(self.fc1(x)))


class SubNet(nn.Module):
    """One block of the MLP: ``Linear(in_features, out_features)``, then ReLU when ``relu``.

    The article's block is the ``Linear`` alone (``relu=False``); the ReLU is the course's
    addition (see :class:`ArticleMLP`)."""

    def __init__(self, in_features: int, out_features: int, relu: bool = True):
        super().__init__()
        self.linear = nn.Linear(in_features, out_features)
        self.relu = relu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.linear(x)
        return torch.relu(x) if self.relu else x


class ArticleMLP(nn.Module):
    """The article's "model parallel" MLP: sub-networks 1024 → 512 → 256 → 100, applied in order.

    The article's sub-networks are one ``nn.Linear`` each with nothing between them
    (``relu=False`` builds exactly that). A stack of linear maps is itself one linear map (here
    1024 → 100, of rank at most 256), so the course adds a ReLU between sub-networks (not after
    the last: its outputs are the logits) to make it an MLP (``relu=True``, the default).
    Splitting, pipelining and the activations saved for backward are the same either way (each
    ReLU's output is the next Linear's input, one tensor). Chapter 06b ("The model", before
    section 2.1) shows the collapse.

    Shapes: input ``(B, sizes[0])``; output ``(B, sizes[-1])``. :meth:`split` cuts it into
    pipeline stages.
    """

    def __init__(self, sizes: tuple[int, ...] = (1024, 512, 256, 100), relu: bool = True):
        super().__init__()
        self.sizes = tuple(sizes)
        n = len(sizes) - 1
        self.subnets = nn.ModuleList(
            SubNet(a, b, relu=relu and i < n - 1)
            for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:]))
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for subnet in self.subnets:
            x = subnet(x)
        return x

    def split(self, num_stages: int) -> list[nn.Sequential]:
        """Cut into ``num_stages`` consecutive stages (``nn.Sequential`` sharing these parameters).

        Sub-networks are dealt out as evenly as possible, earlier stages taking the extra one.

        Raises:
            ValueError: ``num_stages`` < 1 or more than the number of sub-networks.
        """
        n = len(self.subnets)
        if not 1 <= num_stages <= n:
            raise ValueError(
                f"num_stages={num_stages}: this MLP has {n} sub-networks; use 1…{n} stages."
            )
        bounds = [0] + [math.ceil(i * n / num_stages) for i in range(1, num_stages)] + [n]
        return [nn.Sequential(*self.subnets[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters of ``model``."""
    return sum(p.numel() for p in model.parameters())


def unwrap(model: nn.Module) -> nn.Module:
    """The network inside a data-parallel wrapper: ``model.module`` for DDP (chapter 02) and
    :class:`~mgtutorial.ddp.collectives.FromScratchDDP` (chapter 03); the model itself otherwise
    (a plain module, or one sharded in place by FSDP2's ``fully_shard``)."""
    return model.module if isinstance(getattr(model, "module", None), nn.Module) else model


def disable_tf32() -> None:
    """Full float32 in cuDNN and CUDA matmuls (no TF32), for bit-level comparisons on GPUs.

    torch ≥ 2.9: the ``fp32_precision`` API, cuDNN conv and RNN set together (mixing it with the
    legacy switches makes their getter raise); older torch: ``cudnn.allow_tf32`` and
    ``cuda.matmul.allow_tf32``. No effect on CPU computations. Taught in notebooks/02_ddp.ipynb;
    see the TF32 section of
    https://pytorch.org/docs/stable/notes/cuda.html#tensorfloat-32-tf32-on-ampere-and-later-devices
    """
    cudnn, cuda = torch.backends.cudnn, torch.backends.cuda
    if hasattr(cudnn, "conv") and hasattr(cuda.matmul, "fp32_precision"):
        cudnn.conv.fp32_precision = cudnn.rnn.fp32_precision = cuda.matmul.fp32_precision = "ieee"
    else:
        cudnn.allow_tf32 = cuda.matmul.allow_tf32 = False
