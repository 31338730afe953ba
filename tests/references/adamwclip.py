"""The ``AdamWClip`` package (PyPI ``adamwclip`` 0.1.4; torch and it imported inside) on
given gradients. ``AdamWClip.step`` clamps each ``p.grad`` in place before its moments
read it: the share of elements it changed is the step's clipped fraction."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np


def have_adamwclip() -> bool:
    return (
        importlib.util.find_spec("torch") is not None
        and importlib.util.find_spec("AdamWClip") is not None
    )


def run_reference(
    params: dict[str, np.ndarray], grads: list[dict[str, np.ndarray]], **kwargs: Any
) -> tuple[list[dict[str, np.ndarray]], list[dict[str, float]]]:
    """The parameters after each step of ``AdamWClip(**kwargs)`` from float32 ``params``
    (sorted by name) on ``grads``, and each tensor's clipped fraction per step."""
    import torch
    from AdamWClip import AdamWClip

    tensors = {
        k: torch.nn.Parameter(torch.tensor(np.asarray(params[k], np.float32)))
        for k in sorted(params)
    }
    optimizer = AdamWClip(list(tensors.values()), **kwargs)
    out, fractions = [], []
    for step in grads:
        given = {k: np.asarray(step[k], np.float32) for k in tensors}
        for k, p in tensors.items():
            p.grad = torch.tensor(given[k].copy())
        optimizer.step()
        out.append({k: p.detach().numpy().copy() for k, p in tensors.items()})
        fractions.append(
            {k: float(np.mean(p.grad.numpy() != given[k])) for k, p in tensors.items()}
        )
    return out, fractions
