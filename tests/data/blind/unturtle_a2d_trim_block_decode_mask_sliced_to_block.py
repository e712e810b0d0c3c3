# nishide-dev/unturtle#44 (closes #39, second fix): trim-mode block decoding sliced the 2-D padding mask to
# [:, current_block_start:] while keys span the cached prefix too, so prompt-padding columns became visible.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
VOCAB, HIDDEN, HEADS, MASK_ID, PAD_ID = 48, 32, 4, 47, 0


class TinyA2DAttention(nn.Module):
    def __init__(self, layer_idx):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_causal = False
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(HIDDEN, HIDDEN) for _ in range(4))

    def forward(self, h, attention_mask, past_key_values=None):
        B, q_len, _ = h.shape
        split = lambda t: t.view(B, q_len, HEADS, HIDDEN // HEADS).transpose(1, 2)
        q, k, v = split(self.q_proj(h)), split(self.k_proj(h)), split(self.v_proj(h))
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        kv_len = k.shape[-2]
        mask = attention_mask
        if mask is not None and mask.dim() == 2:
            if mask.shape[-1] < kv_len:  # mask covers only the new tokens: cached prefix is visible
                prefix = mask.new_ones(B, kv_len - mask.shape[-1])
                mask = torch.cat([prefix, mask], dim=-1)
            mask = mask[:, None, None, :].bool()  # [B, 1, 1, kv] key padding, bidirectional
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=False)
        return self.o_proj(out.transpose(1, 2).reshape(B, q_len, HIDDEN))


class TrimCache:
    def __init__(self):
        self.k, self.v = {}, {}

    def update(self, k, v, idx):
        if idx in self.k:
            k, v = torch.cat([self.k[idx], k], -2), torch.cat([self.v[idx], v], -2)
        self.k[idx], self.v[idx] = k, v
        return k, v

    def crop(self, length):
        for idx in self.k:
            self.k[idx], self.v[idx] = self.k[idx][..., :length, :], self.v[idx][..., :length, :]


class TinyA2DModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.pos = nn.Embedding(64, HIDDEN)
        self.layers = nn.ModuleList([TinyA2DAttention(i) for i in range(2)])
        self.lm_head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, input_ids, attention_mask, position_ids, past_key_values=None):
        h = self.embed(input_ids) + self.pos(position_ids)
        for layer in self.layers:
            h = h + layer(h, attention_mask, past_key_values)
        return self.lm_head(h)


@torch.no_grad()
def block_decode(model, x, attention_mask, prompt_len, block_size=4, steps=2):
    """Fast-dLLM style block decode, cache_mode='trim': keep the prefix KV, recompute block + suffix."""
    position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    step_logits = []
    for current_block_start in range(prompt_len, x.shape[1], block_size):
        cache = TrimCache()
        model(x, attention_mask, position_ids, cache)  # full forward fills the cache
        for _ in range(steps):
            cache.crop(current_block_start)
            if FIXED:
                mask = attention_mask  # full-length key mask: trimmed prefix + suffix
            else:
                mask = attention_mask[:, current_block_start:]
            logits = model(x[:, current_block_start:], mask, position_ids[:, current_block_start:], cache)
            blk = x[:, current_block_start:current_block_start + block_size]
            step_logits.append((current_block_start, logits[:, :block_size]))
            conf, pred = logits[:, :block_size].softmax(-1).max(-1)
            conf = conf.masked_fill(blk != MASK_ID, -1.0)
            idx = conf.topk(block_size // steps, dim=-1).indices
            blk.scatter_(1, idx, pred.gather(1, idx))
    return x, step_logits


model = TinyA2DModel().eval()
prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9, 10, 11, 12, 13])]
prompt_len, gen_len = 6, 8
x = torch.full((2, prompt_len + gen_len), MASK_ID)
attention_mask = torch.ones_like(x)
for b, p in enumerate(prompts):  # left padding
    x[b, :prompt_len - len(p)] = PAD_ID
    attention_mask[b, :prompt_len - len(p)] = 0
    x[b, prompt_len - len(p):prompt_len] = p
out, step_logits = block_decode(model, x.clone(), attention_mask, prompt_len)

# reference for the first step: no cache, full mask, the padded row only
start, logits = step_logits[0]
with torch.no_grad():
    pos = (attention_mask.cumsum(-1) - 1).clamp(min=0)
    ref = model(x, attention_mask, pos)[:, start:start + 4]
print(f"fixed={FIXED} padded row, cached block step vs full recompute, max |logit diff| = "
      f"{(logits[0] - ref[0]).abs().max().item():.4f}")
print("generated:", out[0, prompt_len:].tolist())
