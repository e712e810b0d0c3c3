# meta-pytorch/torchtune#1835 (Gemma 2 support, review): Gemma2Attention combined its bool causal mask with
# the sliding window via torch.where(sliding_mask == 1, mask, -2.38e38), turning it into an additive float
# mask where future keys inside the window get +0 (visible); fixed by torch.where(sliding_mask == 1, mask, False).
import sys
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Gemma2Attention(nn.Module):
    def __init__(self, embed_dim, num_heads, head_dim, sliding_window_size=None, softcapping=50.0):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.sliding_window_size = sliding_window_size
        self.softcapping = softcapping
        self.q_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(embed_dim, num_heads * head_dim, bias=False)
        self.output_proj = nn.Linear(num_heads * head_dim, embed_dim, bias=False)

    def forward(self, x, y=None, *, mask=None, input_pos=None):
        b, s_x, _ = x.shape
        y = x if y is None else y
        q = self.q_proj(x).view(b, s_x, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(y).view(b, s_x, self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(y).view(b, s_x, self.num_heads, self.head_dim).transpose(1, 2)

        if mask is None:
            mask = torch.tril(torch.ones(size=(b, s_x, s_x), dtype=torch.bool, device=x.device))

        if self.sliding_window_size is not None:
            all_ones = torch.ones_like(mask)
            sliding_mask = torch.triu(all_ones, -1 * self.sliding_window_size + 1) * torch.tril(
                all_ones, self.sliding_window_size - 1
            )
            if FIXED:
                mask = torch.where(sliding_mask == 1, mask, False)
            else:
                mask = torch.where(sliding_mask == 1, mask, -2.3819763e38)

        if mask.dim() == 3:
            mask = mask[:, None, :, :]
        output = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)
        output = output.transpose(1, 2).contiguous().view(b, s_x, -1)
        return self.output_proj(output)


class TransformerSelfAttentionLayer(nn.Module):
    def __init__(self, attn, dim):
        super().__init__()
        self.attn = attn
        self.sa_norm = nn.RMSNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
        self.mlp_norm = nn.RMSNorm(dim)

    def forward(self, x, *, mask=None, input_pos=None):
        h = x + self.attn(self.sa_norm(x), mask=mask, input_pos=input_pos)
        return h + self.mlp(self.mlp_norm(h))


def gemma2(vocab_size=64, num_layers=2, num_heads=2, head_dim=8, embed_dim=16, sliding_window_size=4):
    layers = nn.ModuleList()
    for layer_idx in range(num_layers):
        attn = Gemma2Attention(
            embed_dim, num_heads, head_dim,
            # Gemma 2 alternates local (sliding window) and global layers
            sliding_window_size=sliding_window_size if layer_idx % 2 == 0 else None,
        )
        layers.append(TransformerSelfAttentionLayer(attn, embed_dim))
    return nn.ModuleDict(dict(tok_embeddings=nn.Embedding(vocab_size, embed_dim), layers=layers,
                              norm=nn.RMSNorm(embed_dim), output=nn.Linear(embed_dim, vocab_size, bias=False)))


def forward(model, tokens):
    h = model["tok_embeddings"](tokens)
    for layer in model["layers"]:
        h = layer(h)
    return model["output"](model["norm"](h))


model = gemma2()
tokens = torch.randint(0, 64, (2, 12))
labels = torch.roll(tokens, -1, dims=1)
logits = forward(model, tokens)  # training forward
loss = F.cross_entropy(logits[:, :-1].reshape(-1, 64), labels[:, :-1].reshape(-1))
loss.backward()

# causality probe: change the last token; earlier positions must not move
with torch.no_grad():
    t2 = tokens.clone()
    t2[:, -1] = (t2[:, -1] + 1) % 64
    diff = (forward(model, t2)[:, :-1] - forward(model, tokens)[:, :-1]).abs().max().item()
print("mode:", "fixed" if FIXED else "buggy", "loss %.4f" % loss.item())
print("earlier logits moved by changing the last token: %.5f" % diff)
