# Follows pytorch/torchtune torchtune/generation/_generation.py: generate() pads the left-padded prompt's padding mask by
# max_generated_tokens, builds get_causal_mask_from_padding_mask(..., target_seq_len=cache max_seq_len) (pad rows keep only their
# diagonal) and get_position_ids_from_padding_mask; decode steps slice masks[:, curr_pos, None, :] over a static KVCache.
import math
import torch
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)
vocab, D, NH, n_layers, PAD, max_cache = 48, 32, 4, 2, 0, 20
hd = D // NH


def get_causal_mask_from_padding_mask(padding_mask, target_seq_len=None):
    bsz, seq_len = padding_mask.shape
    target_seq_len = seq_len if target_seq_len is None else target_seq_len
    mask = torch.tril(torch.ones(seq_len, target_seq_len, dtype=torch.bool), diagonal=0).repeat(bsz, 1, 1)
    mask.narrow(2, 0, seq_len).mul_(padding_mask[:, None, :].expand(-1, seq_len, -1))
    mask.diagonal(dim1=1, dim2=2).copy_(torch.Tensor([True]))
    return mask


def get_position_ids_from_padding_mask(padding_mask):
    return ((padding_mask.cumsum(-1) - 1) * padding_mask).to(torch.int)


def rope(x, input_pos):  # x [b, s, h, d], input_pos [b, s]
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2) / hd))
    ang = input_pos[..., None].double() * inv  # [b, s, d/2]
    cos, sin = ang.cos()[:, :, None], ang.sin()[:, :, None]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).flatten(-2)


class KVCache(torch.nn.Module):
    def __init__(self, bsz, max_seq_len):
        super().__init__()
        self.register_buffer("k_cache", torch.zeros(bsz, NH, max_seq_len, hd), persistent=False)
        self.register_buffer("v_cache", torch.zeros(bsz, NH, max_seq_len, hd), persistent=False)
        self.register_buffer("cache_pos", torch.arange(0, max_seq_len), persistent=False)

    def update(self, k_val, v_val):
        seq_len = k_val.shape[2]
        self.k_cache[:, :, self.cache_pos[:seq_len]] = k_val
        self.v_cache[:, :, self.cache_pos[:seq_len]] = v_val
        self.cache_pos.add_(seq_len)
        return self.k_cache, self.v_cache


class Layer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.sa_norm, self.mlp_norm = torch.nn.RMSNorm(D), torch.nn.RMSNorm(D)
        self.q, self.k, self.v, self.o = (torch.nn.Linear(D, D, bias=False) for _ in range(4))
        self.mlp = torch.nn.Sequential(torch.nn.Linear(D, 2 * D, bias=False), torch.nn.SiLU(), torch.nn.Linear(2 * D, D, bias=False))
        self.kv_cache = None

    def forward(self, x, mask, input_pos):
        b, s, _ = x.shape
        h = self.sa_norm(x)
        q = rope(self.q(h).view(b, s, NH, hd), input_pos).transpose(1, 2)
        k = rope(self.k(h).view(b, s, NH, hd), input_pos).transpose(1, 2)
        v = self.v(h).view(b, s, NH, hd).transpose(1, 2)
        if self.kv_cache is not None:
            k, v = self.kv_cache.update(k, v)
        if mask is not None:
            mask = mask[:, None, :, :]  # [b, s, kv] -> [b, 1, s, kv], True = attend
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None and self.kv_cache is None)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, D))
        return x + self.mlp(self.mlp_norm(x))


class TransformerDecoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.tok = torch.nn.Embedding(vocab, D)
        self.layers = torch.nn.ModuleList([Layer() for _ in range(n_layers)])
        self.norm, self.output = torch.nn.RMSNorm(D), torch.nn.Linear(D, vocab, bias=False)

    def setup_caches(self, bsz, max_seq_len):
        for l in self.layers:
            l.kv_cache = KVCache(bsz, max_seq_len)

    def reset_caches(self):
        for l in self.layers:
            l.kv_cache = None

    def forward(self, tokens, mask=None, input_pos=None):
        if input_pos is None:
            input_pos = torch.arange(tokens.shape[1])[None].expand(tokens.shape[0], -1)
        h = self.tok(tokens)
        for l in self.layers:
            h = l(h, mask, input_pos)
        return self.output(self.norm(h))


model = TransformerDecoder().eval()
prompts = [[7, 12, 3, 30, 5], [9, 2], [4, 41, 8]]
max_generated_tokens = 6


@torch.no_grad()
def generate(model, prompt):
    bsz, prompt_length = prompt.shape
    generated_tokens = prompt.clone()
    padding_masks = generated_tokens != PAD
    padding_masks = F.pad(padding_masks, (0, max_generated_tokens), value=True)
    masks = get_causal_mask_from_padding_mask(padding_masks, target_seq_len=max_cache)
    input_pos = get_position_ids_from_padding_mask(padding_masks)
    curr_masks = masks[:, :prompt_length]
    logits = model(prompt, mask=curr_masks, input_pos=input_pos[:, :prompt_length])[:, -1]
    all_logits = [logits]
    tokens = logits.argmax(-1, keepdim=True)
    generated_tokens = torch.cat([generated_tokens, tokens], dim=-1)
    curr_pos = prompt_length
    for _ in range(max_generated_tokens - 1):
        curr_input_pos = input_pos[:, curr_pos, None].contiguous()
        curr_masks = masks[:, curr_pos, None, :].contiguous()
        logits = model(tokens, mask=curr_masks, input_pos=curr_input_pos)[:, -1]
        all_logits.append(logits)
        tokens = logits.argmax(-1, keepdim=True)
        generated_tokens = torch.cat([generated_tokens, tokens], dim=-1)
        curr_pos += 1
    return generated_tokens, torch.stack(all_logits, 1)


P = max(len(p) for p in prompts)
prompt = torch.tensor([[PAD] * (P - len(p)) + p for p in prompts])  # left padding
model.setup_caches(len(prompts), max_cache)
gen, logits = generate(model, prompt)
model.reset_caches()

worst = 0.0
with torch.no_grad():
    for i, p in enumerate(prompts):
        seq = torch.tensor([p])
        for step in range(max_generated_tokens):  # no cache, no mask argument: plain causal recompute of the whole sequence
            ref_logits = model(seq)[:, -1]
            worst = max(worst, (ref_logits[0] - logits[i, step]).abs().max().item())
            seq = torch.cat([seq, ref_logits.argmax(-1, keepdim=True)], 1)
        assert seq[0, len(p):].tolist() == gen[i, P:].tolist()
print(f"left-padded static-cache generate vs each prompt alone without cache: max logit diff = {worst:.3e}")
assert worst < 1e-12, worst
print(f"max difference: {worst:.3e}")
