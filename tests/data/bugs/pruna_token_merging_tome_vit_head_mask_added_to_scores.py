# PrunaAI/pruna, token merging (ToMe) for HF ViT, PR PrunaAI/pruna#537, fixed in commit 573dc33 ("fix: multiply head_mask instead of adding it").
# ToMeViTSelfAttention adds the 0/1 head_mask to the attention scores before the softmax; a per-head constant cancels in the
# softmax, so masked heads keep attending exactly as before and the mask is silently ignored (the fix multiplies it in).
import sys
from typing import Any, Callable, Optional

import math
import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- token merging utilities (src/pruna/algorithms/token_merging.py, adapted from facebook/ToMe) ----
def _do_nothing(x: torch.Tensor, mode: str | None = None) -> torch.Tensor:
    return x


def _parse_r(num_layers: int, r) -> list[int]:
    inflect = 0
    if isinstance(r, list):
        if len(r) < num_layers:
            r = r + [0] * (num_layers - len(r))
        return list(r)
    elif isinstance(r, tuple):
        r, inflect = r
    min_val = int(r * (1.0 - inflect))
    max_val = 2 * r - min_val
    step = (max_val - min_val) / (num_layers - 1) if num_layers > 1 else 0
    return [int(min_val + step * i) for i in range(num_layers)]


def _bipartite_soft_matching(tokens, r, class_token=False, distill_token=False):
    protected = int(class_token) + int(distill_token)
    t = tokens.shape[1]
    r = min(r, (t - protected) // 2)
    if r <= 0:
        return _do_nothing, _do_nothing
    with torch.no_grad():
        tokens = torch.nn.functional.normalize(tokens, dim=-1)
        a, b = tokens[..., ::2, :], tokens[..., 1::2, :]
        scores = a @ b.transpose(-1, -2)
        if class_token:
            scores[..., 0, :] = -math.inf
        if distill_token:
            scores[..., :, 0] = -math.inf
        node_max, node_idx = scores.max(dim=-1)
        edge_idx = node_max.argsort(dim=-1, descending=True)[..., None]
        unm_idx = edge_idx[..., r:, :]
        src_idx = edge_idx[..., :r, :]
        dst_idx = node_idx[..., None].gather(dim=-2, index=src_idx)
        if class_token:
            unm_idx = unm_idx.sort(dim=1)[0]

    def merge(x, mode="mean"):
        src, dst = x[..., ::2, :], x[..., 1::2, :]
        n, t1, c = src.shape
        unm = src.gather(dim=-2, index=unm_idx.expand(n, t1 - r, c))
        src = src.gather(dim=-2, index=src_idx.expand(n, r, c))
        dst = dst.scatter_reduce(-2, dst_idx.expand(n, r, c), src, reduce=mode)
        if distill_token:
            return torch.cat([unm[:, :1], dst[:, :1], unm[:, 1:], dst[:, 1:]], dim=1)
        return torch.cat([unm, dst], dim=1)

    return merge, _do_nothing


def _merge_wavg(merge: Callable, x, size=None):
    if size is None:
        size = torch.ones_like(x[..., 0, None])
    combined = merge(torch.cat([x * size, size], dim=-1), mode="sum")
    size = combined[..., -1:]
    x = combined[..., :-1] / size
    return x, size


# ---- the HuggingFace transformers 4.x ViT modules the patch subclasses (ViTSelfAttention, ViTAttention, ViTLayer),
#      trimmed; transformers 5 no longer ships ViTSelfAttention, so they are written out here ----
class ViTConfig:
    hidden_size = 32
    num_attention_heads = 4
    intermediate_size = 64
    attention_probs_dropout_prob = 0.0
    hidden_dropout_prob = 0.0
    layer_norm_eps = 1e-12
    qkv_bias = True
    num_hidden_layers = 3
    _attn_implementation = "eager"


class _HFViTSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.num_attention_heads = config.num_attention_heads
        self.attention_head_size = int(config.hidden_size / config.num_attention_heads)
        self.all_head_size = self.num_attention_heads * self.attention_head_size
        self.dropout_prob = config.attention_probs_dropout_prob
        self.scaling = self.attention_head_size ** -0.5
        self.is_causal = False
        self.query = nn.Linear(config.hidden_size, self.all_head_size, bias=config.qkv_bias)
        self.key = nn.Linear(config.hidden_size, self.all_head_size, bias=config.qkv_bias)
        self.value = nn.Linear(config.hidden_size, self.all_head_size, bias=config.qkv_bias)


class ViTSelfOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        return self.dropout(self.dense(hidden_states))


class ViTAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = ToMeViTSelfAttention(config)
        self.output = ViTSelfOutput(config)

    def forward(self, hidden_states, head_mask=None, output_attentions=False):
        self_outputs = self.attention(hidden_states, head_mask, output_attentions)
        attention_output = self.output(self_outputs[0], hidden_states)
        return (attention_output,) + self_outputs[1:]


class ViTIntermediate(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.intermediate_act_fn = nn.GELU()

    def forward(self, hidden_states):
        return self.intermediate_act_fn(self.dense(hidden_states))


class ViTOutput(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dense = nn.Linear(config.intermediate_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout_prob)

    def forward(self, hidden_states, input_tensor):
        return self.dropout(self.dense(hidden_states)) + input_tensor


class _HFViTLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.attention = ViTAttention(config)
        self.intermediate = ViTIntermediate(config)
        self.output = ViTOutput(config)
        self.layernorm_before = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.layernorm_after = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)


# ---- pruna's ToMe modules (code before / after commit 573dc33) ----
class ToMeViTSelfAttention(_HFViTSelfAttention):
    _tome_info: dict[str, Any]

    def forward(self, hidden_states, head_mask: Optional[torch.Tensor] = None, output_attentions: bool = False):
        batch_size = hidden_states.shape[0]
        new_shape = (batch_size, -1, self.num_attention_heads, self.attention_head_size)

        key_layer = self.key(hidden_states).view(*new_shape).transpose(1, 2)
        value_layer = self.value(hidden_states).view(*new_shape).transpose(1, 2)
        query_layer = self.query(hidden_states).view(*new_shape).transpose(1, 2)

        # Eager attention so we can inject the proportional-attention term.
        attn_weights = (query_layer @ key_layer.transpose(-2, -1)) * self.scaling

        # Proportional attention: bias scores by log(token_size).
        if self._tome_info["prop_attn"] and self._tome_info["size"] is not None:
            attn_weights = attn_weights + self._tome_info["size"].log()[:, None, None, :, 0]

        if head_mask is not None:
            if FIXED:
                attn_weights = attn_weights * head_mask
            else:
                attn_weights = attn_weights + head_mask

        attn_weights = attn_weights.softmax(dim=-1)
        attn_probs = torch.nn.functional.dropout(attn_weights, p=self.dropout_prob if self.training else 0.0)

        context_layer = (attn_probs @ value_layer).transpose(1, 2)
        context_layer = context_layer.reshape(batch_size, -1, self.all_head_size)

        outputs = (context_layer, attn_probs) if output_attentions else (context_layer,)
        self._tome_info["metric"] = key_layer.mean(1)
        return outputs


class ToMeViTLayer(_HFViTLayer):
    _tome_info: dict[str, Any]

    def forward(self, hidden_states, head_mask=None, output_attentions=False):
        self_attention_outputs = self.attention(self.layernorm_before(hidden_states), head_mask,
                                                output_attentions=output_attentions)
        attention_output = self_attention_outputs[0]
        outputs = self_attention_outputs[1:]
        hidden_states = attention_output + hidden_states

        r = self._tome_info["r"].pop(0)
        if r > 0:
            metric = self._tome_info["metric"]
            merge, _ = _bipartite_soft_matching(metric, r, self._tome_info["class_token"],
                                                self._tome_info["distill_token"])
            hidden_states, self._tome_info["size"] = _merge_wavg(merge, hidden_states, self._tome_info["size"])

        layer_output = self.layernorm_after(hidden_states)
        layer_output = self.intermediate(layer_output)
        layer_output = self.output(layer_output, hidden_states)
        return (layer_output,) + outputs


class Encoder(nn.Module):
    """ViTEncoder loop with HF's get_head_mask conversion: (num_heads,) -> per layer (1, num_heads, 1, 1)."""

    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([ToMeViTLayer(config) for _ in range(config.num_hidden_layers)])
        self.layernorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x, head_mask=None):
        if head_mask is not None:
            head_mask = head_mask[None, None, :, None, None].expand(len(self.layer), -1, -1, -1, -1)
        for i, layer in enumerate(self.layer):
            x = layer(x, head_mask[i] if head_mask is not None else None)[0]
        return self.layernorm(x)


class ToMeModelWrapper(nn.Module):
    def __init__(self, model, r, tome_info, num_layers):
        super().__init__()
        self.model = model
        self.r = r
        self._tome_info = tome_info
        self.num_layers = num_layers

    def forward(self, *args, **kwargs):
        self._tome_info["r"] = _parse_r(self.num_layers, self.r)
        self._tome_info["size"] = None
        self._tome_info["source"] = None
        self._tome_info["metric"] = None
        return self.model(*args, **kwargs)


config = ViTConfig()
encoder = Encoder(config).eval()
tome_info = {"r": None, "size": None, "source": None, "metric": None, "trace_source": False,
             "prop_attn": True, "class_token": True, "distill_token": False}
for m in encoder.modules():
    if isinstance(m, (ToMeViTSelfAttention, ToMeViTLayer)):
        m._tome_info = tome_info
model = ToMeModelWrapper(encoder, r=3, tome_info=tome_info, num_layers=config.num_hidden_layers)

x = torch.randn(2, 17, config.hidden_size)            # [CLS] + 16 patch embeddings
head_mask = torch.tensor([1.0, 0.0, 1.0, 1.0])         # prune head 1 in every layer

with torch.no_grad():
    out_masked = model(x, head_mask=head_mask)
    out_plain = model(x)

print(f"tokens after merging: {out_masked.shape[1]}")
print(f"max |output(head_mask prunes head 1) - output(no head_mask)|: {(out_masked - out_plain).abs().max().item():.3e}")
