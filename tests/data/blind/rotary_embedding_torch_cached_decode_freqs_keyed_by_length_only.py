# lucidrains/rotary-embedding-torch#11 (fixed in commit d4fe047, released as 0.2.7). RotaryEmbedding memoises the
# rotation angles it computes in `self.cache`, and rotate_queries_or_keys(t, offset=...) (the call a decoder makes to
# rotate the new queries / keys at their absolute positions when it keeps a key/value cache) stored them under
# cache_key = f'freqs:{seq_len}', without the offset. In cached decoding every step rotates one token (seq_len 1),
# so after the first decode step each later query and key gets the angles of that first step's position: all
# generated tokens' keys sit at the same position in the cache and the queries' relative distances to them are wrong.
# Fix: cache_key = f'freqs:{seq_len}|offset:{offset}'.
# (rotary_embedding_torch.py before d4fe047, einops calls written out in torch, used by a small GPT-style decoder
# with a per-layer key/value cache and greedy decoding.)
import sys
from math import pi

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


# ---- rotary_embedding_torch/rotary_embedding_torch.py ----------------------------------------------------
def exists(val):
    return val is not None


def rotate_half(x):
    x = x.reshape(*x.shape[:-1], -1, 2)  # '... (d r) -> ... d r', r = 2
    x1, x2 = x.unbind(dim=-1)
    x = torch.stack((-x2, x1), dim=-1)
    return x.flatten(-2)  # '... d r -> ... (d r)'


def apply_rotary_emb(freqs, t, start_index=0, scale=1.0):
    freqs = freqs.to(t)
    rot_dim = freqs.shape[-1]
    end_index = start_index + rot_dim
    assert rot_dim <= t.shape[-1]
    t_left, t, t_right = t[..., :start_index], t[..., start_index:end_index], t[..., end_index:]
    t = (t * freqs.cos() * scale) + (rotate_half(t) * freqs.sin() * scale)
    return torch.cat((t_left, t, t_right), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, custom_freqs=None, freqs_for="lang", theta=10000, max_freq=10, num_freqs=1,
                 learned_freq=False, use_xpos=False, xpos_scale_base=512, interpolate_factor=1.0,
                 theta_rescale_factor=1.0):
        super().__init__()
        theta *= theta_rescale_factor ** (dim / (dim - 2))

        if exists(custom_freqs):
            freqs = custom_freqs
        elif freqs_for == "lang":
            freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
        elif freqs_for == "pixel":
            freqs = torch.linspace(1.0, max_freq / 2, dim // 2) * pi
        elif freqs_for == "constant":
            freqs = torch.ones(num_freqs).float()
        else:
            raise ValueError(f"unknown modality {freqs_for}")

        self.cache = dict()
        self.cache_scale = dict()
        self.freqs = nn.Parameter(freqs, requires_grad=learned_freq)

        assert interpolate_factor >= 1.0
        self.interpolate_factor = interpolate_factor

        self.use_xpos = use_xpos
        if not use_xpos:
            self.register_buffer("scale", None)
            return

    def get_seq_pos(self, seq_len, device, dtype, offset=0):
        return (torch.arange(seq_len, device=device, dtype=dtype) + offset) / self.interpolate_factor

    def rotate_queries_or_keys(self, t, seq_dim=-2, offset=0):
        assert not self.use_xpos, "you must use `.rotate_queries_and_keys` method instead"
        device, dtype, seq_len = t.device, t.dtype, t.shape[seq_dim]
        if FIXED:
            cache_key = f"freqs:{seq_len}|offset:{offset}"
        else:
            cache_key = f"freqs:{seq_len}"
        freqs = self.forward(
            lambda: self.get_seq_pos(seq_len, device=device, dtype=dtype, offset=offset), cache_key=cache_key
        )
        return apply_rotary_emb(freqs, t)

    def forward(self, t, cache_key=None):
        if exists(cache_key) and cache_key in self.cache:
            return self.cache[cache_key]

        if callable(t):
            t = t()

        freqs = self.freqs

        freqs = torch.einsum("..., f -> ... f", t.type(freqs.dtype), freqs)
        freqs = freqs.repeat_interleave(2, dim=-1)  # '... n -> ... (n r)', r = 2

        if exists(cache_key):
            self.cache[cache_key] = freqs

        return freqs


# ---- a small GPT-style decoder that rotates q / k with it and keeps a key/value cache --------------------
class Config:
    vocab_size = 80
    n_layer = 2
    n_head = 4
    n_embd = 64
    block_size = 128


class CausalSelfAttention(nn.Module):
    def __init__(self, config, rotary_emb):
        super().__init__()
        self.n_head = config.n_head
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd)
        self.rotary_emb = rotary_emb

    def forward(self, x, kv_cache=None, offset=0):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, self.head_dim).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_head, self.head_dim).transpose(1, 2)

        # rotate the new queries and keys at their absolute positions offset .. offset + T - 1
        q = self.rotary_emb.rotate_queries_or_keys(q, offset=offset)
        k = self.rotary_emb.rotate_queries_or_keys(k, offset=offset)

        if kv_cache is not None:
            if "k" in kv_cache:
                k = torch.cat([kv_cache["k"], k], dim=2)
                v = torch.cat([kv_cache["v"], v], dim=2)
            kv_cache["k"], kv_cache["v"] = k, v

        # prefill: causal over the prompt; decode: one query that sees every cached key
        y = F.scaled_dot_product_attention(q, k, v, is_causal=(T > 1))
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, config, rotary_emb):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, rotary_emb)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(config.n_embd, 4 * config.n_embd), nn.GELU(), nn.Linear(4 * config.n_embd, config.n_embd)
        )

    def forward(self, x, kv_cache=None, offset=0):
        x = x + self.attn(self.ln_1(x), kv_cache, offset)
        x = x + self.mlp(self.ln_2(x))
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.rotary_emb = RotaryEmbedding(dim=config.n_embd // config.n_head)
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.h = nn.ModuleList([Block(config, self.rotary_emb) for _ in range(config.n_layer)])
        self.ln_f = nn.LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

    def forward(self, idx, kv_caches=None, offset=0):
        x = self.wte(idx)
        for i, block in enumerate(self.h):
            x = block(x, None if kv_caches is None else kv_caches[i], offset)
        return self.lm_head(self.ln_f(x))

    @torch.no_grad()
    def generate(self, idx, max_new_tokens):
        kv_caches = [dict() for _ in self.h]
        logits = self(idx, kv_caches, offset=0)  # prefill
        offset = idx.size(1)
        step_logits = []
        for _ in range(max_new_tokens):
            logits = logits[:, -1, :]
            step_logits.append(logits)
            idx_next = torch.argmax(logits, dim=-1, keepdim=True)
            idx = torch.cat((idx, idx_next), dim=1)
            logits = self(idx_next, kv_caches, offset=offset)
            offset += 1
        return idx, step_logits


def main():
    torch.manual_seed(0)
    model = GPT(Config())
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("c_attn.weight"):
                p.mul_(4.0)
    model.eval()
    prompt = torch.tensor([[3, 41, 17, 66, 8, 29, 52, 11, 70, 5, 38, 24]])
    out, step_logits = model.generate(prompt, max_new_tokens=16)
    print("prompt:   ", prompt[0].tolist())
    print("generated:", out[0, prompt.size(1):].tolist())
    print("max logit per step:", [round(l.max().item(), 4) for l in step_logits])


if __name__ == "__main__":
    main()
