# Correct program (quiet batch quiet-r95a).
#
# Citation: TransformerLensOrg/TransformerLens @3267a43ebcd7e42121fc1c568568165b073f4a9f (tag v2.9.1):
# transformer_lens/HookedTransformer.py (input_to_embed, forward, to_tokens, generate),
# transformer_lens/past_key_value_caching.py (HookedTransformerKeyValueCache / Entry, append_attention_mask),
# transformer_lens/components/abstract_attention.py (forward, apply_causal_mask, apply_rotary,
# calculate_sin_cos_rotary, rotate_every_two), transformer_lens/components/pos_embed.py (PosEmbed.forward),
# transformer_lens/components/transformer_block.py, layer_norm.py, mlps/mlp.py,
# transformer_lens/utils.py (get_attention_mask, get_offset_position_ids, get_cumsum_along_dim).
#
# HookedTransformer.generate() on a left-padded batch of prompts, with its KV cache: every forward builds
# the padding mask from the tokens (get_attention_mask: only the leading pads are zeroed; where BOS is the
# pad id, the last leading pad is the BOS and is kept), the cache concatenates it onto the previous steps'
# mask (append_attention_mask), the positions are the mask's cumsum - 1 from the cache offset on
# (get_offset_position_ids) for the learned W_pos (GPT-2 style, pads' embeddings zeroed) or for rotary
# (GPT-NeoX style, keys rotated from position 0 of the whole cache each step), and apply_causal_mask ands
# the bottom-right slice of the tril buffer with the cached mask. Ported trimmed: no hooks, one device.
#
# Checked against each prompt run alone, unpadded, with a reference forward written here (its own causal
# loop over queries, positions 0..n-1, no cache, no mask): the tokens the cached generate picked, the EOS
# padding after a row finishes, and the batched uncached forward's logits on every real token of the
# generated rows.

import math
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
torch.set_num_threads(1)


@dataclass
class HookedTransformerConfig:
    n_layers: int
    d_model: int
    n_ctx: int
    d_head: int
    n_heads: int
    d_mlp: int
    d_vocab: int
    positional_embedding_type: str = "standard"
    rotary_dim: Optional[int] = None
    rotary_base: int = 10000
    rotary_adjacent_pairs: bool = False
    default_prepend_bos: bool = True
    use_attn_scale: bool = True
    eps: float = 1e-5
    device: str = "cpu"
    dtype: torch.dtype = torch.float32

    def __post_init__(self):
        self.attn_scale = math.sqrt(self.d_head)


# ---------------------------------------------------------------- utils.py


def get_offset_position_ids(past_kv_pos_offset, attention_mask):
    """
    Returns the indices of non-padded tokens, offset by the position of the first attended token.
    """
    # shift the position ids so that the id at the the first attended token position becomes zero.
    # The position ids of the prepending pad tokens are shifted to -1.
    shifted_position_ids = attention_mask.cumsum(dim=1) - 1  # [batch, tokens_length]

    # Set the position ids of all prepending pad tokens to an arbitrary number (zero here)
    # just to avoid indexing errors.
    position_ids = shifted_position_ids.masked_fill(shifted_position_ids < 0, 0)
    return position_ids[:, past_kv_pos_offset:]  # [pos, batch]


def get_cumsum_along_dim(tensor, dim, reverse=False):
    if reverse:
        tensor = tensor.flip(dims=(dim,))
    cumsum = tensor.cumsum(dim=dim)
    if reverse:
        cumsum = cumsum.flip(dims=(dim,))
    return cumsum


def get_attention_mask(tokenizer, tokens: torch.Tensor, prepend_bos: bool) -> torch.Tensor:
    # Initialize the attention mask with ones (indicating all tokens should be attended to)
    attention_mask = torch.ones_like(tokens)
    is_not_pad_token = tokens.ne(tokenizer.pad_token_id)

    if tokenizer.padding_side == "right":
        # Zero-out the rightmost trailing pad tokens
        is_trailing_pad = get_cumsum_along_dim(is_not_pad_token, -1, reverse=True) == 0
        attention_mask[is_trailing_pad] = 0
    else:
        # Zero-out the leftmost leading pad tokens
        is_leading_pad = get_cumsum_along_dim(is_not_pad_token, -1, reverse=False) == 0
        attention_mask[is_leading_pad] = 0

        # If the bos token is the same as the pad token,
        # the last token of the leftmost leading pad tokens is the bos token.
        # We need to set the attention mask for the bos token to 1.
        if prepend_bos and tokenizer.bos_token_id == tokenizer.pad_token_id:
            pad_bos_positions = is_leading_pad.sum(-1) - 1
            attention_mask[torch.arange(attention_mask.shape[0]), pad_bos_positions] = 1

    return attention_mask


# ------------------------------------------------------ past_key_value_caching.py


@dataclass
class HookedTransformerKeyValueCacheEntry:
    past_keys: torch.Tensor
    past_values: torch.Tensor
    frozen: bool = False

    @classmethod
    def init_cache_entry(cls, cfg, device, batch_size=1):
        return cls(
            past_keys=torch.empty((batch_size, 0, cfg.n_heads, cfg.d_head), device=device, dtype=cfg.dtype),
            past_values=torch.empty((batch_size, 0, cfg.n_heads, cfg.d_head), device=device, dtype=cfg.dtype),
        )

    def append(self, new_keys, new_values):
        updated_keys = torch.cat([self.past_keys, new_keys], dim=1)
        updated_values = torch.cat([self.past_values, new_values], dim=1)
        if not self.frozen:
            self.past_keys = updated_keys
            self.past_values = updated_values
        return updated_keys, updated_values


@dataclass
class HookedTransformerKeyValueCache:
    entries: List[HookedTransformerKeyValueCacheEntry]
    previous_attention_mask: torch.Tensor
    frozen: bool = False

    @classmethod
    def init_cache(cls, cfg, device, batch_size=1):
        return cls(
            entries=[
                HookedTransformerKeyValueCacheEntry.init_cache_entry(cfg, device, batch_size)
                for _ in range(cfg.n_layers)
            ],
            previous_attention_mask=torch.empty(
                # This may actually be an int64, but type promotion will handle it:
                (batch_size, 0),
                device=device,
                dtype=torch.int,
            ),
        )

    def append_attention_mask(self, attention_mask):
        attention_mask = attention_mask.to(self.previous_attention_mask.device)
        updated_attention_mask = torch.cat([self.previous_attention_mask, attention_mask], dim=-1)
        if not self.frozen:
            self.previous_attention_mask = updated_attention_mask
        return updated_attention_mask

    def __getitem__(self, idx):
        return self.entries[idx]


# ---------------------------------------------------------------- components


class Embed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.W_E = nn.Parameter(torch.randn(cfg.d_vocab, cfg.d_model) * 0.8)

    def forward(self, tokens):
        return self.W_E[tokens, :]


class PosEmbed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.W_pos = nn.Parameter(torch.randn(cfg.n_ctx, cfg.d_model) * 0.8)

    def forward(self, tokens, past_kv_pos_offset: int = 0, attention_mask=None):
        tokens_length = tokens.size(-1)

        if attention_mask is None:
            pos_embed = self.W_pos[past_kv_pos_offset : tokens_length + past_kv_pos_offset, :]  # [pos, d_model]
            batch_pos_embed = pos_embed[None].expand(tokens.size(0), -1, -1)  # "pos d_model -> batch pos d_model"

        else:
            # Separated from the no padding case for computational efficiency
            # (this code is a bit slower than the code above)

            offset_position_ids = get_offset_position_ids(past_kv_pos_offset, attention_mask)
            pos_embed = self.W_pos[offset_position_ids]  # [batch, pos, d_model]

            # Set the position embeddings to 0 for pad tokens (this is an arbitrary choice)
            padding_mask = ~attention_mask.bool()  # [batch, tokens_length]
            offset_padding_mask = padding_mask[:, past_kv_pos_offset : tokens_length + past_kv_pos_offset].unsqueeze(
                -1
            )  # [batch, pos, 1]
            batch_pos_embed = torch.where(offset_padding_mask, 0, pos_embed)

        return batch_pos_embed.clone()


class LayerNorm(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.eps = cfg.eps
        self.w = nn.Parameter(1.0 + 0.1 * torch.randn(cfg.d_model))
        self.b = nn.Parameter(0.1 * torch.randn(cfg.d_model))

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)  # [batch, pos, length]
        scale = (x.pow(2).mean(-1, keepdim=True) + self.eps).sqrt()
        x = x / scale  # [batch, pos, length]
        return x * self.w + self.b


class Attention(nn.Module):
    def __init__(self, cfg, attn_type="global", layer_id=None):
        super().__init__()
        self.cfg = cfg
        s = cfg.d_model**-0.5
        self.W_Q = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * s * 2)
        self.W_K = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * s * 2)
        self.W_V = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_model, cfg.d_head) * s)
        self.W_O = nn.Parameter(torch.randn(cfg.n_heads, cfg.d_head, cfg.d_model) * s)
        self.b_Q = nn.Parameter(0.1 * torch.randn(cfg.n_heads, cfg.d_head))
        self.b_K = nn.Parameter(0.1 * torch.randn(cfg.n_heads, cfg.d_head))
        self.b_V = nn.Parameter(0.1 * torch.randn(cfg.n_heads, cfg.d_head))
        self.b_O = nn.Parameter(torch.zeros(cfg.d_model))

        self.attn_type = attn_type
        # Create a max_ctx x max_ctx mask, with True iff that query position
        # can attend to that key position (query is first axis, key is second axis)
        causal_mask = torch.tril(torch.ones((self.cfg.n_ctx, self.cfg.n_ctx)).bool())
        # For global attention, this is a lower triangular matrix - key <= query
        self.register_buffer("mask", causal_mask)
        self.register_buffer("IGNORE", torch.tensor(-torch.inf))
        self.layer_id = layer_id
        self.attn_scale = self.cfg.attn_scale if self.cfg.use_attn_scale else 1.0

        if self.cfg.positional_embedding_type == "rotary":
            sin, cos = self.calculate_sin_cos_rotary(
                self.cfg.rotary_dim, self.cfg.n_ctx, base=self.cfg.rotary_base, dtype=self.cfg.dtype
            )
            self.register_buffer("rotary_sin", sin)
            self.register_buffer("rotary_cos", cos)

    def calculate_qkv_matrices(self, query_input, key_input, value_input):
        # "batch pos d_model, head_index d_model d_head -> batch pos head_index d_head"
        attn_fn = lambda x, W, b: torch.einsum("bpm,hmd->bphd", x, W) + b
        q = attn_fn(query_input, self.W_Q, self.b_Q)
        k = attn_fn(key_input, self.W_K, self.b_K)
        v = attn_fn(value_input, self.W_V, self.b_V)
        return q, k, v

    def forward(self, query_input, key_input, value_input, past_kv_cache_entry=None, attention_mask=None):
        q, k, v = self.calculate_qkv_matrices(query_input, key_input, value_input)

        if past_kv_cache_entry is not None:
            # Appends the new keys and values to the cached values, and automatically updates the cache
            kv_cache_pos_offset = past_kv_cache_entry.past_keys.size(1)
            k, v = past_kv_cache_entry.append(k, v)
        else:
            # Not using a cache
            kv_cache_pos_offset = 0

        if self.cfg.positional_embedding_type == "rotary":
            q = self.apply_rotary(q, kv_cache_pos_offset, attention_mask)
            k = self.apply_rotary(k, 0, attention_mask)  # keys are cached so no offset

        attn_scores = self.calculate_attention_scores(q, k)  # [batch, head_index, query_pos, key_pos]

        # If causal attention, we mask it to only attend backwards. If bidirectional, we don't mask.
        attn_scores = self.apply_causal_mask(attn_scores, kv_cache_pos_offset, attention_mask)

        pattern = F.softmax(attn_scores, dim=-1)
        pattern = torch.where(torch.isnan(pattern), torch.zeros_like(pattern), pattern)
        pattern = pattern.to(self.cfg.dtype)
        z = self.calculate_z_scores(v, pattern)  # [batch, pos, head_index, d_head]
        out = torch.einsum("bphd,hdm->bpm", z, self.W_O) + self.b_O
        return out

    def calculate_attention_scores(self, q, k):
        q_ = q.permute(0, 2, 1, 3)  # batch query_pos head_index d_head -> batch head_index query_pos d_head
        k_ = k.permute(0, 2, 3, 1)  # batch key_pos head_index d_head -> batch head_index d_head key_pos
        attn_scores = q_ @ k_ / self.attn_scale
        return attn_scores

    def calculate_z_scores(self, v, pattern):
        v_ = v.permute(0, 2, 1, 3)  # batch key_pos head_index d_head -> batch head_index key_pos d_head
        z = (pattern @ v_).permute(0, 2, 1, 3)  # -> batch query_pos head_index d_head
        return z

    def apply_causal_mask(self, attn_scores, past_kv_pos_offset: int = 0, attention_mask=None):
        # The query context length is the number of positions we take queries from - if not using a past_kv_cache
        # this is just the context length (for the current prompt), but if we're caching it can be different.
        query_ctx_length = attn_scores.size(-2)
        # The key context length is the number of positions in the past - this includes all positions in the cache
        # If not caching, query_ctx_length == key_ctx_length
        key_ctx_length = attn_scores.size(-1)

        if query_ctx_length + past_kv_pos_offset != key_ctx_length:
            raise ValueError(
                f"query_ctx_length {query_ctx_length} + past_kv_pos_offset {past_kv_pos_offset} != "
                f"key_ctx_length {key_ctx_length} - you likely have a bug."
            )

        # Index back to front to ensure local attention works
        final_mask = self.mask[None, None, -query_ctx_length:, -key_ctx_length:]  # [1, 1, pos, pos]
        if attention_mask is not None:
            # Apply a causal mask to the attention scores considering the padding
            einsum_str = "bhqk,bk->bhqk"  # batch head pos offset_pos, batch offset_pos -> batch head pos offset_pos
            final_mask = final_mask.to(attention_mask.device)
            final_mask = torch.einsum(einsum_str, final_mask.to(attention_mask.dtype), attention_mask).bool()

        attn_scores = attn_scores.to(final_mask.device)
        return torch.where(final_mask, attn_scores, self.IGNORE)

    def calculate_sin_cos_rotary(self, rotary_dim, n_ctx, base=10000, dtype=torch.float32):
        high_precision = torch.float32 if dtype != torch.float64 else torch.float64
        pos = torch.arange(n_ctx, dtype=high_precision)
        dim = torch.arange(rotary_dim // 2, dtype=high_precision)
        freq = base ** (dim / (rotary_dim / 2))
        if self.cfg.rotary_adjacent_pairs:
            freq = freq.repeat_interleave(2)  # "d -> (d 2)"
        else:
            freq = freq.repeat(2)  # "d -> (2 d)"
        # Create a n_ctx x rotary_dim tensor, where each column is an arithmetic sequence of angles in that frequency
        angles = pos[:, None] / freq[None, :]
        return torch.sin(angles).to(dtype), torch.cos(angles).to(dtype)

    def rotate_every_two(self, x):
        rot_x = x.clone()
        if self.cfg.rotary_adjacent_pairs:
            rot_x[..., ::2] = -x[..., 1::2]
            rot_x[..., 1::2] = x[..., ::2]
        else:
            n = x.size(-1) // 2
            rot_x[..., :n] = -x[..., n:]
            rot_x[..., n:] = x[..., :n]
        return rot_x

    def apply_rotary(self, x, past_kv_pos_offset=0, attention_mask=None):
        # Only apply rotary to first rotary_dim dimensions
        x_pos = x.size(1)
        x_rot = x[..., : self.cfg.rotary_dim]
        x_pass = x[..., self.cfg.rotary_dim :]
        x_flip = self.rotate_every_two(x_rot)

        if attention_mask is None:
            rotary_cos = self.rotary_cos[None, past_kv_pos_offset : past_kv_pos_offset + x_pos, None, :]
            rotary_sin = self.rotary_sin[None, past_kv_pos_offset : past_kv_pos_offset + x_pos, None, :]
            x_rotated = x_rot * rotary_cos + x_flip * rotary_sin
        else:
            offset_position_ids = get_offset_position_ids(past_kv_pos_offset, attention_mask)
            offset_position_ids = offset_position_ids.to(self.rotary_cos.device)
            mask_rotary_cos = self.rotary_cos[offset_position_ids, None, :]
            mask_rotary_sin = self.rotary_sin[offset_position_ids, None, :]
            x_rotated = x_rot * mask_rotary_cos + x_flip * mask_rotary_sin

        return torch.cat([x_rotated, x_pass], dim=-1)


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        self.W_in = nn.Parameter(torch.randn(cfg.d_model, cfg.d_mlp) * cfg.d_model**-0.5)
        self.b_in = nn.Parameter(0.1 * torch.randn(cfg.d_mlp))
        self.W_out = nn.Parameter(torch.randn(cfg.d_mlp, cfg.d_model) * cfg.d_mlp**-0.5)
        self.b_out = nn.Parameter(torch.zeros(cfg.d_model))

    def forward(self, x):
        pre_act = x @ self.W_in + self.b_in
        post_act = F.gelu(pre_act, approximate="tanh")
        return post_act @ self.W_out + self.b_out


class TransformerBlock(nn.Module):
    def __init__(self, cfg, block_index):
        super().__init__()
        self.cfg = cfg
        self.ln1 = LayerNorm(cfg)
        self.ln2 = LayerNorm(cfg)
        self.attn = Attention(cfg, "global", block_index)
        self.mlp = MLP(cfg)

    def forward(self, resid_pre, shortformer_pos_embed=None, past_kv_cache_entry=None, attention_mask=None):
        attn_in = resid_pre
        attn_out = self.attn(
            query_input=self.ln1(attn_in),
            key_input=self.ln1(attn_in),
            value_input=self.ln1(attn_in),
            past_kv_cache_entry=past_kv_cache_entry,
            attention_mask=attention_mask,
        )  # [batch, pos, d_model]
        resid_mid = resid_pre + attn_out  # [batch, pos, d_model]
        mlp_out = self.mlp(self.ln2(resid_mid))  # [batch, pos, d_model]
        return resid_mid + mlp_out  # [batch, pos, d_model]


class Unembed(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.W_U = nn.Parameter(torch.randn(cfg.d_model, cfg.d_vocab) * 1.5 * cfg.d_model**-0.5)
        self.b_U = nn.Parameter(torch.zeros(cfg.d_vocab))

    def forward(self, residual):
        return residual @ self.W_U + self.b_U


class ToyTokenizer:
    """Stand-in for the HF tokenizer HookedTransformer holds: whitespace words, a fixed vocab."""

    def __init__(self, vocab, pad_token, bos_token, eos_token, padding_side="left"):
        self.vocab = {w: i for i, w in enumerate(vocab)}
        self.inv = list(vocab)
        self.pad_token_id = self.vocab[pad_token]
        self.bos_token_id = self.vocab[bos_token]
        self.eos_token_id = self.vocab[eos_token]
        self.bos_token = bos_token
        self.padding_side = padding_side

    def __call__(self, texts, return_tensors="pt", padding=True):
        ids = [[self.vocab[w] for w in t.split()] for t in texts]
        L = max(len(x) for x in ids)
        rows = []
        for x in ids:
            pad = [self.pad_token_id] * (L - len(x))
            rows.append(pad + x if self.padding_side == "left" else x + pad)
        return {"input_ids": torch.tensor(rows)}

    def decode(self, ids):
        return " ".join(self.inv[i] for i in ids.tolist())


class HookedTransformer(nn.Module):
    def __init__(self, cfg, tokenizer):
        super().__init__()
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.embed = Embed(cfg)
        if cfg.positional_embedding_type != "rotary":
            self.pos_embed = PosEmbed(cfg)
        self.blocks = nn.ModuleList([TransformerBlock(cfg, i) for i in range(cfg.n_layers)])
        self.ln_final = LayerNorm(cfg)
        self.unembed = Unembed(cfg)

    def to_tokens(self, input, prepend_bos=True, padding_side=None):
        if isinstance(input, str):
            input = [input]
        if prepend_bos:
            input = [self.tokenizer.bos_token + " " + s for s in input]
        return self.tokenizer(input, return_tensors="pt", padding=True)["input_ids"]

    def input_to_embed(self, input, prepend_bos=None, attention_mask=None, past_kv_cache=None):
        tokens = input
        if len(tokens.shape) == 1:
            tokens = tokens[None]

        if (self.tokenizer and self.tokenizer.padding_side == "left") or attention_mask is not None or past_kv_cache is not None:
            # This means we need to have an explicit attention mask.
            if attention_mask is None:
                # If the padding side is left or we are using caching, we need to compute the attention
                # mask for the adjustment of absolute positional embeddings and attention masking so
                # that pad tokens are not attended.
                if prepend_bos is None:
                    prepend_bos = self.cfg.default_prepend_bos
                attention_mask = get_attention_mask(self.tokenizer, tokens, prepend_bos)

            assert attention_mask.shape == tokens.shape
            if past_kv_cache is not None:
                # past_kv_cache is not None, so we're doing caching.
                # We need to extend the previous attention_mask.
                # Update the past_kv_cache with the new attention_mask (unless it's frozen)
                attention_mask = past_kv_cache.append_attention_mask(attention_mask)
        else:
            # We separate this case from for computational efficiency.
            attention_mask = None

        if past_kv_cache is None:
            pos_offset = 0
        else:
            batch_size, ctx_length = tokens.shape
            cached_batch_size, cache_ctx_length, num_heads_in_cache, d_head_in_cache = past_kv_cache[0].past_keys.shape
            assert cached_batch_size == batch_size
            assert num_heads_in_cache == self.cfg.n_heads
            assert d_head_in_cache == self.cfg.d_head
            pos_offset = cache_ctx_length
        embed = self.embed(tokens)  # [batch, pos, d_model]
        if self.cfg.positional_embedding_type == "standard":
            pos_embed = self.pos_embed(tokens, pos_offset, attention_mask)  # [batch, pos, d_model]
            residual = embed + pos_embed  # [batch, pos, d_model]
        elif self.cfg.positional_embedding_type == "rotary":
            # Rotary doesn't use positional embeddings, instead they're applied when dot producting
            # keys and queries.
            residual = embed
        else:
            raise ValueError(self.cfg.positional_embedding_type)
        return residual, tokens, None, attention_mask

    def forward(self, input, return_type="logits", prepend_bos=None, attention_mask=None, past_kv_cache=None):
        residual, tokens, shortformer_pos_embed, attention_mask = self.input_to_embed(
            input, prepend_bos=prepend_bos, attention_mask=attention_mask, past_kv_cache=past_kv_cache
        )
        for i, block in enumerate(self.blocks):
            residual = block(
                residual,
                past_kv_cache_entry=past_kv_cache[i] if past_kv_cache is not None else None,
                shortformer_pos_embed=shortformer_pos_embed,
                attention_mask=attention_mask,
            )  # [batch, pos, d_model]
        residual = self.ln_final(residual)  # [batch, pos, d_model]
        return self.unembed(residual)  # [batch, pos, d_vocab]

    @torch.no_grad()
    def generate(self, input, max_new_tokens=10, stop_at_eos=True, eos_token_id=None, do_sample=False,
                 use_past_kv_cache=True, prepend_bos=None):
        tokens = input
        batch_size, ctx_length = tokens.shape
        if use_past_kv_cache:
            past_kv_cache = HookedTransformerKeyValueCache.init_cache(self.cfg, self.cfg.device, batch_size)
        else:
            past_kv_cache = None

        stop_tokens: List[int] = []
        eos_token_for_padding = 0
        if stop_at_eos:
            if eos_token_id is None:
                eos_token_id = self.tokenizer.eos_token_id
            stop_tokens = [eos_token_id]
            eos_token_for_padding = eos_token_id

        # An array to track which sequences in the batch have finished.
        finished_sequences = torch.zeros(batch_size, dtype=torch.bool, device=self.cfg.device)
        self.eval()
        for index in range(max_new_tokens):
            # While generating, we keep generating logits, throw away all but the final logits,
            # and then use those logits to sample from the distribution We keep adding the
            # sampled tokens to the end of tokens.
            if use_past_kv_cache:
                # We just take the final tokens, as a [batch, 1] tensor
                if index > 0:
                    logits = self.forward(tokens[:, -1:], return_type="logits", prepend_bos=prepend_bos,
                                          past_kv_cache=past_kv_cache)
                else:
                    logits = self.forward(tokens, return_type="logits", prepend_bos=prepend_bos,
                                          past_kv_cache=past_kv_cache)
            else:
                # We input the entire sequence, as a [batch, pos] tensor, since we aren't using
                # the cache.
                logits = self.forward(tokens, return_type="logits", prepend_bos=prepend_bos)
            final_logits = logits[:, -1, :]
            sampled_tokens = final_logits.argmax(-1)
            if stop_at_eos:
                # For all unfinished sequences, add on the next token. If a sequence was
                # finished, throw away the generated token and add eos_token_for_padding
                # instead.
                sampled_tokens[finished_sequences] = eos_token_for_padding
                finished_sequences.logical_or_(torch.isin(sampled_tokens, torch.tensor(stop_tokens)))
            tokens = torch.cat([tokens, sampled_tokens.unsqueeze(-1)], dim=-1)
            if stop_at_eos and finished_sequences.all():
                break
        return tokens


# ------------------------------------------------------------------ reference


@torch.no_grad()
def reference_logits(model, ids):
    """One unpadded sequence, written out: positions 0..n-1, a loop over queries (keys 0..i)."""
    cfg = model.cfg
    n = len(ids)
    ids = torch.tensor(ids)
    x = model.embed.W_E[ids]
    if cfg.positional_embedding_type == "standard":
        x = x + model.pos_embed.W_pos[:n]
    for block in model.blocks:
        a = block.attn
        h = block.ln1(x[None])[0]
        q = torch.einsum("pd,hde->phe", h, a.W_Q) + a.b_Q
        k = torch.einsum("pd,hde->phe", h, a.W_K) + a.b_K
        v = torch.einsum("pd,hde->phe", h, a.W_V) + a.b_V
        if cfg.positional_embedding_type == "rotary":
            r = cfg.rotary_dim
            inv = 1.0 / (cfg.rotary_base ** (torch.arange(r // 2, dtype=torch.float32) / (r / 2)))

            ang = torch.arange(n, dtype=torch.float32)[:, None, None] * inv  # [pos, 1, r / 2]
            c, sn = torch.cos(ang), torch.sin(ang)

            def rot(t):
                # pairs (i, i + r / 2) rotated by position * inv[i]; dims past rotary_dim untouched
                x1, x2, rest = t[..., : r // 2], t[..., r // 2 : r], t[..., r:]
                return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn, rest], dim=-1)

            q, k = rot(q), rot(k)
        z = torch.zeros_like(q)
        for i in range(n):
            # query i sees keys 0..i, every head at once
            s = torch.einsum("jhe,he->hj", k[: i + 1], q[i]) / math.sqrt(cfg.d_head)
            w = torch.softmax(s, dim=-1)
            z[i] = torch.einsum("hj,jhe->he", w, v[: i + 1])
        x = x + torch.einsum("phe,hed->pd", z, a.W_O) + a.b_O
        x = x + block.mlp(block.ln2(x[None])[0])
    return model.unembed(model.ln_final(x[None])[0])


def reference_greedy(model, ids, max_new_tokens, eos):
    ids = list(ids)
    steps = []
    for _ in range(max_new_tokens):
        logits = reference_logits(model, ids)[-1]
        steps.append(logits)
        nxt = int(logits.argmax())
        ids.append(nxt)
        if nxt == eos:
            break
    return ids, steps


def run_case(name, cfg, tokenizer, prompts, max_new_tokens):
    model = HookedTransformer(cfg, tokenizer)
    model.eval()
    if tokenizer.pad_token_id != tokenizer.eos_token_id:
        # a trained model never predicts its padding token
        with torch.no_grad():
            model.unembed.b_U[tokenizer.pad_token_id] = -1e4
    tokens = model.to_tokens(prompts, prepend_bos=True)
    mask0 = get_attention_mask(tokenizer, tokens, True)
    out = model.generate(tokens, max_new_tokens=max_new_tokens, stop_at_eos=True, do_sample=False)
    pad, eos = tokenizer.pad_token_id, tokenizer.eos_token_id
    L = tokens.shape[1]

    # the batched, uncached forward over the whole generated batch, its mask made from the tokens
    with torch.no_grad():
        full_logits = model.forward(out)
        full_mask = get_attention_mask(tokenizer, out, True)
    assert torch.equal(full_mask[:, :L], mask0)

    worst = 0.0
    for b, p in enumerate(prompts):
        n_pad = int((mask0[b] == 0).sum())
        prompt_ids = tokens[b, n_pad:].tolist()
        assert prompt_ids[0] == tokenizer.bos_token_id and len(prompt_ids) == len(p.split()) + 1
        ref_ids, ref_steps = reference_greedy(model, prompt_ids, max_new_tokens, eos)
        gen = out[b, L:].tolist()
        n_new = len(ref_ids) - len(prompt_ids)
        assert gen[:n_new] == ref_ids[len(prompt_ids):], (name, b, gen, ref_ids)
        assert all(t == eos for t in gen[n_new:]), (name, b, gen)
        # every real token's logits in the batched masked forward = the sequence alone
        real = out[b, n_pad : L + n_new].tolist()
        assert real == ref_ids[: len(real)]
        ref_all = reference_logits(model, real)
        got = full_logits[b, n_pad : L + n_new]
        err = (got - ref_all).abs().max().item()
        worst = max(worst, err)
        assert err < 1e-3, (name, b, err)
        print(f"{name} row {b}: {n_pad} pads, prompt {len(prompt_ids)}, generated {n_new} "
              f"({tokenizer.decode(torch.tensor(gen))}), max |logit err| {err:.2e}")
    return worst


def main():
    words = ["<|endoftext|>"] + [f"w{i}" for i in range(1, 48)]
    prompts = ["w3 w7 w1", "w12 w5 w9 w30 w2 w44 w8", "w20", "w6 w6 w11 w19 w40"]

    # GPT-2 style: BOS = EOS = PAD, learned absolute positions indexed from the mask
    tok_gpt2 = ToyTokenizer(words, "<|endoftext|>", "<|endoftext|>", "<|endoftext|>", padding_side="left")
    cfg_gpt2 = HookedTransformerConfig(n_layers=2, d_model=32, n_ctx=64, d_head=8, n_heads=4, d_mlp=64,
                                       d_vocab=len(words), positional_embedding_type="standard")
    run_case("standard", cfg_gpt2, tok_gpt2, prompts, max_new_tokens=8)

    # GPT-NeoX style: rotary over the first half of each head, a pad distinct from BOS / EOS
    words_neox = ["<|endoftext|>", "<|padding|>"] + [f"w{i}" for i in range(1, 48)]
    tok_neox = ToyTokenizer(words_neox, "<|padding|>", "<|endoftext|>", "<|endoftext|>", padding_side="left")
    cfg_neox = HookedTransformerConfig(n_layers=2, d_model=32, n_ctx=64, d_head=8, n_heads=4, d_mlp=64,
                                       d_vocab=len(words_neox), positional_embedding_type="rotary",
                                       rotary_dim=4, rotary_adjacent_pairs=False)
    run_case("rotary", cfg_neox, tok_neox, prompts, max_new_tokens=8)
    print("ok")


if __name__ == "__main__":
    main()
