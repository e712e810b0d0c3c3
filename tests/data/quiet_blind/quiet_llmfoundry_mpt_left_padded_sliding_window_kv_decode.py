# Citation: mosaicml/llm-foundry llmfoundry/models/layers/attention.py @11d3d7066fa22766b8f9ce5f72372a90a9b25a82
#   (scaled_multihead_dot_product_attention: past_key_value concat, key_padding_mask, causal mask sliced
#   [-s_q:, -s_k:], sliding_window_size) and llmfoundry/models/mpt/modeling_mpt.py (MPTModel.forward: left-padded
#   positions `pos - cumsum(~attention_mask)` clamped at 0); written from the project's layout, recalled.
# A left-padded batch is prefilled, then decoded token by token with a hand-written KV cache. Every layer keeps
# a sliding window of `sliding_window_size` keys before the query (slot distance = token distance, since the
# only padding is on the left), the key padding mask hides the left pads, positions come from the mask's cumsum.
# Checked against an unpadded per-sequence full recompute (no cache) with a double-loop window mask.
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)


class MPTConfig:
    def __init__(self, d_model=32, n_heads=4, n_layers=2, vocab_size=50, max_seq_len=64, sliding_window_size=3):
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.vocab_size = vocab_size
        self.max_seq_len = max_seq_len
        self.attn_config = {"sliding_window_size": sliding_window_size, "attn_impl": "torch"}


def scaled_multihead_dot_product_attention(query, key, value, n_heads, past_key_value=None, key_padding_mask=None,
                                           is_causal=True, sliding_window_size=-1):
    q = query.view(query.shape[0], query.shape[1], n_heads, -1).transpose(1, 2)  # b h s d
    k = key.view(key.shape[0], key.shape[1], n_heads, -1).permute(0, 2, 3, 1)  # b h d s
    v = value.view(value.shape[0], value.shape[1], n_heads, -1).transpose(1, 2)
    if past_key_value is not None:
        if len(past_key_value) != 0:
            k = torch.cat([past_key_value[0], k], dim=3)
            v = torch.cat([past_key_value[1], v], dim=2)
        past_key_value = (k, v)
    b, _, s_q, d = q.shape
    s_k = k.size(-1)
    softmax_scale = 1 / math.sqrt(d)
    attn_weight = q.matmul(k) * softmax_scale
    min_val = torch.finfo(q.dtype).min
    if key_padding_mask is not None:
        attn_weight = attn_weight.masked_fill(~key_padding_mask.view((b, 1, 1, s_k)), min_val)
    if is_causal and (not q.size(2) == 1):
        s = max(s_q, s_k)
        causal_mask = attn_weight.new_ones(s, s, dtype=torch.float32).tril().to(torch.bool)
        causal_mask = ~causal_mask
        causal_mask = causal_mask[-s_q:, -s_k:]
        attn_weight = attn_weight.masked_fill(causal_mask.view(1, 1, s_q, s_k), min_val)
    if sliding_window_size != -1:
        # query i (absolute slot s_k - s_q + i) keeps keys j with slot_i - j <= sliding_window_size
        q_slot = torch.arange(s_k - s_q, s_k, device=q.device)[:, None]
        k_slot = torch.arange(s_k, device=q.device)[None, :]
        window_mask = (q_slot - k_slot) <= sliding_window_size
        attn_weight = attn_weight.masked_fill(~window_mask.view(1, 1, s_q, s_k), min_val)
    attn_weight = torch.softmax(attn_weight, dim=-1)
    out = attn_weight.matmul(v)
    out = out.transpose(1, 2).reshape(b, s_q, -1)
    return out, past_key_value


class MultiheadAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_heads = config.n_heads
        self.sliding_window_size = config.attn_config["sliding_window_size"]
        self.Wqkv = nn.Linear(config.d_model, 3 * config.d_model)
        self.out_proj = nn.Linear(config.d_model, config.d_model)

    def forward(self, x, past_key_value=None, attention_mask=None, is_causal=True):
        q, k, v = self.Wqkv(x).chunk(3, dim=2)
        ctx, past_key_value = scaled_multihead_dot_product_attention(
            q, k, v, self.n_heads, past_key_value=past_key_value, key_padding_mask=attention_mask,
            is_causal=is_causal, sliding_window_size=self.sliding_window_size)
        return self.out_proj(ctx), past_key_value


class MPTBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm_1 = nn.LayerNorm(config.d_model)
        self.attn = MultiheadAttention(config)
        self.norm_2 = nn.LayerNorm(config.d_model)
        self.ffn = nn.Sequential(nn.Linear(config.d_model, 4 * config.d_model), nn.GELU(),
                                 nn.Linear(4 * config.d_model, config.d_model))

    def forward(self, x, past_key_value=None, attention_mask=None):
        a, past_key_value = self.attn(self.norm_1(x), past_key_value=past_key_value, attention_mask=attention_mask)
        x = x + a
        x = x + self.ffn(self.norm_2(x))
        return x, past_key_value


class MPTForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.d_model)
        self.wpe = nn.Embedding(config.max_seq_len, config.d_model)
        self.blocks = nn.ModuleList([MPTBlock(config) for _ in range(config.n_layers)])
        self.norm_f = nn.LayerNorm(config.d_model)

    def forward(self, input_ids, past_key_values=None, attention_mask=None):
        S = input_ids.size(1)
        past_position = 0
        if past_key_values is not None and len(past_key_values[0]) != 0:
            past_position = past_key_values[0][0].size(3)
        pos = torch.arange(past_position, S + past_position, dtype=torch.long).unsqueeze(0)
        if attention_mask is not None:
            # left padding: shift positions so the first real token is position 0
            pos = torch.clamp(pos - torch.cumsum((~attention_mask).to(torch.int32), dim=1)[:, past_position:], min=0)
        x = self.wte(input_ids) + self.wpe(pos)
        if past_key_values is None:
            past_key_values = [() for _ in range(self.config.n_layers)]
        new_past = []
        for block, past in zip(self.blocks, past_key_values):
            x, past = block(x, past_key_value=past, attention_mask=attention_mask)
            new_past.append(past)
        logits = self.norm_f(x) @ self.wte.weight.T
        return logits, new_past


@torch.no_grad()
def generate(model, input_ids, attention_mask, max_new_tokens):
    logits, past = model(input_ids, past_key_values=None, attention_mask=attention_mask)
    out = input_ids
    for _ in range(max_new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        out = torch.cat([out, nxt], dim=1)
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones(attention_mask.size(0), 1)], dim=1)
        logits, past = model(nxt, past_key_values=past, attention_mask=attention_mask)
    return out, logits


# reference: one unpadded sequence, no cache, explicit double-loop window
@torch.no_grad()
def reference_forward(model, ids):
    W = model.config.attn_config["sliding_window_size"]
    L = ids.size(0)
    x = model.wte(ids) + model.wpe(torch.arange(L))
    allowed = torch.zeros(L, L, dtype=torch.bool)
    for i in range(L):
        for j in range(L):
            allowed[i, j] = j <= i and i - j <= W
    H = model.config.n_heads
    for blk in model.blocks:
        h = blk.norm_1(x)
        q, k, v = blk.attn.Wqkv(h).chunk(3, dim=-1)
        q, k, v = (t.view(L, H, -1).transpose(0, 1) for t in (q, k, v))
        ctx = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        x = x + blk.attn.out_proj(ctx.transpose(0, 1).reshape(L, -1))
        x = x + blk.ffn(blk.norm_2(x))
    return model.norm_f(x) @ model.wte.weight.T


@torch.no_grad()
def reference_generate(model, ids, max_new_tokens):
    for _ in range(max_new_tokens):
        ids = torch.cat([ids, reference_forward(model, ids)[-1].argmax(-1, keepdim=True)])
    return ids, reference_forward(model, ids)[-1]


def main():
    config = MPTConfig()
    model = MPTForCausalLM(config).eval()
    pad = 0
    prompts = [[5, 9, 12, 7, 3, 8, 21], [14, 2, 6], [30, 11, 4, 17, 25]]
    T = max(len(p) for p in prompts)
    input_ids = torch.tensor([[pad] * (T - len(p)) + p for p in prompts])
    attention_mask = torch.tensor([[False] * (T - len(p)) + [True] * len(p) for p in prompts])
    n_new = 6
    out, last_logits = generate(model, input_ids, attention_mask, n_new)
    for b, p in enumerate(prompts):
        ref_ids, ref_logits = reference_generate(model, torch.tensor(p), n_new)
        assert out[b, T - len(p):].tolist() == ref_ids.tolist(), (b, out[b].tolist(), ref_ids.tolist())
        assert torch.allclose(last_logits[b, -1], ref_logits, atol=1e-4), b
    print("ok: left-padded sliding-window KV decode matches per-sequence recompute", out.tolist())


if __name__ == "__main__":
    main()
