# Citation: foundation-model-stack/foundation-model-stack commit c55e59e58dfcaab5c5af4f7ff4d3a4dbc166ce3e
#   ("Mask needed adding"; parent 810d5fa3).
# Upstream: fms/modules/attention.py `_math_attention_with_sinks_op` (the "sdpa_with_sinks" op that
#   fms/models/gpt_oss.py uses: GptOssHeadless.forward hands every layer the same **attn_kwargs with
#   sliding_window=128 on even layers and 0 on the full-attention odd layers), `_sdpa_store_op`,
#   `_sdpa_update_attn_kwargs`, `MultiHeadAttention.forward`; fms/utils/generation.py `pad_input_ids`,
#   `__update_padding_kwargs`, `generate`. Shrunk: tiny dims, plain RoPE instead of the YaRN table,
#   a dense SwiGLU instead of the MoE feed-forward; the mask code paths are as upstream.
# Bug: the sinks op adds the sliding-window band to the mask with `mask += torch.tril(...)`. The
#   supplied float mask (pad_input_ids' 0/-inf mask) survives `.to(same dtype)`, the unsqueeze and
#   the full-width slice as a view of the caller's tensor, so the first sliding layer writes its
#   window into the mask every later layer (the full-attention ones included) and the decode rows
#   that __update_padding_kwargs derives from it receive.
# Fix: add out of place, `mask = mask + torch.tril(...)`.
import sys
import math
from typing import Any, MutableMapping, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

__type_factory_map: dict = {}


def register_attention_op(attn_type, store_op, compute_op, is_prefill_op=None,
                          compute_decode_op=None, update_attn_kwargs_op=None):
    if compute_decode_op is None:
        compute_decode_op = compute_op
    __type_factory_map[attn_type] = {
        "store": store_op,
        "is_prefill": (lambda **_: True) if is_prefill_op is None else is_prefill_op,
        "compute_prefill": compute_op,
        "compute_decode": compute_decode_op,
        "update_attn_kwargs": (lambda **kw: kw) if update_attn_kwargs_op is None else update_attn_kwargs_op,
    }


def get_attention_type(**attn_kwargs):
    return __type_factory_map[attn_kwargs.get("attn_name", "sdpa_causal")]


def _sdpa_store_op(keys, values, key_cache, value_cache, **attn_kwargs):
    keys = keys.transpose(2, 1)
    values = values.transpose(2, 1)
    if key_cache is not None and value_cache is not None and value_cache.numel() > 0:
        sliding_window = attn_kwargs.get("sliding_window", 0)
        if sliding_window != 0:
            sliding_window *= -1
            sliding_window += keys.shape[2]
        key_cache_result = torch.cat((key_cache[:, :, sliding_window:, :], keys), dim=2)
        value_cache_result = torch.cat((value_cache[:, :, sliding_window:, :], values), dim=2)
        return key_cache_result, value_cache_result, key_cache_result, value_cache_result
    return keys, values, keys, values


def _math_attention_with_sinks_op(query, key_cache, value_cache, nheads, kvheads, p_dropout,
                                  scale_factor, **attn_kwargs):
    queries = query.transpose(2, 1)
    if key_cache.shape[1] != kvheads and key_cache.shape[2] == kvheads:
        key_cache = key_cache.transpose(2, 1)
        value_cache = value_cache.transpose(2, 1)

    expansion = nheads // kvheads
    if expansion != 1:
        keys_e = key_cache.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
        values_e = value_cache.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
    else:
        keys_e, values_e = key_cache, value_cache

    attn_sinks = attn_kwargs.get("sinks")
    sliding_window = attn_kwargs.get("sliding_window", 0)
    mask = attn_kwargs.get("mask")

    # https://github.com/openai/gpt-oss/blob/main/gpt_oss/torch/model.py#L153
    batch, n_heads, n_tokens, d_head = queries.shape
    kv_tokens = keys_e.shape[2]
    S = attn_sinks.reshape(1, -1, 1, 1).expand(batch, -1, n_tokens, -1)

    if mask is not None:
        while len(mask.size()) < 4:  # expects bs (x nheads) x q_len x kv_len
            mask = mask.unsqueeze(1)
        if mask.dtype == torch.bool:
            mask = torch.where(mask.logical_not(), -torch.inf, 0.0)
        mask = mask.to(dtype=queries.dtype)
        # truncate for sliding window kv_cache
        mask = mask[..., -n_tokens:, -kv_tokens:]
    else:
        mask = torch.triu(
            queries.new_full((n_tokens, kv_tokens), -torch.inf),
            diagonal=1 + (kv_tokens - n_tokens),
        )

    if 0 < sliding_window < kv_tokens:
        if FIXED:
            mask = mask + torch.tril(
                mask.new_full((n_tokens, kv_tokens), -torch.inf),
                diagonal=(kv_tokens - n_tokens) - sliding_window,
            )
        else:
            mask += torch.tril(
                mask.new_full((n_tokens, kv_tokens), -torch.inf),
                diagonal=(kv_tokens - n_tokens) - sliding_window,
            )
    QK = torch.einsum("bhqd,bhkd->bhqk", queries, keys_e)
    if scale_factor is None:
        scale_factor = 1.0 / math.sqrt(d_head)
    QK *= scale_factor
    QK += mask
    QK = torch.cat([QK, S], dim=-1)
    QK = QK - QK.max(dim=-1, keepdim=True).values
    W = torch.softmax(QK, dim=-1)
    W = W[..., :-1]  # drop the attention sinks after done
    attn = torch.matmul(W, values_e)
    return attn.transpose(2, 1).contiguous()


def _sdpa_update_attn_kwargs(**attn_kwargs):
    mask = attn_kwargs.get("mask", None)
    if mask is not None:
        mask = mask[:, -1:, :]
        mask = torch.cat((mask, torch.zeros(mask.size(0), 1, 1, device=mask.device)), dim=2)
        attn_kwargs["mask"] = mask
    return attn_kwargs


register_attention_op("sdpa_with_sinks", _sdpa_store_op, _math_attention_with_sinks_op,
                      update_attn_kwargs_op=_sdpa_update_attn_kwargs)


class RotaryEmbedding:
    def __init__(self, dim, ratio=150000.0):
        self.inv = 1.0 / (ratio ** (torch.arange(0, dim, 2).float() / dim))

    def adjusted_qk(self, q, k, position_ids, past_kv_state=None, use_cache=False):
        ang = position_ids.float()[..., None] * self.inv  # b x l x d/2
        cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]

        def rot(x):
            x1, x2 = x[..., ::2], x[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)

        return rot(q), rot(k)


class MultiHeadAttention(nn.Module):
    def __init__(self, emb_dim, emb_kq, emb_v, nheads, kvheads, position_encoder, has_sinks=True):
        super().__init__()
        self.nheads, self.kvheads = nheads, kvheads
        self.emb_kq_per_head, self.emb_v_per_head = emb_kq, emb_v
        self.query = nn.Linear(emb_dim, nheads * emb_kq)
        self.key = nn.Linear(emb_dim, kvheads * emb_kq)
        self.value = nn.Linear(emb_dim, kvheads * emb_v)
        self.dense = nn.Linear(nheads * emb_v, emb_dim)
        self.position_encoder = position_encoder
        self.has_sinks = has_sinks
        self.sinks = nn.Parameter(torch.randn(nheads))
        self.scale_factor = None
        self.p_dropout = 0.0

    def forward(self, q, position_ids=None, past_key_value_state=None, use_cache=False,
                sliding_window: Optional[int] = 0, **attn_kwargs):
        batch_size, q_len, _ = q.size()
        queries = self.query(q).view(batch_size, q_len, self.nheads, self.emb_kq_per_head)
        keys = self.key(q).view(batch_size, q_len, self.kvheads, self.emb_kq_per_head)
        values = self.value(q).view(batch_size, q_len, self.kvheads, self.emb_v_per_head)
        queries, keys = self.position_encoder.adjusted_qk(queries, keys, position_ids, past_key_value_state, use_cache)

        attn_compute_dict = get_attention_type(**attn_kwargs)
        if use_cache:
            if past_key_value_state is None:
                past_key_value_state = (None, None)
            keys_compute, values_compute, keys_return, values_return = attn_compute_dict["store"](
                keys, values, past_key_value_state[0], past_key_value_state[1],
                **attn_kwargs, sliding_window=sliding_window,
            )
        else:
            keys_compute, values_compute = keys, values

        if self.has_sinks:
            updated_attn_kwargs = {"sinks": self.sinks, "sliding_window": sliding_window, **attn_kwargs}
        else:
            updated_attn_kwargs = attn_kwargs
        attn = attn_compute_dict["compute_prefill"](
            queries, keys_compute, values_compute, self.nheads, self.kvheads, 0.0,
            self.scale_factor, **updated_attn_kwargs,
        )
        out = self.dense(attn.view(batch_size, q_len, self.nheads * self.emb_v_per_head))
        if use_cache:
            return out, (keys_return, values_return)
        return out


class GptOssConfig:
    src_vocab_size = 128
    emb_dim = 32
    head_dim = 8
    nheads = 4
    kvheads = 2
    nlayers = 4
    layer_types = [f"{'sliding' if i % 2 == 0 else 'full'}_attention" for i in range(4)]


class GptOssBlock(nn.Module):
    def __init__(self, config, layer_sliding_window, rotary_emb):
        super().__init__()
        self.layer_sliding_window = layer_sliding_window
        self.ln = nn.RMSNorm(config.emb_dim, eps=1e-5)
        self.ff_ln = nn.RMSNorm(config.emb_dim, eps=1e-5)
        self.attn = MultiHeadAttention(config.emb_dim, config.head_dim, config.head_dim, config.nheads,
                                       config.kvheads, rotary_emb, has_sinks=True)
        self.w1 = nn.Linear(config.emb_dim, 2 * 64)
        self.w2 = nn.Linear(64, config.emb_dim)

    def forward(self, x, *, position_ids=None, past_key_value_state=None, use_cache=False, **attn_kwargs):
        attn_kwargs["attn_name"] = attn_kwargs.get("attn_name", "sdpa_with_sinks")
        residual = x
        x = self.attn(self.ln(x), position_ids=position_ids, past_key_value_state=past_key_value_state,
                      use_cache=use_cache, **attn_kwargs)
        cache = None
        if use_cache:
            x, cache = x
        x = x + residual
        residual = x
        g, u = self.w1(self.ff_ln(x)).chunk(2, dim=-1)
        x = self.w2(F.silu(g) * u) + residual
        return (x, cache) if use_cache else x


class GptOssHeadless(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.src_vocab_size, config.emb_dim)
        self.rot_emb = RotaryEmbedding(config.head_dim)
        layers = []
        for i in range(config.nlayers):
            layer_sliding_window = 128
            if config.layer_types[i] == "full_attention":
                layer_sliding_window = 0
            layers.append(GptOssBlock(config, layer_sliding_window, self.rot_emb))
        self.layers = nn.ModuleList(layers)
        self.dec_norm = nn.RMSNorm(config.emb_dim, eps=1e-5)

    def forward(self, x_in, position_ids=None, past_key_value_states=None, use_cache=False, **attn_kwargs):
        attn_kwargs["attn_name"] = attn_kwargs.get("attn_name", "sdpa_with_sinks")
        if past_key_value_states is None or len(past_key_value_states) == 0:
            past_key_value_states = [None for _ in range(len(self.layers))]
        x_in = self.embedding(x_in)
        present_key_value_states = []
        for i, layer in enumerate(self.layers):
            output = layer(x=x_in, position_ids=position_ids, past_key_value_state=past_key_value_states[i],
                           use_cache=use_cache, sliding_window=layer.layer_sliding_window, **attn_kwargs)
            if use_cache:
                x_in, present = output
                present_key_value_states.append(present)
            else:
                x_in = output
        return self.dec_norm(x_in), present_key_value_states


class GptOss(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.base_model = GptOssHeadless(config)
        self.head = nn.Linear(config.emb_dim, config.src_vocab_size, bias=False)

    def forward(self, x, position_ids=None, past_key_value_states=None, use_cache=False,
                only_last_token=False, **attn_kwargs):
        output, cache = self.base_model(x, position_ids, past_key_value_states, use_cache, **attn_kwargs)
        if only_last_token:
            output = output[:, -1, :]
        preds = self.head(output)
        return (preds, cache) if use_cache else preds


# ---------------------------------------------------------------- fms/utils/generation.py
def pad_input_ids(input_ids_list, min_pad_length=0, is_causal_mask=True, padding_side="left",
                  position_ids_offset=0, pad_token_id=0):
    max_len = max([min_pad_length] + [seq.size(0) for seq in input_ids_list])
    padded_input_ids_list, mask_list, position_ids_list = [], [], []
    for input_ids_i in input_ids_list:
        seq_len = input_ids_i.size(0)
        pads = torch.full((max_len - seq_len,), pad_token_id, dtype=torch.long)
        non_pads = torch.ones(seq_len, dtype=torch.bool)
        pos_ids_pads = torch.zeros(max_len - seq_len, dtype=torch.long)
        pos_ids_seq = torch.arange(0, seq_len, dtype=torch.long)
        padded_input_ids_list.append(torch.cat((pads, input_ids_i)))
        mask_list.append(torch.cat((pads.bool(), non_pads)))
        position_ids_list.append(torch.cat((pos_ids_pads, pos_ids_seq)))
    input_ids = torch.stack(padded_input_ids_list)
    padding_kwargs = {}
    mask = torch.stack(mask_list)
    mask = mask.unsqueeze(-1) == mask.unsqueeze(-2)
    if is_causal_mask:
        mask = mask.tril()
    mask = torch.where(mask.logical_not(), -torch.inf, 0.0)
    padding_kwargs["mask"] = mask
    position_ids = torch.stack(position_ids_list)
    position_ids += position_ids_offset
    padding_kwargs["position_ids"] = position_ids
    return input_ids, padding_kwargs


def __update_padding_kwargs(use_cache, model_specific_kwargs):
    attn_op = get_attention_type(**model_specific_kwargs)
    if "update_attn_kwargs" in attn_op:
        model_specific_kwargs = attn_op["update_attn_kwargs"](**model_specific_kwargs)
    position_ids = model_specific_kwargs.get("position_ids", None)
    if position_ids is not None:
        if use_cache:
            position_ids = position_ids[:, -1:] + 1
        else:
            position_ids = torch.cat((position_ids, position_ids[:, -1:] + 1), dim=1)
        model_specific_kwargs["position_ids"] = position_ids
    return model_specific_kwargs


def generate(model, input_ids, max_seq_len=4096, max_new_tokens=256, do_sample=False, use_cache=False,
             extra_kwargs: Optional[MutableMapping[str, Any]] = None):
    kwargs: MutableMapping[str, Any] = dict()
    if extra_kwargs is not None:
        kwargs.update(extra_kwargs)
    result = input_ids
    next_input = input_ids
    kwargs["past_key_value_states"] = None
    kwargs["use_cache"] = use_cache
    last_logits = None
    for i in range(max_new_tokens):
        input_ids = next_input[:, -max_seq_len:]
        if i > 0:
            kwargs = __update_padding_kwargs(use_cache, kwargs)
        output = model(input_ids, **kwargs)
        if use_cache:
            logits, past_key_value_states = output
            kwargs["past_key_value_states"] = past_key_value_states
        else:
            logits = output
        logits = logits[:, -1, :]
        last_logits = logits
        next_val = torch.argmax(logits, dim=-1).unsqueeze(0).t()
        result = torch.cat((result, next_val), dim=-1)
        next_input = next_val if use_cache else result
    return result, last_logits


def main():
    config = GptOssConfig()
    model = GptOss(config).eval()
    # two prompts longer than the sliding layers' 128-token window, left-padded to one rectangle
    prompts = [torch.randint(1, config.src_vocab_size, (150,)), torch.randint(1, config.src_vocab_size, (136,))]
    input_ids, padding_kwargs = pad_input_ids(prompts, pad_token_id=0)
    with torch.no_grad():
        result, last_logits = generate(
            model, input_ids, max_new_tokens=8, do_sample=False, use_cache=True,
            extra_kwargs={**padding_kwargs, "attn_name": "sdpa_with_sinks"},
        )
    for b, p in enumerate(prompts):
        print(f"seq {b}: prompt_len={len(p)} generated={result[b, input_ids.shape[1]:].tolist()}")
    print("last-step logits (first 5) row 0:", [round(x, 4) for x in last_logits[0, :5].tolist()])
    print("last-step logits (first 5) row 1:", [round(x, 4) for x in last_logits[1, :5].tolist()])


if __name__ == "__main__":
    main()
