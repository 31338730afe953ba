"""What every reference driver shares: availability checks, the gradient a torch
reference is given and the multiplier measured on it, the output dict."""

from __future__ import annotations

import importlib.util
import math
from typing import Any

import numpy as np

_NAN = float("nan")
_INF = float("inf")


def _have(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


have_torch = lambda: _have("torch")
have_smartclip = lambda: _have("smartclip")  # pure Python, no torch
have_zclip = lambda: have_torch() and _have("zclip")
have_drytorch = lambda: have_torch() and _have("drytorch")


def _as_1d(norms: Any) -> np.ndarray:
    x = np.asarray(norms, dtype=np.float64)
    if x.ndim != 1:
        raise ValueError(f"norms must be 1-D, got shape {x.shape}")
    return x


def _opt(v: float | None) -> float:
    return _NAN if v is None else float(v)


def _measured_scale(before: np.ndarray, after: np.ndarray) -> float:
    """The multiplier from two gradient snapshots (float64; tests/references/__init__.py)."""
    nb = float(np.linalg.norm(before))
    if math.isfinite(nb):
        if nb == 0.0:
            return 1.0
        return float(np.linalg.norm(after)) / nb
    return 1.0 if np.array_equal(before, after, equal_nan=True) else _NAN


def _unit_vector(n_elem: int) -> np.ndarray:
    """``±1 / sqrt(n_elem)``, alternating: with ``n_elem`` a power of 4 (4: ``±0.5``) exact
    binary fractions, so ``||norm * u||`` reproduces ``norm`` to ~1 ulp."""
    if n_elem < 1:
        raise ValueError("n_elem must be >= 1")
    signs = np.where(np.arange(n_elem) % 2 == 0, 1.0, -1.0)
    return signs / math.sqrt(n_elem)


def _torch_dtype(dtype: Any) -> Any:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    return {"float64": torch.float64, "float32": torch.float32}[str(np.dtype(dtype))]


def _set_grad(param: Any, norm: float, u: np.ndarray) -> None:
    import torch

    with np.errstate(invalid="ignore", over="ignore"):
        g = norm * u
    param.grad = torch.tensor(g, dtype=param.dtype)


def _grad_np(param: Any) -> np.ndarray:
    return param.grad.detach().double().numpy().copy()


def _finalize(out: dict[str, list]) -> dict[str, np.ndarray]:
    res = {}
    for k, v in out.items():
        arr = np.asarray(v)
        if arr.dtype.kind == "f":
            arr = arr.astype(np.float64)
        res[k] = arr
    if "scale" in res:
        res["clipped"] = res["scale"] < 1.0
    return res
