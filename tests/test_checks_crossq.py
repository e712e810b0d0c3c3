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


from test_trace_flash import flash_attn  # noqa: E402,F401 - the stand-in flash_attn package (a fixture)

VARLEN = '''
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F
from flash_attn import flash_attn_varlen_func

FIXED = "--fixed" in sys.argv

class CrossAttention(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q, self.to_kv = nn.Linear(dim, dim), nn.Linear(dim, 2 * dim)

    def forward(self, hidden_states, encoder_hidden_states, encoder_attention_mask):
        b, lq, dim = hidden_states.shape
        lk = encoder_hidden_states.shape[1]
        q = self.to_q(hidden_states).view(b * lq, self.heads, -1)
        k, v = self.to_kv(encoder_hidden_states).view(b * lk, 2, self.heads, -1).unbind(1)
        out, queries = _upad_attend(q, k, v, encoder_attention_mask, lq)
        return torch.zeros(b * lq, *out.shape[1:]).index_copy(0, queries, out).view(b, lq, dim)


def _unpad(attention_mask):
    return attention_mask.flatten().nonzero().flatten(), F.pad(attention_mask.sum(-1).cumsum(0), (1, 0)).int()


def _upad_attend(q, k, v, attention_mask, query_length):
    """transformers' _upad_input, written for self-attention: the queries unpadded by the mask's last columns."""
    b, lk = attention_mask.shape
    keys, cu_k = _unpad(attention_mask)
    if FIXED:
        cu_q, queries = torch.arange(0, (b + 1) * query_length, query_length, dtype=torch.int32), torch.arange(b * query_length)
    else:
        attention_mask = attention_mask[:, -query_length:]
        queries, cu_q = _unpad(attention_mask)
    return flash_attn_varlen_func(q[queries], k[keys], v[keys], cu_q, cu_k, query_length, lk), queries

torch.manual_seed(0)
mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1, 1, 1]], dtype=torch.bool)  # left-padded text
with torch.no_grad():
    CrossAttention(8, 2)(torch.randn(2, 4, 8), torch.randn(2, 8, 8), mask)
'''


def test_a_varlen_flash_cross_attention_whose_cu_seqlens_q_follow_the_key_mask_is_flagged(tmp_path, flash_attn):
    """A third way: one flash_attn_varlen_func call, 4 queries per row over 8 left-padded keys (6 and 3 real), its
    cu_seqlens_q taken from the key mask's last 4 columns (4 and 3 queries); the fix's dense queries are quiet."""
    program = tmp_path / "varlen_cross.py"
    program.write_text(VARLEN)
    for fixed in (False, True):
        out = tmp_path / f"varlen{fixed}.json"
        result = runner.invoke(app, ["trace", "--json", str(out), str(program), *(["--fixed"] if fixed else [])])
        data = json.loads(out.read_text())
        assert [c["api"] for c in data["calls"]] == ["flash"], result.output
        found = [f for group in data["groups"] for f in group["findings"] if f["code"] == "queries-unpadded-by-keys"]
        if fixed:
            assert found == [] and result.exit_code == 0, result.output
        else:
            assert result.exit_code == 1 and "attends [4, 3] of them per row" in found[0]["message"], result.output
            assert found[0]["cell"] == [1, 3, 0]
