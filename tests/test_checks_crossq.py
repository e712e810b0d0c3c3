"""checks/crossq.py: a cross-attention whose queries were unpadded with its keys' padding."""

from __future__ import annotations

import json
from pathlib import Path

from checkbugs import check_bug, runner
from maskcli.commands import app

HELD = Path(__file__).parent / "data" / "held"


def test_vllm_omnis_varlen_cross_attention_unpadding_the_image_queries_by_the_text_mask_is_flagged(tmp_path):
    """vllm-project/vllm-omni#5865 (blind-j): `_upad_input` on a cross-attention keeps 5 and 3 of the 6 image
    queries of each row, the text mask's real counts; the fix keeps the queries dense."""
    found = check_bug(tmp_path, "vllm_omni_flash_varlen_cross_attn_query_unpadded_by_key_mask", "queries-unpadded-by-keys")
    assert "attends [5, 3] of them per row" in found[0]["message"] and found[0]["cell"] == [0, 5, 0]


def test_a_latent_loop_trimming_its_queries_by_the_text_lengths_is_flagged(tmp_path):
    """Written another way: a Perceiver-style module that says `is_cross_attention`, a softmax by hand in a loop over
    the batch, the text padding held as lengths, fewer keys (6) than latents (8)."""
    found = check_bug(tmp_path, "latent_cross_attention_trims_queries_by_text_lens", "queries-unpadded-by-keys", HELD)
    assert "attends [6, 2, 4] of them per row" in found[0]["message"]


PROGRAM = '''
import torch
import torch.nn as nn

class Attention(nn.Module):
    def __init__(self, dim, cross):
        super().__init__()
        self.is_cross_attention = cross
        self.qkv = nn.Linear(dim, 3 * dim)

    def forward(self, x, memory, tgt_lens, src_lens):
        q = self.qkv(x)[..., :8].unsqueeze(1)
        k = self.qkv(memory)[..., 8:16].unsqueeze(1)
        out = torch.zeros_like(q)
        for i in range(x.shape[0]):
            m, n = int(tgt_lens[i]), int(src_lens[i])
            w = (q[i:i + 1, :, :m] @ k[i:i + 1, :, :n].transpose(-1, -2)).softmax(-1)
            out[i:i + 1, :, :m] = w @ k[i:i + 1, :, :n]
        return out

class SelfAttention(Attention):
    def forward(self, x, lengths):  # (one padding held: the sequence's own)
        q, k = self.qkv(x)[..., :8].unsqueeze(1), self.qkv(x)[..., 8:16].unsqueeze(1)
        for i in range(x.shape[0]):
            n = int(lengths[i])
            (q[i:i + 1, :, :n] @ k[i:i + 1, :, :n].transpose(-1, -2)).softmax(-1)

torch.manual_seed(0)
with torch.no_grad():
    x = torch.randn(2, 6, 8)
    # a self-attention unpadding its own tokens: queries and keys are one sequence's real tokens
    SelfAttention(8, False)(x, torch.tensor([6, 3]))
    # a cross-attention whose decoder rows are padded as its encoder rows are: each side unpadded by its own lengths
    Attention(8, True)(x, torch.randn(2, 4, 8), torch.tensor([4, 2]), torch.tensor([4, 2]))
'''


def test_a_self_attentions_unpadding_and_a_decoder_unpadded_by_its_own_lengths_are_quiet(tmp_path):
    program = tmp_path / "unpadded.py"
    program.write_text(PROGRAM)
    out = tmp_path / "unpadded.json"
    result = runner.invoke(app, ["trace", "--json", str(out), str(program)])
    data = json.loads(out.read_text())
    assert len(data["calls"]) == 4, result.output
    assert all(c["details"].get("query_input") == [2, 6] for c in data["calls"]), result.output
    codes = [f["code"] for group in data["groups"] for f in group["findings"]]
    assert "queries-unpadded-by-keys" not in codes, result.output
