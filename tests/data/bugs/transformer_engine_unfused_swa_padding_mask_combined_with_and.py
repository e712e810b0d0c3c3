# Citation: NVIDIA/TransformerEngine#1281 "[PyTorch] Fix get_swa_mask() for padding masks"
#   (reported in NVIDIA/TransformerEngine#1271), commit f033498f6c941b190c869bfa09310c2de3efd2c9.
# Upstream: transformer_engine/pytorch/attention.py, get_swa_mask (replaced by get_full_mask),
#   DotProductAttention.forward (unfused dispatch) and UnfusedDotProductAttention.forward;
#   transformer_engine/pytorch/softmax.py FusedScaleMaskSoftmax.forward_torch_softmax;
#   transformer_engine/pytorch/utils.py attention_mask_func.
# Bug: with sliding-window attention (window_size=(w, 0)) and a "padding_causal" mask on the unfused
#   backend, get_swa_mask combined the [b,1,1,s] padding mask (True = masked out) with the window mask
#   using logical_and and relabelled the type "arbitrary", so a key was masked only when it was both a
#   pad key and outside the window, and the padding/causal handling for "padding_causal" was skipped.
# Fix: get_full_mask builds the full [b,1,sq,skv] padding mask, the window (top-left aligned for
#   padding_causal) and combines them with logical_or; the unfused backend calls it itself.
# CPU stand-in: device="cuda" in the mask builders is replaced by the tensors' device.
import sys
import math
from typing import Optional, Tuple, Union

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
DEVICE = "cpu"


# ---- transformer_engine/pytorch/utils.py --------------------------------------------------------
def attention_mask_func(attention_scores: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
    """Get attention mask"""
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


# ---- transformer_engine/pytorch/softmax.py (torch path) -----------------------------------------
_default_causal_mask = {}


def _get_default_causal_mask(mask_type: str, sq: int, sk: int) -> torch.Tensor:
    matrix_identifiers = (mask_type, sq, sk)
    if matrix_identifiers not in _default_causal_mask:
        diagonal_offset = sk - sq + 1 if "bottom_right" in mask_type else 1
        _default_causal_mask[matrix_identifiers] = torch.triu(
            torch.ones(sq, sk, dtype=torch.bool, device=DEVICE), diagonal=diagonal_offset)
    return _default_causal_mask[matrix_identifiers]


class FusedScaleMaskSoftmax(nn.Module):
    def __init__(self, mask_func, softmax_in_fp32=True):
        super().__init__()
        self.mask_func = mask_func
        self.softmax_in_fp32 = softmax_in_fp32

    def forward(self, inp, mask, attn_mask_type, scale=None):
        assert inp.dim() == 4
        self.input_in_fp16 = inp.dtype == torch.float16
        self.input_in_bf16 = inp.dtype == torch.bfloat16
        self.input_in_float16 = self.input_in_fp16 or self.input_in_bf16
        self.attn_mask_type = attn_mask_type
        # fused kernels need fp16/bf16 on GPU: fp32 on CPU takes the torch path
        return self.forward_torch_softmax(inp, mask, scale)

    def forward_torch_softmax(self, inp, mask, scale=None):
        if self.input_in_float16 and self.softmax_in_fp32:
            inp = inp.float()
        if scale is not None:
            inp = inp * scale
        if self.attn_mask_type in ["causal", "causal_bottom_right"]:
            seq_len_q, seq_len_k = inp.size(2), inp.size(3)
            causal_mask = _get_default_causal_mask(self.attn_mask_type, seq_len_q, seq_len_k)
            mask = causal_mask if mask is None else torch.logical_or(mask, causal_mask)
        mask_output = inp
        if mask is not None and self.attn_mask_type != "no_mask":
            mask_output = self.mask_func(inp, mask)
        probs = torch.nn.Softmax(dim=-1)(mask_output)
        return probs


# ---- transformer_engine/pytorch/attention.py: before the fix -------------------------------------
@torch.no_grad()
def get_swa_mask(window_size, max_seqlen_q, max_seqlen_kv, attn_mask_type="no_mask", attention_mask=None):
    mask = torch.ones(max_seqlen_q, max_seqlen_kv, dtype=torch.bool, device=DEVICE)
    if attn_mask_type in ["causal"]:
        left = window_size[0] if window_size[0] != -1 else max_seqlen_q
        right = window_size[1] if window_size[1] != -1 else max_seqlen_q
        mask_upper = torch.triu(mask, diagonal=-left)
        mask_lower = torch.tril(mask_upper, diagonal=right)
    else:
        left = window_size[0] if window_size[0] != -1 else max_seqlen_kv
        right = window_size[1] if window_size[1] != -1 else max_seqlen_kv
        mask_upper = torch.triu(mask, diagonal=max_seqlen_kv - max_seqlen_q - left)
        mask_lower = torch.tril(mask_upper, diagonal=max_seqlen_kv - max_seqlen_q + right)
    attn_mask_type = "arbitrary"
    mask = mask_lower.logical_not()
    if attention_mask is not None:
        mask = torch.logical_and(attention_mask, mask)
    return attn_mask_type, mask


# ---- transformer_engine/pytorch/attention.py: after the fix --------------------------------------
@torch.no_grad()
def get_full_mask(max_seqlen_q, max_seqlen_kv, attn_mask_type="no_mask", attention_mask=None,
                  window_size=None, attention_type="self", bottom_right_alignment=True):
    change_type = window_size is not None and (window_size[0] != -1 or window_size[1] not in [-1, 0])
    if window_size is None:
        window_size = (-1, -1)
    if "causal" in attn_mask_type:
        window_size = (window_size[0], 0)
    window_size = (
        max_seqlen_kv if window_size[0] == -1 else window_size[0],
        max_seqlen_q if window_size[1] == -1 else window_size[1],
    )
    actual_seqlens_q = None
    actual_seqlens_kv = None
    if "padding" in attn_mask_type:
        if attention_type == "self":
            attention_mask = torch.logical_or(attention_mask.squeeze(1).unsqueeze(3), attention_mask)
        else:
            attention_mask = torch.logical_or(attention_mask[0].squeeze(1).unsqueeze(3), attention_mask[1])
        m = attention_mask.logical_not()
        actual_seqlens_q = m[:, 0, :, 0].sum(dim=1)
        actual_seqlens_kv = m[:, 0, 0, :].sum(dim=1)
    mask = torch.arange(max_seqlen_q, dtype=torch.int32, device=DEVICE).view(1, 1, max_seqlen_q, 1) - \
        torch.arange(max_seqlen_kv, dtype=torch.int32, device=DEVICE).view(1, 1, 1, max_seqlen_kv)
    swa_left = None
    swa_right = None
    if attn_mask_type == "causal_bottom_right" or (
            attn_mask_type in ["no_mask", "arbitrary"] and bottom_right_alignment):
        swa_left = mask + max_seqlen_kv - max_seqlen_q - window_size[0]
        swa_right = mask + max_seqlen_kv - max_seqlen_q + window_size[1]
    elif attn_mask_type in ["causal", "padding_causal"] or (
            attn_mask_type in ["no_mask", "padding", "arbitrary"] and not bottom_right_alignment):
        swa_left = mask - window_size[0]
        swa_right = mask + window_size[1]
    elif attn_mask_type == "padding_causal_bottom_right" or (
            attn_mask_type == "padding" and bottom_right_alignment):
        batch_size = attention_mask.shape[0]
        swa_left = mask.expand(batch_size, 1, max_seqlen_q, max_seqlen_kv) + (
            actual_seqlens_kv - actual_seqlens_q - window_size[0]).view(batch_size, 1, 1, 1)
        swa_right = mask.expand(batch_size, 1, max_seqlen_q, max_seqlen_kv) + (
            actual_seqlens_kv - actual_seqlens_q + window_size[1]).view(batch_size, 1, 1, 1)
    swa_mask = torch.logical_not(torch.where(swa_left <= 0, 1, 0) - torch.where(swa_right < 0, 1, 0))
    if attention_mask is not None:
        attention_mask = torch.logical_or(swa_mask, attention_mask)
    else:
        attention_mask = swa_mask
    if change_type:
        attn_mask_type = "arbitrary"
    return attn_mask_type, attention_mask, actual_seqlens_q, actual_seqlens_kv


class UnfusedDotProductAttention(nn.Module):
    """Parallel attention w/o QKV and Proj Gemms: BMM1 -> softmax + dropout -> BMM2"""

    def __init__(self, softmax_scale, attention_type="self", attention_dropout=0.0):
        super().__init__()
        self.softmax_scale = softmax_scale
        self.attention_type = attention_type
        self.scale_mask_softmax = FusedScaleMaskSoftmax(attention_mask_func)
        self.attention_dropout = nn.Dropout(attention_dropout)

    def forward(self, query_layer, key_layer, value_layer, qkv_layout="bshd_bshd_bshd",
                attn_mask_type="causal", attention_mask=None, window_size=None):
        qkv_format = "".join([i for i in qkv_layout.split("_")[0] if i.isalpha()])
        if qkv_format == "bshd":
            query_layer, key_layer, value_layer = [x.transpose(0, 1) for x in [query_layer, key_layer, value_layer]]
        batch_size, max_seqlen_q, max_seqlen_kv = query_layer.shape[1], query_layer.shape[0], key_layer.shape[0]

        if FIXED:
            attn_mask_type, attention_mask, actual_seqlens_q, actual_seqlens_kv = get_full_mask(
                max_seqlen_q, max_seqlen_kv, attn_mask_type=attn_mask_type, attention_mask=attention_mask,
                window_size=window_size, attention_type=self.attention_type)
        elif "padding" in attn_mask_type:
            if self.attention_type == "self":
                assert attention_mask.shape == (batch_size, 1, 1, max_seqlen_q)
                attention_mask = torch.logical_or(attention_mask.squeeze(1).unsqueeze(3), attention_mask)
            else:
                attention_mask = torch.logical_or(attention_mask[0].squeeze(1).unsqueeze(3), attention_mask[1])
            mask = attention_mask.squeeze(1).logical_not()
            actual_seqlens_q = mask[:, :, 0].sum(dim=1)
            actual_seqlens_kv = mask[:, 0, :].sum(dim=1)
            mask = torch.arange(max_seqlen_q, dtype=torch.int32, device=DEVICE).view(1, 1, max_seqlen_q, 1) - \
                torch.arange(max_seqlen_kv, dtype=torch.int32, device=DEVICE).view(1, 1, 1, max_seqlen_kv)
            if attn_mask_type == "padding_causal":
                attention_mask = torch.logical_or(
                    torch.where(mask.view(1, 1, max_seqlen_q, max_seqlen_kv) < 0, 1, 0), attention_mask)
            if attn_mask_type == "padding_causal_bottom_right":
                attention_mask = torch.logical_or(
                    torch.where(mask.expand(batch_size, 1, max_seqlen_q, max_seqlen_kv)
                                + (actual_seqlens_kv - actual_seqlens_q).view(batch_size, 1, 1, 1) < 0, 1, 0),
                    attention_mask)

        batch_size, seqlen = query_layer.shape[1], query_layer.shape[0]
        # [b, np, sq, sk]
        output_size = (query_layer.size(1), query_layer.size(2), query_layer.size(0), key_layer.size(0))
        query_layer = query_layer.reshape(output_size[2], output_size[0] * output_size[1], -1)
        key_layer = key_layer.reshape(output_size[3], output_size[0] * output_size[1], -1)
        matmul_result = torch.empty(output_size[0] * output_size[1], output_size[2], output_size[3],
                                    dtype=query_layer.dtype, device=query_layer.device)
        matmul_result = torch.baddbmm(matmul_result, query_layer.transpose(0, 1),
                                      key_layer.transpose(0, 1).transpose(1, 2),
                                      beta=0.0, alpha=self.softmax_scale).view(*output_size)

        attention_probs = self.scale_mask_softmax(matmul_result, attention_mask, attn_mask_type, None)

        # mask out the pad positions in softmax results, mostly for the rows (pad tokens from q)
        if "padding" in attn_mask_type:
            attention_probs = attention_probs.masked_fill(attention_mask, 0)

        attention_probs = self.attention_dropout(attention_probs)

        output_size = (value_layer.size(1), value_layer.size(2), query_layer.size(0), value_layer.size(3))
        value_layer = value_layer.reshape(value_layer.size(0), output_size[0] * output_size[1], -1)
        attention_probs = attention_probs.view(output_size[0] * output_size[1], output_size[2], -1)
        context_layer = torch.bmm(attention_probs, value_layer.transpose(0, 1))
        context_layer = context_layer.view(*output_size)
        # [b, np, sq, hn] --> [b, sq, np, hn] --> [b, sq, hp]
        context_layer = context_layer.permute(0, 2, 1, 3).contiguous().view(batch_size, seqlen, -1)
        return context_layer


class DotProductAttention(nn.Module):
    """Unfused backend only (NVTE_FLASH_ATTN=0, NVTE_FUSED_ATTN=0)."""

    def __init__(self, num_attention_heads, kv_channels, attn_mask_type="causal", window_size=None,
                 attention_type="self", qkv_format="bshd"):
        super().__init__()
        self.attn_mask_type = attn_mask_type
        self.window_size = window_size
        self.qkv_format = qkv_format
        self.unfused_attention = UnfusedDotProductAttention(1.0 / math.sqrt(kv_channels), attention_type)

    def forward(self, query_layer, key_layer, value_layer, attention_mask=None, attn_mask_type=None,
                window_size=None):
        attn_mask_type = self.attn_mask_type if attn_mask_type is None else attn_mask_type
        window_size = self.window_size if window_size is None else window_size
        qkv_layout = "bshd_bshd_bshd"
        if not FIXED:
            if window_size is not None and (window_size[0] != -1 or window_size[1] not in [-1, 0]):
                attn_mask_type, attention_mask = get_swa_mask(
                    window_size, query_layer.shape[1], key_layer.shape[1], attn_mask_type, attention_mask)
            return self.unfused_attention(query_layer, key_layer, value_layer, qkv_layout=qkv_layout,
                                          attn_mask_type=attn_mask_type, attention_mask=attention_mask)
        return self.unfused_attention(query_layer, key_layer, value_layer, qkv_layout=qkv_layout,
                                      attn_mask_type=attn_mask_type, attention_mask=attention_mask,
                                      window_size=window_size)


# ---- a tiny sliding-window causal LM over a right-padded batch -----------------------------------
class Block(nn.Module):
    def __init__(self, hidden, heads, window):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.core_attention = DotProductAttention(heads, self.head_dim, attn_mask_type="padding_causal",
                                                  window_size=(window, 0), qkv_format="bshd")
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))

    def forward(self, x, attention_mask):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(x.shape[-1], dim=-1)
        q, k, v = [t.view(b, s, self.heads, self.head_dim) for t in (q, k, v)]
        x = x + self.proj(self.core_attention(q, k, v, attention_mask=attention_mask))
        return x + self.mlp(self.ln2(x))


def main():
    torch.manual_seed(0)
    vocab, hidden, heads, window, seq_len, pad_id = 40, 32, 4, 3, 12, 0
    lengths = [12, 9, 6]
    B = len(lengths)
    emb = nn.Embedding(vocab, hidden)
    pos = nn.Embedding(seq_len, hidden)
    blocks = nn.ModuleList([Block(hidden, heads, window) for _ in range(2)])
    ln_f = nn.LayerNorm(hidden)
    head = nn.Linear(hidden, vocab, bias=False)

    ids = torch.randint(1, vocab, (B, seq_len))
    for i, L in enumerate(lengths):
        ids[i, L:] = pad_id
    pad = ids == pad_id                       # True = padded
    attention_mask = pad.view(B, 1, 1, seq_len)  # TE convention: True = masked out

    with torch.no_grad():
        x = emb(ids) + pos(torch.arange(seq_len))[None]
        for blk in blocks:
            x = blk(x, attention_mask)
        logits = head(ln_f(x))
        labels = ids[:, 1:].clone()
        labels[pad[:, 1:]] = -100
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, vocab), labels.reshape(-1), ignore_index=-100)

    for i, L in enumerate(lengths):
        print(f"seq {i} (len {L}): logits[0, :3] = {[round(v, 4) for v in logits[i, 0, :3].tolist()]}, "
              f"logits[{L-1}, :3] = {[round(v, 4) for v in logits[i, L - 1, :3].tolist()]}")
    print(f"next-token loss: {loss.item():.5f}")


if __name__ == "__main__":
    main()
