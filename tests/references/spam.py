"""pytorch-optimizer's ``SPAM`` and ``StableSPAM`` on given gradients (torch and the
package imported inside); clipjax's rules restated in float64 are :mod:`tests.restate.spam`."""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np


def have_pytorch_optimizer() -> bool:
    return (
        importlib.util.find_spec("torch") is not None
        and importlib.util.find_spec("pytorch_optimizer") is not None
    )


def run_reference(
    kind: str,
    params: dict[str, np.ndarray],
    grads: list[dict[str, np.ndarray]],
    **kwargs: Any,
) -> list[dict[str, np.ndarray]]:
    """The parameters (float32) after each ``optimizer.step()`` of ``SPAM`` or
    ``StableSPAM`` (``kind``, with ``**kwargs``) from ``params`` on ``grads``."""
    import torch
    from pytorch_optimizer.optimizer import spam as module

    optimizer_class = getattr(module, kind)
    tensors = {
        k: torch.nn.Parameter(torch.tensor(np.asarray(v, np.float32))) for k, v in params.items()
    }
    optimizer = optimizer_class(list(tensors.values()), **kwargs)
    out = []
    for step in grads:
        for k, p in tensors.items():
            p.grad = torch.tensor(np.asarray(step[k], np.float32))
        optimizer.step()
        out.append({k: p.detach().numpy().copy() for k, p in tensors.items()})
    return out


def spiky_gradients(
    shapes: dict[str, tuple[int, ...]],
    steps: int,
    seed: int = 0,
    spikes: dict[int, float] | None = None,
    element_spikes: dict[int, float] | None = None,
    nonfinite: dict[int, float] | None = None,
    scale: float = 1e-2,
) -> list[dict[str, np.ndarray]]:
    """Gaussian gradients of std ``scale`` (``{name: shape}``, NumPy ``seed``); ``spikes``
    ``{step: factor}`` multiplies a whole step, ``element_spikes`` the first element of
    every leaf, ``nonfinite`` ``{step: value}`` sets the first element of the first leaf."""
    rng = np.random.default_rng(seed)
    spikes, element_spikes, nonfinite = spikes or {}, element_spikes or {}, nonfinite or {}
    out = []
    for t in range(steps):
        g = {k: (scale * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
        for k in g:
            g[k] = g[k] * np.float32(spikes.get(t, 1.0))
            if t in element_spikes:
                g[k].reshape(-1)[0] *= np.float32(element_spikes[t])
        if t in nonfinite:
            first = next(iter(g))
            g[first].reshape(-1)[0] = nonfinite[t]
        out.append(g)
    return out
