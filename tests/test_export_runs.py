"""Every format's printed call, run as printed (issue 28.5): the torch formats executed here; for the GPU libraries, the
real package where it imports, else a stand-in whose classes and functions take exactly the arguments the library's
source gives them (cited beside each), so that a wrong keyword raises TypeError here as it does there."""

from __future__ import annotations

import re
import sys
import types
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from maskcli.commands import app

runner = CliRunner()


def printed(*args) -> str:
    result = runner.invoke(app, ["export", *map(str, args)])
    assert result.exit_code == 0, result.output
    return result.stdout


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

    def keep(self, nq, nk):  # materialize, line 235: triu(shift - window_left), tril(shift + window_right)
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
        assert (nq, nk) == (sum(self.q_seqinfo), sum(self.k_seqinfo))  # materialize's asserts, line 803-810
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
    def __post_init__(self):  # line 1048: every block needs num_keys >= num_queries
        if any(k < q for q, k in zip(self.q_seqinfo, self.k_seqinfo)):
            raise ValueError("Expected `num_keys >= num_queries`")

    def block(self, nq, nk):
        return _causal(nq, nk, True)


@dataclass
class BlockDiagonalCausalLocalAttentionMask(BlockDiagonalCausalMask):  # line 1852: _window_size: int = 0
    _window_size: int = 0

    def __post_init__(self):  # line 1877: a positive window reaching a key from every query
        if self._window_size <= 0 or any(q - self._window_size >= k for q, k in zip(self.q_seqinfo, self.k_seqinfo)):
            raise RuntimeError("No keys are attended")

    def block(self, nq, nk):
        return _causal(nq, nk, False, self._window_size)


@dataclass
class BlockDiagonalCausalLocalAttentionFromBottomRightMask(BlockDiagonalCausalFromBottomRightMask):  # line 1915
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


def pad_rows(ids: str) -> list[list[bool]]:
    return [[int(x) != 0 for x in row.split(",")] for row in ids.split(";")]


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


# --- Hugging Face: a tiny random-weight Llama, run as printed ----------------------------------------


def tiny_model(family: str):
    """A random-weight model built from its config (no download): Llama (rotary positions, which only differences of
    positions reach) or GPT-2 (learned absolute positions, which position_ids change)."""
    transformers = pytest.importorskip("transformers", reason="the hf extra (transformers) is not installed")
    torch.manual_seed(0)
    if family == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(vocab_size=32, n_embd=16, n_layer=2, n_head=2, n_positions=64)).eval()
    config = transformers.LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).eval()


HF = [  # (flags, keep(b, q, kv) of the new queries on absolute positions, offset, total length, ids)
    (["window(3)", "--len", 2, "--offset", 5], lambda b, q, kv: q - 3 < kv <= q, 5, 7, None),
    (["causal", "--len", 1, "--offset", 5, "--ids", "0,0,5,6,7,8;1,2,3,4,5,6"], lambda b, q, kv: kv <= q, 5, 6, "0,0,5,6,7,8;1,2,3,4,5,6"),
    (["document(sizes=[2,3])"], lambda b, q, kv: (q < 2) == (kv < 2) and kv <= q, 0, 5, None),
    (["causal", "--len", 4, "--lengths", "4,2", "--pad", "left"], lambda b, q, kv: kv <= q, 0, 4, "1,1,1,1;0,0,1,1"),
]


def rotary_positions(valid: list[list[bool]], documents: list[int] | None) -> torch.Tensor:
    """Each token's position, by a loop: its place in its document, or the real tokens before it in its row (0 at a
    pad), as generate() makes them (transformers 5.24, generation/utils.py:919-921)."""
    out = []
    for row in valid:
        at, seen, label = [], 0, None
        for p, real in enumerate(row):
            if documents is not None:
                seen = 0 if documents[p] != label else seen
                label = documents[p]
            at.append(seen if real else 0)
            seen += real
        out.append(at)
    return torch.tensor(out)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
@pytest.mark.parametrize("flags, keep, offset, total, ids", HF, ids=[" ".join(map(str, c[0])) for c in HF])
def test_the_printed_hf_call_runs_on_a_tiny_model(tmp_path, family, flags, keep, offset, total, ids):
    """issue 28.4: behind a cache the call prints the cache its 4-D mask counts (it printed none: a size error). The
    reference runs the whole sequence at once with a 4-D mask and positions written by loops: the cached rows causal
    (what the fill call's model mask is) and the padding masked, the new rows by the rule; transformers 5.24 uses a
    4-D mask as given (masking_utils.py:817-819, _preprocess_mask_arguments returns it as-is). Left-padded rows get
    the positions generate() gives them (they started late)."""
    model = tiny_model(family)
    path = tmp_path / "hf.pt"
    code = printed(*flags, "--for", "hf", "--save", path)
    valid = [[True] * total] if ids is None else pad_rows(ids)
    batch = len(valid)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 32, (batch, total), generator=g)
    scope = {"model": model, "input_ids": tokens[:, offset:], "past_ids": tokens[:, :offset]}
    with torch.no_grad():
        exec(code, scope)  # as printed
        positions = rotary_positions(valid, [0, 0, 1, 1, 1] if "document" in flags[0] else None)
        cells = torch.tensor([[[[valid[b][kv] and (keep(b, q, kv) if q >= offset else kv <= q) for kv in range(total)] for q in range(total)]]
                              for b in range(batch)])
        whole = model(tokens, attention_mask=torch.where(cells, 0.0, torch.finfo(torch.float32).min), position_ids=positions)
    assert torch.allclose(scope["out"].logits, whole.logits[:, offset:], atol=1e-5)


def test_an_hf_mask_on_keys_a_model_does_not_hold_is_refused():
    result = runner.invoke(app, ["export", "causal", "--len", "2", "--kv-len", "5", "--for", "hf"])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("maskcli: error: a Hugging Face model's keys are the tokens before its queries and the queries themselves "
                                     "(0-1), and this mask's are keys 0-4: drop --kv-start and --kv-len, or use --for sdpa")


# --- which release each call is written for --------------------------------------------------------


def test_each_call_names_the_release_it_is_written_for_and_the_docs_list_the_same():
    """issue 28.3: the output and docs/export.md's table say, per format, which library version the call is for."""
    from pathlib import Path

    from maskcli.formats.registry import formats

    table = {}
    page = (Path(__file__).parent.parent / "docs" / "export.md").read_text()
    for names, version in re.findall(r"^\| ([a-z, -]+) \| ([A-Za-z_]+ [\d.]+)", page, re.M):
        table.update({name.strip(): version for name in names.split(",")})
    for fmt in formats().values():
        assert table[fmt.name] == fmt.version
        assert printed("document(sizes=[3,5])", "--for", fmt.name).splitlines()[1] == f"# written for {fmt.version}"


def test_magi_call_has_no_max_seqlen_k():
    """MagiAttention 1.1.1's flex_flash_attn_func has no max_seqlen_k (functional/flex_flash_attn.py:1059-1088); 1.0.4
    dropped both max_seqlen arguments, 1.1.0 brought back an optional max_seqlen_q: the call passes neither."""
    code = printed("document(sizes=[3,5]) & window(2)", "--for", "magi")
    assert "out, meta = flex_flash_attn_func(q, k, v, q_ranges=t['q_ranges'], k_ranges=t['k_ranges'], attn_type_map=attn_type_map)" in code
    assert "max_seqlen" not in code


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
    import importlib
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


# --- torch formats: sdpa, mha, flex executed here ---------------------------------------------------------------

TORCH = [  # (flags, keep(b, q, kv) on absolute positions, query positions, key positions, real tokens per batch row)
    (["causal", "--len", 5], lambda b, q, kv: kv <= q, (0, 5), (0, 5), None),
    (["causal", "--len", 2, "--offset", 3], lambda b, q, kv: kv <= q, (3, 5), (0, 5), None),
    (["causal", "--len", 3, "--offset", 2, "--kv-start", 1], lambda b, q, kv: kv <= q, (2, 5), (1, 5), None),
    (["window(2)", "--len", 4, "--lengths", "4,2", "--pad", "left"], lambda b, q, kv: q - 2 < kv <= q, (0, 4), (0, 4), "1,1,1,1;0,0,1,1"),
    (["causal", "--len", 4, "--ids", "1,2,3,0;1,2,0,0"], lambda b, q, kv: kv <= q, (0, 4), (0, 4), "1,2,3,0;1,2,0,0"),
    (["document(sizes=[2,3])"], lambda b, q, kv: (q < 2) == (kv < 2) and kv <= q, (0, 5), (0, 5), None),
]


def torch_reference(keep, q_range, k_range, ids) -> torch.Tensor:
    valid = None if ids is None else pad_rows(ids)
    batch = 1 if valid is None else len(valid)
    return torch.tensor([[[[(valid is None or valid[b][kv]) and keep(b, q, kv) for kv in range(*k_range)] for q in range(*q_range)]]
                         for b in range(batch)])


def attention(q, k, v, keep):
    scores = (q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~keep, float("-inf"))
    return torch.softmax(scores, -1).nan_to_num(0.0) @ v


# flex_attention on the CPU takes about a second a call: it runs the cases the other tests leave (behind a cache that
# dropped its first keys, ids padding); test_command_export runs it on left padding, test_formats on packed documents
RUNS = [(fmt, *case) for case in TORCH for fmt in ("sdpa", "mha", "flex") if fmt != "flex" or {"--kv-start", "--ids"} & set(case[0])]


@pytest.mark.parametrize("fmt, flags, keep, q_range, k_range, ids", RUNS, ids=[f"{c[0]} {' '.join(map(str, c[1]))}" for c in RUNS])
def test_the_printed_torch_call_runs_and_is_the_mask(tmp_path, fmt, flags, keep, q_range, k_range, ids):
    """The printed call executed as printed (with --save where it reads tensors), its output against attention under a
    mask written by a loop over absolute positions (rows that see no key left out: NaN or 0 by backend)."""
    want = torch_reference(keep, q_range, k_range, ids)
    batch, _, lq, lk = want.shape
    path = tmp_path / "m.pt"
    result = runner.invoke(app, ["export", *map(str, flags), "--for", fmt, "--save", str(path)])
    if result.exit_code == 2 and "needs no tensors" in result.stderr:
        result = runner.invoke(app, ["export", *map(str, flags), "--for", fmt])
    assert result.exit_code == 0, result.output
    g = torch.Generator().manual_seed(0)
    seen = want.any(-1)  # (B, 1, Lq)
    if fmt == "mha":
        torch.manual_seed(0)
        query, key = torch.randn(batch, lq, 8, generator=g), torch.randn(batch, lk, 8, generator=g)
        scope = {"embed_dim": 8, "query": query, "key": key, "value": key}
        exec(result.stdout, scope)
        with torch.no_grad():  # the same module, given the loop's mask as one (B * heads, Lq, Lk) block mask, True = masked
            expected, _ = scope["mha"](query, key, key, attn_mask=~want[:, 0])
        assert torch.allclose(scope["out"][seen[:, 0]], expected[seen[:, 0]], atol=1e-5)
        return
    q = torch.randn(batch, 1, lq, 8, generator=g)
    k, v = (torch.randn(batch, 1, lk, 8, generator=g) for _ in range(2))
    scope = {"q": q, "k": k, "v": v}
    exec(result.stdout, scope)  # as printed
    assert torch.allclose(scope["out"][seen], attention(q, k, v, want)[seen], atol=1e-5)
