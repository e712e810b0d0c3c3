"""Wan2.1 text-to-video DiT: video tokens padded to seq_len and masked in self-attention by k_lens, while the
T5 context is zero-padded to a fixed text_len and cross-attended with no mask at all.

Follows Wan-Video/Wan2.1 wan/modules/model.py WanModel.forward:
      seq_lens = torch.tensor([u.size(1) for u in x], dtype=torch.long)
      x = torch.cat([torch.cat([u, u.new_zeros(1, seq_len - u.size(1), u.size(2))], dim=1) for u in x])
      context_lens = None
      context = self.text_embedding(torch.stack([
          torch.cat([u, u.new_zeros(self.text_len - u.size(0), u.size(1))]) for u in context]))
  WanSelfAttention.forward: x = flash_attention(q=rope_apply(q, ...), k=rope_apply(k, ...), v=v, k_lens=seq_lens, ...)
  WanT2VCrossAttention.forward: x = flash_attention(q, k, v, k_lens=context_lens)   # None: every context slot
  wan/modules/attention.py flash_attention: k_lens gives the valid keys per sample (varlen); with k_lens None
  all text_len keys are used. The model was trained this way: the zero-padded text slots, after
  text_embedding, are part of the conditioning, and the padded video tokens are cut off by unpatchify.
Reduced: one block, no rope / time modulation, small sizes, float64; varlen attention written as a key mask.
Check: each video's tokens in the padded batch equal the same video run alone at its own length (its prompt
still zero-padded to text_len, as Wan always does), and the unmasked cross-attention equals an explicit loop
over all text_len slots.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

DIM, TEXT_DIM, HEADS, TEXT_LEN = 32, 24, 4, 8
HD = DIM // HEADS

text_embedding = nn.Sequential(nn.Linear(TEXT_DIM, DIM), nn.GELU(approximate="tanh"), nn.Linear(DIM, DIM))
sa_q, sa_k, sa_v, sa_o = (nn.Linear(DIM, DIM) for _ in range(4))
ca_q, ca_k, ca_v, ca_o = (nn.Linear(DIM, DIM) for _ in range(4))
norm1, norm2, norm3 = nn.LayerNorm(DIM), nn.LayerNorm(DIM), nn.LayerNorm(DIM)
ffn = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(approximate="tanh"), nn.Linear(2 * DIM, DIM))


def heads(t):
    return t.unflatten(-1, (HEADS, HD)).transpose(1, 2)


def attention(q, k, v, k_lens=None):  # flash_attention's semantics: keys j < k_lens[b] are valid
    mask = None
    if k_lens is not None:
        mask = (torch.arange(k.size(2))[None] < k_lens[:, None])[:, None, None, :]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).flatten(2)


def block(x, seq_lens, context):
    y = norm1(x)
    x = x + sa_o(attention(heads(sa_q(y)), heads(sa_k(y)), heads(sa_v(y)), k_lens=seq_lens))
    y = norm3(x)
    x = x + ca_o(attention(heads(ca_q(y)), heads(ca_k(context)), heads(ca_v(context)), k_lens=None))
    return x + ffn(norm2(x))


def wan_forward(videos, prompts):
    seq_len = max(u.size(1) for u in videos)
    seq_lens = torch.tensor([u.size(1) for u in videos], dtype=torch.long)
    x = torch.cat([torch.cat([u, u.new_zeros(1, seq_len - u.size(1), u.size(2))], dim=1) for u in videos])
    context = text_embedding(torch.stack([torch.cat([u, u.new_zeros(TEXT_LEN - u.size(0), u.size(1))]) for u in prompts]))
    out = block(x, seq_lens, context)
    return [out[i, :n] for i, n in enumerate(seq_lens.tolist())], context  # unpatchify keeps the real tokens


videos = [torch.randn(1, n, DIM) for n in (10, 6, 3)]
prompts = [torch.randn(n, TEXT_DIM) for n in (5, 8, 2)]  # T5 outputs cut to each prompt's real length

with torch.no_grad():
    batched, context = wan_forward(videos, prompts)
    worst_alone = max((wan_forward([v], [p])[0][0] - b).abs().max().item()
                      for v, p, b in zip(videos, prompts, batched))

    # explicit loop for the unmasked cross-attention of the first video over all TEXT_LEN slots
    v0 = videos[0]
    y = norm1(v0)
    x = v0 + sa_o(attention(heads(sa_q(y)), heads(sa_k(y)), heads(sa_v(y))))
    y = norm3(x)[0]
    q, k, v = ca_q(y), ca_k(context[0]), ca_v(context[0])
    ca = torch.zeros_like(y)
    for t in range(y.size(0)):
        for h in range(HEADS):
            sl = slice(h * HD, (h + 1) * HD)
            w = torch.softmax(torch.stack([q[t, sl] @ k[j, sl] for j in range(TEXT_LEN)]) / HD ** 0.5, 0)
            ca[t, sl] = sum(w[j] * v[j, sl] for j in range(TEXT_LEN))
    x = x[0] + ca_o(ca)
    ref0 = x + ffn(norm2(x))
    worst_loop = (ref0 - batched[0]).abs().max().item()
print(f"max |padded batch - video alone|: {worst_alone:.3e}; |batch - explicit cross-attention loop|: {worst_loop:.3e}")
assert worst_alone < 1e-10 and worst_loop < 1e-10
