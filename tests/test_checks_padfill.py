"""checks/padfill.py: padding flags that hold the attention's own fill (the mask built in place on them); against
torch's own view semantics."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, traced

PADFILL = Path(__file__).parent / "data" / "padfill"


def _flags_after(build) -> torch.Tensor:
    """The flags [0, 0, 1] after `build(flags)` made a mask of them."""
    flags = torch.tensor([[0.0, 0.0, 1.0]])
    build(flags)
    return flags


def test_timesfm_convert_paddings_to_mask_multiplies_a_view_in_place(tmp_path):
    """google-research/timesfm 1b95563 (written blind, batch blind-cm): `attention_mask = paddings[:, None, None, :];
    attention_mask *= -0.7 * finfo.max` writes the fill into the `paddings` every layer's MLP reads (`1 - paddings`);
    the fix multiplies `paddings.detach().clone()`. Its NaN, spread to later layers and decode steps, is no mask
    finding of its own (layer-differs, mask-argument-dropped left alone). Against torch: the view's in-place product
    changes its base, the clone's does not."""
    name = "timesfm_torch_convert_paddings_to_mask_inplace_corrupts_paddings"
    [hit] = check_bug(tmp_path, name, "padding-holds-fill")
    assert "`paddings` handed to TimesFMDecoderLayer.forward() hold -2.38198e+38" in hit["message"]
    _, found, _ = traced(tmp_path, name, False)
    assert {f["code"] for f in found if f["severity"] == "wrong"} == {"padding-holds-fill"}
    fill = -0.7 * torch.finfo(torch.float32).max

    def view(flags):
        mask = flags[:, None, None, :]
        mask *= fill

    assert _flags_after(view)[0, 2] == torch.tensor(fill)
    assert _flags_after(lambda flags: flags.detach().clone()[:, None, None, :].mul_(fill))[0, 2] == 1.0


def test_encoder_padding_view_mul_in_place(tmp_path):
    """Written another way (tests/data/padfill): a praxis-style encoder over right-padded frames builds its mask once
    as `padding.view(b, 1, 1, n).mul_(-1e9)`, so the flags each layer and the pooling read hold -1e9; the fix's
    out-of-place product is quiet."""
    [hit] = check_bug(tmp_path, "praxis_encoder_padding_view_mul_inplace", "padding-holds-fill", PADFILL)
    assert "`padding` handed to EncoderLayer.forward() hold -1e+09 on 8 of 27" in hit["message"]
    assert _flags_after(lambda flags: flags.view(1, 1, 1, 3).mul_(-1e9))[0, 2] == -1e9
    assert _flags_after(lambda flags: flags.view(1, 1, 1, 3) * -1e9)[0, 2] == 1.0
