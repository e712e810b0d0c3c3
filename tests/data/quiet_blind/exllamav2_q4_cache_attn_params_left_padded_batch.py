"""exllamav2-style Q4 KV cache with an attention Params object, left-padded batch generation.

Follows turboderp/exllamav2 exllamav2/cache.py (ExLlamaV2Cache_Q4: keys/values stored as 4-bit groups with
per-group scales, dequantized into a temporary fp buffer before attention) and exllamav2/attn.py
(ExLlamaV2Attention.Params(batch_size, seq_len, past_len, input_mask, position_offsets); build_attn_mask:
causal triu of -65504 over [seq_len, past_len + seq_len], plus input_mask for left padding;
position_offsets shift RoPE so every row's first real token is position 0). Plain torch, CPU.

Mask meant: row b has `pad[b]` left pad slots; a query sees keys at slots <= its own slot, minus the pad
slots of its row. Pad query rows are never read. In decode, past_len grows and the single new query sees
every cached non-pad slot.
"""
import torch

torch.manual_seed(0)

GROUP = 8
NEG = -65504.0


def quant_q4(x):
    """Per token, groups of GROUP channels, symmetric 4-bit."""
    g = x.reshape(*x.shape[:-1], -1, GROUP)
    scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-6) / 7.0
    q = torch.clamp(torch.round(g / scale), -8, 7).to(torch.int8)
    return q, scale


def dequant_q4(q, scale):
    return (q.float() * scale).reshape(*q.shape[:-2], -1)


class ExLlamaV2Cache_Q4:
    def __init__(self, batch_size, num_heads, max_seq_len, head_dim):
        shape = (batch_size, max_seq_len, num_heads, head_dim // GROUP, GROUP)
        self.key_q = torch.zeros(shape, dtype=torch.int8)
        self.value_q = torch.zeros(shape, dtype=torch.int8)
        self.key_scale = torch.zeros(*shape[:-1], 1)
        self.value_scale = torch.zeros(*shape[:-1], 1)
        self.current_seq_len = 0

    def store(self, k, v, past_len):
        n = k.shape[1]
        self.key_q[:, past_len:past_len + n], self.key_scale[:, past_len:past_len + n] = quant_q4(k)
        self.value_q[:, past_len:past_len + n], self.value_scale[:, past_len:past_len + n] = quant_q4(v)
        self.current_seq_len = past_len + n

    def get_kv(self, upto):
        return (dequant_q4(self.key_q[:, :upto], self.key_scale[:, :upto]),
                dequant_q4(self.value_q[:, :upto], self.value_scale[:, :upto]))


class Params:
    def __init__(self, batch_size, seq_len, past_len, input_mask, position_offsets):
        self.batch_size, self.seq_len, self.past_len = batch_size, seq_len, past_len
        self.input_mask = input_mask  # [b, past_len + seq_len] additive, NEG on pad slots
        self.position_offsets = position_offsets  # [b] = -pad so the first real token is position 0

    def get_attn_mask(self):
        causal = torch.triu(torch.full((self.seq_len, self.past_len + self.seq_len), NEG), self.past_len + 1)
        return (causal[None] + self.input_mask[:, None, :]).clamp(min=NEG)[:, None]


def rope(x, pos):
    d = x.shape[-1] // 2
    ang = pos[..., None].float() / (10000 ** (torch.arange(d) / d))
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    return torch.cat([x[..., :d] * cos - x[..., d:] * sin, x[..., :d] * sin + x[..., d:] * cos], -1)


class ExLlamaV2Attention(torch.nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden, bias=False)

    def forward(self, hidden, cache, attn_params):
        b, s, d = hidden.shape
        q, k, v = self.qkv(hidden).view(b, s, 3, self.heads, -1).unbind(2)
        pos = attn_params.past_len + torch.arange(s)[None] + attn_params.position_offsets[:, None]
        q, k = rope(q, pos), rope(k, pos)
        cache.store(k, v, attn_params.past_len)
        keys, values = cache.get_kv(attn_params.past_len + s)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, keys) / q.shape[-1] ** 0.5
        scores = scores + attn_params.get_attn_mask()
        out = torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), values)
        return out.reshape(b, s, d)


def generate(attn, prompts, steps, hidden=16, heads=2):
    b = len(prompts)
    lens = [p.shape[0] for p in prompts]
    max_len = max(lens)
    pad = torch.tensor([max_len - n for n in lens])
    ids = torch.stack([torch.cat([torch.zeros(max_len - p.shape[0], hidden), p]) for p in prompts])
    cache = ExLlamaV2Cache_Q4(b, heads, max_len + steps, hidden // heads)
    mask_row = torch.zeros(b, max_len + steps)
    for i in range(b):
        mask_row[i, :pad[i]] = NEG
    params = Params(b, max_len, 0, mask_row[:, :max_len], -pad)
    out = attn(ids, cache, params)
    outs = [out[:, -1:]]
    for t in range(steps):
        x = torch.tanh(outs[-1])  # next input from last output, a stand-in for sampling
        params = Params(b, 1, max_len + t, mask_row[:, :max_len + t + 1], -pad)
        outs.append(attn(x, cache, params))
    return torch.cat(outs, 1)


def main():
    attn = ExLlamaV2Attention(16, 2)
    prompts = [torch.randn(n, 16) for n in (7, 4, 5)]
    with torch.no_grad():
        batched = generate(attn, prompts, steps=4)
        for i, p in enumerate(prompts):
            alone = generate(attn, [p], steps=4)
            assert torch.allclose(batched[i], alone[0], atol=1e-4), i
    print("batched left-padded generation with Q4 cache matches per-prompt runs; out", tuple(batched.shape))


if __name__ == "__main__":
    main()
