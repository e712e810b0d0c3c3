"""Correct program (quiet batch quiet-r89b).

Ported from tomaarsen/attention_sinks (adapted by its author from mit-han-lab/streaming-llm):
attention_sinks/attention_sink_kv_cache.py @1cc9a811bc16ff1e5c011167870b09a0bc0ef592 (AttentionSinkKVCache:
keep `attention_sink_size` first keys plus the last `attention_sink_window_size`), attention_sinks/models/gpt_neox/
pos_shift.py @4be38315c51e6513f6aae973893057b4073d375c (gpt_neox_pos_shift_attention_forward: keys cached
*unrotated*, re-rotated at positions 0..len(cache)-1 every step, queries rotated at their position_ids) and
attention_sinks/inject_mixin.py @0ecf9b30 (the model's forward wrapped so the returned past_key_values pass through
the sink cache).  The GPT-NeoX layer around it (fused query_key_value, partial rotary over `rotary_ndims`, the
causal `bias` buffer sliced by key_length - query_length in `_attn`, parallel residual, position_ids =
arange(past_length, past_length + seq_length)) follows transformers 4.34's modeling_gpt_neox.py, which the
project patched; it is written out here because today's transformers no longer has that layout.

The use: the project's "endless generation" demo, greedy decoding of one stream far past the cache size (sink 2 +
window 5 = 7 slots, 6 prompt tokens, 14 new tokens).  Self-check: a reference that processes the stream one token
at a time with plain Python lists, token t attending to the kept earlier tokens (all if at most 7, else the first
2 and the last 5) plus itself, with rotary positions equal to their index in that list, scores written as a double
loop; every step's logits and the greedy tokens must match.
"""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


# ------------------------------------------------------------ attention_sinks/attention_sink_kv_cache.py
def slice2d(x, start, end):
    return x[:, :, start:end, ...]


def slice3d(x, start, end):
    return x[:, :, :, start:end, ...]


def slice1d(x, start, end):
    return x[:, start:end, ...]


DIM_TO_SLICE = {
    1: slice1d,
    2: slice2d,
    3: slice3d,
}


@dataclass
class AttentionSinkKVCache:
    attention_sink_size: int = 4
    attention_sink_window_size: int = 1020
    k_seq_dim: int = 2
    v_seq_dim: int = 2

    def __post_init__(self):
        self.cache_size = self.attention_sink_size + self.attention_sink_window_size
        self.k_slice = DIM_TO_SLICE[self.k_seq_dim]
        self.v_slice = DIM_TO_SLICE[self.v_seq_dim]

    def __call__(self, past_key_values):
        if past_key_values is None:
            return None
        seq_len = past_key_values[0][0].size(self.k_seq_dim)
        if seq_len <= self.cache_size:
            return past_key_values
        return [
            [
                torch.cat(
                    [
                        self.k_slice(k, 0, self.attention_sink_size),
                        self.k_slice(k, seq_len - self.attention_sink_window_size, seq_len),
                    ],
                    dim=self.k_seq_dim,
                ),
                torch.cat(
                    [
                        self.v_slice(v, 0, self.attention_sink_size),
                        self.v_slice(v, seq_len - self.attention_sink_window_size, seq_len),
                    ],
                    dim=self.v_seq_dim,
                ),
            ]
            for k, v in past_key_values
        ]


# ------------------------------------------------------------ GPT-NeoX (transformers 4.34 layout)
@dataclass
class GPTNeoXConfig:
    vocab_size: int = 83
    hidden_size: int = 32
    num_hidden_layers: int = 3
    num_attention_heads: int = 4
    intermediate_size: int = 64
    rotary_pct: float = 0.5
    rotary_emb_base: int = 10000
    max_position_embeddings: int = 64
    layer_norm_eps: float = 1e-5
    use_parallel_residual: bool = True


def rotate_half(x):
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


class GPTNeoXRotaryEmbedding(nn.Module):
    def __init__(self, dim, max_position_embeddings, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)
        t = torch.arange(max_position_embeddings, dtype=torch.float32)
        freqs = torch.einsum("i,j->ij", t, inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cached = emb.cos()[None, None, :, :]
        self.sin_cached = emb.sin()[None, None, :, :]

    def forward(self, x, seq_len=None):
        return self.cos_cached[:, :, :seq_len, ...].to(x.device), self.sin_cached[:, :, :seq_len, ...].to(x.device)


def apply_rotary_pos_emb_single(x, cos, sin, position_ids):
    gather_indices = position_ids[:, None, :, None]  # [bs, 1, seq_len, 1]
    gather_indices = gather_indices.repeat(1, cos.shape[1], 1, cos.shape[3])
    cos = torch.gather(cos.repeat(gather_indices.shape[0], 1, 1, 1), 2, gather_indices)
    sin = torch.gather(sin.repeat(gather_indices.shape[0], 1, 1, 1), 2, gather_indices)
    x_embed = (x * cos) + (rotate_half(x) * sin)
    return x_embed


class GPTNeoXAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_attention_heads = config.num_attention_heads
        self.hidden_size = config.hidden_size
        self.head_size = self.hidden_size // self.num_attention_heads
        self.rotary_ndims = int(self.head_size * config.rotary_pct)
        max_positions = config.max_position_embeddings
        self.register_buffer(
            "bias",
            torch.tril(torch.ones((max_positions, max_positions), dtype=torch.bool)).view(
                1, 1, max_positions, max_positions
            ),
            persistent=False,
        )
        self.rotary_emb = GPTNeoXRotaryEmbedding(self.rotary_ndims, config.max_position_embeddings, base=config.rotary_emb_base)
        self.norm_factor = self.head_size ** -0.5
        self.query_key_value = nn.Linear(config.hidden_size, 3 * config.hidden_size)
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)

    def _split_heads(self, tensor, num_attention_heads, attn_head_size):
        new_shape = tensor.size()[:-1] + (num_attention_heads, attn_head_size)
        return tensor.view(new_shape).permute(0, 2, 1, 3)

    def _merge_heads(self, tensor, num_attention_heads, attn_head_size):
        tensor = tensor.permute(0, 2, 1, 3).contiguous()
        return tensor.view(tensor.size(0), tensor.size(1), num_attention_heads * attn_head_size)

    def _attn(self, query, key, value, attention_mask=None, head_mask=None):
        batch_size, num_attention_heads, query_length, attn_head_size = query.size()
        key_length = key.size(-2)

        causal_mask = self.bias[:, :, key_length - query_length : key_length, :key_length]

        query = query.view(batch_size * num_attention_heads, query_length, attn_head_size)
        key = key.view(batch_size * num_attention_heads, key_length, attn_head_size)
        attn_scores = torch.zeros(
            batch_size * num_attention_heads, query_length, key_length, dtype=query.dtype, device=key.device
        )
        attn_scores = torch.baddbmm(attn_scores, query, key.transpose(1, 2), beta=1.0, alpha=self.norm_factor)
        attn_scores = attn_scores.view(batch_size, num_attention_heads, query_length, key_length)

        mask_value = torch.finfo(attn_scores.dtype).min
        mask_value = torch.tensor(mask_value, dtype=attn_scores.dtype).to(attn_scores.device)
        attn_scores = torch.where(causal_mask, attn_scores, mask_value)

        if attention_mask is not None:
            attn_scores = attn_scores + attention_mask

        attn_weights = nn.functional.softmax(attn_scores, dim=-1)
        attn_weights = attn_weights.to(value.dtype)
        if head_mask is not None:
            attn_weights = attn_weights * head_mask
        attn_output = torch.matmul(attn_weights, value)
        return attn_output, attn_weights


# attention_sinks/models/gpt_neox/pos_shift.py
def gpt_neox_pos_shift_attention_forward(
    self,
    hidden_states: torch.FloatTensor,
    attention_mask: torch.FloatTensor,
    position_ids: torch.LongTensor,
    head_mask: Optional[torch.FloatTensor] = None,
    layer_past: Optional[Tuple[torch.Tensor]] = None,
    use_cache: Optional[bool] = False,
    output_attentions: Optional[bool] = False,
):
    has_layer_past = layer_past is not None

    qkv = self.query_key_value(hidden_states)
    new_qkv_shape = qkv.size()[:-1] + (self.num_attention_heads, 3 * self.head_size)
    qkv = qkv.view(*new_qkv_shape)

    query = qkv[..., : self.head_size].permute(0, 2, 1, 3)
    key = qkv[..., self.head_size : 2 * self.head_size].permute(0, 2, 1, 3)
    value = qkv[..., 2 * self.head_size :].permute(0, 2, 1, 3)

    query_rot = query[..., : self.rotary_ndims]
    query_pass = query[..., self.rotary_ndims :]

    # Compute token offset for rotary embeddings (when decoding)
    seq_len = key.shape[-2]
    if has_layer_past:
        seq_len += layer_past[0].shape[-2]
    cos, sin = self.rotary_emb(value, seq_len=seq_len)
    query = apply_rotary_pos_emb_single(query_rot, cos, sin, position_ids)
    query = torch.cat((query, query_pass), dim=-1)

    # Cache QKV values
    if has_layer_past:
        past_key = layer_past[0]
        past_value = layer_past[1]
        key = torch.cat((past_key, key), dim=-2)
        value = torch.cat((past_value, value), dim=-2)

    present = (key, value) if use_cache else None

    key_rot = key[..., : self.rotary_ndims]
    key_pass = key[..., self.rotary_ndims :]
    key_position_ids = torch.arange(seq_len, device=position_ids.device).unsqueeze(0)
    key = apply_rotary_pos_emb_single(key_rot, cos, sin, key_position_ids)
    key = torch.cat((key, key_pass), dim=-1)

    attn_output, attn_weights = self._attn(query, key, value, attention_mask, head_mask)

    attn_output = self._merge_heads(attn_output, self.num_attention_heads, self.head_size)
    attn_output = self.dense(attn_output)

    outputs = (attn_output, present)
    if output_attentions:
        outputs += (attn_weights,)
    return outputs


GPTNeoXAttention.forward = gpt_neox_pos_shift_attention_forward  # enable_gpt_neox_pos_shift_attention


class GPTNeoXMLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense_h_to_4h = nn.Linear(config.hidden_size, config.intermediate_size)
        self.dense_4h_to_h = nn.Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden_states):
        return self.dense_4h_to_h(F.gelu(self.dense_h_to_4h(hidden_states)))


class GPTNeoXLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.use_parallel_residual = config.use_parallel_residual
        self.input_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.post_attention_layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = GPTNeoXAttention(config)
        self.mlp = GPTNeoXMLP(config)

    def forward(self, hidden_states, attention_mask=None, position_ids=None, layer_past=None, use_cache=False):
        attention_layer_outputs = self.attention(
            self.input_layernorm(hidden_states),
            attention_mask=attention_mask,
            position_ids=position_ids,
            layer_past=layer_past,
            use_cache=use_cache,
        )
        attn_output = attention_layer_outputs[0]
        mlp_output = self.mlp(self.post_attention_layernorm(hidden_states))
        hidden_states = mlp_output + attn_output + hidden_states
        return hidden_states, attention_layer_outputs[1]


@dataclass
class BaseModelOutputWithPast:
    last_hidden_state: torch.Tensor
    past_key_values: Optional[list] = None


class GPTNeoXModel(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_in = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList([GPTNeoXLayer(config) for _ in range(config.num_hidden_layers)])
        self.final_layer_norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids, past_key_values=None, attention_mask=None, position_ids=None, use_cache=True):
        batch_size, seq_length = input_ids.shape
        if past_key_values is None:
            past_length = 0
            past_key_values = tuple([None] * self.config.num_hidden_layers)
        else:
            past_length = past_key_values[0][0].size(-2)
        if position_ids is None:
            position_ids = torch.arange(past_length, seq_length + past_length, dtype=torch.long)
            position_ids = position_ids.unsqueeze(0).view(-1, seq_length)
        if attention_mask is not None:
            attention_mask = attention_mask.view(batch_size, -1)
            attention_mask = attention_mask[:, None, None, :]
            attention_mask = (1.0 - attention_mask.float()) * torch.finfo(torch.float32).min

        hidden_states = self.embed_in(input_ids)
        presents = () if use_cache else None
        for layer, layer_past in zip(self.layers, past_key_values):
            hidden_states, present = layer(
                hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                layer_past=layer_past, use_cache=use_cache,
            )
            if use_cache:
                presents = presents + (present,)
        hidden_states = self.final_layer_norm(hidden_states)
        return BaseModelOutputWithPast(last_hidden_state=hidden_states, past_key_values=presents)


def inject_attention_sink_kv_cache(module, **attention_sink_kwargs):
    """inject_mixin._inject_attention_sink_kv_cache: wrap GPTNeoXModel.forward."""
    attention_sink_kwargs["k_seq_dim"], attention_sink_kwargs["v_seq_dim"] = (2, 2)
    module.attention_sink_kv_cache = AttentionSinkKVCache(**attention_sink_kwargs)
    old_forward = module.forward

    def wrapped_forward(*args, **kwargs):
        outputs = old_forward(*args, **kwargs)
        outputs.past_key_values = module.attention_sink_kv_cache(outputs.past_key_values)
        return outputs

    module.forward = wrapped_forward


class GPTNeoXForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gpt_neox = GPTNeoXModel(config)
        self.embed_out = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def forward(self, input_ids, past_key_values=None, attention_mask=None):
        outputs = self.gpt_neox(input_ids, past_key_values=past_key_values, attention_mask=attention_mask)
        return self.embed_out(outputs.last_hidden_state), outputs.past_key_values


# ------------------------------------------------------------ the project's endless-generation use
SINK, WINDOW = 2, 5
PROMPT_LEN, NEW = 6, 14


@torch.no_grad()
def stream_generate(model, input_ids):
    """A greedy loop standing in for model.generate in the project's demo: the attention mask covers the cache + 1."""
    past_key_values = None
    ids = input_ids
    step_logits, tokens = [], []
    for _ in range(NEW):
        cache_len = 0 if past_key_values is None else past_key_values[0][0].size(-2)
        attention_mask = torch.ones(1, cache_len + ids.shape[1], dtype=torch.long)
        logits, past_key_values = model(ids, past_key_values=past_key_values, attention_mask=attention_mask)
        assert past_key_values[0][0].size(-2) <= SINK + WINDOW
        nxt = logits[:, -1].argmax(-1, keepdim=True)
        step_logits.append(logits[0, -1])
        tokens.append(nxt.item())
        ids = nxt
    return tokens, torch.stack(step_logits)


@torch.no_grad()
def reference_generate(model, prompt):
    """Token by token, lists of unrotated keys/values per layer, attention as a double loop."""
    cfg = GPTNeoXConfig()
    nh, hs = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    rd = int(hs * cfg.rotary_pct)
    inv_freq = 1.0 / (cfg.rotary_emb_base ** (torch.arange(0, rd, 2).float() / rd))

    def rope(x, pos):  # x: (rd,)
        ang = pos * inv_freq
        c, s = torch.cat([ang, ang]).cos(), torch.cat([ang, ang]).sin()
        return x * c + rotate_half(x) * s

    blocks = model.gpt_neox.layers
    K = [[] for _ in blocks]  # K[l][t]: (nh, hs) unrotated key of token t
    V = [[] for _ in blocks]
    stream = list(prompt)
    step_logits, out_tokens = [], []
    t = 0
    while len(out_tokens) < NEW:
        prior = list(range(t))
        if len(prior) > SINK + WINDOW:
            prior = prior[:SINK] + prior[-WINDOW:]
        keep = prior + [t]
        qpos = len(prior)
        h = model.gpt_neox.embed_in(torch.tensor([stream[t]]))[0]
        for l, blk in enumerate(blocks):
            att = blk.attention
            qkv = att.query_key_value(blk.input_layernorm(h)).view(nh, 3 * hs)
            q, k, v = qkv[:, :hs], qkv[:, hs : 2 * hs], qkv[:, 2 * hs :]
            K[l].append(k)
            V[l].append(v)
            o = torch.zeros(nh, hs)
            for head in range(nh):
                qh = torch.cat([rope(q[head, :rd], qpos), q[head, rd:]])
                scores = []
                for slot, j in enumerate(keep):
                    kj = K[l][j][head]
                    kj = torch.cat([rope(kj[:rd], slot), kj[rd:]])
                    scores.append((qh * kj).sum() * hs ** -0.5)
                p = torch.softmax(torch.stack(scores), 0)
                o[head] = sum(p[n] * V[l][j][head] for n, j in enumerate(keep))
            h = h + att.dense(o.reshape(-1)) + blk.mlp(blk.post_attention_layernorm(h))
        logits = model.embed_out(model.gpt_neox.final_layer_norm(h))
        if t >= len(prompt) - 1:
            step_logits.append(logits)
            nxt = int(logits.argmax())
            out_tokens.append(nxt)
            stream.append(nxt)
        t += 1
    return out_tokens, torch.stack(step_logits)


def main():
    torch.manual_seed(0)
    config = GPTNeoXConfig()
    model = GPTNeoXForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3)
    inject_attention_sink_kv_cache(model.gpt_neox, attention_sink_size=SINK, attention_sink_window_size=WINDOW)

    prompt = torch.randint(0, config.vocab_size, (PROMPT_LEN,)).tolist()
    tokens, logits = stream_generate(model, torch.tensor([prompt]))
    ref_tokens, ref_logits = reference_generate(model, prompt)
    err = (logits - ref_logits).abs().max().item()
    print("generated:", tokens)
    print("reference:", ref_tokens, f"max|dlogit|={err:.1e}")
    assert tokens == ref_tokens
    assert err < 1e-4
    assert PROMPT_LEN + NEW > 2 * (SINK + WINDOW)  # the cache evicted many times
    print("ok")


if __name__ == "__main__":
    main()
