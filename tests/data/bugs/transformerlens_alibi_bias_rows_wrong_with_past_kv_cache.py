# TransformerLens (TransformerLensOrg/TransformerLens#777, commit d9792a9): AbstractAttention.forward sliced the ALiBi
# bias as alibi[:, :query_ctx, :key_ctx]; with a past_kv_cache the queries are the LAST query_ctx positions, so a
# cached decode step got row 0 (all zeros) and Bloom ran without its distance bias.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class Cfg:
    n_layers = 2
    d_model = 32
    n_heads = 4
    d_head = 8
    n_ctx = 32
    d_vocab = 50
    positional_embedding_type = "alibi"
    attention_dir = "causal"


class HookedTransformerKeyValueCacheEntry:
    def __init__(self, cfg, batch_size):
        self.past_keys = torch.empty(batch_size, 0, cfg.n_heads, cfg.d_head)
        self.past_values = torch.empty(batch_size, 0, cfg.n_heads, cfg.d_head)

    def append(self, new_keys, new_values):
        updated_keys = torch.cat([self.past_keys, new_keys], dim=1)
        updated_values = torch.cat([self.past_values, new_values], dim=1)
        self.past_keys = updated_keys
        self.past_values = updated_values
        return updated_keys, updated_values


class AbstractAttention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.W_Q = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * 0.3)
        self.W_K = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * 0.3)
        self.W_V = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * 0.3)
        self.W_O = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_head, cfg.d_model) * 0.3)
        self.register_buffer("mask", torch.tril(torch.ones((cfg.n_ctx, cfg.n_ctx)).bool()))
        self.register_buffer("IGNORE", torch.tensor(-torch.inf))
        self.attn_scale = cfg.d_head ** 0.5
        self.alibi = None

    @staticmethod
    def create_alibi_slope(n_ctx, device=None):
        rows = torch.arange(n_ctx, device=device).unsqueeze(0)
        cols = torch.arange(n_ctx, device=device).unsqueeze(1)
        slope_matrix = rows - cols
        return slope_matrix.clamp(max=0).to(torch.float32)

    @staticmethod
    def create_alibi_multipliers(n_heads, device=None):
        start = 2 ** (-8 / n_heads)
        indices = torch.arange(n_heads, device=device)
        return start * (start ** indices)

    @staticmethod
    def create_alibi_bias(n_heads, n_ctx, device=None):
        slope = AbstractAttention.create_alibi_slope(n_ctx, device)
        multipliers = AbstractAttention.create_alibi_multipliers(n_heads, device)
        return torch.einsum("ij,k->kij", slope, multipliers)

    def apply_causal_mask(self, attn_scores, past_kv_pos_offset=0, attention_mask=None):
        query_ctx_length = attn_scores.size(-2)
        key_ctx_length = attn_scores.size(-1)
        if query_ctx_length + past_kv_pos_offset != key_ctx_length:
            raise ValueError("you likely have a bug.")
        final_mask = self.mask[None, None, -query_ctx_length:, -key_ctx_length:]
        return torch.where(final_mask, attn_scores, self.IGNORE)

    def forward(self, x, past_kv_cache_entry=None):
        q = torch.einsum("bpm,hmd->bphd", x, self.W_Q)
        k = torch.einsum("bpm,hmd->bphd", x, self.W_K)
        v = torch.einsum("bpm,hmd->bphd", x, self.W_V)
        if past_kv_cache_entry is not None:
            kv_cache_pos_offset = past_kv_cache_entry.past_keys.size(1)
            k, v = past_kv_cache_entry.append(k, v)
        else:
            kv_cache_pos_offset = 0

        attn_scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.attn_scale

        if self.cfg.positional_embedding_type == "alibi":
            query_ctx = attn_scores.size(-2)
            key_ctx = attn_scores.size(-1)
            if self.alibi is None or key_ctx > self.alibi.size(-1):
                self.alibi = AbstractAttention.create_alibi_bias(self.cfg.n_heads, key_ctx, x.device)
            if FIXED:
                # Take the last query_ctx positions so it also works with past_kv_cache
                attn_scores += self.alibi[:, -query_ctx:, :key_ctx]
            else:
                attn_scores += self.alibi[:, :query_ctx, :key_ctx]
        if self.cfg.attention_dir == "causal":
            attn_scores = self.apply_causal_mask(attn_scores, kv_cache_pos_offset)

        pattern = F.softmax(attn_scores, dim=-1)
        pattern = torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        return torch.einsum("bqhd,hdm->bqm", z, self.W_O)


class TinyBloom(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.blocks = nn.ModuleList([AbstractAttention(cfg) for _ in range(cfg.n_layers)])
        self.ln = nn.ModuleList([nn.LayerNorm(cfg.d_model) for _ in range(cfg.n_layers)])
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab)

    def forward(self, tokens, past_kv_cache=None):
        x = self.embed(tokens)
        for i, (blk, ln) in enumerate(zip(self.blocks, self.ln)):
            entry = past_kv_cache[i] if past_kv_cache is not None else None
            x = x + blk(ln(x), past_kv_cache_entry=entry)
        return self.unembed(x)


cfg = Cfg()
model = TinyBloom(cfg).eval()
prompt = torch.randint(0, cfg.d_vocab, (2, 6))
new_tokens = 8

with torch.no_grad():
    # generate(use_past_kv_cache=True): prefill, then one token per step through the cache
    cache = [HookedTransformerKeyValueCacheEntry(cfg, prompt.size(0)) for _ in range(cfg.n_layers)]
    tokens = prompt
    logits = model(tokens, past_kv_cache=cache)
    cached_logits = []
    for _ in range(new_tokens):
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        tokens = torch.cat([tokens, nxt], dim=1)
        logits = model(nxt, past_kv_cache=cache)
        cached_logits.append(logits[:, -1])

    # reference: the same token sequence without a cache
    full = model(tokens)
    ref = full[:, prompt.size(1):]
    diff = (torch.stack(cached_logits, dim=1) - ref).abs().max().item()

print(f"max |cached decode logits - uncached logits|: {diff:.6f}")
