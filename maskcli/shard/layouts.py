"""Token -> rank assignments of context parallelism, kept as pieces (runs of positions), never per token.

A layout says which rank holds each position of a sequence of `length` real tokens, and in what local order:
pieces (rank, start, size), grouped by rank ascending and each rank's in its local order. A piece with start
-1 is padding: slots that hold no real token (a sequence padded to a multiple of 2 x ranks).

    contiguous    rank r holds the r-th of N equal slices (the tail padded to a multiple of N)
    headtail      2N slices; rank r holds slice r and slice 2N-1-r (PyTorch's _HeadTailLoadBalancer,
                  torch/distributed/tensor/experimental/_context_parallel/_load_balancer.py:146-164;
                  TransformerEngine's bshd/sbhd split)
    per-document  the same within every document, each padded to a multiple of 2N (TransformerEngine's THD
                  split, get_batch_on_this_cp_rank, context_parallel.py:5257; the split the docstring of
                  PyTorch's _PerDocumentHeadTailLoadBalancer draws, _load_balancer.py:222-242)
    striped       stripes of W tokens dealt round-robin: stripe k on rank k mod N (Striped Attention)
    ulysses       the sequence split as contiguous, then all-to-all: every rank sees every token for its heads
    ptrr          query blocks dealt by their work (PyTorch's _PTRRLoadBalancer, _load_balancer.py:312-467)
    FILE          a permutation (PyTorch's rearrange indices, sharded into N equal parts as
                  _context_parallel_buffers does, _attention.py:1151-1155) or one index list per rank

Indices at or past `length` (or negative) in a FILE are padding.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from maskcli.errors import MaskError

NAMES = ("contiguous", "headtail", "per-document", "striped", "ulysses", "ptrr")


@dataclass(frozen=True, eq=False)
class Layout:
    """Which rank holds which positions, as pieces in each rank's local order; see the module docstring."""

    name: str
    ranks: int
    length: int
    rank: np.ndarray  # int64 (P,), ascending
    start: np.ndarray  # int64 (P,); -1 = padding slots
    size: np.ndarray  # int64 (P,), > 0
    period: int | None = None  # the assignment repeats every `period` positions (striped)
    heads: tuple[int, ...] | None = None  # ulysses: heads per rank, every rank seeing every token
    note: str = ""  # how it was made, in words

    @property
    def real(self) -> np.ndarray:
        return self.start >= 0

    def tokens(self) -> np.ndarray:
        """Real tokens per rank, int64 (N,)."""
        return np.bincount(self.rank[self.real], weights=self.size[self.real], minlength=self.ranks).astype(np.int64)

    def slots(self) -> np.ndarray:
        """Slots per rank, padding included, int64 (N,)."""
        return np.bincount(self.rank, weights=self.size, minlength=self.ranks).astype(np.int64)

    def indices(self) -> np.ndarray:
        """The whole order as one index array (PyTorch's rearrange indices): every rank's slots in turn,
        padding slots numbered length, length+1, ... in order."""
        start = self.start.copy()
        pads = ~self.real
        start[pads] = self.length + np.cumsum(np.where(pads, self.size, 0))[pads] - self.size[pads]
        return _expand(start, self.size)

    def rank_indices(self, r: int) -> np.ndarray:
        """Rank r's positions in its local order (-1 for padding slots)."""
        mine = self.rank == r
        starts, sizes = self.start[mine], self.size[mine]
        out = _expand(np.where(starts >= 0, starts, 0), sizes)
        out[np.repeat(starts < 0, sizes)] = -1
        return out

    def owner(self) -> np.ndarray:
        """int32 (length,): the rank holding each real position (-1 where none; the last where several do)."""
        out = np.full(self.length, -1, dtype=np.int32)
        real = self.real
        out[_expand(self.start[real], self.size[real])] = np.repeat(self.rank[real], self.size[real])
        return out


def _expand(starts: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """The runs start..start+size-1 one after another, as one int64 array (vectorised)."""
    sizes = np.asarray(sizes, dtype=np.int64)
    firsts = np.cumsum(sizes) - sizes
    return np.repeat(np.asarray(starts, dtype=np.int64) - firsts, sizes) + np.arange(int(sizes.sum()), dtype=np.int64)


def _chunked(doc_starts: np.ndarray, doc_sizes: np.ndarray, ranks: int, parts: int, name: str, note: str) -> Layout:
    """Each document padded to a multiple of `parts` and cut into `parts` equal chunks: with parts = 2N, rank r
    takes chunks r and 2N-1-r of every document (head-tail); with parts = N, chunk r. Vectorised over documents."""
    padded = -(-doc_sizes // parts) * parts
    chunk = padded // parts  # (D,)
    if parts == 2 * ranks:
        which = np.stack([np.arange(ranks), 2 * ranks - 1 - np.arange(ranks)], axis=1)  # (N, 2)
    else:
        which = np.arange(ranks)[:, None]  # (N, 1)
    # (N, D, k): rank-major, then document, then head before tail: each rank's local order
    lo = which[:, None, :] * chunk[None, :, None]
    hi = lo + chunk[None, :, None]
    real_hi = np.minimum(hi, doc_sizes[None, :, None])
    real = np.clip(real_hi - lo, 0, None)
    pad = (hi - lo) - real
    shape = lo.shape
    rank = np.broadcast_to(np.arange(ranks)[:, None, None], shape)
    start = lo + doc_starts[None, :, None]
    # per chunk: its real piece, then its padding (a document's padding is at its end)
    ranks_ = np.stack([rank, rank], -1).reshape(-1)
    starts = np.stack([start, np.full(shape, -1)], -1).reshape(-1)
    sizes = np.stack([real, pad], -1).reshape(-1)
    keep = sizes > 0
    return Layout(name, ranks, int(doc_sizes.sum()), ranks_[keep].astype(np.int64), starts[keep].astype(np.int64),
                  sizes[keep].astype(np.int64), note=note)


def contiguous(length: int, ranks: int) -> Layout:
    per = -(-length // ranks)
    return _chunked(np.array([0]), np.array([length]), ranks, ranks, "contiguous", f"{per:,} slot{'s' if per != 1 else ''} a rank")


def headtail(length: int, ranks: int) -> Layout:
    chunk = -(-length // (2 * ranks))
    return _chunked(np.array([0]), np.array([length]), ranks, 2 * ranks, "headtail", f"2 x {ranks} chunks of {chunk:,}")


def per_document(doc_sizes, ranks: int) -> Layout:
    sizes = np.asarray(doc_sizes, dtype=np.int64)
    starts = np.cumsum(sizes) - sizes
    return _chunked(starts, sizes, ranks, 2 * ranks, "per-document", f"{len(sizes):,} documents, each in 2 x {ranks} chunks")


def striped(length: int, ranks: int, width: int = 1) -> Layout:
    if width < 1:
        raise MaskError(f"striped:{width}: the stripe width must be at least 1, like striped:128")
    period = ranks * width
    padded = -(-length // period) * period
    stripes = padded // width
    k = np.arange(stripes, dtype=np.int64)
    rank = k % ranks
    order = np.argsort(rank, kind="stable")  # each rank's stripes in position order
    lo = k[order] * width
    real = np.clip(length - lo, 0, width)
    ranks_ = np.stack([rank[order], rank[order]], -1).reshape(-1)
    starts = np.stack([lo, np.full(lo.shape, -1)], -1).reshape(-1)
    sizes = np.stack([real, width - real], -1).reshape(-1)
    keep = sizes > 0
    return Layout("striped", ranks, length, ranks_[keep], starts[keep], sizes[keep], period=period,
                  note=f"stripes of {width:,}")


def ulysses(length: int, ranks: int, heads: int) -> Layout:
    if heads < ranks:
        raise MaskError(f"--layout ulysses splits heads: --heads {heads} is fewer than --ranks {ranks}; give --heads of at least {ranks}")
    split = tuple(int(h) for h in np.diff(np.linspace(0, heads, ranks + 1).round().astype(int))) if heads % ranks else (heads // ranks,) * ranks
    found = contiguous(length, ranks)
    per = ", ".join(sorted({str(h) for h in split}))
    return Layout("ulysses", ranks, length, found.rank, found.start, found.size, heads=split, note=f"{per} of {heads} heads a rank")


def ptrr(block_work: np.ndarray, length: int, ranks: int, block: int) -> Layout:
    """PyTorch's processing-time round-robin: query blocks sorted by the key blocks they compute (descending,
    stable), dealt to the ranks in rows of N, every other row reversed, each rank's blocks then ascending
    (ptrr_scheduling, _load_balancer.py:349-366; the blocks as index runs, :458-461). `block_work`: the
    computed (partial + full) key blocks of each query block."""
    blocks = block_work.size
    if blocks % ranks:
        raise MaskError(f"--layout ptrr: {blocks:,} query blocks of {block} do not divide among {ranks} ranks (PyTorch's "
                        f"ptrr_scheduling requires it): give a length that makes a multiple of {ranks} blocks, or another --ranks")
    order = np.argsort(-np.asarray(block_work), kind="stable")  # torch.sort(descending=True, stable=True)
    reversed_rows = order.reshape(-1, ranks)[:, ::-1].reshape(-1)
    dealt = np.where(np.arange(blocks) // ranks % 2 == 0, order, reversed_rows)
    groups = np.sort(dealt.reshape(-1, ranks).T, axis=1)  # (ranks, blocks / ranks)
    lo = groups.reshape(-1) * block
    real = np.clip(length - lo, 0, block)
    rank = np.repeat(np.arange(ranks), blocks // ranks)
    ranks_ = np.stack([rank, rank], -1).reshape(-1)
    starts = np.stack([lo, np.full(lo.shape, -1)], -1).reshape(-1)
    sizes = np.stack([real, block - real], -1).reshape(-1)
    keep = sizes > 0
    return Layout("ptrr", ranks, length, ranks_[keep].astype(np.int64), starts[keep].astype(np.int64), sizes[keep].astype(np.int64),
                  note=f"{blocks:,} blocks of {block} dealt by their work")


def from_indices(per_rank: list[np.ndarray], length: int, name: str) -> Layout:
    """A layout from each rank's positions in local order (indices >= length or < 0: padding), as runs."""
    ranks_, starts, sizes = [], [], []
    for r, idx in enumerate(per_rank):
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if idx.size == 0:
            continue
        pad = (idx < 0) | (idx >= length)
        key = np.where(pad, -1, idx)
        # a new run where padding starts or stops, or the next position is not one more
        new = np.ones(idx.size, dtype=bool)
        new[1:] = (pad[1:] != pad[:-1]) | (~pad[1:] & (key[1:] != key[:-1] + 1))
        firsts = np.flatnonzero(new)
        ranks_.append(np.full(firsts.size, r))
        starts.append(key[firsts])
        sizes.append(np.diff(np.r_[firsts, idx.size]))
    cat = (lambda parts: np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64))
    return Layout(name, len(per_rank), length, cat(ranks_), cat(starts), cat(sizes), note="read from the file")


def read_file(path: str, length: int, ranks: int) -> Layout:
    """A permutation (1-D, or (1, L) as PyTorch's _generate_indices returns it) split into `ranks` equal parts,
    or one index list per rank ((N, L/N), a list of lists, or a dict rank -> list)."""
    values = _load(path)
    label = f"--layout {path!r}"
    from_dict = isinstance(values, dict)  # a dict is always one list per rank, even of one rank
    if from_dict:
        try:
            values = [values[k] for k in sorted(values, key=int)]
        except ValueError:
            raise MaskError(f"{label}: a dict must map rank numbers to index lists, like {{\"0\": [0, 7], \"1\": [1, 6]}}") from None
    if isinstance(values, list) and values and all(isinstance(v, (list, np.ndarray)) for v in values) and (len(values) != 1 or from_dict):
        per_rank = [_array(v, label) for v in values]
    else:
        array = _array(values, label)
        if array.ndim == 2 and array.shape[0] == 1:
            array = array[0]
        if array.ndim == 2:
            per_rank = list(array)
        elif array.ndim == 1:
            if array.size % ranks:
                raise MaskError(f"{label} holds {array.size:,} indices, not a multiple of --ranks {ranks}: "
                                f"a permutation is sharded into equal parts, so pad it to a multiple of {ranks}")
            per_rank = list(array.reshape(ranks, -1))
        else:
            raise MaskError(f"{label} has shape {list(array.shape)}: give a permutation (L,) or (1, L), or one index list per rank (N, L/N)")
    if len(per_rank) != ranks:
        raise MaskError(f"{label} has index lists for {len(per_rank)} rank{'s' if len(per_rank) != 1 else ''} but --ranks is {ranks}: give --ranks {len(per_rank)}")
    for r, idx in enumerate(per_rank):
        if np.asarray(idx).dtype.kind not in "iu" and np.asarray(idx).size:
            raise MaskError(f"{label}: rank {r}'s indices are {np.asarray(idx).dtype}, not whole numbers")
    return from_indices(per_rank, length, path)


def _array(values, label: str) -> np.ndarray:
    """Numbers as an array, or the one-line error a ragged or non-numeric list deserves."""
    try:
        array = np.asarray(values)
    except ValueError:
        array = None
    if array is None or array.dtype == object or array.dtype.kind not in "biuf":
        raise MaskError(f"{label} holds {type(values).__name__ if array is None or array.dtype == object else array.dtype} values, not "
                        "index lists: give a permutation [0, 7, 1, 6, ...] or one list of whole numbers per rank")
    return array


def _load(path: str):
    import json
    import os

    if not os.path.isfile(path):
        import difflib

        close = difflib.get_close_matches(path.partition(":")[0], NAMES, n=1)
        hint = f"; did you mean {close[0]}?" if close else ""
        raise MaskError(f"--layout {path!r}: no such file, and not a layout ({', '.join(NAMES)}, striped:W, ptrr:BLOCK){hint}")
    lower = path.lower()
    try:
        if lower.endswith(".json"):
            with open(path, encoding="utf-8") as handle:
                return json.load(handle)
        if lower.endswith(".npy"):
            return np.load(path, allow_pickle=False)
        if lower.endswith(".pt"):
            import torch

            data = torch.load(path, map_location="cpu", weights_only=True)
            if isinstance(data, dict):
                return {k: v.numpy() if hasattr(v, "numpy") else v for k, v in data.items()}
            if isinstance(data, (list, tuple)):
                return [v.numpy() if hasattr(v, "numpy") else v for v in data]
            return data.numpy() if hasattr(data, "numpy") else data
        if lower.endswith(".txt"):
            with open(path, encoding="utf-8") as handle:
                rows = [line.replace(",", " ").split() for line in handle if line.strip()]
            if not rows:
                raise MaskError(f"--layout {path!r} is empty: give a permutation (one line) or one line of indices per rank")
            return [np.array([int(v) for v in row]) for row in rows] if len(rows) > 1 else np.array([int(v) for v in rows[0]])
    except MaskError:
        raise
    except Exception as error:  # torch.load's UnpicklingError, a bad zip, a broken .npy: the file, not maskcli
        import pickle

        # torch's UnpicklingError is mostly advice to turn weights_only off, which maskcli never does
        reason = ("not a tensor file torch.load(weights_only=True) reads" if isinstance(error, pickle.UnpicklingError)
                  else " ".join(str(error).split())[:200])
        raise MaskError(f"cannot read --layout {path!r}: {reason}") from None
    raise MaskError(f"--layout {path!r}: give a .json, .npy, .pt or .txt file of indices")
