# foundation-model-stack/foundation-model-stack commit 09380a97 ("Fix attention batch mask"), fms/modules/attention.py.
#
# fms runs GPT-OSS through its "sdpa_with_sinks" attention op (_sdpa_store_op + _math_attention_with_sinks_op, ported
# from openai/gpt-oss). Batched generation goes through fms.utils.generation: pad_input_ids() left-pads the prompts and
# returns padding kwargs (a 3-D additive `mask` and per-row `position_ids`), generate() hands them to the model and
# extends them after each step. Before the fix, _math_attention_with_sinks_op never read attn_kwargs["mask"]: it built
# its own `triu((n_tokens, n_tokens))` causal mask, so in prefill the real tokens of a shorter prompt attend the left
# pads, and in decode (n_tokens == 1) the mask is a single 0 and the new token attends every cached pad slot. The fix
# reads the mask (bool -> -inf, sliced to the last n_tokens x kv_tokens), falls back to a causal (n_tokens, kv_tokens)
# triangle only without one, registers _sdpa_update_attn_kwargs for the op, and trims the cache to the window.
# Trimmed: the MoE feed-forward is a single dense MLP; YaRN rotary is plain rotary on position_ids.
import math
import sys
from typing import Any, List, MutableMapping, Optional, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

# ---------------------------------------------------------------- fms/modules/attention.py
__type_factory_map: dict = {}


def register_attention_op(attn_type, store_op, compute_op, is_prefill_op=None, compute_decode_op=None,
                          update_attn_kwargs_op=None, validate_attn_kwargs_op=None):
    if compute_decode_op is None:
        compute_decode_op = compute_op
    __type_factory_map[attn_type] = {
        "store": store_op,
        "is_prefill": (lambda **_: True) if is_prefill_op is None else is_prefill_op,
        "compute_prefill": compute_op,
        "compute_decode": compute_decode_op,
        "update_attn_kwargs": (lambda **attn_kwargs: attn_kwargs)
        if update_attn_kwargs_op is None
        else update_attn_kwargs_op,
        "validate_attn_kwargs": (lambda **_: None)
        if validate_attn_kwargs_op is None
        else validate_attn_kwargs_op,
    }


def _sdpa_store_op(keys, values, key_cache, value_cache, **attn_kwargs):
    keys = keys.transpose(2, 1)
    values = values.transpose(2, 1)

    if key_cache is not None and value_cache is not None and value_cache.numel() > 0:
        if FIXED:
            sliding_window = attn_kwargs.get("sliding_window", 0)
            if sliding_window != 0:
                sliding_window *= -1
                sliding_window += 1
            key_cache_result = torch.cat((key_cache[:, :, sliding_window:, :], keys), dim=2)
            value_cache_result = torch.cat((value_cache[:, :, sliding_window:, :], values), dim=2)
        else:
            key_cache_result = torch.cat((key_cache, keys), dim=2)
            value_cache_result = torch.cat((value_cache, values), dim=2)
        return (key_cache_result, value_cache_result, key_cache_result, value_cache_result)
    else:
        return (keys, values, keys, values)


def _math_attention_with_sinks_op(query, key_cache, value_cache, nheads, kvheads, p_dropout, scale_factor,
                                  **attn_kwargs):
    queries = query.transpose(2, 1)

    if key_cache.shape[1] != kvheads and key_cache.shape[2] == kvheads:
        key_cache = key_cache.transpose(2, 1)
        value_cache = value_cache.transpose(2, 1)

    # Expand kv so black-box attn will work
    expansion = nheads // kvheads
    # k/v: b h l d
    if expansion != 1:
        keys_e = key_cache.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
        values_e = value_cache.unsqueeze(2).expand(-1, -1, expansion, -1, -1).flatten(1, 2)
    else:
        keys_e = key_cache
        values_e = value_cache

    attn_sinks = attn_kwargs.get("sinks", None)
    # https://github.com/openai/gpt-oss/blob/main/gpt_oss/torch/model.py#L153
    batch, n_heads, n_tokens, d_head = queries.shape
    S = attn_sinks.reshape(1, -1, 1, 1).expand(batch, -1, n_tokens, -1)

    if FIXED:
        sliding_window = attn_kwargs.get("sliding_window", 0)
        mask = attn_kwargs.get("mask", None)
        kv_tokens = keys_e.shape[2]
        if mask is not None:
            # Our expected mask format is bs x q_len x k_len, so to make it broadcastable
            # we need to create the nheads dimension
            while len(mask.size()) < 4:  # expects bs (x nheads) x q_len x kv_len
                mask = mask.unsqueeze(1)
            if mask.dtype == torch.bool:
                mask = torch.where(mask.logical_not(), -torch.inf, 0.0)
            mask = mask.to(dtype=queries.dtype)
            # truncate for sliding window kv_cache
            mask = mask[..., -n_tokens:, -kv_tokens:]
        else:
            mask = torch.triu(queries.new_full((1, 1, n_tokens, kv_tokens), -float("inf")), diagonal=1)

        if sliding_window > kv_tokens and n_tokens == kv_tokens:
            mask += torch.tril(mask.new_full((n_tokens, n_tokens), -float("inf")), diagonal=-sliding_window)
    else:
        sliding_window = attn_kwargs.get("sliding_window", None)
        mask = torch.triu(queries.new_full((n_tokens, n_tokens), -float("inf")), diagonal=1)
        if sliding_window and sliding_window > 0:
            mask += torch.tril(mask.new_full((n_tokens, n_tokens), -float("inf")), diagonal=-sliding_window)
    QK = torch.einsum("bhqd,bhkd->bhqk", queries, keys_e)

    if scale_factor is None:
        scale_factor = 1.0 / math.sqrt(d_head)

    QK *= scale_factor
    if FIXED:
        QK += mask
    else:
        QK += mask[None, None, :, :]
    QK = torch.cat([QK, S], dim=-1)
    QK = QK - QK.max(dim=-1, keepdim=True).values
    W = torch.softmax(QK, dim=-1)
    W = W[..., :-1]  # drop the attention sinks after done
    attn = torch.matmul(W, values_e)

    attn = attn.transpose(2, 1).contiguous()
    return attn


def _sdpa_update_attn_kwargs(**attn_kwargs):
    # this is updating the mask for decoding
    mask = attn_kwargs.get("mask", None)
    if mask is not None:
        # get the last row of the 3d mask
        mask = mask[:, -1:, :]
        # extend the mask one slot
        mask = torch.cat((mask, torch.zeros(mask.size(0), 1, 1, device=mask.device)), dim=2)
        attn_kwargs["mask"] = mask
    return attn_kwargs


register_attention_op("sdpa_causal", _sdpa_store_op, None, update_attn_kwargs_op=_sdpa_update_attn_kwargs)
if FIXED:
    register_attention_op("sdpa_with_sinks", _sdpa_store_op, _math_attention_with_sinks_op,
                          update_attn_kwargs_op=_sdpa_update_attn_kwargs)
else:
    register_attention_op("sdpa_with_sinks", _sdpa_store_op, _math_attention_with_sinks_op)


def get_attention_type(**attn_kwargs):
    attn_name = attn_kwargs.get("attn_name", "sdpa_causal")
    if attn_name not in __type_factory_map:
        raise KeyError(f"The attention {attn_name} is not registered")
    return __type_factory_map[attn_name]


class RotaryEmbedding(nn.Module):
    def __init__(self, dim, theta=150000.0):
        super().__init__()
        self.dim = dim
        self.theta = theta

    def adjusted_qk(self, q, k, position_ids):
        # q, k: b x l x h x d ; position_ids: b x l
        inv = 1.0 / (self.theta ** (torch.arange(0, self.dim, 2, dtype=torch.float32) / self.dim))
        ang = position_ids.float()[..., None] * inv  # b l d/2
        cos, sin = ang.cos()[:, :, None, :], ang.sin()[:, :, None, :]

        def rot(x):
            x1, x2 = x[..., 0::2], x[..., 1::2]
            return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)

        return rot(q), rot(k)


class MultiHeadAttention(nn.Module):
    def __init__(self, emb_dim, emb_kq, emb_v, nheads, kvheads, position_encoder, scale_factor, has_sinks=True):
        super().__init__()
        self.nheads, self.kvheads = nheads, kvheads
        self.emb_kq_per_head, self.emb_v_per_head = emb_kq, emb_v
        self.query = nn.Linear(emb_dim, nheads * emb_kq, bias=True)
        self.key = nn.Linear(emb_dim, kvheads * emb_kq, bias=True)
        self.value = nn.Linear(emb_dim, kvheads * emb_v, bias=True)
        self.dense = nn.Linear(nheads * emb_v, emb_dim, bias=True)
        self.position_encoder = position_encoder
        self.scale_factor = scale_factor
        self.p_dropout = 0.0
        if has_sinks:
            self.sinks = nn.Parameter(torch.randn(nheads) * 0.5)

    def forward(self, q, position_ids=None, past_key_value_state=None, use_cache=False, **attn_kwargs):
        batch_size, q_len, _ = q.size()
        queries = self.query(q).view(batch_size, q_len, self.nheads, self.emb_kq_per_head)
        keys = self.key(q).view(batch_size, q_len, self.kvheads, self.emb_kq_per_head)
        values = self.value(q).view(batch_size, q_len, self.kvheads, self.emb_v_per_head)
        if self.position_encoder is not None:
            queries, keys = self.position_encoder.adjusted_qk(queries, keys, position_ids)
        if hasattr(self, "sinks"):
            attn_kwargs["sinks"] = self.sinks

        attn_compute_dict = get_attention_type(**attn_kwargs)
        if use_cache:
            if past_key_value_state is None:
                past_key_value_state = [None, None]
            keys_compute, values_compute, keys_return, values_return = attn_compute_dict["store"](
                keys, values, past_key_value_state[0], past_key_value_state[1], **attn_kwargs)
        else:
            keys_compute, values_compute = keys, values

        if attn_compute_dict["is_prefill"](**attn_kwargs):
            attn = attn_compute_dict["compute_prefill"](
                queries, keys_compute, values_compute, self.nheads, self.kvheads, self.p_dropout,
                self.scale_factor, **attn_kwargs)
        else:
            attn = attn_compute_dict["compute_decode"](
                queries, keys_compute, values_compute, self.nheads, self.kvheads, self.p_dropout,
                self.scale_factor, **attn_kwargs)

        attn = attn.view(batch_size, q_len, self.nheads * self.emb_v_per_head)
        out = self.dense(attn)
        if use_cache:
            return out, (keys_return, values_return)
        return out


# ---------------------------------------------------------------- fms/models/gpt_oss.py
class GptOssConfig:
    src_vocab_size = 64
    emb_dim = 32
    head_dim = 8
    nheads = 4
    kvheads = 2
    hidden_dim = 64
    nlayers = 2
    sliding_window = 128
    norm_eps = 1e-5
    p_dropout = 0.0
    layer_types = ["sliding_attention", "full_attention"]


class GptOssBlock(nn.Module):
    def __init__(self, config, layer_sliding_window, rotary_emb):
        super().__init__()
        self.config = config
        self.layer_sliding_window = layer_sliding_window
        self.ln = nn.RMSNorm(config.emb_dim, eps=config.norm_eps)
        self.ff_ln = nn.RMSNorm(config.emb_dim, eps=config.norm_eps)
        kvheads = config.nheads if config.kvheads == 0 else config.kvheads
        scale_factor = 1.0 / math.sqrt(config.head_dim)
        self.attn = MultiHeadAttention(config.emb_dim, config.head_dim, config.head_dim, config.nheads, kvheads,
                                       position_encoder=rotary_emb, scale_factor=scale_factor, has_sinks=True)
        # MOEFeedForward trimmed to one dense expert
        self.ff_sub_layer = nn.Sequential(nn.Linear(config.emb_dim, config.hidden_dim), nn.SiLU(),
                                          nn.Linear(config.hidden_dim, config.emb_dim))

    def forward(self, x, *, position_ids=None, past_key_value_state=None, use_cache=False, **attn_kwargs):
        self_attn_past_key_value = past_key_value_state
        attn_kwargs["attn_name"] = attn_kwargs.get("attn_name", "sdpa_with_sinks")
        residual = x
        x = self.ln(x)
        x = self.attn(q=x, position_ids=position_ids, past_key_value_state=self_attn_past_key_value,
                      use_cache=use_cache, **attn_kwargs)
        cache = None
        if use_cache:
            x, cache = x
        x = x + residual
        residual = x
        x = self.ff_ln(x)
        x = self.ff_sub_layer(x)
        x = x + residual
        if use_cache:
            return (x, cache)
        return x


class GptOss(nn.Module):
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
            layers.append(GptOssBlock(config, layer_sliding_window=layer_sliding_window, rotary_emb=self.rot_emb))
        self.layers = nn.ModuleList(layers)
        self.dec_norm = nn.RMSNorm(config.emb_dim, eps=config.norm_eps)
        self.head = nn.Linear(config.emb_dim, config.src_vocab_size, bias=False)

    def forward(self, x_in, position_ids=None, past_key_value_states=None, use_cache=False, **attn_kwargs):
        attn_kwargs["attn_name"] = "sdpa_with_sinks"
        get_attention_type(**attn_kwargs)["validate_attn_kwargs"](
            input_ids=x_in, position_ids=position_ids, past_key_value_states=past_key_value_states, **attn_kwargs)
        if past_key_value_states is None or len(past_key_value_states) == 0:
            past_key_value_states = [None for _ in range(len(self.layers))]
        x_in = self.embedding(x_in)
        present_key_value_states = []
        for i, layer in enumerate(self.layers):
            if layer.layer_sliding_window > 0:
                attn_kwargs["sliding_window"] = layer.layer_sliding_window
            else:
                attn_kwargs["sliding_window"] = 0
            output = layer(x=x_in, position_ids=position_ids, past_key_value_state=past_key_value_states[i],
                           use_cache=use_cache, **attn_kwargs)
            if use_cache:
                x_in, present_key_value_state = output
                present_key_value_states.append(present_key_value_state)
            else:
                x_in = output
        preds = self.head(self.dec_norm(x_in))
        if use_cache:
            return preds, present_key_value_states
        return preds


# ---------------------------------------------------------------- fms/utils/generation.py
def pad_input_ids(input_ids_list: List[torch.Tensor], min_pad_length: int = 0, is_causal_mask=True,
                  padding_side="left", position_ids_offset=0) -> Tuple[torch.Tensor, MutableMapping[str, Any]]:
    max_len = max([min_pad_length] + [seq.size(0) for seq in input_ids_list])

    padded_input_ids_list = []
    mask_list = []
    position_ids_list = []
    for input_ids_i in input_ids_list:
        seq_len = input_ids_i.size(0)
        pads = torch.zeros(max_len - seq_len, dtype=torch.long, device=input_ids_i.device)
        non_pads = torch.ones(seq_len, dtype=torch.bool, device=input_ids_i.device)
        pos_ids_pads = pads
        pos_ids_seq = torch.arange(0, seq_len, dtype=torch.long, device=input_ids_i.device)
        if padding_side == "left":
            padded_input_ids_list.append(torch.cat((pads, input_ids_i)))
            mask_list.append(torch.cat((pads.bool(), non_pads)))
            position_ids_list.append(torch.cat((pos_ids_pads, pos_ids_seq)))
        elif padding_side == "right":
            padded_input_ids_list.append(torch.cat((input_ids_i, pads)))
            mask_list.append(torch.cat((non_pads, pads.bool())))
            position_ids_list.append(torch.cat((pos_ids_seq, pos_ids_pads)))
        else:
            raise NotImplementedError("padding_side must be 'right' or left'")

    input_ids = torch.stack(padded_input_ids_list)
    padding_kwargs = {}
    mask = torch.stack(mask_list)
    mask = mask.unsqueeze(-1) == mask.unsqueeze(-2)
    # this is a causal mask for generation
    if is_causal_mask:
        mask = mask.tril()
    mask = torch.where(mask.logical_not(), -torch.inf, 0.0)
    padding_kwargs["mask"] = mask

    position_ids = torch.stack(position_ids_list)
    position_ids += position_ids_offset
    padding_kwargs["position_ids"] = position_ids
    return input_ids, padding_kwargs


def __update_padding_kwargs(use_cache: bool, model_specific_kwargs: MutableMapping[str, Any]):
    # extend the attention mask
    attn_op = get_attention_type(**model_specific_kwargs)
    if "update_attn_kwargs" in attn_op:
        model_specific_kwargs = attn_op["update_attn_kwargs"](**model_specific_kwargs)

    # extend the position_ids
    position_ids = model_specific_kwargs.get("position_ids", None)
    if position_ids is not None:
        if use_cache:
            position_ids = position_ids[:, -1:] + 1
        else:
            position_ids = torch.cat((position_ids, position_ids[:, -1:] + 1), dim=1)
        model_specific_kwargs["position_ids"] = position_ids
    return model_specific_kwargs


def generate(model, input_ids, max_seq_len=4096, max_new_tokens=256, use_cache=False,
             extra_kwargs: Optional[MutableMapping[str, Any]] = None):
    kwargs: MutableMapping[str, Any] = dict()
    if extra_kwargs is not None:
        kwargs.update(extra_kwargs)
    result = input_ids
    next_input = input_ids
    kwargs["past_key_value_states"] = None
    kwargs["use_cache"] = use_cache
    for i in range(max_new_tokens):
        input_ids = next_input[:, -max_seq_len:]
        # iteration 0 is the prefill step (cache has not been filled yet), so no need to extend the mask/position_ids
        if i > 0:
            kwargs = __update_padding_kwargs(use_cache, kwargs)
        output = model(input_ids, **kwargs)
        if use_cache:
            logits, past_key_value_states = output
            kwargs["past_key_value_states"] = past_key_value_states
        else:
            logits = output
        logits = logits[:, -1, :]
        next_val = torch.argmax(logits, dim=-1).unsqueeze(0).t()
        result = torch.cat((result, next_val), dim=-1)
        if use_cache:
            next_input = next_val
        else:
            next_input = result
    return result


def main():
    torch.manual_seed(0)
    model = GptOss(GptOssConfig()).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(3.0)

    prompts = [
        torch.tensor([5, 17, 42, 8, 23, 11, 30, 2, 9, 14]),
        torch.tensor([7, 3, 51]),
        torch.tensor([12, 40, 6, 33, 19, 27]),
    ]
    ids, padding_kwargs = pad_input_ids(prompts)
    with torch.no_grad():
        result = generate(model, ids, max_new_tokens=8, use_cache=True, extra_kwargs=padding_kwargs)
    for row, prompt in zip(result, prompts):
        print(prompt.tolist(), "->", row[ids.shape[1]:].tolist())


if __name__ == "__main__":
    main()
