"""checks/named.py: what the recogniser named, said as a finding; the naming itself is test_trace.py's (end to end)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np

from maskcli.checks.named import closest, polarity, same_as
from maskcli.inspect.structure import recognise


def test_a_causal_mask_in_the_wrong_polarity_is_named_with_how_the_api_reads_it():
    keep = ~np.tril(np.ones((4, 4), dtype=bool))[None, None]  # torch.triu(ones, 1): MHA's block mask read as keep
    flipped = recognise(~keep)
    assert flipped.kind == "causal"
    [found] = polarity(SimpleNamespace(api="sdpa"), flipped.kind, flipped.expression)
    assert found.message == ("read the other way round it is causal: a mask in the wrong polarity? "
                             "(SDPA reads a bool mask as True = may attend)")
    assert polarity(SimpleNamespace(api="sdpa"), "tril", "tril(1)") == []  # a raw matrix either way round says nothing
    assert polarity(SimpleNamespace(api="sdpa"), None, None) == []


def test_two_names_for_the_same_cells_and_the_nearest_expression():
    local = SimpleNamespace(expression="local(2)")
    assert same_as(local, "document(sizes=[2,2])")[0].message == "local(2) is also document(sizes=[2,2]): the same cells"
    assert same_as(local, None) == []
    near = SimpleNamespace(closest={"expression": "causal", "rows": ["row 1: +key 2", "row 2: +key 3", "row 3"]})
    assert closest(near)[0].message == "against causal: row 1: +key 2; row 2: +key 3"
    assert closest(SimpleNamespace(closest=None)) == []


def test_whole_batch_rows_masked_are_not_said_to_look_flipped():
    """An MSA's column attention (lucidrains/alphafold2's AxialAttention) folds each residue's column into the batch:
    a padded residue's column is a batch row that sees nothing, the others see everything. Read the other way round it
    is padding with lengths 0, which only swaps the empty rows: no polarity slip. A padding mask the wrong way round,
    which keeps part of each row, is still said to look flipped."""
    import torch

    import maskcli

    torch.manual_seed(0)
    real = torch.ones(6, 3, dtype=torch.bool)
    real[4:] = False  # residues 4-5 are padding: their columns' MSA rows are all masked
    q, k, v = torch.randn(3, 6, 2, 3, 4).unbind(0)
    keep = torch.arange(4)[None] < torch.tensor([4, 2, 3])[:, None]  # True = real, handed where True = masked
    q2, k2, v2 = torch.randn(3, 3, 2, 4, 4).unbind(0)
    with maskcli.trace() as t:
        pair = real[:, None, :, None] & real[:, None, None, :]
        (q @ k.transpose(-2, -1)).masked_fill(~pair, -torch.finfo(q.dtype).max).softmax(-1) @ v
        (q2 @ k2.transpose(-2, -1)).masked_fill(keep[:, None, None, :], -1e9).softmax(-1) @ v2
    column, flipped = t.calls
    cells = column.keep()
    for b, h, i, j in np.ndindex(cells.shape):  # what the kernel kept: every cell of a real column, none of a padded one
        assert cells[b, h, i, j] == (b < 4)
    groups = {g.calls[0].index: g for g in t.groups()}
    assert [f.code for f in groups[column.index].findings if f.code == "polarity"] == []
    [said] = [f for f in groups[flipped.index].findings if f.code == "polarity"]
    assert said.message == "read the other way round it is padding (--lengths 4,2,3): a mask in the wrong polarity?"


def test_a_cross_mask_whose_imageless_rows_keep_every_tile_is_not_said_to_look_flipped():
    """mllama's cross-attention mask (transformers' _prepare_cross_attention_mask): a text token before any image keeps
    every tile (its output is zeroed after the call), the others keep the real tiles 0-3 of 6. Read the other way
    round the first row would see no tile at all: no sign of a polarity slip. A causal mask handed the wrong way round
    in the same run is still said to look flipped."""
    import torch
    import torch.nn.functional as F

    import maskcli

    torch.manual_seed(0)
    q, v = torch.randn(2, 1, 2, 6, 8).unbind(0)
    k = torch.randn(1, 2, 6, 8)
    meant = torch.zeros(6, 6, dtype=torch.bool)
    meant[:1] = True  # text before the image: every tile, zeroed after
    meant[1:, :4] = True  # the real tiles
    with maskcli.trace() as t:
        F.scaled_dot_product_attention(q, k, v, attn_mask=meant)
        F.scaled_dot_product_attention(q, k, v, attn_mask=torch.ones(6, 6, dtype=torch.bool).triu(1))
    given, flipped = t.calls
    for i, j in np.ndindex(6, 6):  # what the kernel kept, against the mask built by hand above
        assert given.keep()[0, 0, i, j] == (i < 1 or j < 4)
    groups = {g.calls[0].index: g for g in t.groups()}
    assert [f for f in groups[given.index].findings if f.code == "polarity"] == []
    [said] = [f for f in groups[flipped.index].findings if f.code == "polarity"]
    assert said.message.startswith("read the other way round it is causal")


def test_guidance_rows_over_zero_values_are_left_out_of_the_other_reading():
    """A cross-attention over a text condition padded on the right, doubled for classifier-free guidance: the null rows
    keep no key and read states that are 0 under bias-free projections (MusicGen's generate). Their product with the
    values is 0, so they are left out: the rest is plain right padding, no sign of a polarity slip, and a batch of
    null rows alone says nothing either. The same mask over values that are not 0 still looks flipped."""
    import torch

    import maskcli

    torch.manual_seed(0)
    lengths = [6, 3, 1, 0, 0, 0]
    keep = torch.tensor([[k < n for k in range(6)] for n in lengths])  # (6, 6): batch row x key, by a loop
    states = torch.randn(6, 6, 8)
    states[3:] = 0  # the null rows' zero states
    proj = torch.nn.Linear(8, 8, bias=False)

    def attend(x, mask):
        k = v = proj(x)[:, None]  # (B, 1, 6, 8)
        q = torch.randn(x.shape[0], 1, 2, 8)
        scores = q @ k.transpose(-1, -2) + torch.where(mask, 0.0, torch.finfo(torch.float32).min)[:, None, None, :]
        return torch.softmax(scores, -1) @ v

    with torch.no_grad(), maskcli.trace() as t:
        out = attend(states, keep)
        attend(states[3:], keep[3:])
    assert out[3:].abs().max() == 0
    found = {g.calls[0].index: [f.code for f in g.findings] for g in t.groups()}
    assert "polarity" not in found[0] and "polarity" not in found[1]
    with torch.no_grad(), maskcli.trace() as t:
        attend(states + 1, keep)  # (the null rows' values not 0: no reading left out)
    [group] = t.groups()
    assert "polarity" in [f.code for f in group.findings]


def test_a_causal_tile_of_a_blockwise_kernel_is_not_said_to_look_flipped(tmp_path):
    """A blockwise kernel's (query tile, key tile) pair whose keys all come after its queries is all hidden under a
    causal mask, full read the other way round: no polarity slip where the tile, at its places in the whole
    (trace/tiled.py's "tile"), hides only keys after their queries (memory-efficient-attention-pytorch's chunks in
    tests/data/quiet_blind; a FlashAttention-2 loop in tests/data/quiet, flagged before). A tile that hides keys at or
    before its queries is no causal tile's: still read both ways."""
    from checkbugs import traced
    from maskcli.checks.tiled import hides_only_later

    def hides(keep: np.ndarray, tile: list) -> bool:  # (reference: cell by cell at the places the tile states)
        return all(keep[b, h, i, j] or tile[2][0] + j > tile[1][0] + i
                   for b, h, i, j in np.ndindex(keep.shape))

    after, before = [[0, 1], [0, 30], [14, 30]], [[0, 1], [16, 30], [7, 30]]
    for tile, expected in ((after, True), (before, False)):
        empty = np.zeros((1, 1, 8, 7), dtype=bool)
        tiled = SimpleNamespace(shape=empty.shape, details={"tile": tile})
        assert hides_only_later(tiled, empty) == hides(empty, tile) == expected
    straddling = [[0, 1], [8, 30], [7, 30]]
    for off in (0, -1):  # causal at its places, then one that hides each query's own key too
        keep = np.array([[[[7 + j <= 8 + i + off for j in range(7)] for i in range(8)]]])
        tiled = SimpleNamespace(shape=keep.shape, details={"tile": straddling})
        assert hides_only_later(tiled, keep) == hides(keep, straddling) == (off == 0)
    _, found, _ = traced(tmp_path, "flash2_online_softmax_tiles_causal_pad", False,
                         Path(__file__).parent / "data" / "quiet")
    assert [f for f in found if f["code"] == "polarity"] == []


def test_an_all_hidden_mask_at_a_site_whose_other_masks_read_as_given_is_not_said_to_look_flipped():
    """IDEFICS' gated cross-attention, run again with its image_attention_mask all 0 (the program checking that its
    gate matters): every cell hidden, which read the other way round is full. The same module was handed, at the
    earlier call, a mask that keeps some cells and hides others (text before the first image sees none, later text sees
    the images before it), read as given: the site's code reads masks one way, so the all-0 mask is the program's own,
    no polarity slip. A site where every mask is all hidden (a keep mask of all True handed where True = masked) is
    still said to look flipped."""
    import torch

    import maskcli

    torch.manual_seed(0)

    class CrossAttention(torch.nn.Module):
        def forward(self, x, images, image_mask):  # image_mask: (B, Lq, Lk), 1 = this text token sees that image
            scores = x[:, None] @ images[:, None].transpose(-1, -2)
            fill = (1.0 - image_mask[:, None].to(x.dtype)) * torch.finfo(x.dtype).min  # IDEFICS' additive mask
            return torch.softmax(scores + fill, -1) @ images[:, None]

    seen = torch.zeros(2, 5, 4)
    seen[0, 1:3, :2] = 1  # an image at token 1: text from there sees its two latents
    seen[0, 3:, :] = 1  # a second image at token 3: both images
    seen[1, 2:, :2] = 1
    x, images = torch.randn(2, 5, 8), torch.randn(2, 4, 8)
    layer, other = CrossAttention(), CrossAttention()
    with torch.no_grad(), maskcli.trace() as t:
        layer(x, images, seen)
        layer(x, images, torch.zeros_like(seen))  # the gate off
        other(x[:1, :3], images[:1], torch.ones(1, 3, 4, dtype=torch.bool).logical_not())  # all hidden: a site of its own
    given, zero, alone = t.calls
    for b, i, j in np.ndindex(2, 5, 4):  # what the kernel kept: the mask as handed, and none of the zero one
        assert given.keep()[b, 0, i, j] == bool(seen[b, i, j]) and not zero.keep()[b, 0, i, j]
    found = {g.calls[0].index: [f.code for f in g.findings] for g in t.groups()}
    assert "polarity" not in found[given.index] and "polarity" not in found[zero.index]
    assert "polarity" in found[alone.index]
