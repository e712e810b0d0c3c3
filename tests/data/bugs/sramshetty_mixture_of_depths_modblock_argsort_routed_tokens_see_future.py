# sramshetty/mixture-of-depths, issue sramshetty/mixture-of-depths#5, fixed in commit 485e14d (routing_transformer.py, MoDBlock).
# MoDBlock gathers the routed tokens with torch.argsort(topk_indices) (a permutation of 0..k-1) instead of the sorted
# token positions, so the triu causal mask is applied to the wrong tokens in a shuffled order and routed tokens attend to later tokens.
import math
import sys
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def repeat(t, pattern, d):
    # einops.repeat(t, 'b s -> b s d', d=d)
    assert pattern == 'b s -> b s d'
    return t.unsqueeze(-1).expand(*t.shape, d)


# ---- from llama/model.py (meta-llama/llama), which routing_transformer.py imports ----
class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    return freqs_cis


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis) -> Tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


# ---- mixture_of_depths/routing_transformer.py (fairscale parallel linears -> nn.Linear, world size 1) ----
@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: Optional[int] = None
    vocab_size: int = 50
    multiple_of: int = 16
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    max_batch_size: int = 2
    max_seq_len: int = 16
    routing: bool = True
    aux_routing: bool = False
    capacity: int = 16 // 2
    router_skip_blocks: int = 2
    aux_loss: bool = False


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        model_parallel_size = 1
        self.n_local_heads = args.n_heads // model_parallel_size
        self.n_local_kv_heads = self.n_kv_heads // model_parallel_size
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

    def forward(self, x, start_pos, freqs_cis, mask):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)
        keys = xk
        values = xv
        keys = repeat_kv(keys, self.n_rep)
        values = repeat_kv(values, self.n_rep)
        xq = xq.transpose(1, 2)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.head_dim)
        if mask is not None:
            scores = scores + mask  # (bs, n_local_heads, seqlen, cache_len + seqlen)
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim, hidden_dim, multiple_of, ffn_dim_multiplier):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class MoDBlock(nn.Module):
    def __init__(self, layer_id, args, router, aux_router):
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.head_dim = args.dim // args.n_heads
        self.attention = Attention(args)
        self.feed_forward = FeedForward(dim=args.dim, hidden_dim=4 * args.dim,
                                        multiple_of=args.multiple_of, ffn_dim_multiplier=args.ffn_dim_multiplier)
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.router = router
        self.aux_router = aux_router
        self.aux_routing = args.aux_routing
        self.capacity = args.capacity
        self.block_skip = args.router_skip_blocks

    def forward(self, x, start_pos, freqs_cis, mask):
        seq_len = x.size(1)
        token_weights = None
        aux_weights = None
        topk_indices = None

        if self.layer_id % self.block_skip and self.router:
            if self.aux_routing:
                aux_weights = self.aux_router(x.detach()).squeeze(2)
                token_weights = self.router(x).squeeze(2)
            else:
                token_weights = self.router(x).squeeze(2)

            k = min(seq_len, self.capacity)
            topk_weights, topk_indices = torch.topk(torch.sigmoid(token_weights), k=k, sorted=False)
            if FIXED:
                sorted_indices, sorting_indices = torch.sort(topk_indices)
            else:
                sorted_indices = torch.argsort(topk_indices)

            y = x.clone()
            x = x.gather(dim=1, index=repeat(sorted_indices, 'b s -> b s d', d=self.dim))
            seq_len = x.size(1)
            freqs_cis = freqs_cis[:seq_len]

        if seq_len > 1:
            mask = torch.full((seq_len, seq_len), float("-inf"), device=x.device)
            mask = torch.triu(mask, diagonal=1)
            mask = torch.hstack([
                torch.zeros((seq_len, start_pos), device=x.device),
                mask
            ]).type_as(x)

        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)

        out = self.feed_forward(self.ffn_norm(h))
        if self.layer_id % self.block_skip and self.router:
            if FIXED:
                out *= topk_weights.gather(1, sorting_indices).unsqueeze(2)
            else:
                out *= topk_weights.gather(1, sorted_indices).unsqueeze(2)

        out = h + out

        if self.layer_id % self.block_skip and self.router:
            out = y.scatter_add(dim=1, index=repeat(sorted_indices, 'b s -> b s d', d=self.dim), src=out)

        return out, token_weights, aux_weights, topk_indices


class MoDTransformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers
        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.router = None
        self.aux_router = None
        if params.routing:
            self.router = nn.Linear(params.dim, 1, bias=False)
        self.layers = torch.nn.ModuleList()
        for layer_id in range(params.n_layers):
            self.layers.append(MoDBlock(layer_id, params, self.router, self.aux_router))
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(self.params.dim // self.params.n_heads, self.params.max_seq_len * 2)

    def forward_embeds(self, h, start_pos):
        seqlen = h.size(1)
        freqs_cis = self.freqs_cis[start_pos: start_pos + seqlen]
        mask = None
        for layer in self.layers:
            h, token_weights, aux_weights, topk_indices = layer(h, start_pos, freqs_cis, mask)
        h = self.norm(h)
        return self.output(h).float()


params = ModelArgs()
model = MoDTransformer(params).eval()
B, T = 2, params.max_seq_len
tokens = torch.randint(0, params.vocab_size, (B, T))

# Causality check of a training-style forward (start_pos=0): the router weight of a token depends only on that token,
# so once the routed set is fixed, logits at position p must not depend on inputs at positions q > p.
emb = model.tok_embeddings(tokens).detach().requires_grad_(True)
logits = model.forward_embeds(emb, start_pos=0)
leak = 0.0
for p in range(T - 1):
    g, = torch.autograd.grad(logits[:, p].pow(2).sum(), emb, retain_graph=True)
    leak = max(leak, g[:, p + 1:].abs().max().item())

# Reference for the routed layer: each routed token, in position order, attends to routed tokens at or before it.
blk = model.layers[1]
with torch.no_grad():
    x = model.layers[0](model.tok_embeddings(tokens), 0, model.freqs_cis[:T], None)[0]
    out_blk, _, _, topk_idx = blk(x, 0, model.freqs_cis[:T], None)
    ref = x.clone()
    w = torch.sigmoid(model.router(x).squeeze(2))
    for b in range(B):
        pos = torch.sort(topk_idx[b]).values
        xs = x[b:b + 1, pos]
        k = xs.size(1)
        m = torch.triu(torch.full((k, k), float("-inf")), diagonal=1)
        h = xs + blk.attention(blk.attention_norm(xs), 0, model.freqs_cis[:k], m)
        o = h + blk.feed_forward(blk.ffn_norm(h)) * w[b, pos].view(1, -1, 1)
        ref[b, pos] = x[b, pos] + o[0]
    diff = (out_blk - ref).abs().max().item()

print(f"max |d logits[p] / d input[q>p]| (future leak): {leak:.3e}")
print(f"routed MoDBlock output vs per-token causal reference, max abs diff: {diff:.3e}")
