"""Key rows a call reads blended, since its site's last call, with a key the same call still reads elsewhere.

An attention sink kept as a running summary (Reward-Forcing's EMA sink: `sink = alpha * sink + (1 - alpha) * evicted`)
changes its rows between two calls of one layer by a blend: row p now is T = (1 - w) S + w X, S the row p the site's
last call read, X a key. A rotary turns X by another angle where it sat elsewhere, which keeps each pair's norm, so
wherever X sits in this call: |T_i - (1 - w) S_i|² = w² |X_i|² for every rotary pair i. With D = T - S that is
|D_i|² + 2w <D_i, S_i> + w² (|S_i|² - |X_i|²) = 0, linear in (w, w²): least squares over the pairs for each key X
of this call, a fit where it leaves no residual, w in (0, 1/2] and the w² it finds is w squared.

Read at an SDPA call whose site's last call read as many keys or fewer (keyscale.py keeps it), on the CPU, for
float32/float64 keys, batch row 0's first head: rows p at the same index in both calls that changed and stayed close
(cosine > 0.9: a blend that keeps most of the old row; a rolled or rewritten row is another key altogether), each
against the call's other keys. Details `sink_blend`: the blended rows, the rows of this call their X are, w.
checks/sinkblend.py says where the rows are the stated sink and the X keys are still in the window.
"""

from __future__ import annotations

import numpy as np
import torch

CLOSE = 0.9  # cosine of a blended row with its earlier self, at least
RESIDUAL = 1e-3  # relative residual of a fit
SQUARE = 1e-2  # relative gap between the fitted w² and w squared
MOVED = 64  # rows that moved a little, at most (a sink's; more: the cache changed whole)


def sink_blend(before: torch.Tensor | None, k: torch.Tensor, k_shape: tuple) -> dict:
    """{"sink_blend": {"rows": [...], "from": [...], "w": w}} where rows of `k` blend their earlier selves (rows of
    `before`) with other keys of `k`, else {}."""
    if before is None or len(k_shape) != 4 or k_shape[-1] % 2 or before.dim() != 4 or before.shape[-1] != k_shape[-1]:
        return {}
    try:
        if not k.is_cpu or type(k) is not torch.Tensor or k.dtype not in (torch.float32, torch.float64) \
                or k.data_ptr() == before.data_ptr():
            return {}
        now = k.detach()[0, 0].numpy().astype(np.float64)
        then = before.detach()[0, 0].numpy().astype(np.float64)
    except Exception:  # noqa: BLE001 - a tensor not read here (fake, meta, a subclass's) states no blend
        return {}
    n = min(len(now), len(then))
    if n < 2:
        return {}
    diff = now[:n] - then[:n]
    norms = np.linalg.norm(now[:n], axis=1) * np.linalg.norm(then[:n], axis=1)
    cosine = np.einsum("nd,nd->n", now[:n], then[:n]) / np.where(norms > 0, norms, 1)
    moved = np.flatnonzero((cosine > CLOSE) & (np.abs(diff).max(axis=1) > 1e-6 * np.abs(now[:n]).max()))
    if not moved.size or moved.size > MOVED:
        return {}  # (no row moved a little; or many, a cache re-quantized or re-normed whole: no sink)
    for pairing in (0, 1):
        found = _fits(now, then, diff, moved, pairing)
        if found:
            return {"sink_blend": found}
    return {}


def _pairs(x: np.ndarray, pairing: int) -> tuple[np.ndarray, np.ndarray]:
    half = x.shape[-1] // 2
    return (x[..., :half], x[..., half:]) if pairing == 0 else (x[..., 0::2], x[..., 1::2])


def _fits(now: np.ndarray, then: np.ndarray, diff: np.ndarray, moved: np.ndarray, pairing: int) -> dict | None:
    """The moved rows each fit as a blend with one other key of `now` (its row), all by one w; None where any does
    not."""
    (d0, d1), (s0, s1), (k0, k1) = _pairs(diff[moved], pairing), _pairs(then[moved], pairing), _pairs(now, pairing)
    dd = d0 ** 2 + d1 ** 2  # (m, P): |D_i|²
    ds = d0 * s0 + d1 * s1  # <D_i, S_i>
    ss = s0 ** 2 + s1 ** 2
    kk = k0 ** 2 + k1 ** 2  # (n, P): |X_i|² of every key of this call
    a = np.broadcast_to(2 * ds[:, None, :], (len(moved), len(now), ds.shape[1]))
    b = ss[:, None, :] - kk[None, :, :]
    # normal equations of [a b] (w, z) = -dd per (row, key): 2 x 2, solved in closed form
    aa, ab, bb = (a * a).sum(-1), (a * b).sum(-1), (b * b).sum(-1)
    ay, by = -(a * dd[:, None, :]).sum(-1), -(b * dd[:, None, :]).sum(-1)
    det = aa * bb - ab * ab
    safe = np.where(np.abs(det) > 0, det, 1)
    w, z = (bb * ay - ab * by) / safe, (aa * by - ab * ay) / safe
    residual = np.linalg.norm(a * w[..., None] + b * z[..., None] + dd[:, None, :], axis=-1)
    scale = np.linalg.norm(dd, axis=-1)[:, None]
    good = (np.abs(det) > 0) & (w > 0) & (w <= 0.5) & (np.abs(z - w * w) <= SQUARE * w * w) \
        & (residual <= RESIDUAL * np.where(scale > 0, scale, 1))
    good[np.arange(len(moved)), moved] = False  # (a row is not blended with itself)
    if not good.any(axis=1).all():
        return None
    partner = good.argmax(axis=1)
    weights = w[np.arange(len(moved)), partner]
    if np.abs(weights - weights[0]).max() > SQUARE * weights[0]:
        return None
    return {"rows": moved.tolist(), "from": partner.tolist(), "w": round(float(weights.mean()), 6), "of": len(now)}
