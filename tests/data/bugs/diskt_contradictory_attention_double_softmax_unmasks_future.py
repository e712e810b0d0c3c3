# DisKT (zyy-2001/DisKT#2): contradictory_attention() masks future steps, softmaxes, zeroes the counter-attention
# positions and then softmaxes the probabilities again, so every masked (future) key gets weight exp(0) again.
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def contradictory_attention(query, key, value1, value2, mask=None, dropout=None, counter_attention_mask=None):
    "Compute 'Scaled Dot Product Attention'"
    bs, head, seqlen, d_k = query.size(0), query.size(1), query.size(2), query.size(-1)
    device = query.device
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)

    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e32)
    p_attn = F.softmax(scores, dim=-1)  # [batch_size, head, seq_len, seq_len]

    # Reallocate attention weights, making the positions of mistakes and guesses receive less attention weight
    attn_reshape = p_attn.reshape(bs * head * seqlen, -1)
    counter_attention_mask = counter_attention_mask.unsqueeze(1)
    counter_attention_mask = counter_attention_mask.expand(-1, head * seqlen, -1)
    counter_attention_mask = counter_attention_mask.reshape(-1, seqlen)
    p_attn = torch.where((counter_attention_mask == 1), torch.zeros_like(attn_reshape), attn_reshape)
    p_attn = p_attn.reshape(bs, head, seqlen, -1)

    if FIXED:
        row_sums = p_attn.sum(dim=-1, keepdim=True)
        valid_rows = (row_sums > 0).float()
        safe_row_sums = row_sums + (1 - valid_rows)
        p_attn = p_attn / safe_row_sums
    else:
        p_attn = F.softmax(p_attn, dim=-1)

    pad_zero = torch.zeros(bs, head, 1, seqlen).to(device)
    p_attn = torch.cat([pad_zero, p_attn[:, :, 1:, :]], dim=2)  # first row of scores set to 0
    if dropout is not None:
        p_attn = dropout(p_attn)
    output_v1 = torch.matmul(p_attn, value1)
    output_v2 = torch.matmul(p_attn, value2)
    return output_v1, output_v2, p_attn


def create_mask(input, mask):
    seqlen = input.size(1)
    device = input.device
    nopeek_mask = np.triu(np.ones((1, 1, seqlen, seqlen)), k=mask).astype('uint8')
    src_mask = (torch.from_numpy(nopeek_mask) == 0).to(device)
    return src_mask


class DualAttention(nn.Module):
    def __init__(self, n_heads, d_model, dropout=0.1):
        super(DualAttention, self).__init__()
        assert d_model % n_heads == 0
        self.n_heads = n_heads
        self.d_model = d_model
        self.n_feature = d_model // n_heads
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, q, k, v1, v2, counter_attention_mask):
        batch_size = q.size(0)
        src_mask = create_mask(q, 0)   # strictly past: the current response is not visible either
        q = q.view(batch_size, -1, self.n_heads, self.n_feature).transpose(1, 2)
        k = k.view(batch_size, -1, self.n_heads, self.n_feature).transpose(1, 2)
        v1 = v1.view(batch_size, -1, self.n_heads, self.n_feature).transpose(1, 2)
        v2 = v2.view(batch_size, -1, self.n_heads, self.n_feature).transpose(1, 2)
        output_v1, output_v2, attn_weight = contradictory_attention(q, k, v1, v2, src_mask, self.dropout,
                                                                    counter_attention_mask)
        output_v1 = output_v1.transpose(1, 2).contiguous().view(batch_size, -1, self.d_model)
        output_v2 = output_v2.transpose(1, 2).contiguous().view(batch_size, -1, self.d_model)
        return output_v1, output_v2


class TinyDisKTHead(nn.Module):
    """Question embedding x attends over past positive/negative interaction embeddings y1 / y2."""

    def __init__(self, num_skills, d_model=16, n_heads=2):
        super().__init__()
        self.num_skills = num_skills
        self.q_embed = nn.Embedding(num_skills, d_model)
        self.qa_embed = nn.Embedding(3, d_model)
        self.dual_attention = DualAttention(n_heads=n_heads, d_model=d_model)
        self.out = nn.Linear(3 * d_model, 1)

    def forward(self, s_seq, r_seq, counter_attention_mask):
        x = self.q_embed(s_seq)
        y1 = self.qa_embed(2 - r_seq) + x        # "positive" view
        y2 = self.qa_embed(2 * r_seq) + x        # "negative" view
        o1, o2 = self.dual_attention(x, x, y1, y2, counter_attention_mask)
        h = torch.cat([x - (o1 + o2), x, o1 - o2], dim=-1)
        return torch.sigmoid(self.out(h)).squeeze(-1)


if __name__ == "__main__":
    torch.manual_seed(0)
    bs, seqlen, num_skills = 2, 10, 6
    model = TinyDisKTHead(num_skills).eval()
    s_seq = torch.randint(0, num_skills, (bs, seqlen))
    r_seq = torch.randint(0, 2, (bs, seqlen))
    counter_attention_mask = (torch.rand(bs, seqlen) < 0.2).long()   # mistakes / guesses get no weight
    r_flip = r_seq.clone()
    r_flip[:, 6:] = 1 - r_flip[:, 6:]                                 # change only responses at steps >= 6
    with torch.no_grad():
        p = model(s_seq, r_seq, counter_attention_mask)
        p_flip = model(s_seq, r_flip, counter_attention_mask)
    leak = (p[:, :7] - p_flip[:, :7]).abs().max().item()
    print(f"fixed={FIXED} change of predictions at t<=6 after flipping responses at t>=6: {leak:.6f}")
