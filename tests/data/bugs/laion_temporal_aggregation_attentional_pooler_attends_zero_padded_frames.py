# LAION-AI/temporal-embedding-aggregation#14 (commit d1a75a8, "AttentionalPooling: mask zero padding"; asked for in issue #12)
# AttentionalPooler pools a video's per-frame CLIP embeddings, zero padded to sequence_length, with learned queries
# through CrossAttention. Before the fix no mask reached the attention, so the CLS/video queries attended to the
# zero-padded frames of short clips; the fix masks padded frames (CLS row: all real frames, other rows: tril).
import math
import sys

import torch
import torch.nn.functional as F
from torch import einsum, nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def exists(val):
    return val is not None


def default(val, d):
    return val if exists(val) else d


class PositionalEncoding(nn.Module):

    def __init__(self, d_model: int, max_len: int = 5000):
        super().__init__()
        position = torch.arange(max_len).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2) * (-math.log(10000.0) / d_model))
        pe = torch.zeros(max_len, 1, d_model)
        pe[:, 0, 0::2] = torch.sin(position * div_term)
        pe[:, 0, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.pe[:x.size(0)]
        return x


class LayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.ones(dim))
        self.register_buffer("beta", torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, x.shape[-1:], self.gamma, self.beta)


class CrossAttention(nn.Module):
    def __init__(
        self,
        dim,
        *,
        context_dim=None,
        dim_head=64,
        heads=8,
        norm_context=False
    ):
        super().__init__()
        self.heads = heads
        self.scale = dim_head ** -0.5
        inner_dim = heads * dim_head
        context_dim = default(context_dim, dim)

        self.norm = LayerNorm(dim)
        self.context_norm = LayerNorm(context_dim) if norm_context else nn.Identity()

        self.to_q = nn.Linear(dim, inner_dim, bias=False)
        self.to_kv = nn.Linear(context_dim, dim_head * 2, bias=False)
        self.to_out = nn.Linear(inner_dim, dim, bias=False)

    def forward(self, x, context, attn_mask=None):
        # pre-layernorm, for queries and context
        x = self.norm(x)
        context = self.context_norm(context)

        # get queries
        q = self.to_q(x)
        b, n = q.shape[:2]
        q = q.view(b, n, self.heads, -1).transpose(1, 2)  # b n (h d) -> b h n d

        # scale
        q = q * self.scale

        # get key / values
        k, v = self.to_kv(context).chunk(2, dim=-1)

        # query / key similarity
        sim = einsum('b h i d, b j d -> b h i j', q, k)

        # attention
        if FIXED:
            sim = sim.masked_fill(attn_mask == 0, float('-inf'))

        sim = sim - sim.amax(dim=-1, keepdim=True)
        attn = sim.softmax(dim=-1)

        # aggregate
        out = einsum('b h i j, b j d -> b h i d', attn, v)

        # merge and combine heads
        out = out.transpose(1, 2).reshape(b, n, -1)  # b h n d -> b n (h d)
        out = self.to_out(out)
        return out


class AttentionalPooler(nn.Module):
    def __init__(self, dim, context_dim, seq_len, heads, dim_head, proj_dim=None):
        super().__init__()
        self.pos_encoding = PositionalEncoding(dim)
        self.cls_token = nn.Parameter(torch.randn(dim))

        self.img_queries = nn.Parameter(torch.randn(seq_len + 1, dim)) # num image queries for multimodal, but 1 extra CLS for contrastive learning
        self.img_attn_pool = CrossAttention(dim=dim, context_dim=dim, dim_head=dim_head, heads=heads, norm_context=True)
        self.img_attn_pool_norm = LayerNorm(dim)

        self.proj = None if proj_dim is None else nn.Sequential(
            nn.Linear(dim, (dim+proj_dim)//2),
            nn.GELU(),
            nn.Linear((dim+proj_dim)//2, proj_dim),
        )

    def forward(self, x, zero_masks=None):
        cls_tokens = self.cls_token.view(1, 1, -1).repeat(x.shape[0], 1, 1)  # d -> b 1 d

        # prepend CLS token
        x = torch.cat((cls_tokens, x), dim=-2)

        attn_mask = None
        if FIXED:
            zero_masks = torch.cat((torch.ones(x.shape[0], 1), zero_masks), dim=-1)

            # create attn mask
            attn_mask = zero_masks.unsqueeze(1).repeat(1, zero_masks.shape[-1], 1)  # b s -> b r s
            attn_mask = torch.tril(attn_mask)
            attn_mask[:, 0] = zero_masks # cls token masks should attend to all but zero_pads irregardless of position
            attn_mask = attn_mask.view(x.shape[0], 1, zero_masks.shape[-1], zero_masks.shape[-1])

        x = self.pos_encoding(x)

        img_queries = self.img_queries.unsqueeze(0).repeat(x.shape[0], 1, 1)  # n d -> b n d
        img_queries = self.img_attn_pool(img_queries, x, attn_mask)
        img_queries = self.img_attn_pool_norm(img_queries)

        video_embedding = img_queries[:, 0]
        pred = video_embedding
        if self.proj is not None:
            pred = self.proj(video_embedding)

        return pred


class Args:
    sequence_length = 16
    lr = 1e-3
    wd = 0.1
    beta1, beta2, eps = 0.9, 0.98, 1e-6
    grad_clip = 1.0


DIM = 64
NUM_CLASSES = 10
args = Args()

model = AttentionalPooler(
    dim=DIM,
    context_dim=DIM,
    seq_len=args.sequence_length,
    heads=2,
    dim_head=32,
    proj_dim=NUM_CLASSES,
)
optimizer = torch.optim.AdamW(
    model.parameters(), lr=args.lr, weight_decay=args.wd, betas=(args.beta1, args.beta2), eps=args.eps,
)
loss_func = nn.CrossEntropyLoss()

# a batch of clips with 16, 9 and 4 frames: per-frame CLIP embeddings, zero padded to sequence_length
lengths = [16, 9, 4]
embeddings = torch.zeros(len(lengths), args.sequence_length, DIM)
zero_masks = torch.zeros(len(lengths), args.sequence_length)
for b, n in enumerate(lengths):
    embeddings[b, :n] = F.normalize(torch.randn(n, DIM), dim=-1)
    zero_masks[b, :n] = 1
labs = torch.tensor([3, 7, 1])

model.train()
for step in range(3):
    optimizer.zero_grad()
    pred = model(embeddings, zero_masks) if FIXED else model(embeddings)
    loss = loss_func(pred, labs)
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
    optimizer.step()
print(f"loss {loss.item():.5f}")
