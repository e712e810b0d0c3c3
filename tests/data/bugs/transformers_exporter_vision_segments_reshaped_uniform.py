# huggingface/transformers#47871: the dynamo/ONNX/ExecuTorch exporter replaced chunked vision attention with a reshape
# into `num_segments` equal segments (seg_len = seq_length // num_segments) and one SDPA, so ragged cu_seqlens windows
# were cut at the wrong places and tokens attended across segment boundaries. Fix: block-diagonal mask from cu_seqlens.
import sys

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class VisionAttention(nn.Module):
    """Qwen2-VL style vision attention: one flat token sequence, segments given by cu_seqlens."""

    def __init__(self, dim=32, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.scaling = self.head_dim**-0.5
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.proj = nn.Linear(dim, dim)

    def forward(self, hidden_states, cu_seqlens):
        """Eager reference: split → loop → cat, one attention per segment."""
        seq_length = hidden_states.shape[0]
        q, k, v = self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
        splits = [torch.split(t.transpose(0, 1), lengths, dim=1) for t in (q, k, v)]
        outs = [F.scaled_dot_product_attention(qs, ks, vs, scale=self.scaling) for qs, ks, vs in zip(*splits)]
        return self.proj(torch.cat(outs, dim=1).transpose(0, 1).reshape(seq_length, -1))


def _reshaped_vision_attention_forward(self, hidden_states, cu_seqlens, **kwargs):
    """Export-safe vision attention: reshape segments into batch dim, single SDPA call."""
    seq_length = hidden_states.shape[0]
    num_segments = cu_seqlens.shape[0] - 1
    torch._check(seq_length % num_segments == 0)
    query_states, key_states, value_states = (
        self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    )
    seg_len = seq_length // num_segments

    def _to_batched(t):
        return t.unflatten(0, (num_segments, seg_len)).transpose(1, 2)

    attn_output = F.scaled_dot_product_attention(
        _to_batched(query_states), _to_batched(key_states), _to_batched(value_states), is_causal=False,
        scale=self.scaling)
    attn_output = attn_output.transpose(1, 2).reshape(seq_length, -1).contiguous()
    return self.proj(attn_output)


def _block_diagonal_vision_attention_forward(self, hidden_states, cu_seqlens, **kwargs):
    """Export-safe vision attention: block-diagonal mask from cu_seqlens, one SDPA over the flat sequence."""
    seq_length = hidden_states.shape[0]
    query_states, key_states, value_states = (
        self.qkv(hidden_states).reshape(seq_length, 3, self.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    )
    positions = torch.arange(seq_length)
    segment_ids = torch.searchsorted(cu_seqlens[1:], positions, right=True)
    attn_mask = segment_ids[:, None] == segment_ids[None, :]
    attn_output = F.scaled_dot_product_attention(
        query_states.transpose(0, 1).unsqueeze(0), key_states.transpose(0, 1).unsqueeze(0),
        value_states.transpose(0, 1).unsqueeze(0), attn_mask=attn_mask, scale=self.scaling)
    attn_output = attn_output[0].transpose(0, 1).reshape(seq_length, -1).contiguous()
    return self.proj(attn_output)


def main():
    attn = VisionAttention().eval()
    # two images with different patch grids: 24 and 8 patches (32 % 2 == 0 passes the uniformity check)
    hidden_states = torch.randn(32, 32)
    cu_seqlens = torch.tensor([0, 24, 32])
    with torch.no_grad():
        reference = attn(hidden_states, cu_seqlens)
        patched = _block_diagonal_vision_attention_forward if FIXED else _reshaped_vision_attention_forward
        out = patched(attn, hidden_states, cu_seqlens)  # what the exporter traces
    diff = (out - reference).abs().max().item()
    print(f"fixed={FIXED} max |exported-path output - eager per-segment attention| = {diff:.6f}")


if __name__ == "__main__":
    main()
