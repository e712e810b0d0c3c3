"""Packed pre-training/fine-tuning rows with a flex_attention document mask derived from EOS tokens.

Follows pytorch/torchtitan:
  torchtitan/models/attention.py  FlexAttention._get_document_mask_mod(batch, eos_id):
      mask = batch == eos_id; mask[:, -1] = True; acc_mask = cumsum(where(mask, 1, 0));
      seq_idx[:, 1:] = acc_mask[:, :-1]  (a document ends WITH its eos token);
      document_mask(b, h, q, kv) = seq_idx[b, q] == seq_idx[b, kv], and_masks with the causal mask_mod,
      create_block_mask(mask_mod, B, None, S, S), then flex_attention(q, k, v, block_mask=...)
  torchtitan/datasets/hf_datasets.py  HuggingFaceDataset: documents + eos concatenated and cut into rows
  torchtitan/models/llama3/model.py  RoPE over positions 0..S-1 of the row (no reset per document)
Reduced: 2 rows of 16 tokens holding 3 and 2 documents (the last cut at the row end), a 2-layer RoPE decoder,
hidden 32, 4 heads, float64. Positions are the row's own; RoPE is relative, so a document gets the same
result as alone. The same batch is also run with position ids reset per document (the SFT packing choice).
Reference: every document alone at positions 0..n-1 with is_causal=True SDPA.
"""
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import and_masks, create_block_mask, flex_attention

warnings.filterwarnings("ignore", message=".*flex_attention.*")  # eager flex_attention on CPU
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
V, D, H, S, EOS = 50, 32, 4, 16, 0
HD = D // H


def rope(x, pos):  # x (B, H, S, HD), pos (B, S)
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2) / HD))
    ang = pos.double()[..., None] * inv
    c, s = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x[..., : HD // 2], x[..., HD // 2:]
    return x * c + torch.cat([-x2, x1], -1) * s


def get_document_mask_mod(batch, eos_id):
    mask = batch == eos_id
    mask[:, -1] = True
    acc_mask = torch.cumsum(torch.where(mask, 1, 0), dim=1)
    seq_idx = torch.zeros_like(acc_mask, dtype=torch.int32)
    seq_idx[:, 1:] = acc_mask[:, :-1]

    def document_mask(b, h, q_idx, kv_idx):
        return seq_idx[b, q_idx] == seq_idx[b, kv_idx]

    return document_mask, seq_idx


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


class Decoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(V, D)
        self.wqkv = nn.ModuleList([nn.Linear(D, 3 * D, bias=False) for _ in range(2)])
        self.wo = nn.ModuleList([nn.Linear(D, D, bias=False) for _ in range(2)])
        self.ffn = nn.ModuleList([nn.Sequential(nn.Linear(D, 64), nn.SiLU(), nn.Linear(64, D)) for _ in range(2)])
        self.out = nn.Linear(D, V, bias=False)

    def forward(self, tokens, positions, block_mask=None):
        b, s = tokens.shape
        x = self.emb(tokens)
        for l in range(2):
            q, k, v = self.wqkv[l](F.rms_norm(x, (D,))).view(b, s, 3, H, HD).permute(2, 0, 3, 1, 4)
            q, k = rope(q, positions), rope(k, positions)
            if block_mask is None:
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                a = flex_attention(q, k, v, block_mask=block_mask)
            x = x + self.wo[l](a.transpose(1, 2).reshape(b, s, D))
            x = x + self.ffn[l](F.rms_norm(x, (D,)))
        return self.out(F.rms_norm(x, (D,)))


# documents end with EOS; the stream is cut into rows of S tokens
docs = [torch.randint(1, V, (n,)).tolist() + [EOS] for n in (4, 6, 3, 9)]
stream = sum(docs, [])
extra = torch.randint(1, V, (2 * S - len(stream),)).tolist()  # start of a document cut at the row end
stream = stream + extra
tokens = torch.tensor(stream).view(2, S)

mask_mod, seq_idx = get_document_mask_mod(tokens, EOS)
block_mask = create_block_mask(and_masks(causal, mask_mod), 2, None, S, S, device="cpu")

model = Decoder().eval()
with torch.no_grad():
    row_pos = torch.arange(S).expand(2, S)
    out_row = model(tokens, row_pos, block_mask)
    starts = torch.ones_like(seq_idx, dtype=torch.bool)
    starts[:, 1:] = seq_idx[:, 1:] != seq_idx[:, :-1]
    idx = torch.arange(S).expand(2, S)
    first = torch.cummax(torch.where(starts, idx, 0), dim=1).values
    reset_pos = idx - first                        # position ids reset per document
    out_reset = model(tokens, reset_pos, block_mask)
    max_diff, n_docs = (out_row - out_reset).abs().max().item(), 0
    for r in range(2):
        for d in seq_idx[r].unique().tolist():
            cols = (seq_idx[r] == d).nonzero().flatten()
            doc = tokens[r, cols].unsqueeze(0)
            ref = model(doc, torch.arange(doc.shape[1]).unsqueeze(0))
            max_diff = max(max_diff, (out_row[r, cols] - ref[0]).abs().max().item())
            n_docs += 1

print("rows", tuple(tokens.shape), "documents", n_docs, "seq_idx", seq_idx.tolist())
print("max |packed flex document mask - each document alone|:", max_diff)
assert max_diff < 1e-10
