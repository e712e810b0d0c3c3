"""A causal Performer decoder (FAVOR+, as performer-pytorch writes it): queries and keys are mapped to positive random
features, `exp(x @ projectionᵀ - |x|² / 2 - max)`, by one projection matrix shared by every batch row and head
(`projection_matrix[None, None].expand(b, h, m, d)`), and the causal attention is a prefix sum over the keys'
features: no softmax over queries by keys anywhere. A batch of two sequences, no padding. Correct: each position's
output depends on the tokens up to it only (checked: changing the last token moves no earlier output).
"""

import math

import torch
import torch.nn as nn

torch.manual_seed(0)
DIM, HEADS, FEATURES, LENGTH = 32, 4, 16, 10


def gaussian_orthogonal_random_matrix(rows, columns):
    blocks = [torch.linalg.qr(torch.randn(columns, columns))[0].T for _ in range(math.ceil(rows / columns))]
    return torch.cat(blocks)[:rows] * torch.randn(rows, columns).norm(dim=1, keepdim=True)


def softmax_kernel(data, projection_matrix, is_query, eps=1e-4):
    b, h, *_ = data.shape
    normalizer = data.shape[-1] ** -0.25
    projection = projection_matrix[None, None].expand(b, h, *projection_matrix.shape)
    data_dash = torch.einsum("...id,...jd->...ij", normalizer * data, projection)
    diag = (data ** 2).sum(dim=-1, keepdim=True) / 2.0 * normalizer ** 2
    shift = data_dash.max(dim=-1, keepdim=True).values if is_query else data_dash.max()
    return projection_matrix.shape[0] ** -0.5 * (torch.exp(data_dash - diag - shift) + eps)


def causal_linear_attention(q, k, v):
    k_cumsum = k.cumsum(dim=-2)
    context = torch.einsum("...nd,...ne->...nde", k, v).cumsum(dim=-3)
    out = torch.einsum("...nde,...nd->...ne", context, q)
    return out / torch.einsum("...nd,...nd->...n", q, k_cumsum)[..., None]


class FastAttention(nn.Module):
    def __init__(self, dim_head, nb_features, causal=True):
        super().__init__()
        self.causal = causal
        self.register_buffer("projection_matrix", gaussian_orthogonal_random_matrix(nb_features, dim_head))

    def forward(self, q, k, v):
        q = softmax_kernel(q, self.projection_matrix, is_query=True)
        k = softmax_kernel(k, self.projection_matrix, is_query=False)
        return causal_linear_attention(q, k, v)


class Decoder(nn.Module):
    def __init__(self, vocab=50):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, DIM), nn.Embedding(64, DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)
        self.fast_attention = FastAttention(DIM // HEADS, FEATURES)
        self.head = nn.Linear(DIM, vocab)

    def forward(self, tokens):
        b, n = tokens.shape
        x = self.embed(tokens) + self.pos(torch.arange(n))
        q, k, v = (t.view(b, n, HEADS, -1).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        y = self.fast_attention(q, k, v).transpose(1, 2).reshape(b, n, DIM)
        return self.head(x + self.out(y))


model = Decoder().eval()
tokens = torch.randint(1, 50, (2, LENGTH))
changed = tokens.clone()
changed[:, -1] = (changed[:, -1] % 49) + 1
with torch.no_grad():
    moved = (model(tokens)[:, :-1] - model(changed)[:, :-1]).abs().max().item()
print(f"earlier outputs moved by the last token: {moved:.2e}")
assert moved < 1e-5
