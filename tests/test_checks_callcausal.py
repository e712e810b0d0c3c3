"""checks/callcausal.py: a model call handed is_causal=False whose self-attention still runs causal."""

from __future__ import annotations

from pathlib import Path

from checkbugs import check_bug, first, traced

FOLDER = Path(__file__).parent / "data" / "callcausal"


def test_flash_wrapper_pops_the_callers_is_causal(tmp_path):
    """transformers#39707 (written blind, batch blind-cb): flash_attention_forward dropped the caller's is_causal and
    used the module's True, so `model(..., is_causal=False)` stayed causal. Its fix (the caller's False reaching the
    kernel while Qwen3Attention.is_causal stays True) is quiet: the module's flag is the default the argument overrides
    (own.py's causal-flag-ignored said it was wrong before)."""
    hit = check_bug(tmp_path, "transformers_flash_attention_is_causal_kwarg_ignored", "causal-argument-ignored")[0]
    real = [[1] * 10, [1] * 7 + [0] * 3]  # the program's attention_mask, a loop over real later keys hidden
    assert tuple(hit["cell"]) == first((2, 10, 10), lambda b, q, k: k > q and bool(real[b][q] and real[b][k]))
    assert "is_causal=False handed to Qwen3Model" == hit["source"]


def test_a_gpt_embedding_pass_over_a_left_padded_batch(tmp_path):
    """Written another way: nanoGPT-style blocks that hand is_causal down to a hand-written softmax attention that reads
    its own self.causal instead, over a left-padded batch; the first cell is a double loop's over real queries and the
    later real keys they do not see. The fix is quiet (its module's self.causal = True is overridden too)."""
    status, found, report = traced(tmp_path, "gpt_embedding_pass_is_causal_argument_dropped", False, FOLDER)
    assert status == 1, report
    hit = next(f for f in found if f["code"] == "causal-argument-ignored")
    assert hit["severity"] == "wrong"
    real = [[0, 0, 0, 1, 1, 1, 1], [1] * 7]
    assert tuple(hit["cell"]) == first((2, 7, 7), lambda b, q, k: k > q and bool(real[b][q] and real[b][k]))
    status, found, report = traced(tmp_path, "gpt_embedding_pass_is_causal_argument_dropped", True, FOLDER)
    assert status == 0 and [f for f in found if f["severity"] in ("wrong", "suspicious")] == [], report


QUIET = '''
import torch
import torch.nn.functional as F
from torch import nn


class LM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.qkv = nn.Linear(8, 24)

    def forward(self, idx, is_causal=False, mask=None):
        x = self.embed(idx)
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 4).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None)


model = LM().eval()
idx = torch.arange(6)[None]
with torch.no_grad():
    model(idx)  # is_causal left at its default: the caller said nothing
    model(idx, False, torch.ones(6, 6, dtype=torch.bool).tril())  # its own (L, L) mask: the cells are its word
'''


def test_a_default_left_in_place_or_a_mask_handed_beside_it_says_nothing(tmp_path):
    """is_causal read only where the caller hands it: a default says nothing, and a model call handed its own (L, L)
    mask beside is_causal=False has said what the cells are (is_causal then only adds no triangle)."""
    program = tmp_path / "quiet.py"
    program.write_text(QUIET)
    status, found, report = traced(tmp_path, "quiet", False, tmp_path)
    assert status == 0 and [f for f in found if f["code"] == "causal-argument-ignored"] == [], report


def test_a_helper_called_with_a_literal_causal_false_that_runs_causal(tmp_path):
    """karpathy/nanochat#805 (written blind, batch blind-ci): the SDPA fallback of `flash_attn_func(..., causal=False)`
    never received causal and ran is_causal=True. The program's own call line hands the helper causal=False: the
    kernel's causal mask contradicts it (trace/calledflag.py); its fix, the flag passed on, is quiet."""
    hit = check_bug(tmp_path, "nanochat_sdpa_fallback_drops_causal_false", "causal-argument-ignored")[0]
    assert hit["source"] == "BidirectionalSelfAttention.forward: flash_attn_func(..., causal=False)"
    assert tuple(hit["cell"]) == first((4, 12, 12), lambda b, q, k: k > q)  # the first later key, by a double loop


def test_the_same_helper_bug_in_a_padded_encoder_with_a_softmax_of_its_own(tmp_path):
    """Written another way: a sentence encoder's layer calls `attention(q, k, v, lengths, is_causal=False)` over a
    right-padded batch; the helper ANDs the triangle in whatever it is told, before a hand-written softmax."""
    hit = check_bug(tmp_path, "encoder_attention_fn_ignores_is_causal_false", "causal-argument-ignored", FOLDER)[0]
    assert hit["source"] == "EncoderLayer.forward: attention(..., is_causal=False)"
    real = [8, 4]  # the rows' real tokens (the program's attention_mask): later real keys hidden, counted by a loop
    hidden = sum(1 for b in range(2) for q in range(8) for k in range(8) if q < k < real[b])
    assert f"({hidden} such cells)" in hit["message"]


QUIET_HELPER = """
import torch
import torch.nn.functional as F
from torch import nn


def attend(q, k, v, causal_mask=None, is_causal=False):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x):
        q, k, v = self.qkv(x).view(1, -1, 3, 2, 4).permute(2, 0, 3, 1, 4)
        tri = torch.ones(6, 6, dtype=torch.bool).tril()
        return attend(q, k, v, causal_mask=tri, is_causal=False)  # its own causal mask handed beside the False


with torch.no_grad():
    Layer()(torch.randn(1, 6, 8))
"""


def test_a_literal_false_beside_a_mask_handed_says_nothing(tmp_path):
    """A helper called with is_causal=False and a square mask of the program's own: the cells are its word."""
    program = tmp_path / "quiet_helper.py"
    program.write_text(QUIET_HELPER)
    status, found, report = traced(tmp_path, "quiet_helper", False, tmp_path)
    assert status == 0 and [f for f in found if f["code"] == "causal-argument-ignored"] == [], report
