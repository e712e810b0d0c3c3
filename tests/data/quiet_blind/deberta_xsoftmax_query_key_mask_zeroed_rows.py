"""DeBERTa disentangled self-attention with XSoftmax, as microsoft/DeBERTa writes it.

Follows DeBERTa/deberta/ops.py (XSoftmax, StableDropout), DeBERTa/deberta/bert.py (BertEncoder.get_attention_mask)
and DeBERTa/deberta/disentangled_attention.py (c2p / p2c relative terms, scale sqrt(d * 3)). The [B, S] padding
mask becomes a [B, 1, S, S] query-AND-key mask (`att_mask * att_mask.squeeze(-2).unsqueeze(-1)`), so a padding
query has an all-masked row. XSoftmax fills masked scores with -inf, softmaxes (a padding row becomes NaN) and then
`masked_fill_(rmask, 0)`: the NaN row is zeroed and those weights are what multiply V (and what backward uses).
Real tokens see all real tokens (bidirectional) and no padding.
"""
import math

import torch
import torch.nn as nn


class XSoftmax(torch.autograd.Function):
    """Masked softmax that zeroes masked entries, so a fully masked row is all zeros, not NaN."""

    @staticmethod
    def forward(ctx, input, mask, dim):
        ctx.dim = dim
        rmask = ~(mask.bool())
        output = input.masked_fill(rmask, float("-inf"))
        output = torch.softmax(output, ctx.dim)
        output.masked_fill_(rmask, 0)
        ctx.save_for_backward(output)
        return output

    @staticmethod
    def backward(ctx, grad_output):
        (output,) = ctx.saved_tensors
        inputGrad = output * (grad_output - (output * grad_output).sum(ctx.dim, keepdim=True))
        return inputGrad, None, None


def get_attention_mask(attention_mask):
    if attention_mask.dim() <= 2:
        extended_attention_mask = attention_mask.unsqueeze(1).unsqueeze(2)
        att_mask = extended_attention_mask.byte()
        attention_mask = att_mask * att_mask.squeeze(-2).unsqueeze(-1)
    elif attention_mask.dim() == 3:
        attention_mask = attention_mask.unsqueeze(1)
    return attention_mask


class DisentangledSelfAttention(nn.Module):
    def __init__(self, hidden_size=32, num_attention_heads=4, max_relative_positions=4, dropout=0.1):
        super().__init__()
        self.num_attention_heads = num_attention_heads
        self.attention_head_size = hidden_size // num_attention_heads
        self.in_proj = nn.Linear(hidden_size, hidden_size * 3, bias=False)
        self.pos_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.pos_q_proj = nn.Linear(hidden_size, hidden_size)
        self.rel_embeddings = nn.Embedding(max_relative_positions * 2, hidden_size)
        self.att_span = max_relative_positions
        self.dropout = nn.Dropout(dropout)  # StableDropout in the project; same forward semantics

    def transpose_for_scores(self, x):
        return x.view(*x.shape[:-1], self.num_attention_heads, -1).permute(0, 2, 1, 3)

    def forward(self, hidden_states, attention_mask):
        q, k, v = self.transpose_for_scores(self.in_proj(hidden_states)).chunk(3, dim=-1)
        S = hidden_states.size(1)
        scale = math.sqrt(q.size(-1) * 3)
        scores = torch.matmul(q / scale, k.transpose(-1, -2))
        rel = self.rel_embeddings.weight
        pos_key = self.transpose_for_scores(self.pos_proj(rel).unsqueeze(0))  # [1, H, 2k, d]
        pos_query = self.transpose_for_scores(self.pos_q_proj(rel).unsqueeze(0))
        relative_pos = torch.arange(S)[:, None] - torch.arange(S)[None, :]
        c2p_pos = torch.clamp(relative_pos + self.att_span, 0, self.att_span * 2 - 1)
        c2p_att = torch.matmul(q, pos_key.transpose(-1, -2))  # [B, H, S, 2k]
        c2p_att = torch.gather(c2p_att, -1, c2p_pos.expand(*q.shape[:2], S, S))
        p2c_pos = torch.clamp(-relative_pos + self.att_span, 0, self.att_span * 2 - 1)
        p2c_att = torch.matmul(k, pos_query.transpose(-1, -2))
        p2c_att = torch.gather(p2c_att, -1, p2c_pos.expand(*k.shape[:2], S, S)).transpose(-1, -2)
        scores = scores + (c2p_att + p2c_att) / scale
        attention_probs = XSoftmax.apply(scores, attention_mask, -1)
        attention_probs = self.dropout(attention_probs)
        context = torch.matmul(attention_probs, v).permute(0, 2, 1, 3)
        return context.reshape(*hidden_states.shape[:2], -1), attention_probs


def main():
    torch.manual_seed(0)
    attn = DisentangledSelfAttention().eval()
    lengths = [7, 4, 2]
    input_mask = (torch.arange(7)[None] < torch.tensor(lengths)[:, None]).long()
    x = torch.randn(3, 7, 32, requires_grad=True)
    out, probs = attn(x, get_attention_mask(input_mask))
    probs = probs.detach()
    assert not torch.isnan(out).any() and not torch.isnan(probs).any()
    # padding query rows are exactly zero; real rows sum to one over real keys only
    assert float(probs[1, :, 4:].abs().sum()) == 0.0 and float(probs[1, :, :4, 4:].abs().sum()) == 0.0
    for b, n in enumerate(lengths):  # reference: the sample alone, no padding
        alone, _ = attn(x[b : b + 1, :n], get_attention_mask(torch.ones(1, n, dtype=torch.long)))
        assert torch.allclose(out[b, :n], alone[0], atol=1e-5)
    (out * input_mask[..., None]).sum().backward()
    assert not torch.isnan(x.grad).any()
    print(f"out {tuple(out.shape)} grad ok")


if __name__ == "__main__":
    main()
