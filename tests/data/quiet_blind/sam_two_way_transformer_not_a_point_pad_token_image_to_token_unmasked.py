"""Segment Anything: 64 image tokens attend to 8 prompt tokens, one of them a padding point that is NOT masked.

Follows facebookresearch/segment-anything segment_anything/modeling/prompt_encoder.py
(PromptEncoder._embed_points: with no box, pad=True appends a point at (0, 0) with label -1, whose positional
encoding is zeroed and replaced by not_a_point_embed) and segment_anything/modeling/transformer.py
(TwoWayTransformer, TwoWayAttentionBlock with skip_first_layer_pe, Attention with downsample_rate=2),
mask_decoder.py (MaskDecoder.predict_masks: iou token + 4 mask tokens + sparse prompt tokens).

No attention call has a mask.  The label -1 "padding" point is a learned token that every image token and
every prompt token attends to, as SAM does: it is the model's input, not padding to hide.  Cross-attention
image->token has far more queries (64) than keys (8).  Reference: the same two-way transformer with attention
computed by an explicit Python loop over each query (per batch, per head), and a check that the not-a-point
token does change the result (so it is really attended).  Max diff must be ~0.
"""
import math
import torch

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
C, H, S, DEPTH = 16, 2, 8, 2  # embedding dim, heads, image side, blocks


class Attention(torch.nn.Module):
    def __init__(self, downsample_rate=1):
        super().__init__()
        self.d = C // downsample_rate
        self.q, self.k, self.v = (torch.nn.Linear(C, self.d) for _ in range(3))
        self.out = torch.nn.Linear(self.d, C)

    def forward(self, q, k, v, loop=False):
        q, k, v = self.q(q), self.k(k), self.v(v)
        B, Nq, Nk, dh = q.shape[0], q.shape[1], k.shape[1], self.d // H
        q, k, v = (t.view(B, -1, H, dh).transpose(1, 2) for t in (q, k, v))
        if not loop:
            a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), -1) @ v
        else:
            a = torch.zeros(B, H, Nq, dh)
            for b in range(B):
                for h in range(H):
                    for i in range(Nq):
                        s = torch.tensor([float(q[b, h, i] @ k[b, h, j]) for j in range(Nk)]) / math.sqrt(dh)
                        w = torch.exp(s - s.max())
                        a[b, h, i] = sum(w[j] * v[b, h, j] for j in range(Nk)) / w.sum()
        return self.out(a.transpose(1, 2).reshape(B, Nq, self.d))


class Block(torch.nn.Module):
    def __init__(self, skip_first_layer_pe):
        super().__init__()
        self.self_attn, self.t2i, self.i2t = Attention(), Attention(2), Attention(2)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(C, 32), torch.nn.ReLU(), torch.nn.Linear(32, C))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(C) for _ in range(4))
        self.skip = skip_first_layer_pe

    def forward(self, queries, keys, query_pe, key_pe, loop):
        if self.skip:
            queries = self.self_attn(queries, queries, queries, loop)
        else:
            q = queries + query_pe
            queries = queries + self.self_attn(q, q, queries, loop)
        queries = self.norms[0](queries)
        queries = self.norms[1](queries + self.t2i(queries + query_pe, keys + key_pe, keys, loop))
        queries = self.norms[2](queries + self.mlp(queries))
        # image -> token: every image position queries the few prompt/output tokens, unmasked
        keys = self.norms[3](keys + self.i2t(keys + key_pe, queries + query_pe, queries, loop))
        return queries, keys


blocks = torch.nn.ModuleList(Block(i == 0) for i in range(DEPTH))
final_attn, norm_final = Attention(2), torch.nn.LayerNorm(C)
gauss = torch.randn(2, C // 2)  # PositionEmbeddingRandom
point_embeddings = torch.nn.Embedding(2, C)
not_a_point_embed, iou_token, mask_tokens = torch.nn.Embedding(1, C), torch.nn.Embedding(1, C), torch.nn.Embedding(4, C)


def pe(coords01):
    c = (2 * coords01 - 1) @ gauss * 2 * math.pi
    return torch.cat([c.sin(), c.cos()], -1)


def embed_points(points, labels, pad):
    points = points + 0.5
    if pad:
        points = torch.cat([points, torch.zeros(points.shape[0], 1, 2)], 1)
        labels = torch.cat([labels, -torch.ones(labels.shape[0], 1)], 1)
    emb = pe(points / (S * 4))
    emb[labels == -1] = 0.0
    emb[labels == -1] += not_a_point_embed.weight
    emb[labels == 0] += point_embeddings.weight[0]
    emb[labels == 1] += point_embeddings.weight[1]
    return emb


def two_way(image, image_pe, sparse, loop):
    out_tok = torch.cat([iou_token.weight, mask_tokens.weight], 0)[None].expand(sparse.shape[0], -1, -1)
    tokens = torch.cat([out_tok, sparse], 1)
    keys = image.repeat_interleave(tokens.shape[0], 0).flatten(2).transpose(1, 2)  # (B, HW, C)
    key_pe = image_pe.flatten(2).transpose(1, 2).expand(tokens.shape[0], -1, -1)
    queries = tokens
    for blk in blocks:
        queries, keys = blk(queries, keys, tokens, key_pe, loop)
    queries = norm_final(queries + final_attn(queries + tokens, keys + key_pe, keys, loop))
    return queries, keys


image = torch.randn(1, C, S, S)
ys, xs = torch.meshgrid(torch.arange(S) + 0.5, torch.arange(S) + 0.5, indexing="ij")
image_pe = pe(torch.stack([xs, ys], -1) / S).permute(2, 0, 1)[None]
points = torch.tensor([[[5.0, 9.0], [20.0, 14.0]], [[28.0, 3.0], [11.0, 25.0]]])
labels = torch.tensor([[1.0, 0.0], [1.0, 1.0]])

with torch.no_grad():
    sparse = embed_points(points, labels, pad=True)  # no boxes -> pad point appended, 3 prompt tokens
    q_fast, k_fast = two_way(image, image_pe, sparse, loop=False)
    q_loop, k_loop = two_way(image, image_pe, sparse, loop=True)
    max_diff = max((q_fast - q_loop).abs().max().item(), (k_fast - k_loop).abs().max().item())
    q_nopad, _ = two_way(image, image_pe, embed_points(points, labels, pad=False), loop=False)
    pad_effect = (q_fast[:, :5] - q_nopad[:, :5]).abs().max().item()

print("tokens:", q_fast.shape[1], "image queries:", k_fast.shape[1])
print("max |batched attention - per-query loop|:", max_diff)
print("effect of the not-a-point token on the output tokens (must be > 0):", pad_effect)
assert max_diff < 1e-12 and pad_effect > 1e-6
