# line/lighthouse PR #77 (CG-DETR / QD-DETR / TR-DETR T2V encoder layers, e.g. lighthouse/common/cg_detr_transformer.py).
# The 3D attn_mask for nn.MultiheadAttention (index b*nhead+h) was built with .repeat(nhead,1,1), which tiles
# [M0,M1,M0,M1] instead of [M0,M0,M1,M1], so some heads of each clip use another sample's padding mask.
import sys
from typing import Optional
import torch
import torch.nn.functional as F
from torch import nn, Tensor

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class T2V_TransformerEncoderLayer(nn.Module):
    def __init__(self, d_model, nhead, dim_feedforward=64, dropout=0.1, activation="relu", normalize_before=False):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, dropout=dropout)
        self.linear1 = nn.Linear(d_model, dim_feedforward)
        self.dropout = nn.Dropout(dropout)
        self.linear2 = nn.Linear(dim_feedforward, d_model)
        self.norm1 = nn.LayerNorm(d_model)
        self.norm2 = nn.LayerNorm(d_model)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.activation = F.relu
        self.normalize_before = normalize_before
        self.nhead = nhead

    def with_pos_embed(self, tensor, pos: Optional[Tensor]):
        return tensor if pos is None else tensor + pos

    def forward_post(self, src, src_mask: Optional[Tensor] = None, src_key_padding_mask: Optional[Tensor] = None,
                     pos: Optional[Tensor] = None, video_length=None):
        assert video_length is not None
        pos_src = self.with_pos_embed(src, pos)
        global_token, q, k, v = src[0].unsqueeze(0), pos_src[1:video_length + 1], pos_src[video_length + 1:], src[video_length + 1:]

        qmask, kmask = src_key_padding_mask[:, 1:video_length + 1].unsqueeze(2), src_key_padding_mask[:, video_length + 1:].unsqueeze(1)
        if FIXED:
            attn_mask = torch.matmul(qmask.float(), kmask.float()).bool().repeat_interleave(self.nhead, dim=0)
        else:
            attn_mask = torch.matmul(qmask.float(), kmask.float()).bool().repeat(self.nhead, 1, 1)

        src2 = self.self_attn(q, k, value=v, attn_mask=attn_mask,
                              key_padding_mask=src_key_padding_mask[:, video_length + 1:])[0]
        src2 = src[1:video_length + 1] + self.dropout1(src2)
        src3 = self.norm1(src2)
        src3 = self.linear2(self.dropout(self.activation(self.linear1(src3))))
        src2 = src2 + self.dropout2(src3)
        src2 = self.norm2(src2)
        src2 = torch.cat([global_token, src2], dim=0)
        src = torch.cat([src2, src[video_length + 1:]])
        return src

    def forward(self, src, src_mask=None, src_key_padding_mask=None, pos=None, **kwargs):
        return self.forward_post(src, src_mask, src_key_padding_mask, pos, **kwargs)


class TransformerEncoder(nn.Module):
    def __init__(self, encoder_layer, num_layers):
        super().__init__()
        self.layers = nn.ModuleList([encoder_layer] + [type(encoder_layer)(32, 4) for _ in range(num_layers - 1)])

    def forward(self, src, mask=None, src_key_padding_mask=None, pos=None, **kwargs):
        output = src
        for layer in self.layers:
            output = layer(output, src_mask=mask, src_key_padding_mask=src_key_padding_mask, pos=pos, **kwargs)
        return output


d_model, nhead, L_vid, L_txt = 32, 4, 8, 6
t2v_encoder = TransformerEncoder(T2V_TransformerEncoderLayer(d_model, nhead), 2).eval()

# CG-DETR forward: src = [global token | video clips | query words], mask True = valid; transformer gets ~mask
vid_lens, txt_lens = [8, 5], [6, 3]
B = 2
src_vid = torch.randn(B, L_vid, d_model)
src_txt = torch.randn(B, L_txt, d_model)
src_vid_mask = torch.zeros(B, L_vid)
src_txt_mask = torch.zeros(B, L_txt)
for b in range(B):
    src_vid_mask[b, :vid_lens[b]] = 1
    src_txt_mask[b, :txt_lens[b]] = 1
global_tok = torch.randn(1, 1, d_model).expand(B, 1, d_model)
pos = torch.randn(1, 1 + L_vid + L_txt, d_model).expand(B, -1, -1)


def run(idx):
    src = torch.cat([global_tok[idx], src_vid[idx], src_txt[idx]], dim=1)
    mask = torch.cat([torch.ones(len(idx), 1), src_vid_mask[idx], src_txt_mask[idx]], dim=1).bool()
    src = src.permute(1, 0, 2)  # (L, batch_size, d)
    pos_embed = pos[idx].permute(1, 0, 2)
    memory = t2v_encoder(src, src_key_padding_mask=~mask, pos=pos_embed, video_length=L_vid)
    return memory.permute(1, 0, 2)


with torch.no_grad():
    batched = run([0, 1])
    diff = 0.0
    for b in range(B):
        alone = run([b])[0]
        n = vid_lens[b]
        diff = max(diff, (batched[b, 1:1 + n] - alone[1:1 + n]).abs().max().item())
    print("max |T2V encoder output (valid clips) batched vs each sample alone|: %.6f" % diff)
