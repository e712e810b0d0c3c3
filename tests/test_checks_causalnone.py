"""checks/causalnone.py (and trace/causalnone.py, which records what it reads): a causal mask the attending code holds
as None while the kernel attends every key, later ones included."""

from __future__ import annotations

from pathlib import Path

import torch

from checkbugs import check_bug, traced

CAUSALNONE = Path(__file__).parent / "data" / "causalnone"


def _sees_later(q_len: int) -> tuple[int, int, int]:
    """The first cell a causal mask hides that the kernel kept: SDPA's own causal mask against its unmasked call."""
    q = torch.randn(1, 1, q_len, 4)
    full = torch.ones(q_len, q_len, dtype=torch.bool)
    causal = torch.ones(q_len, q_len, dtype=torch.bool).tril()  # what is_causal=True keeps (torch.tril: the reference)
    assert torch.allclose(torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True),
                          torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=causal))
    q_at, k_at = [int(x) for x in torch.nonzero(full & ~causal)[0]]
    return (0, q_at, k_at)


def test_adapters_llama_sdpa_attention_drops_is_causal(tmp_path):
    # adapter-hub/adapters#722 (closes #721, commit fc929b4bf; written blind, batch blind-dk):
    # LlamaSdpaAttentionWithAdapters called F.scaled_dot_product_attention without is_causal; on a batch with no
    # padding _update_causal_mask returns None and the LoRA-Llama attended the future tokens
    found = check_bug(tmp_path, "adapters_llama_sdpa_attention_drops_is_causal", "causal-mask-none-unapplied")
    assert tuple(found[0]["cell"]) == _sees_later(12)
    assert "causal_mask in forward()" in found[0]["message"]


def test_neox_helper_none_mask_on_the_unpadded_batch(tmp_path):
    """Written another way: a GPT-NeoX-style port whose `_attn(query, key, value, causal_mask=None)` helper hands the
    mask to SDPA positionally; a left-padded batch gets its tensor mask (quiet), the unpadded one None."""
    found = check_bug(tmp_path, "neox_sdpa_helper_none_mask_unpadded_batch", "causal-mask-none-unapplied",
                      folder=CAUSALNONE)
    assert "causal_mask in _attn()" in found[0]["message"]
    assert tuple(found[0]["cell"]) == _sees_later(2)


def test_quiet_where_the_module_says_not_causal(tmp_path):
    """`causal_mask = None` under `if self.causal` with causal False: the encoder's None is a choice."""
    status, found, report = traced(tmp_path, "encoder_flag_false_causal_mask_none", False, CAUSALNONE)
    assert status == 0 and not [f for f in found if f["severity"] in ("wrong", "suspicious")], report
