"""CLIP4Clip seqTransf similarity head: per-video frame mask tiled over heads with ``repeat``.

Citation: ArrowLuo/CLIP4Clip#22 ("wrong masking for multi-head attention"), fixed by commit 7bcad10
("fix masking function of multi-head attention") in ``modules/module_cross.py``.

Bug: with ``sim_header == "seqTransf"`` the frame features of each video go through a temporal transformer
with ``extended_video_mask = (1.0 - video_mask.unsqueeze(1)) * -1000000.0`` ([B, L, L], additive). Each
``ResidualAttentionBlock.attention`` expands it for ``nn.MultiheadAttention`` with
``attn_mask.repeat(self.n_head, 1, 1)``, which tiles ``[M0, M1, M0, M1, ...]`` where the module indexes
``batch * n_head + head``: heads of one video use another video's frame mask, so padded frames are
attended and real frames are hidden.
Fix: ``attn_mask.repeat_interleave(self.n_head, dim=0)``.

This program: the seqTransf branch of ``CLIP4Clip.get_similarity_logits`` (frame position embeddings,
extended additive mask, LND transformer, masked mean pooling) with ``task_config.sim_header =
"seqTransf"``, 4 heads, a batch of two videos with 3 and 6 real frames of 6 (``video_mask``).
"""
import argparse
import sys
from collections import OrderedDict

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor):
        return x * torch.sigmoid(1.702 * x)


class ResidualAttentionBlock(nn.Module):
    def __init__(self, d_model: int, n_head: int):
        super().__init__()
        self.attn = nn.MultiheadAttention(d_model, n_head)
        self.ln_1 = nn.LayerNorm(d_model)
        self.mlp = nn.Sequential(OrderedDict([
            ("c_fc", nn.Linear(d_model, d_model * 4)),
            ("gelu", QuickGELU()),
            ("c_proj", nn.Linear(d_model * 4, d_model)),
        ]))
        self.ln_2 = nn.LayerNorm(d_model)
        self.n_head = n_head

    def attention(self, x: torch.Tensor, attn_mask: torch.Tensor):
        if FIXED:
            attn_mask_ = attn_mask.repeat_interleave(self.n_head, dim=0)
        else:
            attn_mask_ = attn_mask.repeat(self.n_head, 1, 1)
        return self.attn(x, x, x, need_weights=False, attn_mask=attn_mask_)[0]

    def forward(self, para_tuple: tuple):
        x, attn_mask = para_tuple
        x = x + self.attention(self.ln_1(x), attn_mask)
        x = x + self.mlp(self.ln_2(x))
        return (x, attn_mask)


class Transformer(nn.Module):
    def __init__(self, width: int, layers: int, heads: int):
        super().__init__()
        self.resblocks = nn.Sequential(*[ResidualAttentionBlock(width, heads) for _ in range(layers)])

    def forward(self, x: torch.Tensor, attn_mask: torch.Tensor):
        return self.resblocks((x, attn_mask))[0]


class CLIP4Clip(nn.Module):
    def __init__(self, task_config, embed_dim=32, max_frames=6, transformer_heads=4):
        super().__init__()
        self.task_config = task_config
        self.sim_header = task_config.sim_header
        self.frame_position_embeddings = nn.Embedding(max_frames, embed_dim)
        self.transformerClip = Transformer(width=embed_dim, layers=1, heads=transformer_heads)

    def _mean_pooling_for_similarity_visual(self, visual_output, video_mask):
        video_mask_un = video_mask.to(dtype=torch.float).unsqueeze(-1)
        visual_output = visual_output * video_mask_un
        video_mask_un_sum = torch.sum(video_mask_un, dim=1, dtype=torch.float)
        video_mask_un_sum[video_mask_un_sum == 0.0] = 1.0
        return torch.sum(visual_output, dim=1) / video_mask_un_sum

    def _loose_similarity(self, sequence_output, visual_output, video_mask, sim_header="meanP"):
        if sim_header == "seqTransf":
            # Sequential type: Transformer Encoder
            visual_output_original = visual_output
            seq_length = visual_output.size(1)
            position_ids = torch.arange(seq_length, dtype=torch.long).unsqueeze(0).expand(visual_output.size(0), -1)
            visual_output = visual_output + self.frame_position_embeddings(position_ids)

            extended_video_mask = (1.0 - video_mask.unsqueeze(1)) * -1000000.0
            extended_video_mask = extended_video_mask.expand(-1, video_mask.size(1), -1)
            visual_output = visual_output.permute(1, 0, 2)  # NLD -> LND
            visual_output = self.transformerClip(visual_output, extended_video_mask)
            visual_output = visual_output.permute(1, 0, 2)  # LND -> NLD
            visual_output = visual_output + visual_output_original

        visual_output = visual_output / visual_output.norm(dim=-1, keepdim=True)
        visual_output = self._mean_pooling_for_similarity_visual(visual_output, video_mask)
        visual_output = visual_output / visual_output.norm(dim=-1, keepdim=True)
        sequence_output = sequence_output.squeeze(1)
        sequence_output = sequence_output / sequence_output.norm(dim=-1, keepdim=True)
        return torch.matmul(sequence_output, visual_output.t())

    def get_similarity_logits(self, sequence_output, visual_output, attention_mask, video_mask):
        return self._loose_similarity(sequence_output, visual_output, video_mask, sim_header=self.sim_header)


def main():
    torch.manual_seed(0)
    task_config = argparse.Namespace(sim_header="seqTransf", max_frames=6)
    model = CLIP4Clip(task_config).eval()
    video_mask = torch.tensor([[1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 1, 1]])
    visual_output = torch.randn(2, 6, 32)
    sequence_output = torch.randn(2, 1, 32)
    attention_mask = torch.ones(2, 8)
    with torch.no_grad():
        logits = model.get_similarity_logits(sequence_output, visual_output, attention_mask, video_mask)
    print("retrieval logits", [[round(v, 4) for v in row] for row in logits.tolist()])


if __name__ == "__main__":
    main()
