# eole-nlp/eole#340 (commit 2173cec): TransformerDecoder._causal_attn_mask built the prefill mask with
# future_mask.triu_(-sliding_window), letting each prompt token see sliding_window + 1 keys while the
# cached decode path sees sliding_window keys. Fix: triu_(-(sliding_window - 1)).
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class DecoderConfig:
    hidden_size = 32
    heads = 4
    layers = 2
    vocab_size = 50
    sliding_window = 4  # mistral-style local attention


class SelfMHA(nn.Module):
    def __init__(self, cfg, max_t):
        super().__init__()
        self.heads, self.dph = cfg.heads, cfg.hidden_size // cfg.heads
        self.linear_query = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.linear_keys = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.linear_values = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.final_linear = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.max_t = max_t
        self.k_cache = self.v_cache = None

    def init_cache(self, batch):
        self.k_cache = torch.zeros(batch, self.heads, self.max_t, self.dph)
        self.v_cache = torch.zeros(batch, self.heads, self.max_t, self.dph)

    def forward(self, x, attn_mask, cache_slice):
        b, s, _ = x.shape
        shape = lambda t: t.view(b, s, self.heads, self.dph).transpose(1, 2)
        q, k, v = shape(self.linear_query(x)), shape(self.linear_keys(x)), shape(self.linear_values(x))
        self.k_cache[:, :, cache_slice] = k
        self.v_cache[:, :, cache_slice] = v
        out = F.scaled_dot_product_attention(q, self.k_cache, self.v_cache, attn_mask=attn_mask)
        return self.final_linear(out.transpose(1, 2).reshape(b, s, -1))


class TransformerDecoderLayer(nn.Module):
    def __init__(self, cfg, max_t):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.self_attn = SelfMHA(cfg, max_t)
        self.post_attention_layernorm = nn.LayerNorm(cfg.hidden_size)
        self.mlp = nn.Sequential(nn.Linear(cfg.hidden_size, 64), nn.SiLU(), nn.Linear(64, cfg.hidden_size))

    def forward(self, emb, attn_mask, cache_slice):
        emb = emb + self.self_attn(self.input_layernorm(emb), attn_mask, cache_slice)
        return emb + self.mlp(self.post_attention_layernorm(emb))


class TransformerDecoder(nn.Module):
    def __init__(self, cfg, kvcache_maxsize=16):
        super().__init__()
        self.sliding_window = cfg.sliding_window
        self.kvcache_maxsize = kvcache_maxsize
        self.embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.pos = nn.Embedding(kvcache_maxsize, cfg.hidden_size)
        self.transformer_layers = nn.ModuleList(TransformerDecoderLayer(cfg, kvcache_maxsize) for _ in range(cfg.layers))
        self.layer_norm = nn.LayerNorm(cfg.hidden_size)

    def _init_cache(self, batch, cache_leftpad):
        for layer in self.transformer_layers:
            layer.self_attn.init_cache(batch)
        self.cache_seqlens = torch.zeros(batch, dtype=torch.long)
        self.position_indices = torch.arange(self.kvcache_maxsize).unsqueeze(0).expand(batch, -1)
        self.left_pad_attn_mask = self.position_indices >= cache_leftpad.view(-1, 1)

    def _causal_attn_mask(self, tgt_pad_mask):
        B, _, seq_len = tgt_pad_mask.size()
        MAX_T = self.kvcache_maxsize
        future_mask = torch.tril(torch.ones((MAX_T, MAX_T), dtype=torch.bool), diagonal=0)
        if self.sliding_window > 0:
            if FIXED:
                future_mask = future_mask.triu_(-(self.sliding_window - 1))
            else:
                future_mask = future_mask.triu_(-self.sliding_window)
        future_mask = future_mask.unsqueeze(0).expand(B, -1, -1)[:, :seq_len, :]
        tgt_pad_mask_full = torch.zeros((B, MAX_T), dtype=torch.bool)
        tgt_pad_mask_full[:, :seq_len] = tgt_pad_mask[:, 0, :].bool()
        attn_mask = future_mask & ~tgt_pad_mask_full[:, None, :]
        return attn_mask.unsqueeze(1)  # (B, 1, seq_len, MAX_T)

    def forward(self, tgt, tgt_pad_mask):
        _, S = tgt.shape
        current_step = self.cache_seqlens[0]
        pos_ids_1d = current_step + torch.arange(S)
        emb = self.embeddings(tgt) + self.pos(pos_ids_1d)[None]
        cache_slice = pos_ids_1d
        if S > 1:  # prefill: combine pad and causal (sliding) mask
            attn_mask = self._causal_attn_mask(tgt_pad_mask)
        else:  # decoding step against the cache
            valid = self.position_indices <= self.cache_seqlens.view(-1, 1)
            valid = valid & self.left_pad_attn_mask
            if self.sliding_window > 0:
                start = torch.clamp(current_step - self.sliding_window + 1, min=0)
                valid = valid & (self.position_indices >= start)
            attn_mask = valid.unsqueeze(1).unsqueeze(2)
        for layer in self.transformer_layers:
            emb = layer(emb, attn_mask, cache_slice)
        self.cache_seqlens.add_(S)
        return self.layer_norm(emb)


with torch.no_grad():
    decoder = TransformerDecoder(DecoderConfig()).eval()
    prompt = torch.randint(1, DecoderConfig.vocab_size, (1, 10))
    pad = torch.zeros(1, 1, 10, dtype=torch.bool)

    decoder._init_cache(1, torch.zeros(1, dtype=torch.long))
    prefill_out = decoder(prompt, pad)  # whole prompt in one prefill call

    decoder._init_cache(1, torch.zeros(1, dtype=torch.long))
    step_out = torch.cat([decoder(prompt[:, t : t + 1], pad[:, :, t : t + 1]) for t in range(10)], dim=1)

diff = (prefill_out - step_out).abs().max().item()
print(f"fixed={FIXED} sliding_window={DecoderConfig.sliding_window}: prefill vs token-by-token decode max diff {diff:.3e}")
