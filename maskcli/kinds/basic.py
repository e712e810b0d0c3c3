"""full, causal, and the raw torch.tril / torch.triu matrices."""

from __future__ import annotations

from maskcli.kinds.base import Kind, Param, Profile

MEANS = Param(
    "means", "choice", "read the matrix's 1-cells as keep (may attend) or block (masked)", "--means",
    choices=("keep", "block"), metavar="keep|block",
)


def _full_intervals(p, frame):
    return frame.k_start, frame.k_end


def _full_predicate(p, frame, device):
    def full(b, h, q_idx, kv_idx):
        return (q_idx >= 0) & (kv_idx >= 0)

    return full


def _causal_intervals(p, frame):
    return frame.k_start, frame.q_column + 1


def _causal_predicate(p, frame, device):
    def causal(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    return causal


def _causal_candidates(profile: Profile):
    yield {}


def _tril_intervals(p, frame):
    edge = frame.q_column + (p["diagonal"] + 1)  # the 1-cells [k_start, edge); read as block, the rest [edge, k_end)
    return (frame.k_start, edge) if p["means"] == "keep" else (edge, frame.k_end)


def _triu_intervals(p, frame):
    edge = frame.q_column + p["diagonal"]  # the 1-cells [edge, k_end); read as block, the rest [k_start, edge)
    return (edge, frame.k_end) if p["means"] == "keep" else (frame.k_start, edge)


def _tril_predicate(p, frame, device):
    diagonal, keep = p["diagonal"], p["means"] == "keep"

    def tril(b, h, q_idx, kv_idx):
        ones = kv_idx - q_idx <= diagonal  # the 1-cells of torch.tril(ones, diagonal)
        return ones if keep else ~ones

    return tril


def _triu_predicate(p, frame, device):
    diagonal, keep = p["diagonal"], p["means"] == "keep"

    def triu(b, h, q_idx, kv_idx):
        ones = kv_idx - q_idx >= diagonal  # the 1-cells of torch.triu(ones, diagonal)
        return ones if keep else ~ones

    return triu


def later(q: int, kv: int) -> str:
    return f"kv {kv} > q {q}: a later key"


def _full_why(p, frame, b, q, kv):
    return True, "every query sees every key"


def _causal_why(p, frame, b, q, kv):
    return (True, f"kv {kv} <= q {q}") if kv <= q else (False, later(q, kv))


def _read(ones: bool, matrix: str, means: str) -> tuple[bool, str]:
    """A cell of a raw torch.tril/triu matrix, read as keep (1 = may attend) or block (1 = masked)."""
    cell = f"a {1 if ones else 0}-cell of {matrix}, read as {means}"
    return (ones if means == "keep" else not ones), cell + (" (1 = masked)" if means == "block" else "")


def _tril_why(p, frame, b, q, kv):
    d = p["diagonal"]
    ones = kv - q <= d
    keep, cell = _read(ones, f"torch.tril(ones, {d})", p["means"])
    return keep, f"kv - q = {kv - q} {'<=' if ones else '>'} {d}: {cell}"


def _triu_why(p, frame, b, q, kv):
    d = p["diagonal"]
    ones = kv - q >= d
    keep, cell = _read(ones, f"torch.triu(ones, {d})", p["means"])
    return keep, f"kv - q = {kv - q} {'>=' if ones else '<'} {d}: {cell}"


def _diagonals(profile: Profile):
    """tril/triu candidates: which diagonal bounds the visible cells, for the cells the tensor marks.

    torch.tril(ones, d) read as keep is torch.triu(ones, d + 1) read as block; the one named
    is the one whose 1-cells are the cells the tensor marks (True, 1).
    """
    rows = profile.seen
    below_end = rows & (profile.last < profile.k_end - 1)
    if below_end.any():
        i = int(below_end.nonzero()[0][0])
        d = int(profile.last[i] - profile.q[i])
        yield ("tril", {"diagonal": d, "means": "keep"}) if profile.marked == "attend" else ("triu", {"diagonal": d + 1, "means": "block"})
    after_start = rows & (profile.first > profile.k_start)
    if after_start.any():
        i = int(after_start.nonzero()[0][0])
        d = int(profile.first[i] - profile.q[i])
        yield ("triu", {"diagonal": d, "means": "keep"}) if profile.marked == "attend" else ("tril", {"diagonal": d - 1, "means": "block"})


def _tril_candidates(profile: Profile):
    yield from (params for kind, params in _diagonals(profile) if kind == "tril")


def _triu_candidates(profile: Profile):
    yield from (params for kind, params in _diagonals(profile) if kind == "triu")


KINDS = (
    Kind(
        name="full",
        meaning="no mask: every query sees every key (bidirectional encoders, the unmasked tutorial table)",
        keep="always",
        params=(),
        example="full",
        intervals=_full_intervals,
        predicate=_full_predicate,
        why=_full_why,
        rank=0,
        recognise=lambda profile: iter([{}]),
        aliases=("bidirectional",),  # Hugging Face's name (bidirectional_mask_function, create_bidirectional_mask)
        sees_own=True,
        sees_first=True,
    ),
    Kind(
        name="causal",
        meaning="each query sees itself and every earlier key (decoders; behind --offset, a prefill or decode step)",
        keep="kv <= q",
        params=(),
        example="causal",
        intervals=_causal_intervals,
        predicate=_causal_predicate,
        why=_causal_why,
        rank=1,
        recognise=_causal_candidates,
        causal=True,
        aliases=("prefill",),
        sees_own=True,
        sees_first=True,
    ),
    Kind(
        name="tril",
        meaning="the raw torch.tril(ones, D) matrix, its 1-cells read as keep (--means block flips it)",
        keep="kv - q <= D (its 1-cells; means=block hides them instead)",
        params=(
            Param("diagonal", "int", "the diagonal argument of torch.tril (0 = main diagonal)", "--diagonal", default=0, metavar="D"),
            Param(MEANS.name, MEANS.type, MEANS.help, MEANS.flag, default="keep", choices=MEANS.choices, metavar=MEANS.metavar),
        ),
        example="tril(-1)",
        intervals=_tril_intervals,
        predicate=_tril_predicate,
        why=_tril_why,
        rank=20,
        recognise=_tril_candidates,
    ),
    Kind(
        name="triu",
        meaning="the raw torch.triu(ones, D) matrix, its 1-cells read as block, as llama-style code uses it (--means keep flips it)",
        keep="kv - q < D (its 1-cells kv - q >= D are hidden; means=keep keeps them instead)",
        params=(
            Param("diagonal", "int", "the diagonal argument of torch.triu (1 = above the main diagonal)", "--diagonal", default=1, metavar="D"),
            Param(MEANS.name, MEANS.type, MEANS.help, MEANS.flag, default="block", choices=MEANS.choices, metavar=MEANS.metavar),
        ),
        example="triu(1)",
        intervals=_triu_intervals,
        predicate=_triu_predicate,
        why=_triu_why,
        rank=21,
        recognise=_triu_candidates,
    ),
)
