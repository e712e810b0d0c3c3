"""MPT (mosaicml/llm-foundry) packed pretraining with attn_uses_sequence_id.

Follows llm-foundry llmfoundry/models/mpt/modeling_mpt.py (MPTModel._attn_bias /
apply_sequence_id, not pinned): when several text samples are concatenated into one
row by the ConcatTokensDataset, the collator also emits `sequence_id`, and the model
turns it into an additive bias: a key of another sample gets finfo.min, on top of
the causal mask. Positions restart per sample (learned_pos_emb with sequence_id).
The reference runs each sample alone, unpacked, and compares.
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
D, H, VOCAB = 32, 4, 50
HD = D // H


class TinyMPTBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.wqkv = torch.nn.Linear(D, 3 * D, bias=False)
        self.out = torch.nn.Linear(D, D, bias=False)
        self.ln = torch.nn.LayerNorm(D)

    def forward(self, x, attn_bias):
        b, s, _ = x.shape
        q, k, v = self.wqkv(self.ln(x)).chunk(3, dim=-1)
        q, k, v = (t.view(b, s, H, HD).transpose(1, 2) for t in (q, k, v))
        # llm-foundry's torch attention: scores + attn_bias, then softmax
        scores = q @ k.transpose(-1, -2) / HD ** 0.5 + attn_bias
        y = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, s, D)
        return x + self.out(y)


emb = torch.nn.Embedding(VOCAB, D)
pos_emb = torch.nn.Embedding(64, D)
block = TinyMPTBlock()


def attn_bias_for(sequence_id):
    """Causal plus same-sequence, as MPTModel builds it with attn_uses_sequence_id."""
    s = sequence_id.shape[-1]
    neg = torch.finfo(torch.float32).min
    bias = torch.zeros(sequence_id.shape[0], 1, s, s)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    bias = bias.masked_fill(~causal, neg)
    # apply_sequence_id: cannot attend across sequences
    cross = ~torch.eq(sequence_id.unsqueeze(-1), sequence_id.unsqueeze(-2)).unsqueeze(1)
    return bias.masked_fill(cross, neg)


def positions_for(sequence_id):
    """learned_pos_emb restarts at each sample boundary."""
    pos = torch.zeros_like(sequence_id)
    for b in range(sequence_id.shape[0]):
        for i in range(1, sequence_id.shape[1]):
            same = sequence_id[b, i] == sequence_id[b, i - 1]
            pos[b, i] = pos[b, i - 1] + 1 if same else 0
    return pos


def forward(ids, sequence_id):
    x = emb(ids) + pos_emb(positions_for(sequence_id))
    return block(x, attn_bias_for(sequence_id))


# Two packed rows of 12 tokens, samples of lengths (5, 4, 3) and (7, 5).
lengths = [[5, 4, 3], [7, 5]]
seq_ids = torch.stack([
    torch.cat([torch.full((n,), i) for i, n in enumerate(row)]) for row in lengths
])
ids = torch.randint(0, VOCAB, seq_ids.shape)

with torch.no_grad():
    packed = forward(ids, seq_ids)
    worst = 0.0
    for b, row in enumerate(lengths):
        start = 0
        for n in row:
            one_ids = ids[b:b + 1, start:start + n]
            one = forward(one_ids, torch.zeros(1, n, dtype=torch.long))
            worst = max(worst, (one[0] - packed[b, start:start + n]).abs().max().item())
            start += n

print(f"packed vs one sample at a time, max diff {worst:.2e}")
assert worst < 1e-5
