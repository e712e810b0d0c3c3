# Correct program. Ported from facebookresearch/fairseq2 src/fairseq2/models/transformer/attention_bias.py
# (CausalAttentionBias materialised per document from BatchLayout seq_begin_indices) used for a packed batch.
import torch, torch.nn.functional as F
torch.manual_seed(0)
D, H = 16, 2
seq_lens = [3, 5, 2]
seq_begin_indices = torch.tensor([0, 3, 8, 10])
x = torch.randn(1, 10, D)
wq, wk, wv = (torch.nn.Linear(D, D) for _ in range(3))

def materialize_causal_bias(seq_begin_indices, total):
    doc = torch.bucketize(torch.arange(total), seq_begin_indices[1:], right=True)
    i = torch.arange(total)
    allowed = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    return torch.zeros(total, total).masked_fill(~allowed, float("-inf"))

def attn(x, bias):
    sp = lambda t: t.view(1, -1, H, D // H).transpose(1, 2)
    o = F.scaled_dot_product_attention(sp(wq(x)), sp(wk(x)), sp(wv(x)), attn_mask=bias)
    return o.transpose(1, 2).reshape(1, -1, D)

y = attn(x, materialize_causal_bias(seq_begin_indices, 10))
loss = y.pow(2).mean(); loss.backward()
for b, e in zip(seq_begin_indices[:-1].tolist(), seq_begin_indices[1:].tolist()):
    sp = lambda t: t.view(1, -1, H, D // H).transpose(1, 2)
    xs = x[:, b:e]
    r = F.scaled_dot_product_attention(sp(wq(xs)), sp(wk(xs)), sp(wv(xs)), is_causal=True).transpose(1, 2).reshape(1, -1, D)
    assert torch.allclose(y[:, b:e], r, atol=1e-5)
print("ok")
