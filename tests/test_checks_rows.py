"""checks/rows.py: query rows that see no key, and queries that see later keys, each against a double loop over the
cells written here."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from checkbugs import check_bug, first, traced
from maskcli import tracefile
from maskcli.checks.rows import empty_rows, given_empty_rows, given_later, later


def cells(batch: int, q_len: int, k_len: int, keep) -> np.ndarray:
    """(batch, 1, Lq, Lk) bool, cell by cell: keep(b, q, k) with the queries at the end of the keys."""
    out = np.zeros((batch, 1, q_len, k_len), dtype=bool)
    for b in range(batch):
        for q in range(q_len):
            for k in range(k_len):
                out[b, 0, q, k] = keep(b, k_len - q_len + q, k)
    return out


def call(keep: np.ndarray, api: str = "sdpa", **details):
    return SimpleNamespace(api=api, shape=keep.shape, details=details), tracefile.from_dense(keep, keep.shape)


def later_rows(keep: np.ndarray) -> list[int]:
    q_len, k_len = keep.shape[-2:]
    return [q for q in range(q_len) if any(keep[..., q, k].any() for k in range(k_len) if k > k_len - q_len + q)]


def test_a_causal_mask_one_key_off_sees_later_keys_and_a_symmetric_window_does_not():
    off = cells(1, 6, 6, lambda b, q, k: k <= q + 1)
    assert later_rows(off) == [0, 1, 2, 3, 4]
    [found] = later(*call(off), None)
    assert found.code == "sees-later" and found.message.startswith("query rows 0-4 see later keys")
    both = cells(1, 6, 6, lambda b, q, k: abs(q - k) <= 1)  # every later key it sees sees it back: meant both ways
    assert later_rows(both) and later(*call(both), SimpleNamespace(expression=None, kind=None)) == []
    assert later(*call(cells(1, 2, 5, lambda b, q, k: k <= q)), None) == []  # causal at the end of the keys


def test_rows_that_see_no_key_are_a_note_where_the_kernel_gives_zero_and_wrong_where_it_gives_nan():
    padded = cells(2, 3, 3, lambda b, q, k: b == 0 and k <= q)  # batch row 1: a sequence of length 0
    assert [b for b in range(2) if not padded[b].any(axis=-1).all()] == [1]
    for api, details, severity in (("sdpa", {}, "note"), ("mha", {"need_weights": True}, "wrong"),
                                   ("softmax", {"fill": "-inf"}, "suspicious"), ("softmax", {"fill": "min"}, "note")):
        [found] = empty_rows(*call(padded, api, **details), None)
        assert (found.code, found.severity) == ("fully-masked", severity), api
        assert found.message.startswith("query rows 0-2 of batch row 1 see no key at all: "), api
    assert empty_rows(*call(cells(1, 3, 3, lambda b, q, k: k <= q)), None) == []


def test_a_tensor_a_user_gave_is_read_the_same_way():
    mask = SimpleNamespace(reading="mask", kind=None, expression=None)
    off = cells(1, 4, 4, lambda b, q, k: k <= q + 1 and q != 3)  # query 3 sees nothing; 0-2 see one later key
    [empty] = given_empty_rows(off, "mask", q_offset=0)
    assert empty.message.startswith("query row 3 sees no key at all")
    [seen] = given_later(off, mask)
    assert seen.message.startswith("query rows 0-2 see later keys (query 0 sees key 1)")
    assert given_later(off, SimpleNamespace(reading="mask", kind="full", expression="full")) == []  # meant by its kind
    [hides] = given_empty_rows(np.array([[True, True], [False, False]])[:, None, None, :], "key padding [B, S]")
    assert hides.message.startswith("batch row 1 hides every key")


def test_cross_attention_queries_are_never_placed_among_the_keys():
    """A decoder's queries over its encoder's memory: more queries than keys, or a cross-attention module path. An
    all-ones mask (and one with the memory's padding) sees no later key; a causal off-by-one in self-attention still does."""
    every = np.ones((1, 1, 7, 3), bool)  # 7 target tokens over 3 memory keys
    placed = cells(1, 7, 3, lambda b, q, k: True)  # bottom-right: queries 0-5 would sit before key 2
    assert later_rows(placed) == [0, 1, 2, 3, 4, 5]
    keep, stored = call(every)
    assert later(SimpleNamespace(**vars(keep), where="Resampler"), stored, None) == []
    memory = cells(2, 4, 6, lambda b, q, k: k < 6 - 2 * b)  # Lq < Lk: only the path says cross-attention
    keep, stored = call(memory)
    assert later(SimpleNamespace(**vars(keep), where="model.decoder.layers.0.encoder_attn"), stored, None) == []
    assert later(SimpleNamespace(**vars(keep), where="decoder.layers.0.multihead_attn"), stored, None) == []
    assert later(SimpleNamespace(**vars(keep), where="lm.layers.3.gated_xattn"), stored, None) == []  # (Flamingo's)
    assert later(SimpleNamespace(**vars(keep), where="layers.0.flex_attn"), stored, None)[0].code == "sees-later"
    [found] = later(SimpleNamespace(**vars(keep), where="model.decoder.layers.0.self_attn"), stored, None)
    assert found.code == "sees-later"
    mask = SimpleNamespace(reading="mask", kind=None, expression=None)
    odd = np.ones((1, 1, 7, 3), bool)
    odd[0, 0, 1, 1:] = False  # no kind names it; still no query of 7 has a place among 3 keys
    assert given_later(odd, mask) == []
    fused = cells(1, 7, 3, lambda b, q, k: True)  # keys split off the queries' own projection: self-attention
    keep, stored = call(fused, kv_source="query")
    assert later(SimpleNamespace(**vars(keep), where="attn"), stored, None)[0].code == "sees-later"


def test_a_bidirectional_span_longer_than_a_sliding_window_is_no_off_by_one():
    """Gemma 3's sliding layer: (causal | same image) with keys at most W - 1 back and every later key kept. An image
    of 6 tokens under a window of 3: its first token sees its last, which does not see it back. Quiet; a causal mask
    one key off, a mask read the wrong way round and an image that sees past its own end still say sees-later."""
    image = [-1, -1, 0, 0, 0, 0, 0, 0, -1, -1]
    same = lambda q, k: image[q] == image[k] >= 0  # noqa: E731
    sliding = cells(1, 10, 10, lambda b, q, k: (k <= q or same(q, k)) and q - k < 3)
    assert sliding[0, 0, 2, 7] and not sliding[0, 0, 7, 2]  # not both ways
    unnamed = SimpleNamespace(expression=None, kind=None)
    assert later(*call(sliding), unnamed) == []
    tril = SimpleNamespace(expression="tril(1)", kind="tril")  # (the recogniser names a causal mask one key off)
    for wrong, structure in ((lambda b, q, k: k <= q + 1, tril),
                             (lambda b, q, k: k >= q, unnamed),  # causal read the wrong way round
                             (lambda b, q, k: ((k <= q or same(q, k)) and q - k < 3) or (q == 3 and k == 8), unnamed)):
        [found] = later(*call(cells(1, 10, 10, wrong)), structure)  # (the last: query 3 sees key 8, past its image)
        assert found.code == "sees-later"


def test_a_self_attention_whose_every_query_sees_no_key_is_wrong_and_a_cross_attention_is_not():
    """Every cell masked (an all-True mask handed where True = masked) is wrong in a self-attention, whatever the kernel
    makes of it; one empty batch row stays as above, and a cross-attention's all-masked memory is not judged so."""
    import torch

    masked = ~torch.ones(2, 1, 4, 4, dtype=torch.bool).numpy()  # what ChatGLM's all-True (= masked) mask keeps
    for api, details in (("sdpa", {}), ("softmax", {"fill": "finite", "fill_value": -1e4})):
        [found] = empty_rows(*call(masked, api, **details), None)
        assert (found.code, found.severity) == ("fully-masked", "wrong"), api
        assert found.message.startswith("every query of every batch row sees no key at all"), api
    memory, stored = call(np.zeros((2, 1, 5, 3), dtype=bool))
    memory.where = "decoder.layers.0.encoder_attn"
    [found] = empty_rows(memory, stored, None)
    assert found.severity == "note"


def test_rows_empty_in_some_heads_only_are_no_mask_that_masks_everything():
    """"The mask masks everything" holds only where every head of every row sees nothing: rows empty in some heads
    (a head the program zeroes after its softmax, or Longformer's banded scores read with positions for heads, which
    called LED's every padded encoder batch wrong) stay a row finding; all heads empty stays wrong. Cells written here
    with a double loop: head h of batch row b sees keys k <= q unless (h + b) is even, where it sees none."""
    keep = np.zeros((2, 4, 3, 3), dtype=bool)
    for b in range(2):
        for h in range(4):
            for q in range(3):
                for k in range(3):
                    keep[b, h, q, k] = (h + b) % 2 == 1 and k <= q
    [found] = empty_rows(*call(keep), None)
    assert found.code == "fully-masked" and found.severity != "wrong", found
    assert found.message.startswith("query rows 0-2 of batch row 0; query rows 0-2 of batch row 1 see no key"), found
    [masked] = empty_rows(*call(np.zeros((2, 4, 3, 3), dtype=bool)), None)
    assert (masked.code, masked.severity) == ("fully-masked", "wrong")


def test_chatglm_finetune_all_true_attention_mask(tmp_path):
    """mymusise/ChatGLM-Tuning#30: attention_mask=torch.ones(1, 1, L, L).bool() where True = masked."""
    from checkbugs import check_bug

    check_bug(tmp_path, "chatglm_finetune_all_true_attention_mask", "fully-masked")


def test_extended_mask_of_the_wrong_sign_on_an_unpadded_batch(tmp_path):
    """Written another way: SDPA given mask * -10000 for an all-ones attention_mask (BERT's extended mask, sign turned)."""
    from pathlib import Path

    from checkbugs import traced

    folder = Path(__file__).parent / "data" / "args"
    status, found, report = traced(tmp_path, "extended_mask_wrong_sign_unpadded", fixed=False, folder=folder)
    assert status == 1 and any(f["code"] == "fully-masked" and f["severity"] == "wrong" for f in found), report
    status, found, report = traced(tmp_path, "extended_mask_wrong_sign_unpadded", fixed=True, folder=folder)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_nan_rows_a_program_zeroes_after_its_softmax_are_no_alarm(tmp_path):
    """WeNet / ESPnet: softmax(scores.masked_fill(mask, -inf)).masked_fill(mask, 0.0) sets the padding rows that see
    no key to 0 (trace/after.py records it); zeroing only some of those rows leaves NaN, still suspicious."""
    import json
    import textwrap

    from typer.testing import CliRunner

    from maskcli.commands import app

    def run(rows_zeroed: str) -> dict:
        script = tmp_path / f"zeroed_{rows_zeroed}.py"
        script.write_text(textwrap.dedent(f"""
            import torch
            torch.manual_seed(0)
            lengths = torch.tensor([5, 3])
            keys = torch.arange(5)[None, :] < lengths[:, None]               # (B, Lk) real keys
            same_chunk = torch.arange(5)[:, None] // 2 == torch.arange(5)[None, :] // 2  # chunks of 2, no left chunk
            mask = ~(keys[:, None, :] & same_chunk[None])                      # True = masked; row 1's query 4: no key
            q = k = v = torch.randn(2, 2, 5, 4)
            scores = (q @ k.transpose(-2, -1)).masked_fill(mask[:, None], float("-inf"))
            zeroed = mask[:, None] {rows_zeroed}
            attn = torch.softmax(scores, dim=-1).masked_fill(zeroed, 0.0)
            out = attn @ v
        """))
        out = tmp_path / f"zeroed_{rows_zeroed}.json"
        result = CliRunner().invoke(app, ["trace", "--json", str(out), str(script)])
        data = json.loads(out.read_text())
        assert data["exit_status"] == 0, result.output
        return {f["severity"]: f["message"] for g in data["groups"] for f in g["findings"] if f["code"] == "fully-masked"}

    assert run("") == {"note": "query row 4 of batch row 1 sees no key at all: 0 output there (the program zeroes those "
                                "rows' weights after the softmax)"}
    assert run("& (torch.arange(5) < 4)[None, None, :, None]") == {
        "suspicious": "query row 4 of batch row 1 sees no key at all: NaN weights there (softmax of all -inf)"}


def test_nan_output_rows_a_program_sets_to_zero_are_no_alarm(tmp_path):
    """BLT's patch cross-attention (tests/data/quiet_blind, written blind): where(isnan(out), 0, out) after weights @ v
    sets the NaN rows of its empty pad patches to 0; written another way, a hierarchical encoder's sentence slots pooled
    by einsum, out.nan_to_num_(0.0) in place (tests/data/quiet). Both a note; a where that leaves a NaN row, suspicious."""
    import textwrap

    from checkbugs import traced

    quiet = Path(__file__).parent / "data" / "quiet"
    status, found, report = traced(tmp_path, "hierarchical_sentence_pooling_nan_to_num", False, quiet)
    sentences = [3, 2]  # the program's documents' sentence counts, padded to 3 slots: document 1's slot 2 is empty
    empty = [(b, s) for b, n in enumerate(sentences) for s in range(max(sentences)) if s >= n]
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    [row] = [f for f in found if f["code"] == "fully-masked"]
    assert row["message"].startswith(f"query row {empty[0][1]} of batch row {empty[0][0]} sees no key at all: 0 output")

    def run(zeroing: str) -> set:
        script = tmp_path / "where.py"
        script.write_text(textwrap.dedent(f"""
            import torch
            torch.manual_seed(0)
            own = torch.tensor([[0, 0, 1, 1], [0, 0, 0, -1]])  # each key's patch; batch row 1: patch 1 empty
            keep = own[:, None, :] == torch.arange(2)[None, :, None]  # (B, patches, keys)
            q, k, v = torch.randn(2, 2, 4), torch.randn(2, 4, 4), torch.randn(2, 4, 4)
            bias = torch.where(keep, 0.0, float("-inf"))
            out = torch.softmax(q @ k.transpose(-1, -2) + bias, -1) @ v
            out = {zeroing}
        """))
        status, found, report = traced(tmp_path, "where", False, tmp_path)
        return {f["severity"] for f in found if f["code"] == "fully-masked"}

    assert run("torch.where(torch.isnan(out), torch.zeros(()), out)") == {"note"}
    assert run("out.where(~torch.isnan(out), 0.0)") == {"note"}
    assert run("torch.where(torch.isnan(out) & (torch.arange(2) == 0)[None, :, None], 0.0, out)") == {"suspicious"}


def test_llms_from_scratch_future_mask_as_sdpa_keep_mask(tmp_path):
    """LLMs-from-scratch#1061: triu(ones, 1).bool() handed to SDPA as its keep-mask: the last token sees no key, though
    every earlier query sees it as a key; the fix (~mask) is quiet. The row is the one torch.triu leaves empty."""
    import torch

    from checkbugs import check_bug

    hit = check_bug(tmp_path, "llms_from_scratch_sdpa_without_flash_uncausal_bool_mask", "fully-masked")[0]
    keep = torch.triu(torch.ones(6, 6), diagonal=1).bool()
    empty = [q for q in range(6) if not keep[q].any()]
    assert hit["message"].startswith(f"query {empty[0]} of batch row 0 sees no key at all, not even its own")


def test_mha_causal_mask_that_hides_the_own_token(tmp_path):
    """Written another way: nn.MultiheadAttention, an additive -inf triu(diagonal=0): query 0 sees nothing though
    query 1 sees key 0 (the row torch.softmax of the mask makes NaN); the fix (diagonal=1) is quiet."""
    import torch

    from checkbugs import caught

    mask = torch.triu(torch.full((5, 5), float("-inf")), diagonal=0)
    row = int(torch.isnan(torch.softmax(mask, dim=-1)).any(dim=-1).nonzero()[0])
    hit = caught(tmp_path, "mha_causal_mask_hides_own_token", ("fully-masked",))
    assert hit["message"].startswith(f"query {row} of batch row 0 sees no key at all")
    assert tuple(hit["cell"]) == (0, row, row)


def test_later_keys_in_runs_no_slip_of_a_triangle_makes_are_a_note_and_a_slip_stays_suspicious():
    """BD3-LM (block diffusion) attends a noised copy of the sequence over [x_t, x_0]: each noised block both ways
    within itself and over the clean blocks before it, laid after it: later keys in runs of 3, 15, 11, ... keys,
    which no causal mask one key off or read the wrong way round makes: a note. The triangle the wrong way round,
    right-padded and so named by no kind, sees on to each row's last real key: still suspicious."""
    from maskcli.checks.registry import severity

    n, size = 8, 4

    def block_diff(b, q, k):  # written here from the paper's three parts, on absolute positions
        q0, k0 = q >= n, k >= n
        bq, bk = (q - n if q0 else q) // size, (k - n if k0 else k) // size
        return (bq == bk and q0 == k0) or (bq > bk and k0 and not q0) or (bq >= bk and k0 and q0)

    unnamed = SimpleNamespace(expression=None, kind=None)
    [found] = later(*call(cells(1, 2 * n, 2 * n, block_diff)), unnamed)
    assert found.code == "sees-later" and severity(found) == "note", found
    lengths = (6, 4)
    flipped = cells(2, 6, 6, lambda b, q, k: k >= q and k < lengths[b])  # the triangle the wrong way round, padded
    [found] = later(*call(flipped), unnamed)
    assert severity(found) == "suspicious" and "the wrong way round?" in found.message


def test_a_graphs_adjacency_whose_later_keys_skip_a_key_is_a_note():
    """A graph's nodes in one (Lq, Lk) plane (torch_geometric's TransformerConv over a ring with one directed chord,
    written blind in quiet-f): node 0 sees its ring neighbours 1 and 4, past keys 2-3 it does not see, which no slip of a
    causal mask makes (a slip skips no key): a note, not suspicious. tril(1), every later key next to the query's own,
    stays suspicious."""
    from maskcli.checks.registry import severity

    n = 5
    edges = {(i, (i + 1) % n) for i in range(n)} | {((i + 1) % n, i) for i in range(n)} | {(i, i) for i in range(n)}
    edges |= {(0, n // 2)}  # (source 0, target 2: node 2 sees node 0, not back)
    ring = cells(1, n, n, lambda b, q, k: (k, q) in edges)
    unnamed = SimpleNamespace(expression=None, kind=None)
    [found] = later(*call(ring), unnamed)
    assert found.code == "sees-later" and severity(found) == "note", found
    [found] = later(*call(cells(1, n, n, lambda b, q, k: k <= q + 1)), unnamed)
    assert severity(found) == "suspicious", found


def test_a_padded_causal_mask_one_key_off_no_expression_names_is_still_an_off_by_one():
    # query and key padding both hidden (right-padded rows of lengths 4, 7, 5): no kind names the mask, and every later
    # key a query sees sees it back (query i sees i + 1, which sees i): yet query i sees every earlier key while key
    # i - 2 does not see it, so no window or span is symmetric there
    lengths = (4, 7, 5)
    off = cells(3, 7, 7, lambda b, q, k: k <= q + 1 and q < lengths[b] and k < lengths[b])
    unnamed = SimpleNamespace(expression=None, kind=None)
    [found] = later(*call(off), unnamed)
    assert found.code == "sees-later" and found.message.startswith("query rows 0-5 see later keys (queries placed at")
    assert "off-by-one" in found.message
    # a symmetric window padded the same way, and a bidirectional prefix then causal, stay quiet
    window = cells(3, 7, 7, lambda b, q, k: abs(q - k) <= 2 and q < lengths[b] and k < lengths[b])
    prefix = cells(3, 7, 7, lambda b, q, k: (k <= q or k < 3) and q < lengths[b] and k < lengths[b])
    assert later(*call(window), unnamed) == [] and later(*call(prefix), unnamed) == []


def test_a_padded_float_mask_built_one_key_off_is_found_in_a_traced_program(tmp_path):
    from checkbugs import traced

    (tmp_path / "pad_tril.py").write_text(
        "import sys\nimport torch\nimport torch.nn.functional as F\n"
        "FIXED = '--fixed' in sys.argv\ntorch.manual_seed(0)\nB, L, H, D = 3, 7, 2, 8\n"
        "lengths = torch.tensor([4, 7, 5])\nattention_mask = (torch.arange(L)[None] < lengths[:, None]).long()\n"
        "allowed = torch.tril(torch.ones(L, L), diagonal=0 if FIXED else 1).bool()\n"
        "keep = allowed[None] & attention_mask[:, None, :].bool() & attention_mask[:, :, None].bool()\n"
        "bias = torch.zeros(B, 1, L, L).masked_fill(~keep[:, None], torch.finfo(torch.float32).min)\n"
        "q, k, v = (torch.randn(B, H, L, D) for _ in range(3))\n"
        "F.scaled_dot_product_attention(q, k, v, attn_mask=bias)\n")
    for fixed, expected in ((False, ["sees-later"]), (True, [])):
        found = traced(tmp_path, "pad_tril", fixed, folder=tmp_path)[1]
        assert [f["code"] for f in found if f["code"] == "sees-later"] == expected, found


def _gpt2_keep(real: list[int], diagonal: int) -> np.ndarray:
    """(1, 1, L, L) what GPT-2's softmax gives weight over one batch row (tril(diagonal) where-filled with -1e4, then
    (1 - attention_mask) * -1e4 added, as trajectory_gpt2.py does), read off torch.softmax itself."""
    import torch

    torch.manual_seed(0)
    n = len(real)
    scores = torch.randn(1, 1, n, n) * 0.1
    scores = torch.where(torch.tril(torch.ones(n, n), diagonal=diagonal).bool(), scores, torch.tensor(-1e4))
    scores = scores + (1.0 - torch.tensor(real, dtype=torch.float32))[None, None, None, :] * -1e4
    return (torch.softmax(scores, dim=-1) > 0).numpy()


def test_a_one_row_batchs_padding_row_that_sees_every_key_is_no_slip():
    """decision_transformer (tests/data/quiet_blind): a batch of ONE left-padded row through GPT-2's -1e4 fills: the last
    padding query sees every key, the real ones after it included (its output is never used): no slip of a causal mask.
    The same batch with the causal buffer one key off, its real tokens stated (the model call's
    attention_mask), is still one, on its real rows; its padding rows' runs do not make it a note."""
    from maskcli.checks.registry import severity

    unnamed = SimpleNamespace(expression=None, kind=None)
    real = [0] * 6 + [1] * 4
    keep = _gpt2_keep(real, 0)
    assert later_rows(keep) == [0, 1, 2, 3, 4, 5] and [q for q in range(10) if keep[0, 0, q].all()] == [5]
    # (padding rows 0-4 see the real keys past the padding ones they do not: no run from their own; row 5 every key)
    assert later(*call(keep, "softmax"), unnamed) == []
    off = _gpt2_keep(real, 1)
    shown = [q for q in later_rows(off) if real[q] and not off[0, 0, q].all()]
    [found] = later(*call(off, "softmax"), unnamed, real=np.array([real], dtype=bool))
    assert shown == [6, 7, 8] and severity(found) == "suspicious" and found.message.startswith("query rows 6-8 see later keys") and "off-by-one" in found.message


def test_later_keys_only_padding_rows_see_by_the_model_calls_own_word_are_no_slip(tmp_path):
    """A windowed GPT-2 over one left-padded row (tests/data/args): its last padding query within reach of the real keys
    sees them (-1e4) but not the padding before its window (-2e4), so it does not see every key; the model call's
    attention_mask states it padding: quiet. With the window's band one key off, the real rows that see the next token,
    by a double loop over the band, are said, suspicious, and the padding rows' runs do not turn it into a note."""
    from checkbugs import traced

    args = Path(__file__).parent / "data" / "args"
    status, found, report = traced(tmp_path, "left_padded_one_row_window_gpt2_fills", fixed=False, folder=args)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    status, found, report = traced(tmp_path, "left_padded_one_row_window_gpt2_fills", fixed=False, folder=args,
                                   args=("--buggy",))
    real = [0, 0, 0, 0, 1, 1, 1, 1]
    band = [[k <= q + 1 and k > q - 3 for k in range(8)] for q in range(8)]
    rows = [q for q in range(8) if real[q] and any(band[q][k] and real[k] for k in range(q + 1, 8))]
    hit = next(f for f in found if f["code"] == "sees-later")  # (the prefill's group is the first)
    assert rows == [4, 5, 6] and hit["severity"] == "suspicious", report
    assert hit["message"].startswith("query rows 4-6 see later keys (queries placed at the end of the keys): "), report


def test_mlx_vlm_gemma4_mtp_drafter_swa_mask_absolute_offset(tmp_path):
    """mlx-vlm#1138: the drafter's sliding-window mask from the absolute decode position over a rotating cache: every
    local key out of window
    (written blind, batch blind-m; caught before any rule was changed for it)."""
    from checkbugs import check_bug

    check_bug(tmp_path, "mlx_vlm_gemma4_mtp_drafter_swa_mask_absolute_offset", "fully-masked")


def test_a_drafters_window_over_a_cache_it_sits_past_is_no_later_key(tmp_path):
    """The fixed mlx-vlm drafter: its queries sit past the target's cache (its model call's query_offset, 20, at or past
    every layer's last key: the drafter writes no key of its own), each over the last keys of its window. Placed at the
    end of the keys they would see later ones, and read the other way round the mask is a causal one at a static
    cache's start; neither placement is where the program says its queries are: no sees-later, no polarity."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "mlx_vlm_gemma4_mtp_drafter_swa_mask_absolute_offset", True)
    assert (status, [f for f in found if f["severity"] in ("wrong", "suspicious")]) == (0, []), report


WINDOW_PAST_CACHE = """
import sys
import torch
import torch.nn.functional as F
INSIDE = "--inside" in sys.argv  # the block's own keys written into the cache before it attends
class Block(torch.nn.Module):
    def forward(self, x, cache_k, cache_v, start_pos):
        q = x.view(1, 1, 4, 8)
        k, v = (torch.cat([c, q], dim=2) for c in (cache_k, cache_v)) if INSIDE else (cache_k, cache_v)
        k_len = k.shape[2]
        q_idx = torch.arange(start_pos, start_pos + 4)[:, None]
        k_idx = torch.arange(k_len)[None, :]
        keep = (k_idx > q_idx - 6) & (k_idx <= q_idx + int(INSIDE))  # (inside: the band one key off)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
torch.manual_seed(0)
cache = torch.randn(1, 1, 10, 8)
with torch.no_grad():
    Block()(torch.randn(1, 4, 8), cache, cache.clone(), 10)
"""


def test_queries_stated_past_the_keys_see_no_later_key_and_queries_among_them_still_do(tmp_path):
    """A block of 4 queries whose model call states start_pos 10 over a cache of 10 keys it is not written into: a window
    of 6 back from each query, every key before every query (quiet). The same block written into the cache first (keys
    10-13 its own, start_pos 10 = 14 - 4: the queries at the end of the keys) with its band one key off: the rows that
    see a later key, by a double loop, are still said."""
    from checkbugs import traced

    (tmp_path / "past.py").write_text(WINDOW_PAST_CACHE)
    status, found, report = traced(tmp_path, "past", False, folder=tmp_path)
    assert (status, [f for f in found if f["severity"] in ("wrong", "suspicious")]) == (0, []), report
    status, found, report = traced(tmp_path, "past", False, folder=tmp_path, args=("--inside",))
    rows = [q for q in range(4) if any(10 + q - 6 < k <= 10 + q + 1 and k > 10 + q for k in range(14))]
    hit = [f for f in found if f["code"] == "sees-later"]
    assert rows == [0, 1, 2] and hit and hit[0]["message"].startswith("query rows 0-2 see later keys"), report


def test_ofa_sequence_generator_decoder_mask_not_inverted(tmp_path):
    """OFA b3f1e6a: the generator passes tokens.eq(pad) (True = pad) where the decoder expects 1 = keep, so every
    real token is a masked key (written blind, batch blind-r; caught before any rule was changed for it)."""
    from checkbugs import check_bug

    check_bug(tmp_path, "ofa_sequence_generator_decoder_mask_not_inverted", "fully-masked")


def test_mobius_static_cache_nonpad_kv_seqlen_before_scatter(tmp_path):
    """onnxruntime/mobius#365: nonpad_kv_seqlen counted before the static cache's scatter, so the prefill passes 0
    valid keys and sees none (written blind, batch blind-y; caught before any rule was changed for it). Fix quiet."""
    from checkbugs import check_bug

    check_bug(tmp_path, "mobius_static_cache_nonpad_kv_seqlen_before_scatter", "fully-masked")



def test_queries_over_a_static_cache_are_placed_where_the_model_call_states_them():
    """Five prompt queries at cache_position 0-4 over 12 slots, row 1 left-padded by 3 (its padding rows opened on
    every slot, as transformers does): placed at 0-4 (stated_places), its padding queries are no real queries and no
    real one sees a later key; placed at the end of the slots (7-11), the padding rows read as real ones that see
    later slots. A real query that sees one slot past its own position sees a later key either way."""
    q_len, k_len, pads = 5, 12, (0, 3)
    real = np.array([[k >= pads[b] for k in range(k_len)] for b in range(2)])

    def mask(reach):  # keep(b, q, k) for query q at position q; a padding query's row sees every slot
        return cells(2, q_len, k_len, lambda b, p, k: p - (k_len - q_len) < pads[b]
                     or real[b, k] and k <= p - (k_len - q_len) + reach)

    places = np.arange(q_len)
    assert later(*call(mask(0)), None, real, None, lambda: places) == []
    assert later(*call(mask(0)), None, real, None, None) != []  # (bottom-right: the padding rows read as real)
    bad = [q for q in range(q_len) if q >= pads[1] or q >= pads[0]]  # real queries that see slot q + 1
    [found] = later(*call(mask(1)), None, real, None, lambda: places)
    assert found.message.startswith(f"query rows {bad[0]}-{bad[-1]} see later keys")


def test_palm_rlhf_encoder_reward_model_key_mask_inverted(tmp_path):
    """lucidrains/PaLM-rlhf-pytorch 6e1baf6: the encoder reward model's key padding mask `x < 0` used as a keep-mask,
    so every real key is masked (batch blind-af); written blind and caught before any rule was changed for it.
    The fix is quiet."""
    check_bug(tmp_path, "palm_rlhf_encoder_reward_model_key_mask_inverted", "fully-masked")


def test_midashenglm_audio_encoder_mask_inverted_for_sdpa(tmp_path):
    """vllm-project/vllm#25925: MiDashengLM's audio encoder hands SDPA its length mask inverted (batch blind-ai);
    written blind and caught before any rule was changed for it. The fix is quiet."""
    check_bug(tmp_path, "midashenglm_audio_encoder_mask_inverted_for_sdpa", "fully-masked")


def test_tinytorch_gpt_additive_causal_mask_into_binary_apply_mask(tmp_path):
    """harvard-edge/cs249r_book#1785: TinyTorch's GPT passes an additive -inf causal mask to a binary _apply_mask,
    every kept key gets -1e9 (batch blind-ak); written blind and caught before any rule was changed for it. The
    fix is quiet."""
    check_bug(tmp_path, "tinytorch_gpt_additive_causal_mask_into_binary_apply_mask", "fully-masked")


def test_later_keys_seen_by_blocks_of_equal_rows_are_a_note():
    """DN-DETR's decoder self-attention (quiet-v, prepare_for_dn): one denoising group of 3 queries before 5 matching
    queries; the group sees every query, the matching queries see only themselves. Its rows come in runs of equal rows,
    which no triangle one key off or the wrong way round makes (its rows differ one from the next): a note. The same
    size of triangle the wrong way round stays suspicious."""
    from maskcli.checks.registry import severity

    group = 3
    dn = cells(1, 8, 8, lambda b, q, k: q < group or k >= group)  # (keep: MHA's attn_mask[group:, :group] = True)
    unnamed = SimpleNamespace(expression=None, kind=None)
    [found] = later(*call(dn), unnamed)
    assert found.code == "sees-later" and severity(found) == "note", found
    [found] = later(*call(cells(1, 8, 8, lambda b, q, k: k >= q)), unnamed)
    assert severity(found) == "suspicious", found


ENCODER_PADDING = """
import sys
import torch
import torch.nn as nn
torch.manual_seed(0)
enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 4, 32, batch_first=True), 2)
enc.train("--train" in sys.argv)
lengths = torch.tensor([int(n) for n in sys.argv[1].split(",")])
pad = torch.arange(6)[None, :] >= lengths[:, None]  # True = padding, as src_key_padding_mask reads it
if "--inverted" in sys.argv:
    pad = ~pad  # True on the real tokens: the polarity mix-up
with torch.no_grad():
    enc(torch.randn(len(lengths), 6, 16), src_key_padding_mask=pad)
"""


def _encoder_rows(*flags: str) -> tuple[bool, bool]:
    """torch's own answer for the program above with lengths 6,4 inverted (batch row 0 all padding): is batch row 0 of
    the layer's output NaN (eval without grad: the fused fast path), and is its self-attention's output there 0 (the
    slow path, in training)?"""
    import torch
    import torch.nn as nn

    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 4, 32, batch_first=True).train("--train" in flags)
    pad = ~(torch.arange(6)[None, :] >= torch.tensor([6, 4])[:, None])
    x = torch.randn(2, 6, 16)
    with torch.no_grad():
        out = layer(x, src_key_padding_mask=pad)
        attended = layer.self_attn(x, x, x, key_padding_mask=pad, need_weights=False)[0]
    return bool(out[0].isnan().all()), bool((attended[0] == 0).all())


def test_rows_with_no_key_are_nan_on_mhas_fast_path_and_0_on_its_slow_path_and_in_a_nested_tensor(tmp_path):
    """An encoder's src_key_padding_mask built True on the real tokens (lengths 6, 4: batch row 0 all True, masked
    whole): in eval mode without grad nn.TransformerEncoderLayer runs its fused fast path, which gives those rows NaN
    (wrong); in training MHA's slow path gives them 0 (a note); either way the script's lengths say the mask is the
    wrong way round (lengths-inverted, exit 1). A correct mask over a batch with an empty
    sequence, left-aligned, goes into a nested tensor that leaves the empty row out (0 there: a note)."""
    from checkbugs import traced

    (tmp_path / "encoder.py").write_text(ENCODER_PADDING)
    cases = (("6,4", ("--inverted",), "NaN output there (MHA's fast path", "wrong"),
             ("6,4", ("--inverted", "--train"), "0 output there (SDPA gives rows with no key 0)", "note"),
             ("0,4", (), "0 output there (the encoder's nested tensor", "note"))
    for lengths, flags, said, severity in cases:
        status, found, report = traced(tmp_path, "encoder", False, folder=tmp_path, args=(lengths, *flags))
        empty = [f for f in found if f["code"] == "fully-masked"]
        assert len(empty) == 1 and said in empty[0]["message"] and empty[0]["severity"] == severity, report
        # (the script's top-level lengths say the inverted mask is the wrong way round, whichever path ran: turned.py)
        inverted = [f["severity"] for f in found if f["code"] == "lengths-inverted"]
        assert (status, inverted) == ((1, ["wrong"]) if "--inverted" in flags else (0, [])), report
    assert _encoder_rows()[0] and not _encoder_rows("--train")[0]  # torch's fast path: NaN; its slow path: none
    assert _encoder_rows("--train")[1]  # (MHA's slow path: 0 on those rows)


def test_scores_filled_whole_then_shifted_by_their_row_max_see_no_key(tmp_path):
    """lucidrains/h-transformer-1d 5385d15 (written blind): the True = keep mask filled where True, so an all-True mask
    filled every block score, and `S - amax(S)` before `exp` made every row uniform: trace/shifted.py reads the rows
    filled whole as seeing no key. Written another way: a stable softmax over (B, L, L) scores whose keep mask is added
    as `mask * -1e9`. Both fixes quiet."""
    from pathlib import Path

    from checkbugs import traced

    found = check_bug(tmp_path, "h_transformer_1d_hattention_key_mask_polarity_inverted", "fully-masked")
    assert "the mask masks everything" in found[0]["message"]
    folder = Path(__file__).parent / "data" / "rows"
    status, found, report = traced(tmp_path, "stable_softmax_keep_mask_added_as_bias", fixed=False, folder=folder)
    assert status == 1 and any(f["code"] == "fully-masked" and f["severity"] == "wrong" for f in found), report
    status, found, report = traced(tmp_path, "stable_softmax_keep_mask_added_as_bias", fixed=True, folder=folder)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_tile_of_a_blockwise_kernel_is_read_at_its_places():
    """memory-efficient-attention-pytorch's chunked loop (tests/data/quiet_blind, written blind): the tile of queries
    24-29 over keys 21-27 of a causal mask, read with its queries at the end of its keys, sees later keys; at its places
    (trace/tiled.py's "tile") it sees none, and is quiet. The same tile one key off at its places is still found."""
    tile = [[0, 2], [24, 30], [21, 30]]

    def at_places(off: int) -> np.ndarray:
        keep = np.zeros((2, 1, 6, 7), dtype=bool)
        for b, i, j in np.ndindex(2, 6, 7):
            keep[b, 0, i, j] = 21 + j <= 24 + i + off
        return keep

    causal = at_places(0)
    assert later_rows(causal)  # (read bottom-right, as before)
    assert later(*call(causal, "softmax", tile=tile), None) == []
    [found] = later(*call(at_places(1), "softmax", tile=tile), None)
    assert found.code == "sees-later"


def test_executorch_export_leaves_the_causal_mask_buffer_all_false(tmp_path):
    """pytorch/executorch#18380 (07b7c7e; written blind, batch blind-fb, caught before any rule was changed for it):
    _materialize_buffers zero-fills the meta buffers and rebuilds the tril mask only where isinstance(layer.attn,
    FullAttention), False for model.py imported under another path: the static-cache SDPA gets an all-False mask. The
    cell is a double loop's first cell a causal prefill over the 16-slot cache keeps (every one is hidden)."""
    found = check_bug(tmp_path, "executorch_qwen3_5_moe_export_causal_mask_buffer_left_zero", "fully-masked")
    assert tuple(found[0]["cell"]) == first((1, 6, 16), lambda b, q, k: k <= q), found
    assert "the mask masks everything" in found[0]["message"], found


ROWSDATA = Path(__file__).parent / "data" / "rows"


def test_a_hybrid_models_causal_buffers_rebuilt_on_the_wrong_layers_after_meta_init(tmp_path):
    """executorch#18380 written another way: a hybrid model (config.layer_types: three linear-attention layers, then
    a full one, twice; a dataclass) built on meta, to_empty() and its buffers zeroed, the causal masks rebuilt where
    i % full_attention_interval == 0, which are linear layers: the full layers' eager softmax over the static cache
    sees no slot. The cell is a double loop's first cell a causal prefill keeps; the fix (the layer's own kind) is
    quiet, and the all-False mask is read as no window (config.py's window-on-full-layer says nothing of it)."""
    from checkbugs import traced

    name = "hybrid_linear_full_meta_init_causal_buffer_rebuilt_on_wrong_layers"
    found = check_bug(tmp_path, name, "fully-masked", ROWSDATA)
    assert tuple(found[0]["cell"]) == first((2, 5, 12), lambda b, q, k: k <= q), found
    assert "the mask masks everything (NaN weights there" in found[0]["message"], found
    status, found, report = traced(tmp_path, name, False, ROWSDATA)
    assert not [f for f in found if f["code"] == "window-on-full-layer"], report
    status, found, report = traced(tmp_path, name, True, ROWSDATA)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


def test_a_static_cache_mask_rebuilt_after_meta_init_with_left_pad_rows_sdpa_zeroes_is_quiet(tmp_path):
    """Correct: meta init, buffers zeroed, each layer's mask rebuilt where it has one; a left-padded row's pad queries
    see no key under causal & padding and SDPA gives them 0: a note, nothing wrong or suspicious."""
    from checkbugs import traced

    status, found, report = traced(tmp_path, "static_cache_meta_init_mask_rebuilt_left_pad_rows_sdpa_zero", False,
                                   ROWSDATA)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert [f["severity"] for f in found if f["code"] == "fully-masked"] == ["note"], report


def test_unsloth_gemma2_padded_inference_mask_converted_again_and_cut_to_row_0(tmp_path):
    """unslothai/unsloth#3034 (8e994f07fb; written blind, batch blind-fw): Gemma 2's eval path re-applies
    `(1.0 - mask) * finfo.min` to the 4-D mask already 0 / finfo.min (kept cells -> finfo.min, masked -> -inf) and cuts it
    to `[0][0]`, batch row 0's. No cell of it lets a key through, so every query of both rows sees none (the cell, the
    double loop's first), while the model call's attention_mask calls row 0's 8 tokens and row 1's 3 real; the softmax
    spreads the weight over row 0's finfo.min keys and gives the -inf ones none (torch's answer, the program's print).

    The fix is flagged window-on-full-layer, and that is true of unsloth's code at 8e994f07fb (and at 015bdef0d9):
    LlamaModel_fast_forward's eval branch turns the 2-D mask into a 4-D one with `sliding_window =
    getattr(self.config, "sliding_window", None)` before the Gemma 2 branch, and transformers'
    `_prepare_4d_causal_attention_mask_for_sdpa` returns a 4-D mask as given, so dynamic_GA_mask, built "with
    sliding_window=None" for the odd (global) layers, is the windowed mask: Gemma2Config's layer_types[1] is
    full_attention, and layer 1 sees 4 keys at most (a padded prompt longer than sliding_window, on the path without
    flash-attn's softcapping)."""
    import torch

    from checkbugs import traced

    Gemma2Config = pytest.importorskip("transformers").Gemma2Config  # (the program is built from transformers' classes)
    name = "unsloth_gemma2_padded_inference_mask_inverted_row0_only"
    status, found, report = traced(tmp_path, name, False)
    assert status == 1, report
    lengths, t, window = (8, 3), 8, 4
    real = [[k >= t - n for k in range(t)] for n in lengths]  # left padded
    row0 = lambda q, k: k <= q and q - k < window  # noqa: E731 - the mask cut to [0][0]: row 0's, no padding
    values = [[torch.finfo(torch.float32).min if row0(q, k) else float("-inf") for k in range(t)] for q in range(t)]
    [masked] = [f for f in found if f["code"] == "fully-masked"]
    assert masked["severity"] == "wrong" and "the mask masks everything" in masked["message"], report
    assert tuple(masked["cell"]) == first((2, t, t), lambda b, q, k: values[q][k] < 0), report  # no cell is 0
    assert "uniform weights over the keys its finite fill holds there, none on the -inf ones" in masked["message"]
    weights = torch.softmax(torch.randn(t, t) + torch.tensor(values), -1)  # uniform over row 0's window, whatever the scores
    assert torch.allclose(weights[-1], torch.tensor([0.0] * 4 + [0.25] * 4)) and not real[1][4]  # pad key 4 of row 1
    [blind] = [f for f in found if f["code"] == "real-query-blind"]
    assert blind["severity"] == "wrong" and "(11 such rows)" in blind["message"], report  # 8 + 3 real queries
    assert tuple(blind["cell"]) == first((2, t, t), lambda b, q, k: real[b][q] and values[q][k] < 0), report
    [inf] = [f for f in found if f["code"] == "fill-became-inf"]
    assert inf["severity"] == "suspicious" and "x -3.40282e+38 in float32" in inf["message"], report

    status, found, report = traced(tmp_path, name, True)
    assert [(f["code"], f["severity"]) for f in found if f["severity"] in ("wrong", "suspicious")] == [
        ("window-on-full-layer", "wrong")], report  # true of the fix, above
    [wide] = [f for f in found if f["code"] == "window-on-full-layer"]
    config = Gemma2Config(num_hidden_layers=2, sliding_window=window)
    assert config.layer_types[1] == "full_attention" and wide["message"].startswith("layer 1 is a full-attention layer")
    given = lambda b, q, k: real[b][k] and row0(q, k)  # noqa: E731 - the windowed 4-D mask every layer gets
    full = lambda b, q, k: real[b][k] and k <= q  # noqa: E731 - what layer_types[1] states: causal + padding
    assert first((2, t, t), lambda b, q, k: full(b, q, k) and not given(b, q, k)) == (0, 4, 0)  # a key the window cut


def test_an_additive_mask_converted_again_as_if_it_were_0_1_masks_everything(tmp_path):
    """unsloth#3034's bug written another way: a generation wrapper hands the decoder a 4-D additive mask (0 / finfo.min,
    causal and padding) and the decoder converts it again, `(1.0 - mask) * finfo.min`: its kept cells become finfo.min
    and its masked ones -inf, so no key is let through; nn.MultiheadAttention (batch_first) with a (b * heads, L, L)
    float mask, right padded. The cell is a double loop's first where the converted value masks; MHA spreads the weight
    over the finfo.min keys (torch's answer, checked). The fix (a 4-D mask passed on as it is) is quiet, and so is the
    same decoder handed the 0/1 mask and converting it once, left padded (its pad queries: a note)."""
    import torch

    from checkbugs import traced

    found = check_bug(tmp_path, "additive_mask_converted_again_mha_right_padded", "fully-masked", ROWSDATA)
    lengths, t, low = (6, 3), 6, torch.finfo(torch.float32).min
    additive = [[[0.0 if k <= q and k < n else low for k in range(t)] for q in range(t)] for n in lengths]
    again = torch.tensor([[[(1.0 - v) * low for v in row] for row in plane] for plane in additive])  # cell by cell
    assert tuple(found[0]["cell"]) == first((2, t, t), lambda b, q, k: bool(again[b, q, k] < 0)), found
    assert "the mask masks everything (uniform weights over the keys its float mask fills with a finite value" in \
        found[0]["message"], found
    weights = torch.softmax(torch.randn(t) + again[1, 5], -1)  # row 1's last query: its 3 real keys, evenly
    assert torch.allclose(weights, torch.tensor([1 / 3] * 3 + [0.0] * 3))
    status, found, report = traced(tmp_path, "additive_mask_converted_once_mha_left_padded_quiet", False, ROWSDATA)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report
    assert [f["severity"] for f in found if f["code"] == "fully-masked"] == ["note"], report


def test_an_encoders_self_attention_sees_later_keys_by_design(tmp_path):
    """A query that sees later keys where the module path names an encoder and no decoder is the program's word that
    the layer attends both ways: transformers' LongT5 transient-global encoder blocks (quiet-r85b, written blind: its
    blocked keys, [previous, own, next block, global tokens], read as sees-later before round 85). The same cells at a
    decoder's self-attention still are a slip."""
    off = cells(1, 4, 4, lambda b, q, k: k <= q + 1)  # (a causal mask one key off: the double loop above)
    for where, said in (("encoder.block.0.layer.0.TransientGlobalSelfAttention", False),
                        ("vision_model.encoder.layers.1.self_attn", False),
                        ("model.decoder.layers.0.self_attn", True), ("layers.0.attn", True)):
        keep, stored = call(off)
        found = later(SimpleNamespace(**vars(keep), where=where), stored, None)
        assert bool(found) == said, where
    status, found, report = traced(tmp_path, "quiet_transformers_longt5_tglobal_padded_sources_summarise", False,
                                   Path(__file__).parent / "data" / "quiet_blind")
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report


def test_a_pool_of_cache_slots_an_engine_states_its_requests_over_has_no_query_order():
    """vLLM's flex backend (written blind, quiet-r82a, sees-later *suspicious*): every page of the KV cache is the key
    axis, the queries of every request packed as rows, the mask mapping each physical slot to its request's position.
    A request whose pages sit late in the pool sees slots after the column the queries would take at the end of the
    keys, though it sees only its own earlier positions. Its metadata (query_start_loc, seq_lens: 3 new tokens, 8 keys,
    over 24 slots) says the keys are no sequence laid on the axis: quiet. The same cells with no metadata are still
    read with the queries at the end of the keys."""
    import torch
    import torch.nn.functional as F

    import maskcli

    block, pages = 4, {0: [5, 1], 1: [0]}  # request 0: 5 keys on pages 5 then 1; request 1: 3 keys on page 0
    lengths, new = [5, 3], [1, 2]
    keep = torch.zeros(1, 1, 3, 24, dtype=torch.bool)
    row = 0
    for r, (n, m) in enumerate(zip(lengths, new)):
        for position in range(n - m, n):  # each new token, at its position, sees its request's positions 0..itself
            for k in range(position + 1):
                keep[0, 0, row, pages[r][k // block] * block + k % block] = True
            row += 1
    assert keep[0, 0, 0].nonzero().flatten().tolist() == [4, 20, 21, 22, 23]  # slots after column 21 (24 - 3 + 0)

    def attend(q, k, v, mask, attn_metadata):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    def engine_step(q, k, v, mask):  # (the metadata held only here: the bare call below is made where none is)
        return attend(q, k, v, mask, SimpleNamespace(query_start_loc=torch.tensor([0, 1, 3]),
                                                     seq_lens=torch.tensor(lengths)))

    def bare(q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    q, k, v = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 24, 8), torch.randn(1, 2, 24, 8)
    with maskcli.trace() as t:
        engine_step(q, k, v, keep)
    [group] = t.groups()
    assert [f.code for f in group.findings if f.code == "sees-later"] == []
    with maskcli.trace() as t:
        bare(q, k, v, keep)
    [group] = t.groups()
    assert "sees-later" in [f.code for f in group.findings]


def test_a_sequence_the_programs_own_mask_calls_padding_whole_is_a_note_and_an_all_true_block_mask_is_wrong():
    """mlx-audio's Irodori-TTS fix (written blind, batch blind-om; fully-masked *wrong* on it before): an empty caption
    is masked whole, every token 0 in its `mask` (1 = real), and its caption encoder attends over nothing real. The
    program states the sequence is padding, and its ids (a BOS, then pad ids) bear it out, so the rows that see nothing
    are a note; over ids that are text the same mask is wrong. A key_padding_mask of all True handed where True = masked
    (meant: every token real) still masks everything, wrong."""
    import torch
    import torch.nn.functional as F

    import maskcli

    def encode(x, input_ids, mask):  # mask: (B, L), 1 = real, as the caption encoder takes it
        keep = mask[:, None, None, :] & mask[:, None, :, None]
        return F.scaled_dot_product_attention(x, x, x, attn_mask=torch.where(keep, 0.0, -1e9))

    x = torch.randn(1, 2, 6, 4)
    empty = torch.tensor([[1, 0, 0, 0, 0, 0]])  # (an empty caption: BOS, then the pad id)
    with torch.no_grad(), maskcli.trace() as t:
        encode(x, empty, torch.zeros(1, 6, dtype=torch.bool))
    [group] = t.groups()
    [said] = [f for f in group.findings if f.code == "fully-masked"]
    assert said.severity == "note" and "calls every token padding" in said.message, said

    # the same mask, 0 everywhere, over ids that are text (PaLM-rlhf's encoder `mask = x < 0` read as a keep mask): the
    # mask alone says nothing of its polarity, and the tokens are real
    with torch.no_grad(), maskcli.trace() as t:
        encode(x, torch.tensor([[5, 9, 3, 7, 2, 8]]), torch.zeros(1, 6, dtype=torch.bool))
    [group] = t.groups()
    assert [f.severity for f in group.findings if f.code == "fully-masked"] == ["wrong"]

    mha = torch.nn.MultiheadAttention(4, 2, batch_first=True)
    with torch.no_grad(), maskcli.trace() as t:
        mha(x[0], x[0], x[0], key_padding_mask=torch.ones(2, 6, dtype=torch.bool), need_weights=True)
    codes = {(f.code, f.severity) for g in t.groups() for f in g.findings}
    assert ("fully-masked", "wrong") in codes, codes


def test_sd_scripts_lumina_noise_refiner_image_mask_never_filled(tmp_path):
    """kohya-ss/sd-scripts d94bed64 (written blind, batch blind-ov; caught before any rule changed for it): NextDiT's
    noise refiner got `torch.zeros(..., dtype=torch.bool)` for its image tokens' mask, never filled, so SDPA gave every
    image token 0 from the refiner's attention. The fix sets each sample's image tokens True."""
    [hit, *_] = check_bug(tmp_path, "sd_scripts_lumina_nextdit_noise_refiner_image_mask_all_false", "fully-masked")
    assert "every query of every batch row sees no key at all" in hit["message"]


def test_attention_gym_paged_mask_mod_reads_the_block_masks_batch_row(tmp_path):
    """meta-pytorch/attention-gym#190 (written blind, batch blind-ot; caught before any rule changed for it, with an
    unwritten-slot false alarm on its fix then): the converted mask_mod looked the page map up by the block mask's own
    batch index, so a request prefilled in slot 1 read slot 0's page map and saw none of its own keys. The fix, whose
    requests sit on pages of one pool (slot j no position j), is quiet."""
    hits = check_bug(tmp_path, "attention_gym_paged_mask_mod_page_map_row_from_block_mask_batch", "fully-masked")
    assert all("every query of every batch row sees no key at all" in hit["message"] for hit in hits)
