"""FlexAttention: a BlockMask (four block-index tensors) and, for its partial blocks, the mask_mod.

Documented rule (torch.nn.attention.flex_attention): BlockMask.from_kv_blocks(kv_num_blocks,
kv_indices, full_kv_num_blocks, full_kv_indices, BLOCK_SIZE, mask_mod, seq_lengths) builds
what create_block_mask(mask_mod, B, H, Lq, Lk) makes; flex_attention computes full blocks
without calling mask_mod and applies mask_mod to every cell of a partial block, so the
BlockMask alone holds a mask only when none of its blocks is partial. mask_mod gets local
indices. The four tensors come from maskcli/blockmask.py, from the intervals.
"""

from __future__ import annotations

import numpy as np

from maskcli.blockmask import DEFAULT_BLOCK, layout
from maskcli.formats.base import Export

NAME = "flex"


def build_arguments(mask) -> dict | None:
    """The keywords of a maskcli.build(...) call that makes this mask again, as Python literals; None for a file's
    or a user's mask. Every option that shapes the mask is here: positions, key padding (lengths and the side it
    is on, or ids), heads, and the region a --rows/--keys view cuts out of the whole."""
    from maskcli.terms import terms

    if mask.expression is None or any(term.kind.rank >= 100 for term in terms(mask.expression)):
        return None
    whole = mask.whole or mask.frame
    args = {"length": whole.q_len, "offset": whole.q_start, "kv_start": whole.k_start, "kv_len": whole.k_len}
    if whole.lengths is not None:
        args["lengths"] = ",".join(map(str, whole.lengths))
        if whole.pad_side != "right":
            args["pad"] = whole.pad_side
    if whole.ids is not None:
        args["ids"] = ";".join(",".join(map(str, row)) for row in whole.ids.tolist())
        args["pad_id"] = whole.pad_id
    if mask.heads > 1:
        args["heads"] = mask.heads
    if mask.whole is not None:
        f = mask.frame
        args["rows"], args["keys"] = f"{f.q_start}:{f.q_end}", f"{f.k_start}:{f.k_end}"
    return args


def same_place(a, b) -> bool:
    """Whether two masks of one expression sit on the same positions with the same key padding (so the same cells)."""
    fa, fb = a.frame, b.frame
    positions = (fa.q_start, fa.q_len, fa.k_start, fa.k_len) == (fb.q_start, fb.q_len, fb.k_start, fb.k_len)
    valid = (fa.key_valid is None) == (fb.key_valid is None) and (fa.key_valid is None or np.array_equal(fa.key_valid, fb.key_valid))
    return a.text == b.text and positions and valid and (a.batch, a.heads) == (b.batch, b.heads) and (a.whole is None) == (b.whole is None)


def build_call(mask) -> str | None:
    """A maskcli.build(...) call that makes this mask again (its mask_mod), checked by building it; None where it
    would not (a file's or a user's mask: the mask_mod then reads the cells)."""
    from maskcli.mask import build

    args = build_arguments(mask)
    if args is None:
        return None
    rebuilt = build(mask.text, **{key: value for key, value in args.items() if key not in ("rows", "keys")})
    if mask.whole is not None:  # as maskcli.build cuts a --rows/--keys region out of the whole
        f = mask.frame
        rebuilt = rebuilt.crop((f.q_start, f.q_end), (f.k_start, f.k_end))
    if not same_place(rebuilt, mask):
        return None
    return f"build({', '.join([repr(mask.text)] + [f'{key}={value!r}' for key, value in args.items()])})"


def to(mask, block: int = DEFAULT_BLOCK) -> Export:
    found = layout(mask, block, block)
    arrays = {name: np.array(value) for name, value in found.arrays().items()}  # a copy: the arrays may be read-only broadcast views
    partial = int(found.kv_num_blocks.sum())
    f = mask.frame
    code = ["import torch", "from torch.nn.attention.flex_attention import BlockMask, flex_attention"]
    notes = []
    if partial == 0:
        mask_mod = ""
        notes.append("every block is full or empty: the BlockMask alone holds the mask (no mask_mod)")
    else:
        call = build_call(mask)
        if call is not None:
            code.append("from maskcli import build")
            code.append(f"mask_mod = {call}.local_mask_mod(q.device)  # on q's device: compiled flex_attention reads no CPU tensor")
        else:
            arrays["keep"] = mask.dense()  # a file's cells, or a user's mask_mod evaluated: the mask_mod reads them
            b = "b" if arrays["keep"].shape[0] > 1 else "0"
            h = "h" if arrays["keep"].shape[1] > 1 else "0"
            code.append("keep = <keep>")
            code.append(f"def mask_mod(b, h, q_idx, kv_idx):\n    return keep[{b}, {h}, q_idx, kv_idx]")
        mask_mod = ", mask_mod=mask_mod"
        notes.append(f"{partial} partial block{'s' if partial != 1 else ''}: flex_attention calls mask_mod on "
                     f"{'their' if partial != 1 else 'its'} cells, so the BlockMask needs it")
    code.append("block_mask = BlockMask.from_kv_blocks(<kv_num_blocks>, <kv_indices>, <full_kv_num_blocks>, <full_kv_indices>,")
    code.append(f"                                     BLOCK_SIZE=({block}, {block}){mask_mod}, seq_lengths=({f.q_len}, {f.k_len}))")
    code.append("out = flex_attention(q, k, v, block_mask=block_mask)  # q: (B, H, Lq, D), k and v: (B, H, Lk, D)")
    arrays["block_size"] = np.array([block, block], dtype=np.int64)  # for --from flex
    arrays["seq_lengths"] = np.array([f.q_len, f.k_len], dtype=np.int64)
    return Export(code, arrays, notes, device="q.device")


def load(path: str, flag: str) -> dict:
    """A .pt of BlockMask tensors, as `maskcli blocks --save` writes it too: BLOCK_SIZE and seq_lengths may be
    tuples of ints (what BlockMask.from_kv_blocks takes), read as block_size and seq_lengths."""
    import torch

    from maskcli.errors import MaskError
    from maskcli.tensorfile import checked_source

    source, where, _ = checked_source(path, flag)
    try:
        data = torch.load(source, map_location="cpu", weights_only=True)
    except Exception as error:  # refused pickles, truncated files: one line
        raise MaskError(f"{where}: not a readable .pt file of BlockMask tensors ({type(error).__name__}: {str(error).splitlines()[0][:160]})") from None
    if not isinstance(data, dict):
        raise MaskError(f"{where}: holds {type(data).__name__}, not a dict of BlockMask tensors: save it with maskcli export --for flex --save")
    out = {}
    for key, value in data.items():
        name = {"BLOCK_SIZE": "block_size"}.get(str(key), str(key))
        if isinstance(value, (tuple, list, int)) and all(isinstance(v, int) for v in (value if isinstance(value, (tuple, list)) else [value])):
            value = torch.tensor(value)
        if not isinstance(value, torch.Tensor):
            raise MaskError(f"{where}: entry {key!r} is {type(value).__name__}, not a tensor or whole numbers")
        out[name] = value
    return out


def read(tensors: dict, flags: dict):
    """A BlockMask's four tensors (with block_size and seq_lengths) back to a mask: exact only where every
    block is full or empty, since a partial block's cells are known only to its mask_mod."""
    from maskcli.errors import MaskError
    from maskcli.formats.base import check_rows, mask_of, rows_of, saved
    from maskcli.intervals import Intervals

    what = "--from flex"
    num, full_num, full_idx = (saved(tensors, name, what) for name in ("kv_num_blocks", "full_kv_num_blocks", "full_kv_indices"))
    sizes = {name: saved(tensors, name, what).ravel() for name in ("block_size", "seq_lengths")}
    if sizes["block_size"].size not in (1, 2) or sizes["seq_lengths"].size != 2:
        raise MaskError(f"{what}: block_size is one or two numbers and seq_lengths two (queries, keys); got "
                        f"{sizes['block_size'][:8].tolist()} and {sizes['seq_lengths'][:8].tolist()}")
    q_block, kv_block = (int(x) for x in np.broadcast_to(sizes["block_size"], (2,)))
    q_len, k_len = (int(x) for x in sizes["seq_lengths"])
    if full_idx.ndim != 4 or num.shape != full_num.shape or full_num.shape != full_idx.shape[:3]:
        raise MaskError(f"{what}: full_kv_indices must be (B, H, n_q, n_kv) and the counts (B, H, n_q); got {list(full_idx.shape)} and {list(full_num.shape)}")
    if 0 in full_idx.shape[:2]:
        raise MaskError(f"{what}: full_kv_indices has shape {list(full_idx.shape)}: no batch row or no head; a mask has at least one of each")
    if (num < 0).any():
        raise MaskError(f"{what}: kv_num_blocks holds {int(num.min())}, a negative count of partial blocks: save the "
                        "BlockMask's own kv_num_blocks (each 0 .. the blocks of a row)")
    if int(num.sum()):
        raise MaskError(f"{what}: the BlockMask has {int(num.sum()):,} partial blocks, whose cells only its mask_mod knows; maskcli reads a "
                        "BlockMask exactly only when every block is full or empty: give the mask itself (an expression, or --mask with a dense tensor)")
    if full_idx.shape[1] > 1 and not ((full_num == full_num[:, :1]).all() and (full_idx == full_idx[:, :1]).all()):
        raise MaskError(f"{what}: its {full_idx.shape[1]} heads differ; maskcli reads one mask for every head: save one head")
    batch, _, n_q, n_kv = full_idx.shape
    if min(q_block, kv_block) < 1 or min(q_len, k_len) < 1 or n_q != -(-q_len // q_block) or n_kv != -(-k_len // kv_block):
        raise MaskError(f"{what}: {n_q} x {n_kv} blocks of {q_block} x {kv_block} do not cover seq_lengths ({q_len}, {k_len}): save the BlockMask with its block_size and seq_lengths")
    for name, values, top in (("full_kv_num_blocks", full_num, n_kv), ("full_kv_indices", full_idx, n_kv - 1)):
        if ((values < 0) | (values > top)).any():
            bad = int(values.ravel()[np.argmax(((values < 0) | (values > top)).ravel())])
            raise MaskError(f"{what}: {name} holds {bad}; block counts and indices must lie in 0..{n_kv} and 0..{n_kv - 1}")
    listed = np.sort(np.where(np.arange(n_kv) < full_num[..., None], full_idx, -1 - np.arange(n_kv)), axis=-1)
    if (listed[..., 1:] == listed[..., :-1]).any():  # flex_attention would add such a block's keys in twice
        b, _, row, at = np.argwhere(listed[..., 1:] == listed[..., :-1])[0]
        raise MaskError(f"{what}: full_kv_indices lists key block {int(listed[b, 0, row, at])} twice in query block {int(row)}: "
                        "save the BlockMask's own full_kv_indices (each block at most once a row)")
    check_rows(batch * q_len, what)
    planes = []
    for b in range(batch):
        chosen = np.arange(n_kv)[None, :] < full_num[b, 0][:, None]
        rows = np.broadcast_to(np.arange(n_q)[:, None], chosen.shape)[chosen]
        blocks = full_idx[b, 0][chosen]
        per_block = rows_of([(rows, blocks * kv_block, np.minimum((blocks + 1) * kv_block, k_len))], n_q, 0, k_len)
        block_of = np.arange(q_len) // q_block  # each query row's block (a repeat by q_block would make n_q x q_block rows)
        planes.append(Intervals.of(per_block.starts[:, block_of], per_block.ends[:, block_of], 0, k_len))
    width = max(p.per_row for p in planes)

    def pad(a):
        return np.concatenate([a, np.full(a.shape[:2] + (width - a.shape[2],), k_len, dtype=np.int64)], -1)

    intervals = Intervals(np.concatenate([pad(p.starts) for p in planes]), np.concatenate([pad(p.ends) for p in planes]), 0, k_len)
    return mask_of(intervals, q_len, k_len, batch, f"flex BlockMask({batch} x {n_q} x {n_kv} blocks of {q_block} x {kv_block})")
