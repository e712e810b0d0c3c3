"""A sliding layer's window dropped at decode, in a static cache read through the program's own softmax (a port of
google-deepmind/gemma's gm `Attention.__call__`: K and V written at `end_index % cache_size`, the mask over the cache's
stored positions; the correct program is tests/data/quiet_blind/quiet_gemma_gm_sliding_mask_cache_positions_left_padded.py).

The slip: the sliding mask is applied only where the call writes more than one token (`x.shape[1] > 1`, meant to skip
work at decode), so each decode step of a local layer sees every cached key. --fixed applies it at every call. The
static cache's last slots are unwritten and hidden at each step, so the steps' queries sit before them, not at the
keys' end. Prints the largest gap between each decode step's logits and the prompt decoded alone (0 with --fixed).
"""
import enum
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)
K_MASK = -2.3819763e38


def create_sliding_mask(positions, *, cache_positions=None, sliding_window_size):
    if cache_positions is None:
        cache_positions = positions
    cache_positions = cache_positions[..., None, :]  # B 1 cache_len
    positions = positions[..., :, None]  # B L 1
    sliding_mask = cache_positions > positions - sliding_window_size
    sliding_mask = sliding_mask & (cache_positions < positions + sliding_window_size)
    return sliding_mask


class AttentionType(enum.Enum):
    GLOBAL = 1
    LOCAL_SLIDING = 2


def apply_rope(inputs, positions, base_frequency=10_000, scale_factor=1.0):
    head_dim = inputs.shape[-1]
    fraction = 2 * torch.arange(0, head_dim // 2, dtype=torch.float32) / head_dim
    timescale = base_frequency ** fraction
    sinusoid_inp = positions[..., None].float() / timescale[None, None, :]
    sinusoid_inp = sinusoid_inp[..., None, :] / scale_factor
    sin, cos = torch.sin(sinusoid_inp), torch.cos(sinusoid_inp)
    first_half, second_half = inputs.chunk(2, dim=-1)
    return torch.cat([first_half * cos - second_half * sin, second_half * cos + first_half * sin], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + 1e-6) * (1 + self.scale)


class Attention(nn.Module):
    def __init__(self, num_heads, features, head_dim, attn_type, query_pre_attn_scalar, sliding_window_size=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.attn_type = attn_type
        self.query_pre_attn_scalar = query_pre_attn_scalar
        self.sliding_window_size = sliding_window_size
        self.qkv_einsum = nn.Parameter(torch.randn(3, num_heads, features, head_dim) / math.sqrt(features))
        self.attn_vec_einsum = nn.Parameter(torch.randn(num_heads, head_dim, features) / math.sqrt(head_dim))

    def forward(self, x, segment_pos, cache, attn_mask):
        query_proj, key_proj, value_proj = torch.einsum("btd,sndh->sbtnh", x, self.qkv_einsum)
        query_proj = apply_rope(query_proj, segment_pos)
        query_scaled = query_proj * self.query_pre_attn_scalar
        key_proj = apply_rope(key_proj, segment_pos)

        # Cache is left aligned.
        if cache is not None:
            end_index = int(cache["end_index"][0])
            cache_size = cache["v"].shape[1]
            update_index = end_index % cache_size
            seq_len = x.shape[1]
            value_proj_c = cache["v"].clone()
            value_proj_c[:, update_index:update_index + seq_len] = value_proj
            key_proj_c = cache["k"].clone()
            key_proj_c[:, update_index:update_index + seq_len] = key_proj
            cache_positions = cache["positions"].clone()
            cache_positions[:, update_index:update_index + seq_len] = segment_pos
            value_proj, key_proj = value_proj_c, key_proj_c

        logits = torch.einsum("btnh,bsnh->btns", query_scaled, key_proj)

        if self.attn_type == AttentionType.LOCAL_SLIDING and (FIXED or x.shape[1] > 1):
            sliding_mask = create_sliding_mask(
                segment_pos,
                cache_positions=cache_positions if cache else None,
                sliding_window_size=self.sliding_window_size,
            )
            attn_mask = attn_mask & sliding_mask

        padded_logits = torch.where(attn_mask.unsqueeze(-2), logits, torch.tensor(K_MASK))
        probs = torch.softmax(padded_logits, dim=-1)
        encoded = torch.einsum("btns,bsnh->btnh", probs, value_proj)
        attn_output = torch.einsum("btnh,nhd->btd", encoded, self.attn_vec_einsum)

        if cache is not None:
            new_cache = {
                "v": value_proj,
                "k": key_proj,
                "end_index": cache["end_index"] + x.shape[1],
                "positions": cache_positions,
            }
        else:
            new_cache = None
        return new_cache, attn_output


class Block(nn.Module):
    def __init__(self, num_heads, embed_dim, head_dim, hidden_dim, attn_type, sliding_window_size):
        super().__init__()
        self.pre_attention_norm = RMSNorm(embed_dim)
        self.attn = Attention(num_heads, embed_dim, head_dim, attn_type, head_dim ** -0.5, sliding_window_size)
        self.post_attention_norm = RMSNorm(embed_dim)
        self.pre_ffw_norm = RMSNorm(embed_dim)
        self.gating = nn.Linear(embed_dim, 2 * hidden_dim, bias=False)
        self.linear = nn.Linear(hidden_dim, embed_dim, bias=False)
        self.post_ffw_norm = RMSNorm(embed_dim)

    def forward(self, x, segment_pos, cache, attn_mask):
        cache, attn_output = self.attn(self.pre_attention_norm(x), segment_pos, cache, attn_mask)
        attn_output = self.post_attention_norm(attn_output) + x
        g, u = self.gating(self.pre_ffw_norm(attn_output)).chunk(2, dim=-1)
        outputs = self.post_ffw_norm(self.linear(F.gelu(g, approximate="tanh") * u))
        return cache, outputs + attn_output


class Transformer(nn.Module):
    attention_types = (AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL,
                       AttentionType.LOCAL_SLIDING, AttentionType.GLOBAL)

    def __init__(self, vocab_size=48, embed_dim=32, num_heads=2, head_dim=16, hidden_dim=64, sliding_window_size=3):
        super().__init__()
        self.embed_dim, self.num_heads, self.head_dim = embed_dim, num_heads, head_dim
        self.input_embedding = nn.Parameter(torch.randn(vocab_size, embed_dim) * 0.5)
        self.blocks = nn.ModuleList(
            Block(num_heads, embed_dim, head_dim, hidden_dim, t, sliding_window_size) for t in self.attention_types)
        self.final_norm = RMSNorm(embed_dim)

    def init_cache(self, batch_size, cache_size):
        return {
            f"layer_{i}": {
                "v": torch.zeros(batch_size, cache_size, self.num_heads, self.head_dim),
                "k": torch.zeros(batch_size, cache_size, self.num_heads, self.head_dim),
                "end_index": torch.zeros(batch_size, dtype=torch.long),
                "positions": torch.zeros(batch_size, cache_size, dtype=torch.long),
            }
            for i in range(len(self.blocks))
        }

    def forward(self, tokens, positions, cache, attention_mask):
        x = self.input_embedding[tokens] * math.sqrt(self.embed_dim)
        new_cache = {} if cache is not None else None
        for i, block in enumerate(self.blocks):
            layer_name = f"layer_{i}"
            layer_cache = cache[layer_name] if cache else None
            layer_cache, x = block(x, positions, layer_cache, attention_mask)
            if cache is not None:
                new_cache[layer_name] = layer_cache
        x = self.final_norm(x)
        logits = x @ self.input_embedding.T
        return logits, new_cache


def build_positions_from_mask(input_mask):
    positions = torch.cumsum(input_mask.long(), dim=-1)
    return positions - (positions >= 1).long()


def make_causal_attn_mask(input_mask, cache_size):
    seq_len = input_mask.shape[-1]
    causal = torch.tril(torch.ones(seq_len, seq_len, dtype=torch.bool))
    attn_mask = input_mask[..., None, :] & causal[None]
    return F.pad(attn_mask, (0, cache_size - seq_len), value=False)


def reference_logits(model, tokens, window):
    n = len(tokens)
    layer_masks = []
    for block in model.blocks:
        m = torch.zeros(1, n, n, dtype=torch.bool)
        for q in range(n):
            for k in range(n):
                if block.attn.attn_type == AttentionType.LOCAL_SLIDING:
                    m[0, q, k] = q - window < k <= q
                else:
                    m[0, q, k] = k <= q
        layer_masks.append(m)
    x = model.input_embedding[torch.tensor(tokens)[None]] * math.sqrt(model.embed_dim)
    pos = torch.arange(n)[None]
    for block, m in zip(model.blocks, layer_masks):
        # The reference hands its own full mask and skips the block's sliding branch.
        saved = block.attn.attn_type
        block.attn.attn_type = AttentionType.GLOBAL
        _, x = block(x, pos, None, m)
        block.attn.attn_type = saved
    return (model.final_norm(x) @ model.input_embedding.T)[0]


def main():
    window = 3
    model = Transformer(sliding_window_size=window).eval()
    prompts = [[3, 4, 5, 6, 7, 8, 9], [10, 11, 12, 13]]
    B, P = len(prompts), max(len(p) for p in prompts)
    steps = 5
    cache_size = P + steps
    tokens = torch.zeros(B, P, dtype=torch.long)
    input_mask = torch.zeros(B, P, dtype=torch.bool)
    for b, p in enumerate(prompts):  # left padding
        tokens[b, P - len(p):] = torch.tensor(p)
        input_mask[b, P - len(p):] = True

    with torch.no_grad():
        cache = model.init_cache(B, cache_size)
        positions = build_positions_from_mask(input_mask)
        attn_mask = make_causal_attn_mask(input_mask, cache_size)
        logits, cache = model(tokens, positions, cache, attn_mask)
        last_logits = logits[:, -1]
        last_pos = positions[:, -1]
        # Slots a decode step may read: the prompt's real tokens, then every slot written since.
        slot_valid = F.pad(input_mask, (0, steps), value=False)
        generated = [[] for _ in range(B)]
        gap = 0.0
        for step in range(steps):
            for b in range(B):
                ref = reference_logits(model, prompts[b] + generated[b], window)[-1]
                gap = max(gap, float((last_logits[b] - ref).abs().max()))
            next_tok = last_logits.argmax(-1)
            for b in range(B):
                generated[b].append(int(next_tok[b]))
            end_index = P + step
            slot_valid = slot_valid.clone()
            slot_valid[:, end_index] = True
            step_mask = slot_valid[:, None, :]
            last_pos = last_pos + 1
            logits, cache = model(next_tok[:, None], last_pos[:, None], cache, step_mask)
            last_logits = logits[:, -1]
    print(f"largest gap to the per-prompt reference: {gap:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
