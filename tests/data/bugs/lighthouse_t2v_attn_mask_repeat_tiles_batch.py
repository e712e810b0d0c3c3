"""Lighthouse (CG-DETR / QD-DETR style T2V encoder): 3D attn_mask tiled over heads with ``repeat``.

Citation: line/lighthouse#77 ("Fix 3D attn_mask head/batch layout in T2V/V2T cross-attention
(repeat -> repeat_interleave)"), code of ``lighthouse/common/CIM.py::T2V_TransformerEncoderLayer``.

Bug: ``nn.MultiheadAttention`` wants a 3D ``attn_mask`` of shape ``(N * num_heads, L, S)`` indexed
``batch_idx * num_heads + head_idx``. The layer builds its per-sample video-query x text-key mask and
expands it with ``.repeat(self.nhead, 1, 1)``, which tiles ``[M0, M1, M0, M1, ...]`` instead of
``[M0, M0, ..., M1, M1, ...]``: most heads of a sample use another sample's padding mask.
Fix: ``.repeat_interleave(self.nhead, dim=0)``.

This program: ``T2V_TransformerEncoderLayer.forward_post`` as the project wrote it (sequence-first
``src`` = [global token, video clips, text tokens], ``src_key_padding_mask`` True = pad,
``video_length``), batch of two with video lengths [3, 6] of 6 and text lengths [2, 5] of 5, 4 heads.
With the bug, heads 0 and 2 of sample 1 get sample 0's mask, so sample 1's valid video clips 3..5 lose
its valid text tokens 2..4 there (sample 0 is unaffected only because ``key_padding_mask`` already hides
its padded text keys).
"""
import sys
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv


def _get_activation_fn(activation):
    if activation == "relu":
        return F.relu
    if activation == "gelu":
        return F.gelu
    raise RuntimeError(f"activation should be relu/gelu, not {activation}.")


class T2V_TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=2048, dropout=0.1, activation="relu", normalize_before=False):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = _get_activation_fn(activation)
        self.normalize_before = normalize_before
        self.nhead = nhead

    def with_pos_embed(self, tensor, pos: Optional[Tensor]):
        return tensor if pos is None else tensor + pos

    def forward_post(self, src, src_mask=None, src_key_padding_mask=None, pos=None, video_length=None):
        assert video_length is not None
        pos_src = self.with_pos_embed(src, pos)
        global_token, q, k, v = (
            src[0].unsqueeze(0),
            pos_src[1 : video_length + 1],
            pos_src[video_length + 1 :],
            src[video_length + 1 :],
        )
        qmask = src_key_padding_mask[:, 1 : video_length + 1].unsqueeze(2)
        kmask = src_key_padding_mask[:, video_length + 1 :].unsqueeze(1)
        if FIXED:
            attn_mask = torch.matmul(qmask.float(), kmask.float()).bool().repeat_interleave(self.nhead, dim=0)
        else:
            attn_mask = torch.matmul(qmask.float(), kmask.float()).bool().repeat(self.nhead, 1, 1)

        src2 = self.self_attn(
            q, k, value=v, attn_mask=attn_mask, key_padding_mask=src_key_padding_mask[:, video_length + 1 :]
        )[0]
        src2 = src[1 : video_length + 1] + self.dropout1(src2)
        src3 = self.norm1(src2)
        src3 = self.linear2(self.dropout(self.activation(self.linear1(src3))))
        src2 = src2 + self.dropout2(src3)
        src2 = self.norm2(src2)
        src2 = torch.cat([global_token, src2], dim=0)
        return torch.cat([src2, src[video_length + 1 :]])

    def forward(self, src, src_mask=None, src_key_padding_mask=None, pos=None, **kwargs):
        return self.forward_post(src, src_mask, src_key_padding_mask, pos, **kwargs)


def main():
    torch.manual_seed(0)
    d_model, nhead, video_length, max_txt = 32, 4, 6, 5
    vid_lens, txt_lens = [3, 6], [2, 5]
    layer = T2V_TransformerEncoderLayer(d_model, nhead, dim_feedforward=64, dropout=0.0).eval()

    bs = len(vid_lens)
    # mask as the model builds it: [global token | video clips | text tokens], True = padding
    src_key_padding_mask = torch.zeros(bs, 1 + video_length + max_txt, dtype=torch.bool)
    for b in range(bs):
        src_key_padding_mask[b, 1 + vid_lens[b] : 1 + video_length] = True
        src_key_padding_mask[b, 1 + video_length + txt_lens[b] :] = True
    src = torch.randn(1 + video_length + max_txt, bs, d_model)
    pos = torch.randn_like(src)
    with torch.no_grad():
        out = layer(src, src_key_padding_mask=src_key_padding_mask, pos=pos, video_length=video_length)
    print("src_for_vid", tuple(out.shape), "sample-1 clips sum %.6f" % out[1 : 1 + video_length, 1].abs().sum())


if __name__ == "__main__":
    main()
