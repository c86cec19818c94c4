"""Optimizers: dense AdamW (data-parallel) and the item table's fused in-backward optimizer (fbgemm TBE)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torchrec.optim.rowwise_adagrad import RowWiseAdagrad

from fstrain.errors import ConfigError


SPARSE_OPTIMIZERS = ("rowwise_adagrad", "adagrad", "sgd", "adam")


def sparse_optimizer(optim: "OptimConfig", device: torch.device | None = None
                     ) -> tuple[type[torch.optim.Optimizer], dict]:
    """The fused in-backward optimizer of the embedding table: ``(class, kwargs)``.

    Args:
        optim: the settings.
        device: where the table lives (``adam`` needs CUDA); None: not checked.

    Raises:
        ConfigError: ``optim.sparse_optimizer`` is not one of :data:`SPARSE_OPTIMIZERS`, or ``adam``
            on a CPU table.
    """
    if optim.sparse_optimizer not in SPARSE_OPTIMIZERS:
        raise ConfigError(f"unknown sparse optimizer {optim.sparse_optimizer!r}; use {', '.join(SPARSE_OPTIMIZERS)}")
    if optim.sparse_optimizer == "rowwise_adagrad":
        return RowWiseAdagrad, {"lr": optim.sparse_lr}
    if optim.sparse_optimizer == "adagrad":
        return torch.optim.Adagrad, {"lr": optim.sparse_lr, "eps": 1e-8}
    if optim.sparse_optimizer == "adam":
        if device is not None and device.type != "cuda":
            raise ConfigError("--sparse-optimizer adam runs only on CUDA (fbgemm's CPU table-batched embeddings have "
                              "no Adam); use rowwise_adagrad or adagrad on CPU")
        from torchrec.optim.optimizers import Adam  # noqa: PLC0415 (fbgemm's fused Adam, by torchrec's placeholder)

        return Adam, {"lr": optim.sparse_lr, "beta1": optim.betas[0], "beta2": optim.betas[1], "eps": 1e-8,
                      "weight_decay": 0.0}
    return torch.optim.SGD, {"lr": optim.sparse_lr}



@dataclass(kw_only=True, slots=True)
class OptimConfig:
    """Optimizers: dense AdamW (data-parallel), sparse fused in backward (fbgemm TBE).

    Dense defaults are generative-recommenders' ML-1M recipe (AdamW, lr 1e-3, betas (0.9, 0.98),
    no weight decay); the item table uses a fused optimizer because torchrec updates it inside the
    backward (Adam there only on CUDA).
    """

    dense_lr: float = 1e-3
    """AdamW learning rate of the dense tower."""
    betas: tuple[float, float] = (0.9, 0.98)
    """AdamW betas (also the table's with ``sparse_optimizer="adam"``)."""
    weight_decay: float = 0.0
    """AdamW (decoupled) weight decay of the dense tower."""
    sparse_lr: float = 0.05
    """Learning rate of the item table's fused optimizer."""
    sparse_optimizer: str = "rowwise_adagrad"
    """``rowwise_adagrad``, ``adagrad``, ``sgd`` or ``adam`` (CUDA only), applied inside the backward
    by fbgemm's table-batched embeddings."""


