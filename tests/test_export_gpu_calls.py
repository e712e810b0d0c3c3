"""The GPU libraries' printed calls run as printed (issue 28.5): xformers, flash_attn, flashinfer, paddle's flashmask and
MagiAttention, with the real package where it imports, else stand-ins whose classes and functions take exactly the
arguments the library's source gives them (cited beside each), so that a wrong keyword raises TypeError here as it
does there. No GPU here: the kernels' outputs are computed from the cells the arguments mean, or not at all."""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass

import pytest
import torch

from test_export_runs import pad_rows, printed


def real_keys(b: int, lo: int, hi: int, valid) -> list[int]:
    """Positions lo..hi-1 that are real tokens of batch row b (all of them without padding)."""
    return [p for p in range(lo, hi) if valid is None or valid[b][p]]


def packed_reference(keep, q_range, k_range, valid, packed: bool) -> torch.Tensor:
    """What a varlen kernel sees: each batch row's real queries and keys, packed one after another (B = 1); cells
    across batch rows are masked. keep(b, q, kv) on absolute positions."""
    batch = 1 if valid is None else len(valid)
    if not packed:
        return torch.tensor([[[keep(b, q, kv) for kv in range(*k_range)] for q in range(*q_range)] for b in range(batch)])
    rows = [(b, q) for b in range(batch) for q in real_keys(b, *q_range, valid)]
    cols = [(b, kv) for b in range(batch) for kv in real_keys(b, *k_range, valid)]
    return torch.tensor([[[bq == bk and keep(bq, q, kv) for bk, kv in cols] for bq, q in rows]])


# --- xformers: the stand-in ------------------------------------------------------------------------
# Each class below takes the constructor and methods of xformers 0.0.35's xformers/ops/fmha/attn_bias.py (the wheel's
# source; later commits re-export the same classes from mslk.attention.fmha.attn_bias) and keeps cells by its
# docstring's rule, written here as a loop: _materialize_causal_mask (line 114) keeps j <= i + shift and, with a
# window, j >= i + shift - window_size + 1, shift = Lk - Lq from the bottom right, 0 top-left.


def _causal(nq, nk, bottom_right, window=None):
    shift = nk - nq if bottom_right else 0
    return [[j <= i + shift and (window is None or j >= i + shift - window + 1) for j in range(nk)] for i in range(nq)]


class LowerTriangularMask:  # line 142; __init__(self, device=None), line 153
    def __init__(self, device=None):
        pass

    def keep(self, nq, nk):
        return _causal(nq, nk, False)


@dataclass
class LocalAttentionFromBottomRightMask:  # line 175: fields window_left, window_right (line 218-219), each >= 0
    window_left: int
    window_right: int

    def __post_init__(self):
        if self.window_left < 0 or self.window_right < 0:
            raise ValueError("Invalid window value")

    def keep(self, nq, nk):  # materialize, line 238: triu(shift - window_left), tril(shift + window_right)
        return [[-self.window_left <= j - i - (nk - nq) <= self.window_right for j in range(nk)] for i in range(nq)]


class LowerTriangularFromBottomRightMask:  # line 261, no constructor arguments
    def keep(self, nq, nk):
        return _causal(nq, nk, True)

    def make_local_attention(self, window_size):  # line 297
        return LowerTriangularFromBottomRightLocalAttentionMask(window_size)


@dataclass
class LowerTriangularFromBottomRightLocalAttentionMask(LowerTriangularFromBottomRightMask):  # line 308: one field, _window_size
    _window_size: int

    def __post_init__(self):
        if self._window_size <= 0:
            raise ValueError("Expected `window_size > 0`")

    def keep(self, nq, nk):
        return _causal(nq, nk, True, self._window_size)


@dataclass
class BlockDiagonalMask:  # line 752: q_seqinfo, k_seqinfo, _batch_sizes (the seqinfos held here as lists of lengths)
    q_seqinfo: list
    k_seqinfo: list
    _batch_sizes: object = None

    @classmethod
    def from_seqlens(cls, q_seqlen, kv_seqlen=None, *, device=None):  # line 849
        assert kv_seqlen is None or len(q_seqlen) == len(kv_seqlen)
        return cls(q_seqinfo=list(q_seqlen), k_seqinfo=list(q_seqlen if kv_seqlen is None else kv_seqlen))

    def make_local_attention(self, window_size):  # line 970: top-left, causal inside each block
        return BlockDiagonalCausalLocalAttentionMask(q_seqinfo=self.q_seqinfo, k_seqinfo=self.k_seqinfo, _window_size=window_size)

    def make_local_attention_from_bottomright(self, window_size):  # line 981
        return BlockDiagonalCausalLocalAttentionFromBottomRightMask(q_seqinfo=self.q_seqinfo, k_seqinfo=self.k_seqinfo, _window_size=window_size)

    def block(self, nq, nk):
        return [[True] * nk for _ in range(nq)]

    def keep(self, nq, nk):
        assert (nq, nk) == (sum(self.q_seqinfo), sum(self.k_seqinfo))  # materialize's asserts, line 823-830
        out = [[False] * nk for _ in range(nq)]
        q0 = k0 = 0
        for lq, lk in zip(self.q_seqinfo, self.k_seqinfo):
            for i, row in enumerate(self.block(lq, lk)):
                out[q0 + i][k0:k0 + lk] = row
            q0, k0 = q0 + lq, k0 + lk
        return out


class BlockDiagonalCausalMask(BlockDiagonalMask):  # line 993: LowerTriangularMask inside each block
    def block(self, nq, nk):
        return _causal(nq, nk, False)


class BlockDiagonalCausalFromBottomRightMask(BlockDiagonalMask):  # line 1025
    def __post_init__(self):  # line 1049: every block needs num_keys >= num_queries
        if any(k < q for q, k in zip(self.q_seqinfo, self.k_seqinfo)):
            raise ValueError("Expected `num_keys >= num_queries`")

    def block(self, nq, nk):
        return _causal(nq, nk, True)


@dataclass
class BlockDiagonalCausalLocalAttentionMask(BlockDiagonalCausalMask):  # line 1852: _window_size: int = 0
    _window_size: int = 0

    def __post_init__(self):  # line 1876: a positive window reaching a key from every query
        if self._window_size <= 0 or any(q - self._window_size >= k for q, k in zip(self.q_seqinfo, self.k_seqinfo)):
            raise RuntimeError("No keys are attended")

    def block(self, nq, nk):
        return _causal(nq, nk, False, self._window_size)


@dataclass
class BlockDiagonalCausalLocalAttentionFromBottomRightMask(BlockDiagonalCausalFromBottomRightMask):  # line 1916
    _window_size: int = 0

    def __post_init__(self):
        super().__post_init__()
        if self._window_size <= 0:
            raise ValueError("Expected `window_size > 0`")

    def block(self, nq, nk):
        return _causal(nq, nk, True, self._window_size)


STANDIN = [LowerTriangularMask, LocalAttentionFromBottomRightMask, LowerTriangularFromBottomRightMask,
           LowerTriangularFromBottomRightLocalAttentionMask, BlockDiagonalMask, BlockDiagonalCausalMask,
           BlockDiagonalCausalFromBottomRightMask, BlockDiagonalCausalLocalAttentionMask, BlockDiagonalCausalLocalAttentionFromBottomRightMask]


def standin_keep(bias, nq, nk) -> torch.Tensor:
    return torch.ones(nq, nk, dtype=torch.bool) if bias is None else torch.tensor(bias.keep(nq, nk))


def real_keep(bias, nq, nk) -> torch.Tensor:
    return torch.ones(nq, nk, dtype=torch.bool) if bias is None else bias.materialize((nq, nk)) == 0


def run_xformers(code: str, q, k, v, monkeypatch, real: bool):
    """Run the printed call with xformers.ops.memory_efficient_attention computing attention from the bias's cells
    (the GPU kernel is not here); returns the output and the (Lq, Lk) cells the bias keeps."""
    seen = {}
    if real:
        attn_bias = pytest.importorskip("xformers.ops.fmha.attn_bias", reason="xformers is not installed")
        keep_of = real_keep
    else:
        attn_bias = types.ModuleType("xformers.ops.fmha.attn_bias")
        for cls in STANDIN:
            setattr(attn_bias, cls.__name__, cls)
        keep_of = standin_keep

    def memory_efficient_attention(query, key, value, attn_bias=None, p=0.0, scale=None, *, op=None, output_dtype=None):
        # the signature of xformers 0.0.35's xformers/ops/fmha/__init__.py:199; q, k, v: (B, M, H, K)
        keep = keep_of(attn_bias, query.shape[1], key.shape[1])
        seen["keep"] = keep
        scores = torch.einsum("bqhd,bkhd->bhqk", query, key) / query.shape[-1] ** 0.5
        weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0)
        return torch.einsum("bhqk,bkhd->bqhd", weights, value)

    package, ops, fmha = (types.ModuleType(name) for name in ("xformers", "xformers.ops", "xformers.ops.fmha"))
    ops.memory_efficient_attention, ops.fmha, fmha.attn_bias, package.ops = memory_efficient_attention, fmha, attn_bias, ops
    for name, module in (("xformers", package), ("xformers.ops", ops), ("xformers.ops.fmha", fmha), ("xformers.ops.fmha.attn_bias", attn_bias)):
        monkeypatch.setitem(sys.modules, name, module)
    scope = {"q": q, "k": k, "v": v}
    exec(code, scope)  # as printed
    return scope["out"], seen["keep"]


XFORMERS = [  # (flags, the bias it must print, keep(b, q, kv) on absolute positions, query and key positions, padding, packed)
    (["document(sizes=[3,5]) & window(2)"], "BlockDiagonalCausalMask.from_seqlens([3, 5]).make_local_attention(2)",
     lambda b, q, kv: (q < 3) == (kv < 3) and q - 2 < kv <= q, (0, 8), (0, 8), None, True),
    (["window(3)", "--len", 6], "LowerTriangularFromBottomRightMask().make_local_attention(3)",
     lambda b, q, kv: q - 3 < kv <= q, (0, 6), (0, 6), None, False),
    (["window(3)", "--len", 2, "--offset", 4], "LowerTriangularFromBottomRightMask().make_local_attention(3)",
     lambda b, q, kv: q - 3 < kv <= q, (4, 6), (0, 6), None, False),
    (["causal", "--len", 4, "--kv-len", 6, "--align", "top-left"], "LowerTriangularMask()",  # was refused
     lambda b, q, kv: kv <= q, (0, 4), (0, 6), None, False),
    (["window(3)", "--len", 4, "--kv-len", 6, "--align", "top-left"], "BlockDiagonalMask.from_seqlens([4], [6]).make_local_attention(3)",
     lambda b, q, kv: q - 3 < kv <= q, (0, 4), (0, 6), None, True),
    (["window(3)", "--len", 1, "--offset", 5, "--ids", "0,0,5,6,7,8;1,2,3,4,5,6"],  # was refused
     "BlockDiagonalCausalFromBottomRightMask.from_seqlens([1, 1], [4, 6]).make_local_attention_from_bottomright(3)",
     lambda b, q, kv: q - 3 < kv <= q, (5, 6), (0, 6), "0,0,5,6,7,8;1,2,3,4,5,6", True),
    (["causal", "--len", 1, "--offset", 5, "--ids", "0,0,5,6,7,8"],  # printed LowerTriangularFromBottomRightMask(): the pads were seen
     "BlockDiagonalMask.from_seqlens([1], [4])", lambda b, q, kv: kv <= q, (5, 6), (0, 6), "0,0,5,6,7,8", True),
    (["causal", "--len", 4, "--lengths", "4,2", "--pad", "left"], "BlockDiagonalCausalMask.from_seqlens([4, 2])",
     lambda b, q, kv: kv <= q, (0, 4), (0, 4), "1,1,1,1;0,0,1,1", True),
    (["segment(sizes=[2,3])"], "BlockDiagonalMask.from_seqlens([2, 3])", lambda b, q, kv: (q < 2) == (kv < 2), (0, 5), (0, 5), None, True),
    (["tril(2)", "--len", 5], "LocalAttentionFromBottomRightMask(window_left=5, window_right=2)",
     lambda b, q, kv: kv <= q + 2, (0, 5), (0, 5), None, False),
    (["full", "--len", 3], "attn_bias=None", lambda b, q, kv: True, (0, 3), (0, 3), None, False),
]


@pytest.mark.parametrize("real", [False, True], ids=["standin", "xformers"])
@pytest.mark.parametrize("flags, bias, keep, q_range, k_range, ids, packed", XFORMERS, ids=[" ".join(map(str, c[0])) for c in XFORMERS])
def test_the_printed_xformers_call_runs_and_is_the_mask(monkeypatch, real, flags, bias, keep, q_range, k_range, ids, packed):
    code = printed(*flags, "--for", "xformers")
    assert bias in code
    valid = None if ids is None else pad_rows(ids)
    want = packed_reference(keep, q_range, k_range, valid, packed)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(want.shape[0], want.shape[1], 2, 4, generator=g)
    k, v = (torch.randn(want.shape[0], want.shape[2], 2, 4, generator=g) for _ in range(2))
    out, cells = run_xformers(code, q, k, v, monkeypatch, real)
    assert torch.equal(cells.expand_as(want), want)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / 2
    expected = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores.masked_fill(~want[:, None], float("-inf")), -1).nan_to_num(0.0), v)
    assert torch.allclose(out, expected, atol=1e-6)


def test_a_wrong_keyword_raises_in_the_standin_as_in_xformers(monkeypatch):
    """The stand-in is strict: what issue 28.2 found printed (window_size= on from_seqlens) fails here too."""
    q = k = v = torch.zeros(1, 8, 1, 4)
    with pytest.raises(TypeError):
        run_xformers("import xformers.ops as xops\nfrom xformers.ops.fmha.attn_bias import BlockDiagonalCausalLocalAttentionMask\n"
                     "out = xops.memory_efficient_attention(q, k, v, attn_bias=BlockDiagonalCausalLocalAttentionMask.from_seqlens([3, 5], window_size=2))",
                     q, k, v, monkeypatch, real=False)
    with pytest.raises(TypeError):
        run_xformers("from xformers.ops.fmha.attn_bias import LowerTriangularFromBottomRightLocalAttentionMask\n"
                     "out = LowerTriangularFromBottomRightLocalAttentionMask(window_size=3)", q, k, v, monkeypatch, real=False)


# --- flash_attn, flashinfer, paddle's flashmask, MagiAttention: run against their signatures ---------------------
# Each signature is copied from the release the format names (Format.version), file and line beside it. The printed
# code runs with these stubs in place of the package: a wrong keyword, a missing argument or a wrong import fails as
# it would there. Where the package imports here, the stub's parameters are checked against the real function too.

SIGNATURES = {
    # flash_attn 2.8.3.post1, flash_attn/flash_attn_interface.py:1370
    ("flash_attn", "flash_attn_varlen_func"): "def f(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0, "
    "softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None, deterministic=False, return_attn_probs=False, "
    "block_table=None): pass",
    # flash_attn 2.8.3.post1, flash_attn/flash_attn_interface.py:1464
    ("flash_attn", "flash_attn_with_kvcache"): "def f(q, k_cache, v_cache, k=None, v=None, rotary_cos=None, rotary_sin=None, cache_seqlens=None, "
    "cache_batch_idx=None, cache_leftpad=None, block_table=None, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, "
    "rotary_interleaved=True, alibi_slopes=None, num_splits=0, return_softmax_lse=False): pass",
    # flashinfer 0.6.17, flashinfer/prefill.py:3040 (BatchPrefillWithRaggedKVCacheWrapper.__init__)
    ("flashinfer", "BatchPrefillWithRaggedKVCacheWrapper.__init__"): "def f(self, float_workspace_buffer, kv_layout='NHD', use_cuda_graph=False, "
    "qo_indptr_buf=None, kv_indptr_buf=None, custom_mask_buf=None, mask_indptr_buf=None, backend='auto', jit_args=None, jit_kwargs=None): pass",
    # flashinfer 0.6.17, flashinfer/prefill.py:3198 (.plan)
    ("flashinfer", "BatchPrefillWithRaggedKVCacheWrapper.plan"): "def f(self, qo_indptr, kv_indptr, num_qo_heads, num_kv_heads, head_dim_qk, "
    "head_dim_vo=None, custom_mask=None, packed_custom_mask=None, causal=False, pos_encoding_mode='NONE', use_fp16_qk_reduction=False, "
    "window_left=-1, logits_soft_cap=None, sm_scale=None, rope_scale=None, rope_theta=None, q_data_type='float16', kv_data_type=None, "
    "o_data_type=None, non_blocking=True, prefix_len_ptr=None, token_pos_in_items_ptr=None, token_pos_in_items_len=0, max_item_len_ptr=None, "
    "fixed_split_size=None, disable_split_kv=False, seq_lens=None, seq_lens_q=None, max_token_per_sequence=None, max_sequence_kv=None, "
    "v_indptr=None, o_indptr=None): pass",
    # flashinfer 0.6.17, flashinfer/prefill.py:3738 (.run)
    ("flashinfer", "BatchPrefillWithRaggedKVCacheWrapper.run"): "def f(self, q, k, v, *args, q_scale=None, k_scale=None, v_scale=None, "
    "o_scale=None, out=None, lse=None, return_lse=False, enable_pdl=None, kv_cache_sf=None): pass",
    # paddlepaddle 3.3.1, python/paddle/nn/functional/flash_attention.py:1228
    ("paddle.nn.functional.flash_attention", "flashmask_attention"): "def f(query, key, value, startend_row_indices=None, *, dropout=0.0, "
    "causal=False, window_size=None, return_softmax_lse=False, return_seed_offset=False, fixed_seed_offset=None, rng_name='', "
    "training=True, name=None, softmax_scale=None, block_mask=None): pass",
    # paddlepaddle 3.3.1, python/paddle/tensor/creation.py:1073
    ("paddle", "to_tensor"): "def f(data, dtype=None, place=None, stop_gradient=True): pass",
    # MagiAttention 1.1.1, magi_attention/functional/flex_flash_attn.py:1059
    ("magi_attention.functional", "flex_flash_attn_func"): "def f(q, k, v, q_ranges=None, k_ranges=None, attn_type_map=None, *, "
    "index_attn_indices=None, q_block_size=1, k_block_size=1, sink=None, sink_layout='sh', softmax_scale=None, softcap=0.0, "
    "deterministic=False, sm_margin=0, disable_fwd_atomic_reduction=False, disable_bwd_dkv_atomic_reduction=False, ref_block_size=None, "
    "max_seqlen_q=None, auto_range_merge=False, swap_ab=False, pack_gqa=False, cat_gqa=False, sparse_load=False, index_attn=False, "
    "swap_bwd_qk_loop=False, return_max_logits=False): pass",
}


def signature_of(module: str, name: str):
    import inspect

    scope = {}
    exec(SIGNATURES[module, name], scope)
    return inspect.signature(scope["f"])


def stub(module: str, name: str, calls: list, result=None):
    """A function that binds its arguments to the library's signature (TypeError as there), records them, returns result."""
    signature = signature_of(module, name)

    def call(*args, **kwargs):
        calls.append((name, signature.bind(*args, **kwargs).arguments))
        return result() if callable(result) else result

    return call


def standin_packages(calls: list) -> dict:
    """Modules named as the printed code imports them, each function a stub of its release's signature."""
    out = {}

    def module(name, **attrs):
        found = out.setdefault(name, types.ModuleType(name))
        for key, value in attrs.items():
            setattr(found, key, value)
        return found

    module("flash_attn", **{n: stub("flash_attn", n, calls, "out") for n in ("flash_attn_varlen_func", "flash_attn_with_kvcache")})

    class BatchPrefillWithRaggedKVCacheWrapper:
        def __init__(self, *args, **kwargs):
            stub("flashinfer", "BatchPrefillWithRaggedKVCacheWrapper.__init__", calls)(self, *args, **kwargs)

        def plan(self, *args, **kwargs):
            stub("flashinfer", "BatchPrefillWithRaggedKVCacheWrapper.plan", calls)(self, *args, **kwargs)

        def run(self, *args, **kwargs):
            return stub("flashinfer", "BatchPrefillWithRaggedKVCacheWrapper.run", calls, "out")(self, *args, **kwargs)

    module("flashinfer", BatchPrefillWithRaggedKVCacheWrapper=BatchPrefillWithRaggedKVCacheWrapper)
    flash = module("paddle.nn.functional.flash_attention", flashmask_attention=stub("paddle.nn.functional.flash_attention", "flashmask_attention", calls, "out"))
    functional = module("paddle.nn.functional", flash_attention=flash)
    module("paddle", to_tensor=stub("paddle", "to_tensor", calls, "paddle tensor"), nn=module("paddle.nn", functional=functional))
    module("magi_attention", functional=module("magi_attention.functional",
                                               flex_flash_attn_func=stub("magi_attention.functional", "flex_flash_attn_func", calls, ("out", "meta"))))
    return out


@pytest.mark.parametrize("module, name", sorted(SIGNATURES))
def test_a_signature_copied_here_is_the_installed_one(module, name):
    """Where the library installs, the copy above must be its signature (else the copy is all there is)."""
    import importlib.util
    import inspect

    found = importlib.import_module(module) if importlib.util.find_spec(module.split(".")[0]) else None
    if found is None:
        pytest.skip(f"{module.split('.')[0]} is not installed: checked against the signature copied from its source")
    for part in name.split("."):
        found = getattr(found, part)
    assert list(inspect.signature(found).parameters) == list(signature_of(module, name).parameters)


GPU_CALLS = [  # (format, flags, the functions the call must reach, in order)
    ("flash-attn", ["document(sizes=[3,5]) & window(2)"], ["flash_attn_varlen_func"]),
    ("flash-attn", ["window(3)", "--len", 1, "--offset", 5, "--ids", "0,0,5,6,7,8;1,2,3,4,5,6"], ["flash_attn_with_kvcache"]),
    ("flashinfer", ["document(sizes=[3,5]) & window(2)"], ["BatchPrefillWithRaggedKVCacheWrapper.__init__", "BatchPrefillWithRaggedKVCacheWrapper.plan",
                                                         "BatchPrefillWithRaggedKVCacheWrapper.run"]),
    ("flashinfer", ["causal | blocks(-1,-1,0,0,0,-1)"], ["BatchPrefillWithRaggedKVCacheWrapper.__init__", "BatchPrefillWithRaggedKVCacheWrapper.plan",
                                                       "BatchPrefillWithRaggedKVCacheWrapper.run"]),
    ("flashmask", ["causal | blocks(-1,-1,0,0,0,-1)"], ["to_tensor", "flashmask_attention"]),
    ("flashmask", ["document(sizes=[3,5])"], ["to_tensor", "flashmask_attention"]),
    ("magi", ["document(sizes=[3,5]) & window(2)"], ["flex_flash_attn_func"]),
    ("magi", ["window(3)", "--len", 4, "--offset", 5], ["flex_flash_attn_func"]),
]


@pytest.mark.parametrize("fmt, flags, reached", GPU_CALLS, ids=[f"{c[0]} {' '.join(map(str, c[1]))}" for c in GPU_CALLS])
def test_the_printed_gpu_call_binds_to_its_library_signature(tmp_path, monkeypatch, fmt, flags, reached):
    """issue 28.5: the printed call run as printed with stubs of its release's functions (no GPU here: "cuda" is read
    as "cpu"); every argument it passes must bind, and every tensor handed over is the saved one."""
    calls = []
    for name, module in standin_packages(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    path = tmp_path / "m.pt"
    code = printed(*flags, "--for", fmt, "--save", path).replace('"cuda"', '"cpu"')
    scope = {"q": "q", "k": "k", "v": "v", "k_cache": "k_cache", "v_cache": "v_cache", "num_qo_heads": 2, "num_kv_heads": 1, "head_dim": 8}
    exec(code, scope)  # as printed
    assert [name for name, _ in calls] == reached
    saved = torch.load(path, weights_only=True)
    for _, arguments in calls:
        for key, value in arguments.items():
            if isinstance(value, torch.Tensor) and key in saved:
                assert torch.equal(value, saved[key]), key
    assert scope["out"] == "out"
