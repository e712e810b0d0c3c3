"""checks/kernelrows.py: what each attention API makes of a query row that sees no key, against torch itself."""

from __future__ import annotations

from types import SimpleNamespace


def test_a_row_masked_only_by_a_finite_float_fill_is_uniform_not_nan_in_mha_and_sdpa():
    """fairseq's TransformerEncoderLayer fills its context mask with -1e8 and hands key padding beside it: a padding
    query whose window holds only padding keys gets uniform weights over the -1e8 keys, as MHA computes (no NaN),
    where the same row filled with -inf is NaN. What the kernel gives is checked here against torch itself."""
    import torch
    import torch.nn.functional as F

    from maskcli.checks.kernelrows import what_api_does
    from maskcli.trace.masks import mha, sdpa

    torch.manual_seed(0)
    x = torch.randn(4, 1, 8)  # (L, B, E)
    weights = [torch.randn(24, 8), torch.zeros(24), torch.randn(8, 8), torch.zeros(8)]
    padding = torch.tensor([[False, False, True, True]])  # keys 2, 3 padding
    for fill, nan in ((-1e8, False), (float("-inf"), True)):
        context = torch.zeros(4, 4)
        context[3, :2] = fill  # query 3 sees keys 2-3 only, both padding
        args = (x, x, x, 8, 2, *weights[:2], None, None, False, 0.0, *weights[2:])
        kwargs = {"training": False, "key_padding_mask": padding, "need_weights": True, "attn_mask": context}
        seen = mha(args, kwargs)
        call = SimpleNamespace(api="mha", details=seen.details)
        out, _ = F.multi_head_attention_forward(*args, **kwargs)
        assert bool(out[3].isnan().any()) is nan  # torch's own answer
        assert ("NaN" in what_api_does(call)) is nan, what_api_does(call)
        q = torch.randn(1, 1, 4, 8)
        float_mask = context.masked_fill(padding[0][None, :].expand(4, 4), float("-inf"))
        seen = sdpa((q, q, q), {"attn_mask": float_mask})
        seen.make()
        call = SimpleNamespace(api="sdpa", details=seen.details)
        weights_row = torch.softmax(float_mask[3], -1)
        assert bool(weights_row.isnan().any()) is nan
        assert ("uniform" in what_api_does(call)) is (not nan), what_api_does(call)


def test_a_softmax_over_rows_mixing_the_lowest_value_and_minus_inf_is_uniform_over_the_finite_ones():
    """unslothai/unsloth#3034: `(1.0 - mask) * finfo.min` of a mask already 0 / finfo.min makes its kept cells finfo.min
    and its masked ones -inf. Every row sees no key by the mask's values, yet none is -inf only: softmax spreads each
    row's weight evenly over the finfo.min keys and gives the -inf ones none, as torch computes here (the message said
    "every key there, masked ones included"). A row of finfo.min only is still every key; a row of -inf only NaN."""
    import torch

    from maskcli.checks.kernelrows import what_api_does
    from maskcli.trace.masks import softmax

    low = torch.finfo(torch.float32).min
    keep = torch.ones(4, 4, dtype=torch.bool).tril()  # causal, row 0's of the batch
    mixed = torch.where(keep, torch.tensor(low), torch.tensor(float("-inf")))[None, None]
    scores = torch.randn(1, 1, 4, 4) + mixed
    weights = scores.softmax(-1)
    for q in range(4):  # the reference: uniform over the finite keys, 0 on the -inf ones
        for k in range(4):
            assert abs(float(weights[0, 0, q, k]) - (1 / (q + 1) if k <= q else 0.0)) < 1e-6
    call = SimpleNamespace(api="softmax", details=softmax((scores, -1), {}).details)
    said = what_api_does(call)
    assert said.startswith("uniform weights over the keys its finite fill holds") and "none on the -inf" in said, said
    for filled, expected in ((torch.full((1, 1, 4, 4), low), "masked ones included"),
                             (torch.full((1, 1, 4, 4), float("-inf")), "NaN")):
        call = SimpleNamespace(api="softmax", details=softmax((filled, -1), {}).details)
        assert expected in what_api_does(call), what_api_does(call)
