"""TransformerLens: HookedTransformer.generate() attends the left padding of a batched prompt.

Citation: TransformerLensOrg/TransformerLens issue #1005 ("Padding Tokens not masked during
HookedTransformer.generate()"), fixed by PR #999, merged as commit
bd67b0f5053ad215164b60553703f04e798df3de ("Fixed Masking in HookedTransformer.generate").
Pre-fix and fixed `HookedTransformer.generate`, `utils.get_attention_mask`, `PosEmbed.forward`,
`get_offset_position_ids` and `AbstractAttention.apply_causal_mask` were read upstream.

Bug: in the generation loop the mask handed to `get_residual` is computed from
`tokens = torch.zeros(...)` (not the prompt tokens), so it is all ones, and `self.forward(residual,
start_at_layer=0, past_kv_cache=...)` gets no `attention_mask` at all. With `start_at_layer` set the
model never builds a mask itself, so `apply_causal_mask` uses the causal mask alone and the shorter
prompt's left pads are attended (and their positions are counted) during prefill and every cached
decode step.

Fix: compute `initial_attention_mask = utils.get_attention_mask(tokenizer, input_tokens, prepend_bos)`
from the real (left-padded) prompt once, extend it with a column of ones per generated token, and
pass it both to `get_residual` and to `forward(..., attention_mask=attention_mask)`.

Reproduction: a two-layer HookedTransformer-style model (standard positional embeddings, manual
softmax over q@k^T with `torch.where(final_mask, attn_scores, IGNORE)`), a per-layer key/value cache,
and a batch of two prompts of lengths 7 and 3 left-padded to 7; greedy generation of 4 tokens.
"""
import sys
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


@dataclass
class HookedTransformerConfig:
    n_layers: int = 2
    d_model: int = 32
    n_heads: int = 4
    d_head: int = 8
    n_ctx: int = 32
    d_vocab: int = 40
    positional_embedding_type: str = "standard"
    default_prepend_bos: bool = True


# ---- transformer_lens/utilities ----
def get_cumsum_along_dim(tensor, dim, reverse=False):
    if reverse:
        tensor = tensor.flip(dims=(dim,))
    cumsum = tensor.cumsum(dim=dim)
    if reverse:
        cumsum = cumsum.flip(dims=(dim,))
    return cumsum


def get_attention_mask(tokenizer, tokens, prepend_bos):
    """Only the leftmost leading pads (padding_side == left) are real pads that should not be attended."""
    attention_mask = torch.ones_like(tokens)
    is_not_pad_token = tokens.ne(tokenizer.pad_token_id)
    if tokenizer.padding_side == "right":
        is_trailing_pad = get_cumsum_along_dim(is_not_pad_token, -1, reverse=True) == 0
        attention_mask[is_trailing_pad] = 0
    else:
        is_leading_pad = get_cumsum_along_dim(is_not_pad_token, -1, reverse=False) == 0
        attention_mask[is_leading_pad] = 0
        if prepend_bos and tokenizer.bos_token_id == tokenizer.pad_token_id:
            pad_bos_positions = is_leading_pad.sum(-1) - 1
            attention_mask[torch.arange(attention_mask.shape[0]), pad_bos_positions] = 1
    return attention_mask


def get_offset_position_ids(past_kv_pos_offset, attention_mask):
    shifted_position_ids = attention_mask.cumsum(dim=1) - 1
    position_ids = shifted_position_ids.masked_fill(shifted_position_ids < 0, 0)
    return position_ids[:, past_kv_pos_offset:]


# ---- transformer_lens/components ----
class PosEmbed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.W_pos = nn.Parameter(torch.randn(cfg.n_ctx, cfg.d_model) * 0.5)

    def forward(self, tokens, past_kv_pos_offset=0, attention_mask=None):
        tokens_length = tokens.size(-1)
        if attention_mask is None:
            pos_embed = self.W_pos[past_kv_pos_offset:tokens_length + past_kv_pos_offset, :]
            return pos_embed.unsqueeze(0).expand(tokens.size(0), -1, -1).clone()
        offset_position_ids = get_offset_position_ids(past_kv_pos_offset, attention_mask)
        pos_embed = self.W_pos[offset_position_ids]
        padding_mask = ~attention_mask.bool()
        offset_padding_mask = padding_mask[:, past_kv_pos_offset:tokens_length + past_kv_pos_offset].unsqueeze(-1)
        return torch.where(offset_padding_mask, 0, pos_embed).clone()


class TransformerLensKeyValueCacheEntry:
    def __init__(self, cfg, batch_size):
        self.past_keys = torch.empty(batch_size, 0, cfg.n_heads, cfg.d_head)
        self.past_values = torch.empty(batch_size, 0, cfg.n_heads, cfg.d_head)

    def append(self, new_keys, new_values):
        self.past_keys = torch.cat([self.past_keys, new_keys], dim=1)
        self.past_values = torch.cat([self.past_values, new_values], dim=1)
        return self.past_keys, self.past_values


class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.W_Q = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * 0.3)
        self.W_K = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * 0.3)
        self.W_V = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * 0.3)
        self.W_O = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_head, cfg.d_model) * 0.3)
        self.register_buffer("mask", torch.tril(torch.ones((cfg.n_ctx, cfg.n_ctx)).bool()))
        self.register_buffer("IGNORE", torch.tensor(-torch.inf))

    def apply_causal_mask(self, attn_scores, past_kv_pos_offset=0, attention_mask=None):
        query_ctx_length = attn_scores.size(-2)
        key_ctx_length = attn_scores.size(-1)
        assert query_ctx_length + past_kv_pos_offset == key_ctx_length
        # Index back to front to ensure local attention works
        final_mask = self.mask[None, None, -query_ctx_length:, -key_ctx_length:]
        if attention_mask is not None:
            attention_mask = attention_mask[:, None, None, :]
            final_mask = (final_mask * attention_mask).bool()
        return torch.where(final_mask, attn_scores, self.IGNORE)

    def forward(self, x, past_kv_cache_entry=None, attention_mask=None):
        q = torch.einsum("bpm,hmd->bphd", x, self.W_Q)
        k = torch.einsum("bpm,hmd->bphd", x, self.W_K)
        v = torch.einsum("bpm,hmd->bphd", x, self.W_V)
        kv_cache_pos_offset = 0
        if past_kv_cache_entry is not None:
            kv_cache_pos_offset = past_kv_cache_entry.past_keys.size(1)
            k, v = past_kv_cache_entry.append(k, v)
        attn_scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / self.cfg.d_head ** 0.5
        attn_scores = self.apply_causal_mask(attn_scores, kv_cache_pos_offset, attention_mask)
        pattern = torch.nn.functional.softmax(attn_scores, dim=-1)
        # Fully masked rows (query at a pad) give NaN; zero them as upstream does
        pattern = torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern)
        z = torch.einsum("bhqk,bkhd->bqhd", pattern, v)
        return torch.einsum("bqhd,hdm->bqm", z, self.W_O)


class TransformerBlock(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)

    def forward(self, resid_pre, past_kv_cache_entry=None, attention_mask=None):
        return resid_pre + self.attn(self.ln1(resid_pre), past_kv_cache_entry, attention_mask)


class HookedTransformer(nn.Module):
    def __init__(self, cfg, tokenizer):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.embed = nn.Embedding(cfg.d_vocab, cfg.d_model)
        self.pos_embed = PosEmbed(cfg)
        self.blocks = nn.ModuleList([TransformerBlock(cfg) for _ in range(cfg.n_layers)])
        self.ln_final = nn.LayerNorm(cfg.d_model)
        self.unembed = nn.Linear(cfg.d_model, cfg.d_vocab)

    def to_tokens(self, prompts):
        """Left-pads token-id prompts (BOS already prepended) like the tokenizer with padding_side='left'."""
        n = max(len(p) for p in prompts)
        return torch.tensor([[self.tokenizer.pad_token_id] * (n - len(p)) + p for p in prompts])

    def get_residual(self, embed, pos_offset, device=None, attention_mask=None):
        tokens = torch.ones((embed.size(0), embed.size(1))).int()
        pos_embed = self.pos_embed(tokens, pos_offset, attention_mask)
        return embed + pos_embed

    def forward(self, input, past_kv_cache=None, start_at_layer=None, attention_mask=None):
        residual = input  # start_at_layer is not None: the caller hands the residual stream
        for i, block in list(enumerate(self.blocks))[start_at_layer:]:
            residual = block(residual, past_kv_cache[i] if past_kv_cache is not None else None,
                             attention_mask=attention_mask)
        return self.unembed(self.ln_final(residual))

    @torch.no_grad()
    def generate(self, input, max_new_tokens=4, prepend_bos=True):
        input = self.to_tokens(input)
        input_tokens = input
        batch_size = input.shape[0]
        initial_attention_mask = None
        if FIXED:
            initial_attention_mask = get_attention_mask(self.tokenizer, input_tokens, prepend_bos)
        past_kv_cache = [TransformerLensKeyValueCacheEntry(self.cfg, batch_size) for _ in self.blocks]
        embeds = self.embed(input)
        sampled_tokens_list = []
        for index in range(max_new_tokens):
            pos_offset = past_kv_cache[0].past_keys.size(1)
            if FIXED:
                # Extend the initial attention mask with 1s for generated tokens.
                n_new = len(sampled_tokens_list)
                attention_mask = torch.cat(
                    [initial_attention_mask, torch.ones(batch_size, n_new, dtype=initial_attention_mask.dtype)], dim=1)
            else:
                tokens = torch.zeros((embeds.size(0), embeds.size(1))).to(torch.int)
                attention_mask = get_attention_mask(self.tokenizer, tokens, False if prepend_bos is None else prepend_bos)
            residual = self.get_residual(embeds, 0, attention_mask=attention_mask)
            start_at_layer = 0  # Make forward take embeddings
            forward_mask = attention_mask if FIXED else None
            if index > 0:
                logits = self.forward(residual[:, -1:], past_kv_cache=past_kv_cache,
                                      start_at_layer=start_at_layer, attention_mask=forward_mask)
            else:
                logits = self.forward(residual, past_kv_cache=past_kv_cache,
                                      start_at_layer=start_at_layer, attention_mask=forward_mask)
            sampled_tokens = logits[:, -1, :].argmax(-1)
            sampled_tokens_list.append(sampled_tokens.unsqueeze(1))
            embeds = torch.hstack([embeds, self.embed(sampled_tokens.unsqueeze(-1))])
        return torch.cat([input] + sampled_tokens_list, dim=1)


def main():
    torch.manual_seed(0)
    tokenizer = SimpleNamespace(pad_token_id=39, bos_token_id=38, padding_side="left")
    model = HookedTransformer(HookedTransformerConfig(), tokenizer).eval()
    prompts = [[38, 5, 17, 3, 22, 9, 11], [38, 14, 2]]
    out = model.generate(prompts, max_new_tokens=4)
    print("generated:", out[:, -4:].tolist())


if __name__ == "__main__":
    main()
