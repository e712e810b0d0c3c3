# jundot/omlx#2172, fixed by jundot/omlx#2201 ("fix(turboquant): track the written physical end in batched KV
# caches"), omlx/turboquant_kv.py BatchTurboQuantKVCache.
#
# omlx's continuous-batching scheduler keeps a left-padded batch in BatchTurboQuantKVCache (rows end-aligned,
# offset = -left_padding per row, mask from mlx-lm's create_causal_mask(N, offset, left_padding)). Before the fix,
# for B>1 both the append position in update_and_fetch and the mask's column count were derived from
# offset.max(). That equals the written end only while some row has zero left padding. When filter() removes the
# longest-prompt row (it finished first), every logical offset falls short of the written end: each later decode
# step writes min(left_padding) columns early, over the survivors' own live KV, and the mask shrinks with it.
# The fix keeps a separate written-end counter (_phys_end) and uses it for both the write and the mask.
#
# Torch port of the MLX code; the TurboQuant codec is replaced by an identity (fp32 storage) since the bug is in
# the batch bookkeeping, not the quantizer. The model is a tiny llama-style decoder as mlx-lm writes it (mask from
# the first layer's cache, RoPE at the per-row cache offset).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def create_causal_mask(N, offset=0, window_size=None, right_padding=None, left_padding=None):
    # mlx_lm.models.base.create_causal_mask
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    if right_padding is not None:
        mask = mask & (rinds < (offset + N - right_padding)[:, None, None, None])
    if left_padding is not None:
        mask = mask & (rinds >= left_padding[:, None, None, None])
    return mask


class TurboQuantKVCache:
    # mlx_vlm.turboquant.TurboQuantKVCache, codec = identity: grows by `step`, writes at the int offset.
    step = 256

    def __init__(self, bits=4.0, seed=0):
        self.bits = bits
        self.seed = seed
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        prev = self.offset
        B, H, T, D = keys.shape
        if self.keys is None or prev + T > self.keys.shape[2]:
            n_steps = (self.step + T - 1) // self.step
            new_k = torch.zeros(B, H, n_steps * self.step, D)
            new_v = torch.zeros(B, H, n_steps * self.step, D)
            if self.keys is not None:
                self.keys = torch.cat([self.keys[..., :prev, :], new_k], dim=2)
                self.values = torch.cat([self.values[..., :prev, :], new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += T
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


class BatchTurboQuantKVCache(TurboQuantKVCache):
    def __init__(self, left_padding, bits=4.0, seed=0):
        super().__init__(bits=bits, seed=seed)
        self.group_size = 0
        self.left_padding = torch.tensor(left_padding)
        self._batch_size = len(left_padding)
        self.offset = torch.tensor([-l for l in left_padding])
        self._right_padding = None
        self._phys_end = 0

    def update_and_fetch(self, keys, values):
        T_new = keys.shape[2]
        if FIXED:
            int_offset = self._phys_end
        else:
            int_offset = int(self.offset.max().item())
        self.offset = self.offset + T_new
        saved_offset = self.offset
        self.offset = int_offset
        result = super().update_and_fetch(keys, values)
        self.offset = saved_offset
        self._phys_end = int_offset + T_new
        return result

    def make_mask(self, N, return_array=False, window_size=None):
        if FIXED:
            phys = self._phys_end
        else:
            phys = int(self.offset.max().item())
        return create_causal_mask(N, offset=phys, window_size=window_size, left_padding=self.left_padding)

    def filter(self, batch_indices):
        if self.keys is not None:
            self.keys = self.keys[batch_indices]
            self.values = self.values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]


class ModelArgs:
    vocab_size = 64
    hidden_size = 32
    num_hidden_layers = 2
    num_attention_heads = 4
    intermediate_size = 64
    rope_theta = 10000.0


def rope(x, offset, base):
    # mx.fast.rope with a per-row array offset (traditional=False)
    B, H, L, D = x.shape
    pos = offset[:, None].float() + torch.arange(L).float()[None]  # (B, L)
    inv = 1.0 / (base ** (torch.arange(0, D, 2).float() / D))
    ang = pos[..., None] * inv  # (B, L, D/2)
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : D // 2], x[..., D // 2 :]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.head_dim = args.hidden_size // self.n_heads
        self.scale = self.head_dim**-0.5
        self.rope_theta = args.rope_theta
        self.q_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.k_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.v_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)
        self.o_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=False)

    def forward(self, x, mask, cache):
        B, L, _ = x.shape
        q = self.q_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        k = self.k_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        v = self.v_proj(x).view(B, L, self.n_heads, -1).transpose(1, 2)
        q = rope(q, cache.offset, self.rope_theta)
        k = rope(k, cache.offset, self.rope_theta)
        k, v = cache.update_and_fetch(k, v)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.self_attn = Attention(args)
        self.mlp = nn.Sequential(
            nn.Linear(args.hidden_size, args.intermediate_size), nn.SiLU(), nn.Linear(args.intermediate_size, args.hidden_size)
        )
        self.input_layernorm = nn.RMSNorm(args.hidden_size)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size)

    def forward(self, x, mask, cache):
        h = x + self.self_attn(self.input_layernorm(x), mask, cache)
        return h + self.mlp(self.post_attention_layernorm(h))


class Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList([TransformerBlock(args) for _ in range(args.num_hidden_layers)])
        self.norm = nn.RMSNorm(args.hidden_size)
        self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs, cache):
        h = self.embed_tokens(inputs)
        mask = cache[0].make_mask(h.shape[1])  # create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, c)
        return self.lm_head(self.norm(h))


@torch.no_grad()
def main():
    args = ModelArgs()
    model = Model(args).eval()
    for p in model.parameters():
        p.data.normal_(0, 0.5)

    prompts = [[5, 9, 12, 3, 44, 17, 8, 30], [7, 21, 2, 50, 11], [33, 4, 19, 6, 27, 40]]
    max_tokens = [2, 8, 8]  # the longest (unpadded) prompt finishes first
    max_len = max(len(p) for p in prompts)
    left_padding = [max_len - len(p) for p in prompts]
    inputs = torch.tensor([[0] * lp + p for lp, p in zip(left_padding, prompts)])

    cache = [BatchTurboQuantKVCache(left_padding) for _ in range(args.num_hidden_layers)]
    logits = model(inputs, cache)
    y = logits[:, -1].argmax(-1)

    uids = list(range(len(prompts)))
    outs = {u: [] for u in uids}
    while uids:
        for u, t in zip(uids, y.tolist()):
            outs[u].append(t)
        keep = [i for i, u in enumerate(uids) if len(outs[u]) < max_tokens[u]]
        if len(keep) < len(uids):
            for c in cache:
                c.filter(torch.tensor(keep, dtype=torch.long))
            uids = [uids[i] for i in keep]
            y = y[keep]
        if not uids:
            break
        logits = model(y[:, None], cache)
        y = logits[:, -1].argmax(-1)

    for u in range(len(prompts)):
        print(f"request {u}: {outs[u]}")


main()
