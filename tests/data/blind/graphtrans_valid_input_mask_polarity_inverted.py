# Reproduces ucbrise/graphtrans#10: MaskedOnlyTransformerEncoder masks with `valid_input_mask == 0`
# while the caller passes a padding mask (True = padded node), so real nodes are masked and padding is attended.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, attn_pdrop, resid_pdrop):
        super().__init__()
        assert n_embd % n_head == 0
        self.key = nn.Linear(n_embd, n_embd)
        self.query = nn.Linear(n_embd, n_embd)
        self.value = nn.Linear(n_embd, n_embd)
        self.attn_drop = nn.Dropout(attn_pdrop)
        self.resid_drop = nn.Dropout(resid_pdrop)
        self.proj = nn.Linear(n_embd, n_embd)
        self.n_head = n_head

    def forward(self, x, attn_mask=None, valid_input_mask=None, mask_value=-1e6):
        B, T, C = x.size()
        k = self.key(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = self.query(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = self.value(x).view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        if attn_mask is not None:
            att = att.masked_fill(attn_mask.unsqueeze(1) == 0, mask_value)
        if valid_input_mask is not None:
            if FIXED:
                att = att.masked_fill(valid_input_mask.unsqueeze(1).unsqueeze(2) != 0, mask_value)
            else:
                att = att.masked_fill(valid_input_mask.unsqueeze(1).unsqueeze(2) == 0, mask_value)
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, n_embd, n_ff, n_head, attn_pdrop, resid_pdrop, prenorm=True):
        super().__init__()
        self.prenorm = prenorm
        self.ln1 = nn.LayerNorm(n_embd)
        self.ln2 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, attn_pdrop, resid_pdrop)
        self.mlp = nn.Sequential(nn.Linear(n_embd, n_ff), nn.GELU(), nn.Linear(n_ff, n_embd), nn.Dropout(resid_pdrop))

    def forward(self, x, attn_mask=None, valid_input_mask=None):
        if self.prenorm:
            x = x + self.attn(self.ln1(x), attn_mask, valid_input_mask)
            x = x + self.mlp(self.ln2(x))
        else:
            x = self.ln1(x + self.attn(x, attn_mask, valid_input_mask))
            x = self.ln2(x + self.mlp(x))
        return x


class MaskedTransformerBlock(nn.Module):
    def __init__(self, n_layer, n_embd, n_ff, n_head, attn_pdrop, resid_pdrop, prenorm=True):
        super().__init__()
        self.blocks = nn.ModuleList([Block(n_embd, n_ff, n_head, attn_pdrop, resid_pdrop, prenorm) for _ in range(n_layer)])

    def forward(self, x, attn_mask=None, valid_input_mask=None):
        for block in self.blocks:
            x = block(x, attn_mask, valid_input_mask)
        return x


class MaskedOnlyTransformerEncoder(nn.Module):
    def __init__(self, n_layer=2, d_model=16, dim_feedforward=32, nhead=2, dropout=0.0):
        super().__init__()
        self.masked_transformer = MaskedTransformerBlock(n_layer, d_model, dim_feedforward, nhead, dropout, dropout)

    def forward(self, x, attn_mask=None, valid_input_mask=None):
        """padded_h_node: B x n_b x h_d ; src_key_padding_mask: B x n_b"""
        return self.masked_transformer(x, attn_mask=attn_mask, valid_input_mask=valid_input_mask)


def pad_batch(node_feats, d_model):
    """Pad graphs of different node counts; returns padded nodes and src_key_padding_mask (True = pad)."""
    n_max = max(h.size(0) for h in node_feats)
    padded = torch.zeros(len(node_feats), n_max, d_model)
    src_key_padding_mask = torch.ones(len(node_feats), n_max, dtype=torch.bool)
    for i, h in enumerate(node_feats):
        padded[i, : h.size(0)] = h
        src_key_padding_mask[i, : h.size(0)] = False
    return padded, src_key_padding_mask


def main():
    torch.manual_seed(0)
    d_model = 16
    model = MaskedOnlyTransformerEncoder(d_model=d_model).eval()
    graphs = [torch.randn(5, d_model), torch.randn(3, d_model)]
    padded_h_node, src_key_padding_mask = pad_batch(graphs, d_model)
    with torch.no_grad():
        out = model(padded_h_node, valid_input_mask=src_key_padding_mask)
        # reference: the 3-node graph run alone, without any padding
        ref = model(graphs[1].unsqueeze(0))
    diff = (out[1, :3] - ref[0]).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: max |padded - unpadded| on real nodes of graph 1 = {diff:.4e}")


if __name__ == "__main__":
    main()
