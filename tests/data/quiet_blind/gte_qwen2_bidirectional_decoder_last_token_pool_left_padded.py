"""gte-Qwen2-instruct style embeddings: a Qwen2 decoder run bidirectionally, last-token pooling over a
left-padded batch.

Follows Alibaba-NLP/gte-Qwen2-7B-instruct (model card usage and its sentence-transformers config): the
tokenizer pads on the left, each text ends with <|endoftext|>, and the model card states that the model
uses bidirectional attention (every real token sees every real token; the padding mask is the only mask);
the card's pooling is
      def last_token_pool(last_hidden_states, attention_mask):
          left_padding = (attention_mask[:, -1].sum() == attention_mask.shape[0])
          if left_padding:
              return last_hidden_states[:, -1]
  followed by F.normalize(embeddings, p=2, dim=1). Position ids are not passed (arange over the padded row);
  RoPE depends only on distances, so the shift by the padding changes nothing.
Reduced: a 2-layer Qwen2-like block in plain torch (RMSNorm, RoPE, GQA with q/k/v bias, SwiGLU), float64.
Check: the left-padded batch embeddings equal each text alone, unpadded; and an explicit per-query loop
over the real keys gives the same last-token state.
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)

V, D, H, KV, LAYERS = 64, 32, 4, 2, 2
HD = D // H
PAD = EOS = 0  # Qwen2: pad token is <|endoftext|>, which also ends every text


class RMSNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(1 + 0.1 * torch.randn(D))

    def forward(self, x):
        return self.w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def rope(x, pos):
    inv = 1.0 / (10000 ** (torch.arange(0, HD, 2) / HD))
    ang = pos[..., None] * inv
    cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
    x1, x2 = x.chunk(2, -1)
    return x * cos + torch.cat([-x2, x1], -1) * sin


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = nn.Linear(D, D), nn.Linear(D, KV * HD), nn.Linear(D, KV * HD)
        self.o = nn.Linear(D, D, bias=False)
        self.gate, self.up, self.down = nn.Linear(D, 2 * D, bias=False), nn.Linear(D, 2 * D, bias=False), nn.Linear(2 * D, D, bias=False)
        self.n1, self.n2 = RMSNorm(), RMSNorm()

    def qkv(self, x, pos):
        B, T, _ = x.shape
        y = self.n1(x)
        q = rope(self.q(y).view(B, T, H, HD).transpose(1, 2), pos)
        k = rope(self.k(y).view(B, T, KV, HD).transpose(1, 2), pos).repeat_interleave(H // KV, 1)
        v = self.v(y).view(B, T, KV, HD).transpose(1, 2).repeat_interleave(H // KV, 1)
        return q, k, v

    def finish(self, x, attn):
        x = x + self.o(attn)
        y = self.n2(x)
        return x + self.down(F.silu(self.gate(y)) * self.up(y))

    def forward(self, x, pos, attention_mask):
        q, k, v = self.qkv(x, pos)
        mask = attention_mask.bool()[:, None, None, :]  # bidirectional: padding is the only mask
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        return self.finish(x, attn.transpose(1, 2).flatten(2))


embed = nn.Embedding(V, D)
layers = nn.ModuleList(Layer() for _ in range(LAYERS)).eval()
final_norm = RMSNorm()


def encode(input_ids, attention_mask):
    pos = torch.arange(input_ids.size(1))[None].expand_as(input_ids).double()
    x = embed(input_ids)
    for layer in layers:
        x = layer(x, pos, attention_mask)
    return final_norm(x)


def last_token_pool(last_hidden_states, attention_mask):
    left_padding = (attention_mask[:, -1].sum() == attention_mask.shape[0])
    assert left_padding
    return last_hidden_states[:, -1]


texts = [torch.cat([torch.randint(1, V, (n,)), torch.tensor([EOS])]) for n in (8, 2, 5)]
T = max(len(t) for t in texts)
input_ids = torch.full((len(texts), T), PAD)
attention_mask = torch.zeros(len(texts), T, dtype=torch.long)
for i, t in enumerate(texts):
    input_ids[i, T - len(t):], attention_mask[i, T - len(t):] = t, 1

with torch.no_grad():
    emb = F.normalize(last_token_pool(encode(input_ids, attention_mask), attention_mask), p=2, dim=1)
    alone = torch.cat([F.normalize(encode(t[None], torch.ones(1, len(t), dtype=torch.long))[:, -1], p=2, dim=1)
                       for t in texts])
    d_alone = (emb - alone).abs().max().item()

    # explicit loop for the shortest text: every query over its real keys only, no mask tensor
    t = texts[1]
    x = embed(t[None])
    pos = torch.arange(len(t))[None].double()
    for layer in layers:
        q, k, v = layer.qkv(x, pos)
        out = torch.zeros(1, len(t), D)
        for i in range(len(t)):
            for h in range(H):
                w = torch.softmax(k[0, h] @ q[0, h, i] / HD ** 0.5, 0)
                out[0, i, h * HD:(h + 1) * HD] = w @ v[0, h]
        x = layer.finish(x, out)
    d_loop = (F.normalize(final_norm(x)[:, -1], p=2, dim=1)[0] - emb[1]).abs().max().item()
print(f"max |left-padded bidirectional batch - alone|: {d_alone:.3e}; |batch - explicit loop|: {d_loop:.3e}")
assert d_alone < 1e-10 and d_loop < 1e-10
