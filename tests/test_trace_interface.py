"""maskcli.trace.interface: Hugging Face's AttentionInterface calls seen while tracing, on tiny random-weight models
built from config classes (no download); each mask against a double loop over positions written here."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F

os.environ["HF_HUB_OFFLINE"] = "1"
transformers = pytest.importorskip("transformers", reason="the hf extra (transformers)")

import maskcli  # noqa: E402
from maskcli.hf import families, quiet  # noqa: E402
from test_trace_flash import flash_attn  # noqa: E402,F401 (the stand-in flash_attn package, a fixture)


def model(family: str, attn: str, window: int | None = None, heads: tuple[int, int] | None = None):
    config = families.tiny(families.load(family), window=window, name=family)
    if heads is not None:  # (query heads, key/value heads)
        config.num_attention_heads, config.num_key_value_heads = heads
    torch.manual_seed(0)
    with quiet():
        return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=attn).eval()


def documents_keep(labels: list[int], window: int | None = None) -> np.ndarray:
    """Same document, causal, and (with a window) at most window - 1 keys back: a double loop."""
    n = len(labels)
    keep = np.zeros((n, n), dtype=bool)
    for q in range(n):
        for k in range(n):
            keep[q, k] = labels[q] == labels[k] and k <= q and (window is None or q - k < window)
    return keep


def test_mistral_under_sdpa_its_calls_carry_layer_and_sliding_window_and_are_not_recorded_twice():
    mistral = model("mistral", "sdpa", window=3)
    ids = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    with torch.no_grad():
        untraced = mistral(ids, attention_mask=mask).logits
        with maskcli.trace() as t:
            traced = mistral(ids, attention_mask=mask).logits
    assert torch.equal(untraced, traced)
    assert [c.api for c in t.calls] == ["sdpa", "sdpa"]  # the interface calls are these: one record a layer
    for layer, call in enumerate(t.calls):
        hf = call.details["hf"]
        assert call.where == f"model.layers.{layer}.self_attn"
        assert (hf["attn_implementation"], hf["layer_idx"], hf["sliding_window"], hf["attention_mask"]) == ("sdpa", layer, 3, [2, 1, 6, 6])
        keep = call.keep()
        for b in range(2):
            for q in range(6):
                for k in range(6):
                    assert keep[b, 0, q, k] == (k <= q and q - k < 3 and bool(mask[b, k])), (b, q, k)


def test_a_packed_batch_with_position_ids_and_no_attention_mask():
    """HF reads packed documents off position_ids only without a cache (a training setup): traced, both show."""
    mistral = model("mistral", "sdpa", window=3)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    labels = [0, 0, 0, 0, 1, 1, 2, 2, 2]
    ids = torch.arange(1, 10)[None]
    with torch.no_grad(), maskcli.trace() as t:
        mistral(ids, position_ids=positions, use_cache=False)
        mistral(ids, position_ids=positions)  # with the cache generate would make: the documents are not read
    packed, cached = t.calls[:2], t.calls[2:]
    for call in t.calls:
        assert call.api == "sdpa" and call.details["hf"]["position_ids"] == positions.tolist()
    assert all(np.array_equal(call.keep()[0, 0], documents_keep(labels, window=3)) for call in packed)
    assert all(np.array_equal(call.keep()[0, 0], documents_keep([0] * 9, window=3)) for call in cached)
    with torch.no_grad(), maskcli.trace(apis=("hf",)) as alone:  # HF's view alone: the mask it handed SDPA, the same
        mistral(ids, position_ids=positions, use_cache=False)
    assert [c.api for c in alone.calls] == ["hf", "hf"] and alone.calls[0].details["implicit"] == "the attention_mask given"
    assert all(np.array_equal(c.keep()[0, 0], documents_keep(labels, window=3)) for c in alone.calls)


def attend_documents(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A registered attention function of its own: ignores attention_mask, attends within the documents that
    cu_seq_lens_q/k give, causal, one head and one document at a time (2-D scores: no kernel maskcli sees)."""
    cu = kwargs["cu_seq_lens_q"].tolist()
    groups = query.shape[1] // key.shape[1]
    out = torch.zeros_like(query)
    for h in range(query.shape[1]):
        for start, end in zip(cu[:-1], cu[1:]):
            q, k, v = query[0, h, start:end], key[0, h // groups, start:end], value[0, h // groups, start:end]
            scores = (q @ k.T) * scaling
            scores = scores.masked_fill(torch.ones_like(scores, dtype=torch.bool).triu(1), float("-inf"))
            out[0, h, start:end] = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).contiguous(), None


def test_a_registered_attention_function_is_recorded_with_the_mask_its_cu_seq_lens_mean():
    from transformers import AttentionInterface

    AttentionInterface.register("maskcli_test_documents", attend_documents)
    try:
        llama = model("llama", "maskcli_test_documents")
        cu = torch.tensor([0, 3, 7, 9], dtype=torch.int32)
        packed = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
        ids = torch.arange(1, 10)[None]
        with torch.no_grad():
            untraced = llama(ids, **packed).logits
            with maskcli.trace() as t:
                traced = llama(ids, **packed).logits
    finally:
        AttentionInterface._global_mapping.pop("maskcli_test_documents", None)
    assert torch.equal(untraced, traced)
    assert [c.api for c in t.calls] == ["hf", "hf"]
    want = documents_keep([0, 0, 0, 1, 1, 1, 1, 2, 2])
    for layer, call in enumerate(t.calls):
        hf = call.details["hf"]
        assert call.where == f"model.layers.{layer}.self_attn" and hf["layer_idx"] == layer
        assert hf["attn_implementation"] == "maskcli_test_documents" and hf["cu_seq_lens_q"] == [0, 3, 7, 9]
        assert call.details["implicit"] == "cu_seq_lens_q/k" and call.shape == (1, 2, 9, 9)
        assert np.array_equal(call.keep()[0, 1], want)
    (group,) = t.groups()
    assert group.name == "document(0,0,0,1,1,1,1,2,2)"


def test_a_two_d_padding_mask_is_read_as_hf_flash_path_unpads_it():
    """The mask HF's flash path applies for a 2-D padding mask: each row's real queries and keys one sequence,
    bottom-right aligned, a window of W keys; a double loop over each row's real positions."""
    from maskcli.trace.interface import read

    valid = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1], [1, 0, 1, 1, 0, 1, 1]], dtype=torch.bool)

    class Module:
        is_causal = True
        layer_idx = 4

    for q_len in (7, 3, 1):
        q = torch.zeros(3, 2, q_len, 4)
        k = torch.zeros(3, 2, 7, 4)
        seen = read((Module(), q, k, k, valid), {"sliding_window": 3, "_hf": {}})
        got = seen.intervals
        for b in range(3):
            keys = [j for j in range(7) if valid[b, j]]
            rows = valid[b] if q_len == 7 else torch.ones(1, dtype=torch.bool) if q_len == 1 else valid[b, -q_len:]
            queries = [i for i in range(q_len) if rows[i]]
            for i in range(q_len):
                want = set()
                if i in queries:
                    r = queries.index(i) + len(keys) - len(queries)  # bottom-right among the real ones
                    want = {keys[j] for j in range(len(keys)) if r - 3 < j <= r}
                cells = {j for s, e in got.row(b, i) for j in range(s, e)}
                assert cells == want, (q_len, b, i, cells, want)


def test_after_the_trace_the_interface_is_hugging_faces_own_again():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    before = (AttentionInterface.__dict__.get("__getitem__"), AttentionInterface.__dict__.get("get_interface"))
    with maskcli.trace():
        assert getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "_maskcli_interface", ())
    assert (AttentionInterface.__dict__.get("__getitem__"), AttentionInterface.__dict__.get("get_interface")) == before
    assert not getattr(ALL_ATTENTION_FUNCTIONS["sdpa"], "_maskcli_interface", ())


def test_position_ids_restarting_are_documents_as_hfs_flash_path_reads_them_and_a_window_cuts_each():
    from maskcli.trace.interface import read

    class Module:
        is_causal = True

    q = torch.zeros(1, 2, 9, 4)
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    seen = read((Module(), q, q, q, None), {"position_ids": positions, "sliding_window": 2, "_hf": {}})
    assert seen.details["implicit"] == "position_ids restarting at their lowest value"
    got = np.stack([seen.intervals.dense(0, 0, 9)])[0]
    assert np.array_equal(got, documents_keep([0, 0, 0, 0, 1, 1, 2, 2, 2], window=2))
    two_rows = torch.zeros(2, 2, 9, 4)  # more than one batch row: HF's flash path does not read them as packed
    seen = read((Module(), two_rows, two_rows, two_rows, None), {"position_ids": positions.expand(2, -1), "is_causal": True, "_hf": {}})
    assert seen.details["implicit"] == "is_causal and sliding_window"
    assert np.array_equal(seen.intervals.dense(0, 0, 9), documents_keep([0] * 9))


def test_a_block_mask_handed_to_the_interface_is_read_block_by_block():
    """HF's flex path compiles flex_attention, where no capture runs: the interface call is then the record, its
    BlockMask read as the kernel applies it (against FlexAttention's own create_mask)."""
    from torch.nn.attention.flex_attention import create_block_mask, create_mask

    from maskcli.trace.interface import read

    lengths = torch.tensor([5, 3])

    def padded_causal(b, h, q, kv):
        return (kv <= q) & (kv >= 8 - lengths[b])

    block_mask = create_block_mask(padded_causal, 2, 1, 8, 8, device="cpu", BLOCK_SIZE=4)
    q = torch.zeros(2, 2, 8, 4)
    seen = read((object(), q, q, q, block_mask), {"_hf": {"attn_implementation": "flex_attention"}})
    want = create_mask(padded_causal, 2, 1, 8, 8, device="cpu").numpy()
    for b in range(2):
        assert np.array_equal(seen.intervals.dense(b, 0, 8), want[b, 0])
    assert seen.details["implicit"] == "the BlockMask given"


@pytest.mark.parametrize("attn, kernel", [("sdpa", "sdpa"), ("eager", "softmax")])
def test_generating_with_hf_alone_records_the_masks_the_kernels_apply(attn, kernel):
    """Left padding, a sliding window, two decode steps: the interface's own records (apis hf alone) hold the same
    masks as the kernel calls (apis sdpa, or the eager softmax, alone), call for call."""
    mistral = model("mistral", attn, window=3)
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 0, 1, 1, 1], [1] * 5])
    options = dict(attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    runs = {}
    for apis in (("hf",), (kernel,)):
        with quiet(), torch.no_grad(), maskcli.trace(apis=apis) as t:
            runs[apis[0]] = mistral.generate(ids, **options)
        runs[apis] = t.calls
    assert torch.equal(runs["hf"], runs[kernel])
    hf, kernels = runs[("hf",)], runs[(kernel,)]
    assert [c.api for c in hf] == ["hf"] * 6 and [c.api for c in kernels] == [kernel] * 6
    for ours, theirs in zip(hf, kernels):
        assert (ours.where, ours.step) == (theirs.where, theirs.step) and "hf" not in theirs.details  # (hf left out)
        assert ours.where == f"model.layers.{ours.details['hf']['layer_idx']}.self_attn"
        assert np.array_equal(np.broadcast_to(ours.keep(), ours.shape)[:, 0], np.broadcast_to(theirs.keep(), theirs.shape)[:, 0])


def padded_keep(valid: list[int], q_len: int, window: int | None = None) -> np.ndarray:
    """One batch row's mask from its padding and positions: the queries are the last q_len keys; each sees the real
    keys up to itself (and, with a window, fewer than window positions back): a double loop."""
    k_len = len(valid)
    keep = np.zeros((q_len, k_len), dtype=bool)
    for i in range(q_len):
        q = k_len - q_len + i
        for k in range(k_len):
            keep[i, k] = bool(valid[k]) and k <= q and (window is None or q - k < window)
    return keep


@pytest.mark.parametrize("family, window", [("llama", None), ("mistral", 3)])
def test_gqa_decode_steps_packed_by_hfs_sdpa_are_recorded_as_one_query_of_every_head(family, window):
    """HF's sdpa packs one query's n_rep heads as n_rep query rows of one key/value head (pack_gqa): recorded as the
    model computed it, (B, H, 1, Lk), its one query at the last key; the mask a double loop from padding and positions."""
    gqa = model(family, "sdpa", window=window, heads=(4, 1))
    ids = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]])
    valid = [[0, 0, 1, 1, 1], [1] * 5]
    options = dict(attention_mask=torch.tensor(valid), max_new_tokens=2, min_new_tokens=2, do_sample=False, pad_token_id=0)
    with quiet(), torch.no_grad():
        untraced = gqa.generate(ids, **options)
        with maskcli.trace() as t:
            traced = gqa.generate(ids, **options)
    assert torch.equal(untraced, traced) and len(t.calls) == 4
    for call in t.calls:
        step = call.step
        q_len = 5 if step == 0 else 1
        row_valid = [v + [1] * step for v in valid]  # the tokens generated are real
        if window is not None and step:  # the sliding cache holds the last `window` positions
            row_valid = [v[-window:] for v in row_valid]
        k_len = len(row_valid[0])
        assert call.shape == (2, 4, q_len, k_len) and call.q[:3] == (2, 4, q_len)
        keep = np.broadcast_to(call.keep(), call.shape)
        for b in range(2):
            want = padded_keep(row_valid[b], q_len, window if not step else None)
            for h in range(4):
                assert np.array_equal(keep[b, h], want), (call.index, b, h)
        if step:
            assert call.details["pack_gqa"]["kernel_q"][1:3] == [1, 4] and call.details["pack_gqa"]["num_key_value_groups"] == 4
    want = "window(3)" if window else "causal"
    from maskcli.trace.expect import check

    assert check(t.calls, [("*", want)]) == []


def test_unpacked_heads_puts_packed_row_i_of_key_value_head_j_at_query_head_j_times_n_rep_plus_i():
    """The one unpacking of a packed GQA call's cells (the trace's unpack_gqa and model's hf/run both call it): HF's
    pack_gqa reshapes the query (B, H, 1, D) to (B, H / n_rep, n_rep, D), so row i of key/value head j is head j * n_rep + i."""
    from maskcli.trace.interface import unpacked_heads

    torch.manual_seed(0)
    packed = torch.rand(2, 3, 4, 5) > 0.5  # (B, H_kv, n_rep, Lk): a mask per head, packed as the query was
    got = unpacked_heads(packed, (2, 3, 4, 5))
    assert got.shape == (2, 12, 1, 5)
    for b in range(2):
        for j in range(3):
            for i in range(4):
                assert torch.equal(got[b, j * 4 + i, 0], packed[b, j, i])
    one_row = torch.rand(2, 1, 1, 5) > 0.5  # HF's (B, 1, 1, Lk) mask, broadcast over the packed rows: every head's
    assert torch.equal(unpacked_heads(one_row, (2, 3, 4, 5)), one_row.expand(2, 12, 1, 5))


def drops_everything(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """A registered attention function that ignores what HF asked: no mask, no is_causal (full attention)."""
    return F.scaled_dot_product_attention(query, key, value, scale=scaling).transpose(1, 2), None


def drops_the_window(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Causal, but the sliding_window HF passed is dropped."""
    return F.scaled_dot_product_attention(query, key, value, scale=scaling, is_causal=True).transpose(1, 2), None


def keeps_both(module, query, key, value, attention_mask, scaling=None, dropout=0.0, sliding_window=None, **kwargs):
    """Causal and the window, as HF asked (a bool mask built here)."""
    n = query.shape[2]
    q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = (k <= q) & ((q - k < sliding_window) if sliding_window else True)
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling).transpose(1, 2), None


@pytest.mark.parametrize("function, width, kind, codes", [
    (drops_everything, None, "full", ["hf-not-causal"]),
    (drops_everything, 3, "full", ["hf-not-causal", "hf-not-windowed"]),
    (drops_the_window, 3, "causal", ["hf-not-windowed"]),
    (keeps_both, 3, "window", []),
    (keeps_both, None, "causal", []),
])
def test_a_registered_function_that_drops_is_causal_or_the_window_hf_asked_for_is_said_to(function, width, kind, codes):
    """HF hands the function no mask (no padding) and asks for causal (its module's is_causal) and, for Mistral, a
    sliding window: what the kernel applied (a double loop here) and the findings on what it dropped."""
    name = f"maskcli_test_{function.__name__}"
    transformers.AttentionInterface.register(name, function)
    family = "mistral" if width else "llama"
    config = families.tiny(families.load(family), window=width, name=family)
    torch.manual_seed(0)
    with quiet():
        built = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=name).eval()
    with torch.no_grad(), maskcli.trace() as t:
        built(torch.arange(1, 7)[None])
    assert t.calls and all(call.api == "sdpa" and call.details["hf"]["attention_mask"] is None for call in t.calls)
    want = np.array([[{"full": True, "causal": k <= q, "window": k <= q and q - k < 3}[kind] for k in range(6)] for q in range(6)])
    for call in t.calls:
        assert np.array_equal(np.broadcast_to(call.keep(), call.shape)[0, 0], want)
    (group,) = t.groups()
    said = {f.code: f.message for f in group.findings}
    assert [code for code in said if code.startswith("hf-")] == codes
    if "hf-not-causal" in codes:
        assert said["hf-not-causal"] == ("HF asked for a causal mask (its module's is_causal is True) but the kernel "
                                         "applied full: queries see later keys")
    if "hf-not-windowed" in codes:
        assert said["hf-not-windowed"].startswith("HF asked for sliding_window=3 but the kernel applied ")


@pytest.fixture
def hf_flash(flash_attn, monkeypatch):
    """HF's own flash path (flash_attention_forward, _flash_attention_forward) running the stand-in flash_attn of
    test_trace_flash, under the implementation name "flash_standin" (flash_attn proper needs CUDA)."""
    import transformers.modeling_flash_attention_utils as utils
    from transformers import AttentionInterface
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    def lazy(implementation, *args, **kwargs):  # HF reads the functions' signatures here: while traced too
        functions = (flash_attn.flash_attn_func, flash_attn.flash_attn_varlen_func, flash_attn.flash_attn_with_kvcache)
        process = tuple(utils._lazy_define_process_function(f) for f in functions[1:])
        return (*functions, utils._pad_input, utils._unpad_input), process

    import transformers.modeling_utils

    monkeypatch.setattr(utils, "lazy_import_flash_attention", lazy)
    monkeypatch.setattr(transformers.modeling_utils, "lazy_import_flash_attention", lazy)  # (its import at build)
    AttentionInterface.register("flash_standin", flash_attention_forward)
    AttentionMaskInterface.register("flash_standin", flash_attention_mask)
    yield model("mistral", "flash_standin", window=3)
    AttentionInterface._global_mapping.pop("flash_standin", None)
    AttentionMaskInterface._global_mapping.pop("flash_standin", None)


def test_hfs_flash_path_its_flash_calls_are_annotated_and_mean_what_hf_alone_reads(hf_flash):
    """What interface.read makes of HF's arguments (apis hf alone) against the flash_attn calls HF's own code makes
    of them (apis flash): the same cells, for a packed batch (position_ids), a plain batch, and a left-padded
    batch generating (unpadded by HF: compared real query by real key)."""
    positions = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    ids = torch.arange(1, 10)[None]
    for run in (lambda: hf_flash(ids, position_ids=positions, use_cache=False), lambda: hf_flash(ids.expand(2, -1))):
        with torch.no_grad(), maskcli.trace(apis=("flash", "hf")) as flash, maskcli.trace(apis=("hf",)) as alone:
            run()
        assert [c.api for c in flash.calls] == ["flash", "flash"] and [c.api for c in alone.calls] == ["hf", "hf"]
        for ours, theirs in zip(alone.calls, flash.calls):
            assert theirs.details["hf"]["layer_idx"] == ours.details["hf"]["layer_idx"] and theirs.details["hf"]["sliding_window"] == 3
            assert ours.shape == theirs.shape and np.array_equal(np.broadcast_to(ours.keep(), ours.shape), np.broadcast_to(theirs.keep(), theirs.shape))
    assert flash.calls[0].details["function"] == "flash_attn_func"
    assert alone.calls[0].details["implicit"] == "is_causal and sliding_window"

    padded = torch.tensor([[0, 0, 5, 6, 7, 8], [9, 10, 11, 12, 13, 14]])
    mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1] * 6])
    options = dict(attention_mask=mask, max_new_tokens=3, min_new_tokens=3, do_sample=False, pad_token_id=0)
    outputs = {}
    for apis in (("flash", "hf"), ("hf",)):
        with quiet(), torch.no_grad(), maskcli.trace(apis=apis) as t:
            outputs[apis] = (hf_flash.generate(padded, **options), t.calls)
    (out_flash, flash_calls), (out_alone, alone_calls) = outputs.values()
    assert torch.equal(out_flash, out_alone) and len(flash_calls) == len(alone_calls) == 6
    # the prefill unpadded into flash_attn_varlen_func; decode steps whose window holds no padding key get no mask
    assert [c.details["function"] for c in flash_calls] == ["flash_attn_varlen_func"] * 2 + ["flash_attn_func"] * 4
    for ours, theirs in zip(alone_calls, flash_calls):
        keep = np.broadcast_to(ours.keep(), ours.shape)[:, 0]
        if theirs.details["function"] == "flash_attn_func":
            assert ours.details["implicit"] == "is_causal and sliding_window" and ours.shape == theirs.shape
            assert np.array_equal(keep, np.broadcast_to(theirs.keep(), theirs.shape)[:, 0])
            continue
        assert ours.details["implicit"] == "the 2-D padding mask, unpadded"
        packed = theirs.keep()[0, 0]
        cu_q, cu_k = theirs.details["cu_seqlens_q"], theirs.details["cu_seqlens_k"]
        real = mask.bool().numpy()
        for b in range(2):
            rows = keys = np.flatnonzero(real[b])
            assert np.array_equal(keep[b][np.ix_(rows, keys)], packed[cu_q[b]:cu_q[b + 1], cu_k[b]:cu_k[b + 1]])
            assert keep[b].sum() == packed[cu_q[b]:cu_q[b + 1]].sum()  # nothing on padding rows or keys


from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@settings(max_examples=150, deadline=None)
@given(data=st.data(), causal=st.booleans(), window=st.one_of(st.none(), st.integers(1, 6)))
def test_any_two_d_padding_mask_unpadded_is_each_rows_real_positions_bottom_right(data, causal, window):
    """Padding anywhere (left, right, holes), any number of queries: the intervals against HF's unpadding rule as a
    double loop over each batch row's real queries and keys."""
    from maskcli.trace.interface import read

    k_len = data.draw(st.integers(1, 8))
    valid = np.array(data.draw(st.lists(st.lists(st.booleans(), min_size=k_len, max_size=k_len), min_size=1, max_size=3)))
    q_len = data.draw(st.sampled_from(sorted({1, k_len, max(1, k_len // 2)})))
    batch = len(valid)

    class Module:
        is_causal = causal

    q, k = torch.zeros(batch, 1, q_len, 4), torch.zeros(batch, 1, k_len, 4)
    seen = read((Module(), q, k, k, torch.from_numpy(valid)), {"sliding_window": window, "_hf": {}})
    left, right = (window - 1, window - 1) if window is not None and k_len > window else (-1, -1)
    for b in range(batch):
        keys = [j for j in range(k_len) if valid[b, j]]
        rows = valid[b] if q_len == k_len else np.ones(1, bool) if q_len == 1 else valid[b, -q_len:]
        queries = [i for i in range(q_len) if rows[i]]
        got = seen.intervals.dense(b, 0, q_len)
        for i in range(q_len):
            for j in range(k_len):
                want = False
                if i in queries and j in keys:
                    r, c = queries.index(i) + len(keys) - len(queries), keys.index(j)
                    want = not (causal and c > r) and not (left >= 0 and c < r - left) and not (right >= 0 and not causal and c > r + right)
                assert got[i, j] == want, (b, i, j)


def test_gpt_oss_eager_sink_logit_is_left_out_of_the_softmax_it_joins():
    """GPT-OSS's eager attention softmaxes torch.cat([attn_weights, sinks], dim=-1)
    (transformers/models/gpt_oss/modeling_gpt_oss.py:244, eager_attention_forward) and drops the sink after
    (`probs[..., :-1]`): the recorded mask is the keys' columns alone. The reference: the weights the model itself
    returns (output_attentions), non-zero exactly where a query attends (HF's eager fill gets weight exactly 0)."""
    gpt = model("gpt_oss", "eager", window=3)
    ids = torch.tensor([[1, 2, 3, 4, 5], [0, 0, 8, 9, 10]])
    with quiet(), torch.no_grad(), maskcli.trace() as t:
        out = gpt(ids, attention_mask=(ids != 0).long(), output_attentions=True)
    calls = [call for call in t.calls if call.api == "softmax" and "self_attn" in call.where]
    assert len(calls) == 2 and all(call.shape[2:] == (5, 5) and call.details["sink_column"] == 5 for call in calls)
    for call, weights in zip(calls, out.attentions):
        assert np.array_equal(call.keep(), weights.numpy() > 0)
    assert [group.name for group in t.groups() if "self_attn" in group.where] == [
        "window(3) (--lengths 5,3 --pad left)", "causal (--lengths 5,3 --pad left)"]


def test_a_tile_over_part_of_the_queries_or_keys_hf_handed_is_not_judged_by_hf_s_causal_word(tmp_path):
    """A registered attention function that attends in tiles merged by log-sum-exp (flash's way, a ring's steps): its
    unmasked tile (the last queries over the first keys, all earlier) was told hf-not-causal, its queries placed at the
    end of its own keys. A kernel call over fewer queries or keys than the interface call is a part of it
    (details['hf_part']), where its queries sit is the function's own split: no finding. The program checks its logits
    against transformers' own sdpa."""
    from pathlib import Path

    from checkbugs import traced

    pytest.importorskip("transformers")
    folder = Path(__file__).parent / "data" / "args"
    status, found, report = traced(tmp_path, "hf_interface_tiled_causal_lse_merge_quiet", False, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_a_zigzag_ring_s_steps_are_not_judged_against_the_rank_s_own_tokens(tmp_path):
    """360-LLaMA-Factory's zigzag ring SFT (commit 797b1490, written blind in blind-gd, ranks as threads): each rank's
    steps attend half its queries or the other rank's half keys. Its fix was told hf-not-causal and padding-ignored
    (another rank's keys read as this rank's tokens): quiet now. Its bug (positions restarted on each rank) is left."""
    from pathlib import Path

    from checkbugs import traced

    pytest.importorskip("transformers")
    folder = Path(__file__).parent / "data" / "blind"
    status, found, report = traced(tmp_path, "llamafactory360_zigzag_ring_sft_no_position_ids", True, folder)
    assert status == 0 and [f for f in found if f["severity"] == "wrong"] == [], report


def test_a_function_looked_up_while_tracing_and_registered_again_is_hugging_faces_own_after():
    """axolotl's patch of "sdpa" (quiet_blind's quiet_axolotl_sdpa_varlen_packed_position_ids_mask_dropped.py) looks the
    registered function up, registers a wrapper around it, and later registers that looked-up function back: under a
    trace the lookup is the trace's wrapper, which stayed in the registry after the trace and wrapped every later
    program's calls (CI's hf stage: this file's test after it failed). The trace puts the program's own function back."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    own = ALL_ATTENTION_FUNCTIONS["sdpa"]
    with maskcli.trace():
        looked_up = ALL_ATTENTION_FUNCTIONS["sdpa"]
        assert looked_up is not own and getattr(looked_up, "_maskcli_interface", ())
        ALL_ATTENTION_FUNCTIONS.register("sdpa", lambda *args, **kwargs: looked_up(*args, **kwargs))
        ALL_ATTENTION_FUNCTIONS.register("sdpa", looked_up)  # (the program's unpatch)
    assert ALL_ATTENTION_FUNCTIONS["sdpa"] is own
