"""checks/padflag.py (with trace/stated.py's padding_flags): a padding mask handed on and applied where the module that
calls the model states its padding is not masked, on a reproduction of a published bug and on a program written
otherwise, and quiet where the flag is True or no mask is handed on."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import maskcli
from checkbugs import check_bug
from maskcli.checks.registry import severity


def test_mosaicml_mask_pad_tokens_false_is_flagged_and_its_fix_is_not(tmp_path):
    # mosaicml/diffusion#147: the tokenizer's mask handed to CLIP and the U-Net although mask_pad_tokens=False
    pytest.importorskip("transformers")  # (its CLIP text encoder: the hf extra)
    check_bug(tmp_path, "mosaicml_sd_generate_masks_text_encoder_despite_mask_pad_tokens_false",
              "padding-masked-despite-flag")


class Encoder(nn.Module):
    """A bidirectional eager encoder layer: attention_mask (B, L), 1 = real, filled with -inf before the softmax."""

    def __init__(self, dim=8, heads=2):
        super().__init__()
        self.heads, self.qkv = heads, nn.Linear(dim, 3 * dim)

    def forward(self, x, attention_mask=None):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        scores = q @ k.transpose(-1, -2)
        if attention_mask is not None:
            scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, float("-inf"))
        return (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, n, d)


class Retriever(nn.Module):
    """Written otherwise: a flag named mask_padding, a hand-written encoder, the mask passed by keyword from a method."""

    def __init__(self, mask_padding: bool):
        super().__init__()
        self.mask_padding = mask_padding
        self.encoder = Encoder()

    def embed(self, x, mask, pass_mask: bool):
        return self.encoder(x, attention_mask=mask if pass_mask else None).mean(1)


def traced(mask_padding: bool, pass_mask: bool) -> list:
    torch.manual_seed(0)
    model = Retriever(mask_padding)
    x = torch.randn(2, 5, 8)
    lengths = [5, 2]
    mask = torch.tensor([[1 if j < n else 0 for j in range(5)] for n in lengths])
    with maskcli.trace() as t, torch.no_grad():
        model.embed(x, mask, pass_mask)
    return [(f.code, severity(f), f.message) for group in t.groups() for f in group.findings]


def test_a_wrapper_flag_false_with_a_mask_handed_on_is_wrong():
    found = [f for f in traced(False, True) if f[0] == "padding-masked-despite-flag"]
    assert len(found) == 1 and found[0][1] == "wrong", found
    # cells hidden, by a plain loop over rows, queries and keys: every query of row 1 kept from its 3 padding keys
    lengths, n = [5, 2], 5
    cells = sum(1 for b in range(2) for q in range(n) for k in range(n) if k >= lengths[b])
    assert f"({cells} such cells)" in found[0][2] and "mask_padding=False" in found[0][2], found


def test_the_flag_true_or_no_mask_handed_on_is_quiet():
    assert [f for f in traced(True, True) if f[0] == "padding-masked-despite-flag"] == []
    assert [f for f in traced(False, False) if f[0] == "padding-masked-despite-flag"] == []
