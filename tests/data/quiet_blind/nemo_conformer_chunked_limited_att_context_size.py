"""NeMo cache-aware streaming Conformer: att_context_style "chunked_limited" from att_context_size [left, right].

Follows NVIDIA/NeMo nemo/collections/asr/modules/conformer_encoder.py (ConformerEncoder._create_masks:
chunk_size = att_context_size[1] + 1, left_chunks_num = att_context_size[0] // chunk_size, pad_mask_for_att_mask
AND-ed on both sides, mask inverted) and nemo/collections/asr/parts/submodules/multi_head_attention.py
(MultiHeadAttention.compute_att: masked_fill(mask, -10000), softmax, then masked_fill(mask, 0.0)), recalled.
The model config is a dict as in a NeMo YAML: att_context_style="chunked_limited", att_context_size=[4, 1].
Mask: frames are grouped in chunks of 2 (the right context 1 is the look-ahead INSIDE the chunk: frame 0 of a
chunk sees frame 1 of the same chunk, which is in its future on purpose); each chunk sees itself and the 2 chunks
before it, nothing older, nothing later. Padded frames (beyond `length`) are hidden as keys, and their query rows
are fully masked and then zeroed by the second masked_fill (those frames are dropped by the length).
A chunk-by-chunk streaming run with a cache of the last 4 frames gives the same outputs as the masked full run.
"""
import math

import torch
from torch import nn

encoder_cfg = {
    "d_model": 16,
    "n_heads": 4,
    "att_context_style": "chunked_limited",
    "att_context_size": [4, 1],
    "self_attention_model": "abs_pos",
}


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, n_feat):
        super().__init__()
        self.d_k = n_feat // n_head
        self.s_d_k = math.sqrt(self.d_k)
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k).transpose(1, 2)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1)  # (batch, 1, time1, time2)
            scores = scores.masked_fill(mask, -10000.0)
            attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)  # (batch, head, time1, time2)
        else:
            attn = torch.softmax(scores, dim=-1)
        x = torch.matmul(attn, value)
        x = x.transpose(1, 2).reshape(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / self.s_d_k
        return self.forward_attention(v, scores, mask)


def _create_masks(att_context_style, att_context_size, padding_length, max_audio_length):
    """Returns pad_mask (True = pad) and att_mask (True = not allowed), as ConformerEncoder does."""
    att_mask = torch.ones(1, max_audio_length, max_audio_length, dtype=torch.bool)
    if att_context_style == "regular":
        if att_context_size[0] >= 0:
            att_mask = att_mask.triu(diagonal=-att_context_size[0])
        if att_context_size[1] >= 0:
            att_mask = att_mask.tril(diagonal=att_context_size[1])
    elif att_context_style == "chunked_limited":
        # When right context is unlimited, just the left side of the masking need to get updated
        if att_context_size[1] == -1:
            if att_context_size[0] >= 0:
                att_mask = att_mask.triu(diagonal=-att_context_size[0])
        else:
            chunk_size = att_context_size[1] + 1
            # left_chunks_num specifies the number of chunks to be visible by each chunk on the left side
            if att_context_size[0] >= 0:
                left_chunks_num = att_context_size[0] // chunk_size
            else:
                left_chunks_num = 10000
            chunk_idx = torch.arange(0, max_audio_length, dtype=torch.int)
            chunk_idx = torch.div(chunk_idx, chunk_size, rounding_mode="trunc")
            diff_chunks = chunk_idx.unsqueeze(1) - chunk_idx.unsqueeze(0)
            chunked_limited_mask = torch.logical_and(torch.le(diff_chunks, left_chunks_num), torch.ge(diff_chunks, 0))
            att_mask = torch.logical_and(att_mask, chunked_limited_mask.unsqueeze(0))

    pad_mask = torch.arange(0, max_audio_length).expand(padding_length.size(0), -1) < padding_length.unsqueeze(-1)
    pad_mask_for_att_mask = pad_mask.unsqueeze(1).repeat([1, max_audio_length, 1])
    pad_mask_for_att_mask = torch.logical_and(pad_mask_for_att_mask, pad_mask_for_att_mask.transpose(1, 2))
    att_mask = torch.logical_and(pad_mask_for_att_mask, att_mask[:, :max_audio_length, :max_audio_length])
    return ~pad_mask, ~att_mask


class ConformerLayerAttention(nn.Module):
    """The self-attention part of one Conformer layer (pre-norm, residual)."""

    def __init__(self, cfg):
        super().__init__()
        self.norm_self_att = nn.LayerNorm(cfg["d_model"])
        self.self_attn = MultiHeadAttention(cfg["n_heads"], cfg["d_model"])

    def forward(self, x, att_mask, cache=None):
        x_norm = self.norm_self_att(x)
        key = x_norm if cache is None else torch.cat([cache, x_norm], dim=1)
        return x + self.self_attn(x_norm, key, key, att_mask), key


def main():
    torch.manual_seed(0)
    cfg = encoder_cfg
    layer = ConformerLayerAttention(cfg).eval()
    max_audio_length = 12
    length = torch.tensor([12, 9])
    audio_signal = torch.randn(2, max_audio_length, cfg["d_model"])
    pad_mask, att_mask = _create_masks(cfg["att_context_style"], cfg["att_context_size"], length, max_audio_length)
    with torch.no_grad():
        full, _ = layer(audio_signal, att_mask)

        # Cache-aware streaming: one chunk at a time, keys = cached left context + the chunk itself.
        left, right = cfg["att_context_size"]
        chunk_size = right + 1
        outs = []
        for b in range(2):
            cache = audio_signal.new_zeros(1, 0, cfg["d_model"])
            pieces = []
            n = int(length[b])
            for start in range(0, n, chunk_size):
                chunk = audio_signal[b:b + 1, start:min(start + chunk_size, n)]
                y, keys = layer(chunk, None, cache)
                cache = keys[:, -left:]
                pieces.append(y)
            outs.append(torch.cat(pieces, dim=1)[0])
    for b in range(2):
        n = int(length[b])
        assert torch.allclose(full[b, :n], outs[b], atol=1e-5), (full[b, :n] - outs[b]).abs().max()
    assert not pad_mask[0].any() and pad_mask[1, 9:].all()
    print("nemo chunked_limited streaming matches full masked run:", tuple(full.shape))


if __name__ == "__main__":
    main()
