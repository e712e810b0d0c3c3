# Gen-Verse/MMaDA#19 (commit 0ef94ba, models/modeling_llada.py + modeling_mmada.py).
# LLaDABlock.attention casts the bool attention_bias built by MMadaModelLM.t2i_generate but then calls SDPA with
# attn_mask=None, so the masked-diffusion model attends to the padded prompt slots of the CFG (uncond) rows.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D, H, L, V = 32, 4, 2, 48
PAD, MASK_ID = 0, 47


def ensure_finite_(x, check_neg_inf=True, check_pos_inf=False):
    if check_neg_inf:
        x.masked_fill_(x == float("-inf"), torch.finfo(x.dtype).min)
    if check_pos_inf:
        x.masked_fill_(x == float("inf"), torch.finfo(x.dtype).max)


class RotaryEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.inv_freq = 1.0 / (10000 ** (torch.arange(0, dim, 2).float() / dim))

    def rotate_half(self, x):
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)

    def forward(self, q, k):
        t = torch.arange(k.shape[-2]).float()
        freqs = torch.einsum("i,j->ij", t, self.inv_freq)
        pos = torch.cat((freqs, freqs), dim=-1)[None, None]
        return (q * pos.cos() + self.rotate_half(q) * pos.sin(),
                k * pos.cos() + self.rotate_half(k) * pos.sin())


class LLaDALlamaBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_norm = nn.RMSNorm(D)
        self.ff_norm = nn.RMSNorm(D)
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(D, D), nn.Linear(D, D), nn.Linear(D, D)
        self.attn_out = nn.Linear(D, D)
        self.ff_proj, self.up_proj, self.ff_out = nn.Linear(D, 2 * D), nn.Linear(D, 2 * D), nn.Linear(2 * D, D)
        self.rotary_emb = RotaryEmbedding(D // H)

    @classmethod
    def _cast_attn_bias(cls, bias, input_dtype):
        if bias.dtype != input_dtype:
            bias = bias.to(input_dtype)
            ensure_finite_(bias, check_neg_inf=True, check_pos_inf=False)
        return bias

    def _scaled_dot_product_attention(self, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False):
        # Modify: MDM set causal to False
        return F.scaled_dot_product_attention(
            q, k, v,
            attn_mask=attn_mask if FIXED else None,
            dropout_p=dropout_p, is_causal=False)

    def attention(self, q, k, v, attention_bias=None):
        B, T, C = q.size()
        dtype = k.dtype
        q = q.view(B, T, H, C // H).transpose(1, 2)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        query_len, key_len = q.shape[-2], k.shape[-2]
        q, k = self.rotary_emb(q, k)
        if attention_bias is not None:
            attention_bias = self._cast_attn_bias(attention_bias[:, :, key_len - query_len: key_len, :key_len], dtype)
        att = self._scaled_dot_product_attention(
            q, k, v,
            attn_mask=attention_bias if FIXED else None,
            dropout_p=0.0, is_causal=False)
        att = att.transpose(1, 2).contiguous().view(B, T, C)
        return self.attn_out(att)

    def forward(self, x, attention_bias=None):
        h = self.attn_norm(x)
        x = x + self.attention(self.q_proj(h), self.k_proj(h), self.v_proj(h), attention_bias)
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class LLaDAModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.wte = nn.Embedding(V, D)
        self.blocks = nn.ModuleList(LLaDALlamaBlock() for _ in range(L))
        self.ln_f = nn.RMSNorm(D)
        self.ff_out = nn.Linear(D, V)

    def forward(self, input_ids, attention_bias=None):
        x = self.wte(input_ids)
        if attention_bias is not None and attention_bias.dtype in (torch.int8, torch.bool):
            attention_bias = attention_bias.to(dtype=torch.float)
            attention_bias.masked_fill_(attention_bias == 0.0, torch.finfo(attention_bias.dtype).min)
        for block in self.blocks:
            x = block(x, attention_bias=attention_bias)
        return self.ff_out(self.ln_f(x))


class MMadaModelLM(LLaDAModel):
    @torch.no_grad()
    def t2i_generate(self, input_ids, uncond_input_ids, attention_mask, uncond_attention_mask,
                     guidance_scale=3.0, timesteps=3, resolution=6, seq_len=8):
        num_vq_tokens = seq_len
        uncond_prefix = uncond_input_ids[:, :resolution + 1]
        first_uncond_logits = None
        for step in range(timesteps):
            uncond_input_ids = torch.cat([uncond_prefix, input_ids[:, resolution + 1:]], dim=1)
            model_input = torch.cat([input_ids, uncond_input_ids])
            if FIXED:
                all_attention_mask = torch.cat([attention_mask, uncond_attention_mask], dim=0)
                attention_bias = (all_attention_mask[:, :, None] & all_attention_mask[:, None, :]).bool().unsqueeze(1)
            else:
                attention_mask = torch.cat([attention_mask, uncond_attention_mask], dim=0)
                attention_bias = (attention_mask[:, :, None] & attention_mask[:, None, :]).bool().unsqueeze(1)
            logits = self(model_input, attention_bias=attention_bias)
            cond_logits, uncond_logits = torch.chunk(logits, 2, dim=0)
            if first_uncond_logits is None:
                first_uncond_logits = uncond_logits
            logits = (1 + guidance_scale) * cond_logits - guidance_scale * uncond_logits
            logits = logits[:, -(num_vq_tokens + 1):-1]
            # unmask the most confident masked image token (trimmed MaskGIT schedule)
            img = input_ids[:, -(num_vq_tokens + 1):-1]
            conf, pred = logits.softmax(-1).max(-1)
            conf = conf.masked_fill(img != MASK_ID, -1.0)
            pos = conf.argmax(-1)
            img[torch.arange(img.shape[0]), pos] = pred[torch.arange(img.shape[0]), pos]
        return input_ids, first_uncond_logits


model = MMadaModelLM().eval()
B, resolution, seq_len = 2, 6, 8
# [t2i] prompt (left-padded to `resolution` + 1) then [soi] image tokens (all masked) [eoi]
prompt_lens = [6, 3]
input_ids = torch.full((B, resolution + 1 + seq_len + 1), MASK_ID)
attention_mask = torch.ones(B, input_ids.shape[1], dtype=torch.long)
for b, n in enumerate(prompt_lens):
    input_ids[b, :resolution + 1 - n] = PAD
    attention_mask[b, :resolution + 1 - n] = 0
    input_ids[b, resolution + 1 - n:resolution + 1] = torch.randint(1, 40, (n,))
input_ids[:, -1] = 45
# unconditional branch: empty prompt -> only the last prompt slot is real
uncond_input_ids = input_ids.clone()
uncond_input_ids[:, :resolution] = PAD
uncond_input_ids[:, resolution] = 1
uncond_attention_mask = torch.ones_like(attention_mask)
uncond_attention_mask[:, :resolution] = 0

_, uncond_logits = model.t2i_generate(input_ids.clone(), uncond_input_ids, attention_mask, uncond_attention_mask,
                                      resolution=resolution, seq_len=seq_len)
with torch.no_grad():
    ref = model(uncond_input_ids[:, resolution:])          # the same unconditional rows with the padding removed
diff = (uncond_logits[:, resolution:] - ref).abs().max().item()
print(f"max |CFG-batch uncond logits - unpadded uncond logits|: {diff:.6f}")
