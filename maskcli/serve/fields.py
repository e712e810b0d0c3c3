"""The named tensors of a batch file, read as the engines name them, with messages that quote those names."""

from __future__ import annotations

import numpy as np

from maskcli.errors import MaskError

# No engine's length, position, slot or page id comes near 2^40 (a trillion tokens); past it, sums and products of
# two such values (page x page_size, nodes x keys) would wrap int64 and read as other, wrong, numbers.
LIMIT = 1 << 40
PAGE_LIMIT = 1 << 20  # tokens per page: page ids under LIMIT times this stay far inside int64


class Fields:
    """A file's tensors as int64 numpy arrays (bool masks kept bool), looked up by the engine's names."""

    def __init__(self, arrays: dict[str, np.ndarray], source: str, engine: str):
        self.arrays, self.source, self.engine = arrays, source, engine

    def key(self, *names: str) -> str | None:
        return next((name for name in names if name in self.arrays), None)

    def has(self, *names: str) -> bool:
        return self.key(*names) is not None

    def raw(self, *names: str) -> np.ndarray | None:
        key = self.key(*names)
        return None if key is None else self.arrays[key]

    def vector(self, *names: str, required: bool = False, why: str = "") -> np.ndarray | None:
        """A 1-D int64 field (a (1, N) one is read as N)."""
        key = self.key(*names)
        if key is None:
            if required:
                raise MaskError(f"{self.source!r} holds {self.engine} but no {' or '.join(names)}{': ' + why if why else ''}; "
                                f"add it to the file")
            return None
        array = np.asarray(self.arrays[key])
        if array.ndim == 2 and array.shape[0] == 1:
            array = array[0]
        if array.ndim != 1:
            raise MaskError(f"{self.source!r}: {key} has shape {list(array.shape)}; it is one value per request or token (1-D)")
        return array.astype(np.int64)

    def positions(self) -> np.ndarray | None:
        """Per-token positions; mRoPE's (3, N) rotary positions are not one position per token, and are not read."""
        array = self.raw("positions")
        if array is None or np.ndim(array) > 1 and np.shape(array)[0] != 1:
            return None
        return self.vector("positions")

    def scalar(self, *names: str, default=None):
        key = self.key(*names)
        if key is None:
            return default
        array = np.asarray(self.arrays[key]).ravel()
        if array.size != 1:
            raise MaskError(f"{self.source!r}: {key} holds {array.size} values; it is one number")
        return int(array[0])

    def indptr(self, *names: str, required: bool = True) -> np.ndarray | None:
        """A cumulative (N+1,) field: starts at 0, never goes down."""
        values = self.vector(*names, required=required)
        if values is None:
            return None
        key = self.key(*names)
        if values.size < 1 or values[0] != 0:
            raise MaskError(f"{self.source!r}: {key} {values[:8].tolist()} must start at 0 (cumulative, N+1 entries for N requests)")
        down = np.flatnonzero(np.diff(values) < 0)
        if down.size:
            i = int(down[0])
            raise MaskError(f"{self.source!r}: {key} goes down at entry {i + 1} ({int(values[i])} then {int(values[i + 1])}); "
                            f"cumulative lengths never go down")
        return values

    def per_request(self, values: np.ndarray | None, requests: int, *names: str) -> np.ndarray | None:
        if values is not None and values.size < requests:
            raise MaskError(f"{self.source!r}: {self.key(*names)} has {values.size} entries for {requests} requests; give one per request")
        return None if values is None else values[:requests]

    def count(self, *names: str):
        """A scalar that counts tokens (a page size, a window side): True or False there is no count (true was read as 1)."""
        key = self.key(*names)
        values = None if key is None else np.asarray(self.arrays[key])
        if values is not None and values.dtype == np.bool_:
            held = bool(values.ravel()[0]) if values.size else "[]"
            raise MaskError(f"{self.source!r}: {key} holds {held}, a flag; it is a number of tokens")
        return self.scalar(*names)

    def page_size(self, *names: str) -> int:
        size = self.count(*names)
        if size is None:
            raise MaskError(f"{self.source!r} has a page table but no page size: add {names[0]} (tokens per page) to the file")
        return checked_page_size(size, f"{self.source!r}: {self.key(*names)}")

    def flag(self, *names: str, default: bool) -> bool:
        value = self.scalar(*names)
        if value not in (None, 0, 1):  # causal=2 was read as True, -1 too: no engine writes either
            raise MaskError(f"{self.source!r}: {self.key(*names)} holds {value}; it is a flag, True or False (1 or 0)")
        return default if value is None else bool(value)

    def limit(self, *names: str) -> tuple[int | None, tuple[str, ...]]:
        """A window's side, -1 for no limit (FlashInfer's window_left, SGLang's sliding_window_size), and a note where
        it is another negative value: the kernel reads any negative side as no limit (-5 was read so, silently)."""
        value = self.count(*names)
        if value is None or value >= -1:
            return value, ()
        return value, (f"{self.key(*names)} {value}: the kernel reads any negative window side as no limit (as -1)",)


def checked_page_size(size: int, where: str) -> int:
    """Tokens per page: 1 to PAGE_LIMIT."""
    if not 1 <= size <= PAGE_LIMIT:
        raise MaskError(f"{where} {size} must be 1 to {PAGE_LIMIT:,} (tokens per page)")
    return size


def numbers(tensors, reads: tuple[str, ...], source: str):
    """The file's fields named in `reads`, each as_numbers when first looked up: an .npz's members are unpacked only
    where the engine reads them (a required field missing is said before any is)."""
    from maskcli.tensorfile.base import Lazy

    return Lazy([key for key in tensors if key in reads], lambda key: as_numbers(tensors[key], f"{source!r}: {key}"))


def as_numbers(value, where: str) -> np.ndarray:
    """A tensor, array or Python number as numpy: bool stays bool, whole floats become int64; every value within
    +-LIMIT (uint8 and bool are masks, kept as they are)."""
    if type(value).__module__.startswith("torch"):
        from maskcli.tensorfile import without_plain_values

        kind = without_plain_values(value)
        if kind is not None:
            raise MaskError(f"{where} is {kind}; batch metadata is plain integers: save a dense tensor (.to_dense(), .dequantize())")
        value = value.detach().cpu()
        value = value.numpy() if value.dtype.is_floating_point is False else value.double().numpy()
    try:
        array = np.asarray(value)
    except (ValueError, TypeError, OverflowError):  # ragged lists, an int past uint64
        raise MaskError(f"{where} is not a rectangular list of integers ({_short(value)}); batch metadata is integers") from None
    if array.dtype.kind == "b":
        return array
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array) | (array != np.round(array)) | (np.abs(array) > LIMIT)
        if bad.any():
            raise MaskError(f"{where} holds {float(array.ravel()[np.argmax(bad.ravel())])!r}, not a whole number within "
                            f"+-{LIMIT:,}; batch metadata is integers")
        return array.astype(np.int64)
    if array.dtype.kind not in "iu":
        raise MaskError(f"{where} is not numbers ({array.dtype}: {_short(value)}); batch metadata is integers")
    if array.dtype == np.uint8:
        return array
    if array.size and (array.max() > LIMIT or (array.dtype.kind == "i" and array.min() < -LIMIT)):
        flat = array.ravel()
        far = flat[np.argmax(flat > LIMIT)] if array.max() > LIMIT else flat[np.argmin(flat)]
        raise MaskError(f"{where} holds {int(far)}, past the {LIMIT:,} that any length, position, slot or page id "
                        f"reaches; batch metadata that large is damaged")
    return array.astype(np.int64)


def _short(value) -> str:
    text = " ".join(repr(value).split())
    return text if len(text) <= 40 else text[:37] + "..."
