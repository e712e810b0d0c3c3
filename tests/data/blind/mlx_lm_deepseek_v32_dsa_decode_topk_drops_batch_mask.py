# ml-explore/mlx-lm#1072 (commit 3f9d179f, "Batch generation refactoring and various fixes"), the DeepSeek-V3.2
# part ("Deepseek DSA batch mode fixed ... the mask was ignored in batch mode"), mlx_lm/models/deepseek_v32.py,
# ported from MLX to torch with the upstream names (DeepSeek Sparse Attention: a lightning Indexer picks
# index_topk keys, MLA with the absorbed single-token path).
#
# Bug: in the single-token decode path (L == 1), once the cache holds more than index_topk keys the attention
# gathers kv_latent / k_pe at the indexer's top-k positions and sets `mask = None`. In batch generation the mask
# is BatchKVCache's left-padding mask: a left-padded row whose real keys number fewer than index_topk gets pad
# slots among its top-k (the indexer scored them -inf, but topk still has to return index_topk of them), and
# with the mask dropped the decode step attends those pad keys.
# Fix: gather the mask with the same indices, `mask = mx.take_along_axis(mask, topk_indices, axis=-1)`.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class ModelArgs:
    vocab_size = 64
    hidden_size = 32
    intermediate_size = 64
    num_hidden_layers = 2
    num_attention_heads = 4
    q_lora_rank = 16
    kv_lora_rank = 16
    qk_rope_head_dim = 8
    qk_nope_head_dim = 8
    v_head_dim = 8
    index_n_heads = 2
    index_head_dim = 16
    index_topk = 4
    rope_theta = 10000.0
    rope_scaling = None
    attention_bias = False
    rms_norm_eps = 1e-6
    max_position_embeddings = 128


class RMSNorm(nn.Module):
    def __init__(self, dims, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)


class RoPE(nn.Module):
    # mlx nn.RoPE(dims, traditional=True, base): rotates the first `dims` features in interleaved pairs,
    # positions offset + arange(L); offset is a per-row array under BatchKVCache.
    def __init__(self, dims, base):
        super().__init__()
        self.dims = dims
        self.base = base

    def forward(self, x, offset=0):
        L = x.shape[-2]
        if not torch.is_tensor(offset):
            offset = torch.tensor([offset])
        pos = offset.reshape(-1, 1, 1).float() + torch.arange(L).float().reshape(1, L, 1)
        inv = self.base ** (-torch.arange(0, self.dims, 2).float() / self.dims)
        theta = (pos * inv)[:, None]  # (B or 1, 1, L, dims/2)
        cos, sin = theta.cos(), theta.sin()
        rot, rest = x[..., : self.dims], x[..., self.dims:]
        x1, x2 = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)
        return torch.cat([out, rest], dim=-1)


def initialize_rope(dims, base, traditional, max_position_embeddings, scaling_config):
    return RoPE(dims, base)


def create_causal_mask(N, offset=0, window_size=None, right_padding=None, left_padding=None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if left_padding is not None:
        mask = mask & (left_padding.reshape(-1, 1, 1, 1) <= rinds)
    return mask


class BatchKVCache:
    def __init__(self, left_padding):
        self.keys = None
        self.values = None
        self.left_padding = torch.tensor(left_padding)
        self.offset = torch.tensor([-l for l in left_padding])
        self._idx = 0

    def update_and_fetch(self, keys, values):
        if self.keys is None:
            self.keys, self.values = keys, values
        else:
            self.keys = torch.cat([self.keys, keys], dim=2)
            self.values = torch.cat([self.values, values], dim=2)
        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def make_mask(self, N, return_array=False, window_size=None):
        return create_causal_mask(N, offset=self._idx, window_size=window_size, left_padding=self.left_padding)


def create_attention_mask(h, cache=None, window_size=None, return_array=False):
    N = h.shape[1]
    if cache is not None and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    return create_causal_mask(N, 0, window_size=window_size)


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask):
    scores = (queries * scale) @ keys.transpose(-1, -2)
    if mask is not None:
        scores = scores + mask
    return torch.softmax(scores.float(), dim=-1).to(values.dtype) @ values


class MultiLinear(nn.Module):
    def __init__(self, input_dims, output_dims, num_heads):
        super().__init__()
        scale = math.sqrt(1.0 / input_dims)
        self.weight = nn.Parameter(torch.empty(num_heads, output_dims, input_dims).uniform_(-scale, scale))

    def forward(self, x, transpose=True):
        if transpose:
            return x @ self.weight.transpose(-1, -2)
        return x @ self.weight


class Indexer(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.dim = args.hidden_size
        self.n_heads = args.index_n_heads
        self.head_dim = args.index_head_dim
        self.rope_head_dim = args.qk_rope_head_dim
        self.index_topk = args.index_topk
        self.q_lora_rank = args.q_lora_rank
        self.wq_b = nn.Linear(self.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(self.dim, self.head_dim, bias=False)
        self.k_norm = nn.LayerNorm(self.head_dim)
        self.weights_proj = nn.Linear(self.dim, self.n_heads, bias=False)
        self.softmax_scale = self.head_dim ** -0.5
        self.rope = initialize_rope(args.qk_rope_head_dim, args.rope_theta, True,
                                    args.max_position_embeddings, args.rope_scaling)

    def forward(self, x, qr, mask, cache=None):
        b, s, _ = x.shape
        q = self.wq_b(qr)
        q = q.reshape(b, s, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x)
        k = self.k_norm(k)
        k = k.reshape(b, 1, s, self.head_dim)

        offset = cache.offset if cache is not None else 0

        q = self.rope(q, offset=offset)
        k = self.rope(k, offset=offset)

        if cache is not None:
            k, _ = cache.update_and_fetch(k, torch.zeros(b, 1, s, 0))
        if k.shape[2] <= self.index_topk:
            return None
        scores = q @ k.transpose(-1, -2)
        scores = torch.clamp(scores, min=0)
        weights = self.weights_proj(x) * (self.n_heads ** -0.5 * self.softmax_scale)
        weights = weights.transpose(-1, -2)[..., None]
        scores = scores * weights
        scores = scores.sum(dim=1, keepdim=True)
        if mask is not None:
            scores = torch.where(mask, scores, torch.tensor(-float("inf")))
        return torch.topk(scores, self.index_topk, dim=-1).indices


class DeepseekV32Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.q_lora_rank = config.q_lora_rank
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.v_head_dim = config.v_head_dim
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.q_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.scale = self.q_head_dim ** -0.5

        self.q_a_proj = nn.Linear(self.hidden_size, self.q_lora_rank, bias=config.attention_bias)
        self.q_a_layernorm = RMSNorm(self.q_lora_rank, eps=1e-6)
        self.q_b_proj = nn.Linear(self.q_lora_rank, self.num_heads * self.q_head_dim, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(self.hidden_size, self.kv_lora_rank + self.qk_rope_head_dim,
                                            bias=config.attention_bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, eps=1e-6)
        self.embed_q = MultiLinear(self.qk_nope_head_dim, self.kv_lora_rank, self.num_heads)
        self.unembed_out = MultiLinear(self.kv_lora_rank, self.v_head_dim, self.num_heads)
        self.o_proj = nn.Linear(self.num_heads * self.v_head_dim, self.hidden_size, bias=config.attention_bias)

        self.indexer = Indexer(config)
        self.rope = initialize_rope(self.qk_rope_head_dim, config.rope_theta, True,
                                    config.max_position_embeddings, config.rope_scaling)

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape

        qr = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(qr)

        q = q.reshape(B, L, self.num_heads, self.q_head_dim).transpose(1, 2)
        q_nope, q_pe = torch.split(q, [self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        compressed_kv = self.kv_a_proj_with_mqa(x)
        compressed_kv, k_pe = torch.split(compressed_kv, [self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        k_pe = k_pe.reshape(B, L, 1, self.qk_rope_head_dim).transpose(1, 2)
        kv_latent = self.kv_a_layernorm(compressed_kv)

        offset = cache[0].offset if cache is not None else 0
        q_pe = self.rope(q_pe, offset)
        k_pe = self.rope(k_pe, offset)

        kv_latent = kv_latent.unsqueeze(1)

        if cache is not None:
            kv_latent, k_pe = cache[0].update_and_fetch(kv_latent, k_pe)
        else:
            cache = [None] * 2

        topk_indices = self.indexer(x, qr, mask, cache=cache[1])
        if topk_indices is not None:
            if L == 1:
                idx = topk_indices[:, :, 0, :, None]
                kv_latent = torch.gather(kv_latent, 2, idx.expand(*idx.shape[:-1], kv_latent.shape[-1]))
                k_pe = torch.gather(k_pe, 2, idx.expand(*idx.shape[:-1], k_pe.shape[-1]))
                if FIXED:
                    if mask is not None:
                        mask = torch.gather(mask.expand(B, -1, -1, -1), -1, topk_indices)
                else:
                    mask = None
            else:
                shape = list(topk_indices.shape)
                shape[-1] = kv_latent.shape[2]
                sparse_mask = torch.zeros(shape, dtype=torch.bool)
                sparse_mask = sparse_mask.scatter(-1, topk_indices, True)
                if mask is not None:
                    sparse_mask = sparse_mask & mask
                mask = sparse_mask

        pe_scores = (q_pe * self.scale) @ k_pe.transpose(-1, -2)
        if mask is not None:
            pe_scores = torch.where(mask, pe_scores, torch.tensor(torch.finfo(pe_scores.dtype).min))

        if L == 1:
            q_nope = self.embed_q(q_nope)
            k = v = kv_latent
        else:
            k = self.embed_q(kv_latent, transpose=False)
            v = self.unembed_out(kv_latent)

        output = scaled_dot_product_attention(q_nope, k, v, cache=cache, scale=self.scale, mask=pe_scores)
        if L == 1:
            output = self.unembed_out(output)

        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.o_proj(output)


class DeepseekV32MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DeepseekV32DecoderLayer(nn.Module):
    def __init__(self, config, layer_idx):
        super().__init__()
        self.self_attn = DeepseekV32Attention(config)
        self.mlp = DeepseekV32MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, mask=None, cache=None):
        r = self.self_attn(self.input_layernorm(x), mask, cache)
        h = x + r
        r = self.mlp(self.post_attention_layernorm(h))
        return h + r


class DeepseekV32Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([DeepseekV32DecoderLayer(config, i) for i in range(config.num_hidden_layers)])
        self.num_layers = len(self.layers)
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, x, cache=None):
        h = self.embed_tokens(x)
        if cache is None:
            cache = [None] * self.num_layers
        mask = create_attention_mask(h, cache[0][0] if cache[0] else None, return_array=True)
        for i in range(self.num_layers):
            h = self.layers[i](h, mask, cache[i])
        return self.norm(h)


class Model(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.args = config
        self.model = DeepseekV32Model(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, inputs, cache=None):
        return self.lm_head(self.model(inputs, cache))

    def make_cache(self, left_padding):
        # one (MLA latent cache, indexer key cache) pair per layer
        return [[BatchKVCache(left_padding), BatchKVCache(left_padding)] for _ in self.model.layers]


def main():
    torch.manual_seed(0)
    args = ModelArgs()
    model = Model(args).eval()

    pad_id = 0
    prompts = [[5, 17, 23, 9, 41, 12, 33, 7], [19, 44]]
    max_len = max(len(p) for p in prompts)
    left_padding = [max_len - len(p) for p in prompts]
    inputs = torch.tensor([[pad_id] * lp + p for lp, p in zip(left_padding, prompts)])

    cache = model.make_cache(left_padding)
    generated = [[] for _ in prompts]
    with torch.no_grad():
        logits = model(inputs, cache=cache)[:, -1, :]
        for step in range(6):
            y = logits.argmax(-1)
            for b in range(len(prompts)):
                generated[b].append(int(y[b]))
            logits = model(y[:, None], cache=cache)[:, -1, :]

    for b, p in enumerate(prompts):
        print(f"row {b} prompt {p} -> {generated[b]}")
    print("last-step logits row 1 [:6]:", [round(v, 4) for v in logits[1, :6].tolist()])


if __name__ == "__main__":
    main()
