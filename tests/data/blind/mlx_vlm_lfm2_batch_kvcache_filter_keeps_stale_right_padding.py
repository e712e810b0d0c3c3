"""mlx-vlm LFM2 (hybrid short-conv + attention) batched prefill: BatchKVCache.filter left the
pending right padding behind when it filtered (reordered) the rows.

Citation: Blaizzy/mlx-vlm#1890 (commit 570afed3, "Keep pending padding metadata aligned after
filtering"), mlx_vlm/models/cache.py BatchKVCache.filter.

Mixed prefill right-pads the prompt rows: each cache is told `prepare(right_padding=...,
lengths=...)`, and once the prompt is through `finalize()` rolls every row's trailing pad slots to
the front of that row's keys/values and adds them to `left_padding`, so that the decode mask
(`create_causal_mask(..., left_padding=...)`) hides them. `BatchKVCache.filter(batch_indices)`
reindexed keys, values, offset and left_padding but not `_right_padding`, so after a filter that
moved rows the pending pad counts belonged to the old row order: finalize rolled the wrong rows,
the padded row kept its pad keys visible at the end and the full row had its last real keys moved
under left padding (and its RoPE offset shifted). The conv layers' ArraysCache.filter already
reindexed `lengths`, so only the attention layers see it. The fix reindexes `_right_padding` (and
BatchRotatingKVCache's `_lengths`) in filter.

The program ports mlx-vlm's LFM2 language model (mlx_vlm/models/lfm2/language.py: Attention with
RoPE at `cache.offset`, ShortConv with the ArraysCache state taken at `cache.lengths`, the
attention mask from the first full-attention layer's cache, the ssm mask from the first conv
layer's cache), cache.py's BatchKVCache / ArraysCache / create_causal_mask / dynamic_roll and
generate/ar.py's right-padded prefill (`_right_pad_prompts`, chunked `prompt_step`, `generate`
taking each row's last real token, then `finalize`), from MLX to torch at toy sizes with random
weights. As the PR's test does, the rows are filtered in a new order (`filter([1, 0])`) while the
right padding is still pending, between two prefill chunks; then a few greedy decode steps run.
"""

import sys
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


# --------------------------------------------------------------------------- config


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    norm_eps: float
    conv_bias: bool
    conv_L_cache: int
    block_dim: int
    block_ff_dim: int
    block_multiple_of: int
    block_ffn_dim_multiplier: Optional[float]
    block_auto_adjust_ff_dim: bool
    rope_theta: float = 1000000.0
    conv_causal: bool = True
    full_attn_idxs: Optional[List[int]] = None
    layer_types: Optional[List[str]] = None
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.full_attn_idxs is None:
            self.full_attn_idxs = [
                i
                for i, layer_type in enumerate(self.layer_types)
                if layer_type == "full_attention"
            ]


# --------------------------------------------------------------------------- cache.py


def create_causal_mask(
    N: int,
    offset: int = 0,
    window_size: Optional[int] = None,
    right_padding: Optional[torch.Tensor] = None,
    left_padding: Optional[torch.Tensor] = None,
):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    linds = linds[:, None]
    rinds = rinds[None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    if right_padding is not None:
        mask = mask & (rinds < ((offset + N) - right_padding)[:, None, None, None])
    if left_padding is not None:
        mask = mask & (left_padding[:, None, None, None] <= rinds)
    return mask


def dynamic_roll(x, shifts, axis):
    n = x.shape[axis]
    expand_shifts = (...,) + (None,) * (x.ndim - axis)
    expand_indices = expand_shifts[:-1]
    idx = (torch.arange(n)[expand_indices] - shifts[expand_shifts]) % n
    idx = idx.expand(*x.shape[:axis], n, *x.shape[axis + 1 :])
    rolled = torch.take_along_dim(x, idx, dim=axis)
    return rolled


class KVCache:
    pass


class BatchKVCache:
    step = 256

    def __init__(self, left_padding: List[int]):
        self.keys = None
        self.values = None
        self.left_padding = torch.tensor(left_padding)
        self.offset = torch.tensor([-pad for pad in left_padding])
        self._idx = 0

        self._right_padding = None

    def update_and_fetch(self, keys, values):
        prev = self._idx
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            k_shape = (B, n_kv_heads, n_steps * self.step, k_head_dim)
            v_shape = (B, n_kv_heads, n_steps * self.step, v_head_dim)
            new_k = torch.zeros(k_shape, dtype=keys.dtype)
            new_v = torch.zeros(v_shape, dtype=values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v

        self.offset = self.offset + keys.shape[2]
        self._idx += keys.shape[2]
        self.keys[..., prev : self._idx, :] = keys
        self.values[..., prev : self._idx, :] = values
        return self.keys[..., : self._idx, :], self.values[..., : self._idx, :]

    def prepare(self, *, left_padding=None, lengths=None, right_padding=None):
        if left_padding is not None:
            if self.keys is not None:
                raise ValueError(
                    "Left padding can only be added to an empty BatchKVCache"
                )
            left_padding = torch.tensor(left_padding)
            self.left_padding = self.left_padding + left_padding
            self.offset = self.offset - left_padding

        if right_padding is not None and max(right_padding) > 0:
            self._right_padding = torch.tensor(right_padding)

    def finalize(self):
        if self._right_padding is not None:
            padding = self._right_padding
            self.keys = dynamic_roll(self.keys, padding[:, None], axis=2)
            self.values = dynamic_roll(self.values, padding[:, None], axis=2)
            self.offset = self.offset - padding
            self.left_padding = self.left_padding + padding
            self._right_padding = None

    def make_mask(self, N: int, return_array: bool = False, **kwargs):
        return create_causal_mask(
            N, offset=self._idx, left_padding=self.left_padding, **kwargs
        )

    def filter(self, batch_indices):
        """
        In-place filter to keep just the given indices in the cache.
        """
        if self.keys is not None:
            self.keys = self.keys[batch_indices]
            self.values = self.values[batch_indices]
        self.offset = self.offset[batch_indices]
        self.left_padding = self.left_padding[batch_indices]
        if FIXED:
            if self._right_padding is not None:
                self._right_padding = self._right_padding[batch_indices]

        # Shift left to reduce padding
        min_left_pad = self.left_padding.min().item()
        if min_left_pad > 0:
            if self.keys is not None:
                self.keys = self.keys[..., min_left_pad:, :]
                self.values = self.values[..., min_left_pad:, :]
            self._idx -= min_left_pad
            self.left_padding = self.left_padding - min_left_pad


class ArraysCache:
    def __init__(self, size, left_padding: Optional[List[int]] = None):
        self.cache = [None] * size
        self.left_padding = None
        self.lengths = None
        if left_padding:
            self.left_padding = torch.tensor(left_padding)

    def __setitem__(self, idx, value):
        self.cache[idx] = value

    def __getitem__(self, idx):
        return self.cache[idx]

    def filter(self, batch_indices):
        self.cache = [c[batch_indices] if c is not None else None for c in self.cache]
        if self.left_padding is not None:
            self.left_padding = self.left_padding[batch_indices]
        if self.lengths is not None:
            self.lengths = self.lengths[batch_indices]

    def prepare(self, lengths=None, **kwargs):
        self.lengths = torch.tensor(lengths)

    def finalize(self):
        self.lengths = None
        self.left_padding = None

    def advance(self, N):
        if self.lengths is not None:
            self.lengths = self.lengths - N
        if self.left_padding is not None:
            self.left_padding = self.left_padding - N

    def make_mask(self, N: int):
        if self.left_padding is not None:
            pos = torch.arange(N)
            return pos >= self.left_padding[:, None]
        elif self.lengths is not None:
            pos = torch.arange(N)
            return pos < self.lengths[:, None]
        else:
            return None


# --------------------------------------------------------------------------- base.py


def create_attention_mask(h, cache=None, window_size=None, return_array=False):
    N = h.shape[1]
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(N, return_array=return_array, window_size=window_size)
    if N == 1:
        return None
    if return_array or (window_size and N > window_size):
        return create_causal_mask(N, window_size=window_size)
    return "causal"


def create_ssm_mask(h, cache=None):
    if cache and hasattr(cache, "make_mask"):
        return cache.make_mask(h.shape[1])
    return None


def scaled_dot_product_attention(queries, keys, values, cache, scale, mask):
    n_rep = queries.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(n_rep, dim=1)
    values = values.repeat_interleave(n_rep, dim=1)
    if isinstance(mask, str):
        return F.scaled_dot_product_attention(
            queries, keys, values, is_causal=True, scale=scale
        )
    return F.scaled_dot_product_attention(
        queries, keys, values, attn_mask=mask, scale=scale
    )


# --------------------------------------------------------------------------- lfm2/language.py


class RMSNorm(nn.Module):
    def __init__(self, dims, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dims))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class RoPE(nn.Module):
    def __init__(self, dims, base, traditional=False):
        super().__init__()
        self.dims = dims
        self.base = base

    def forward(self, x, offset=0):
        B, H, L, D = x.shape
        if isinstance(offset, torch.Tensor):
            pos = offset.reshape(-1, 1, 1, 1).float() + torch.arange(L).float()[None, None, :, None]
        else:
            pos = (offset + torch.arange(L).float())[None, None, :, None]
        freqs = self.base ** (-torch.arange(0, D, 2).float() / D)
        theta = pos * freqs
        cos, sin = theta.cos(), theta.sin()
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return torch.cat([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1)


def swiglu(gate, x):
    return F.silu(gate) * x


class Attention(nn.Module):
    def __init__(self, args):
        super().__init__()

        dim = args.hidden_size
        self.n_heads = n_heads = args.num_attention_heads
        self.n_kv_heads = n_kv_heads = args.num_key_value_heads

        self.head_dim = head_dim = args.hidden_size // n_heads

        self.scale = head_dim**-0.5

        self.q_layernorm = RMSNorm(head_dim, eps=args.norm_eps)
        self.k_layernorm = RMSNorm(head_dim, eps=args.norm_eps)

        self.q_proj = nn.Linear(dim, n_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(dim, n_kv_heads * head_dim, bias=False)
        self.out_proj = nn.Linear(n_heads * head_dim, dim, bias=False)

        self.rope = RoPE(self.head_dim, base=args.rope_theta, traditional=False)

    def forward(self, x, mask=None, cache=None):
        B, L, D = x.shape

        queries, keys, values = self.q_proj(x), self.k_proj(x), self.v_proj(x)

        queries = self.q_layernorm(queries.reshape(B, L, self.n_heads, -1)).transpose(1, 2)
        keys = self.k_layernorm(keys.reshape(B, L, self.n_kv_heads, -1)).transpose(1, 2)
        values = values.reshape(B, L, self.n_kv_heads, -1).transpose(1, 2)

        if cache is not None:
            queries = self.rope(queries, offset=cache.offset)
            keys = self.rope(keys, offset=cache.offset)
            keys, values = cache.update_and_fetch(keys, values)
        else:
            queries = self.rope(queries)
            keys = self.rope(keys)

        output = scaled_dot_product_attention(
            queries, keys, values, cache=cache, mask=mask, scale=self.scale
        )
        output = output.transpose(1, 2).reshape(B, L, -1)
        return self.out_proj(output)


class ShortConv(nn.Module):
    def __init__(self, args, layer_idx: int):
        super().__init__()
        self.args = args
        self.layer_idx = layer_idx
        self.L_cache = args.conv_L_cache
        self.bias = args.conv_bias
        self.causal = getattr(args, "conv_causal", True)

        self.conv = nn.Conv1d(
            in_channels=args.hidden_size,
            out_channels=args.hidden_size,
            kernel_size=self.L_cache,
            groups=args.hidden_size,
            bias=self.bias,
        )
        self.in_proj = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=self.bias)
        self.out_proj = nn.Linear(args.hidden_size, args.hidden_size, bias=self.bias)

    def forward(self, x, mask=None, cache=None):
        BCx = self.in_proj(x)
        B, C, x = torch.split(BCx, self.args.hidden_size, dim=-1)
        Bx = B * x
        if mask is not None:
            Bx = torch.where(mask[..., None], Bx, torch.zeros_like(Bx))

        if cache is not None:
            if cache[0] is None:
                state = torch.zeros(
                    (Bx.shape[0], self.L_cache - 1, self.args.hidden_size),
                    dtype=Bx.dtype,
                )
            else:
                state = cache[0]
            Bx = torch.cat([state, Bx], dim=1)
            n_keep = self.L_cache - 1
            t = x.shape[1]
            if cache.lengths is not None:
                ends = torch.clamp(cache.lengths, 0, t)
                positions = (ends[:, None] + torch.arange(n_keep))[..., None]
                cache[0] = torch.take_along_dim(
                    Bx, positions.expand(-1, -1, Bx.shape[-1]), dim=1
                )
            else:
                cache[0] = Bx[:, -n_keep:, :]
            cache.advance(t)
        elif self.causal:
            Bx = F.pad(Bx, (0, 0, self.L_cache - 1, 0))

        # mlx Conv1d is channels-last
        conv_out = self.conv(Bx.transpose(1, 2)).transpose(1, 2)

        y = C * conv_out
        return self.out_proj(y)


class MLP(nn.Module):
    def __init__(self, dim, ff_dim, multiple_of, auto_adjust_ff_dim, ffn_dim_multiplier):
        super().__init__()
        if auto_adjust_ff_dim:
            ff_dim = int(2 * ff_dim / 3)
            if ffn_dim_multiplier is not None:
                ff_dim = int(ffn_dim_multiplier * ff_dim)
            ff_dim = multiple_of * ((ff_dim + multiple_of - 1) // multiple_of)

        self.w1 = nn.Linear(dim, ff_dim, bias=False)
        self.w3 = nn.Linear(dim, ff_dim, bias=False)
        self.w2 = nn.Linear(ff_dim, dim, bias=False)

    def forward(self, x):
        return self.w2(swiglu(self.w1(x), self.w3(x)))


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, args, layer_idx: int):
        super().__init__()
        self.is_attention_layer = layer_idx in args.full_attn_idxs

        if self.is_attention_layer:
            self.self_attn = Attention(args)
        else:
            self.conv = ShortConv(args, layer_idx)
        self.feed_forward = MLP(
            dim=args.block_dim,
            ff_dim=args.block_ff_dim,
            multiple_of=args.block_multiple_of,
            auto_adjust_ff_dim=args.block_auto_adjust_ff_dim,
            ffn_dim_multiplier=args.block_ffn_dim_multiplier,
        )

        self.operator_norm = RMSNorm(args.hidden_size, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.hidden_size, eps=args.norm_eps)

    def forward(self, x, mask=None, cache=None):
        if self.is_attention_layer:
            r = self.self_attn(self.operator_norm(x), mask=mask, cache=cache)
        else:
            r = self.conv(self.operator_norm(x), mask=mask, cache=cache)
        h = x + r
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class Lfm2Model(nn.Module):
    def __init__(self, args):
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.num_hidden_layers = args.num_hidden_layers
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size)
        self.layers = nn.ModuleList(
            [Lfm2DecoderLayer(args, layer_idx=i) for i in range(args.num_hidden_layers)]
        )

        self.embedding_norm = RMSNorm(args.hidden_size, eps=args.norm_eps)

        self.fa_idx = args.full_attn_idxs[0]
        self.conv_idx = 0
        for i in range(args.num_hidden_layers):
            if i in args.full_attn_idxs:
                self.conv_idx += 1
            else:
                break

    def forward(self, inputs, cache=None, input_embeddings=None):
        if input_embeddings is not None:
            h = input_embeddings
        else:
            h = self.embed_tokens(inputs)

        if cache is None:
            cache = [None] * len(self.layers)

        attn_mask = create_attention_mask(h, cache[self.fa_idx])
        conv_mask = create_ssm_mask(h, cache[self.conv_idx])

        for layer, c in zip(self.layers, cache):
            mask = attn_mask if layer.is_attention_layer else conv_mask
            h = layer(h, mask, cache=c)

        return self.embedding_norm(h)


class LanguageModel(nn.Module):
    def __init__(self, args: ModelConfig):
        super().__init__()
        self.args = args
        self.model = Lfm2Model(args)
        if not args.tie_word_embeddings:
            self.lm_head = nn.Linear(args.hidden_size, args.vocab_size, bias=False)

    def forward(self, inputs=None, cache=None, inputs_embeds=None, **kwargs):
        out = self.model(inputs, cache, inputs_embeds)
        if self.args.tie_word_embeddings:
            out = out @ self.model.embed_tokens.weight.T
        else:
            out = self.lm_head(out)
        return out

    @property
    def layers(self):
        return self.model.layers

    def make_cache(self):
        return [
            KVCache() if layer.is_attention_layer else ArraysCache(size=1)
            for layer in self.layers
        ]


# --------------------------------------------------------------------------- generate/ar.py


def _make_cache(model, left_padding):
    def to_batch_cache(c):
        if isinstance(c, KVCache):
            return BatchKVCache(left_padding)
        elif isinstance(c, ArraysCache):
            c.left_padding = torch.tensor(left_padding)
            return c
        raise ValueError(f"{type(c)} does not yet support batching")

    return [to_batch_cache(c) for c in model.make_cache()]


def _right_pad_prompts(prompts, max_length=None):
    if max_length is None:
        max_length = max(len(p) for p in prompts)
    return torch.tensor([list(p) + [0] * (max_length - len(p)) for p in prompts])


def main():
    config = ModelConfig(
        model_type="lfm2",
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        norm_eps=1e-5,
        conv_bias=False,
        conv_L_cache=3,
        block_dim=32,
        block_ff_dim=96,
        block_multiple_of=16,
        block_ffn_dim_multiplier=None,
        block_auto_adjust_ff_dim=True,
        rope_theta=10000.0,
        layer_types=["conv", "full_attention", "conv", "full_attention"],
        tie_word_embeddings=False,
    )
    model = LanguageModel(config).eval()

    # Two requests of a mixed prefill: rows right-padded to the longest one.
    input_ids = [
        [5, 17, 33, 2, 41, 9, 28],
        [12, 7, 50, 3, 22, 61, 14, 38, 6, 19],
    ]
    lengths = [len(ids) for ids in input_ids]
    max_length = max(lengths)
    right_pad_per_row = [max_length - l for l in lengths]
    suffix_lens = list(lengths)
    prefill_step_size = 6
    max_tokens = 6

    left_padding = [0] * len(input_ids)
    padded = _right_pad_prompts(input_ids, max_length=max_length)
    prompt_cache = _make_cache(model, left_padding)
    for c in prompt_cache:
        c.prepare(right_padding=right_pad_per_row, lengths=suffix_lens)

    with torch.no_grad():
        # prompt_step: first chunk
        n = min(prefill_step_size, padded.shape[1] - 1)
        model(padded[:, :n], cache=prompt_cache)
        padded = padded[:, n:]

        # The batch's rows are filtered in a new order while the right padding is pending.
        keep = [1, 0]
        keep_arr = torch.tensor(keep, dtype=torch.int64)
        for c in prompt_cache:
            c.filter(keep_arr)
        padded = padded[keep_arr]
        right_pad_per_row = [right_pad_per_row[i] for i in keep]
        order = list(keep)

        # prompt_step: remaining chunks but the last column(s)
        while padded.shape[1] > prefill_step_size:
            n = min(prefill_step_size, padded.shape[1] - 1)
            model(padded[:, :n], cache=prompt_cache)
            padded = padded[:, n:]

        # generate(): last chunk, take each row's last real token, then finalize.
        logits = model(padded, cache=prompt_cache)
        seq = logits.shape[1]
        last_idx = torch.tensor([seq - 1 - p for p in right_pad_per_row])
        logits = logits[torch.arange(logits.shape[0]), last_idx]
        tokens = logits.argmax(-1)
        for c in prompt_cache:
            c.finalize()

        generated = [[t] for t in tokens.tolist()]
        last_logits = []
        for _ in range(max_tokens - 1):
            logits = model(tokens[:, None], cache=prompt_cache)[:, -1, :]
            last_logits = logits
            tokens = logits.argmax(-1)
            for i, t in enumerate(tokens.tolist()):
                generated[i].append(t)

    for row, uid in enumerate(order):
        print(f"request {uid}: prompt {input_ids[uid]} -> {generated[row]}")
    print("last decode logits (first 6 per row):")
    print(last_logits[:, :6])


if __name__ == "__main__":
    main()
