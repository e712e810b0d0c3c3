# Citation: amazon-science/chronos-forecasting#331 ("[chronos-2] add support for SDPA"), PR-branch commit
#   06a1aad ("flash attention doesnt work with 2d mask"); the PR was squash-merged as ca9c327.
# Upstream: src/chronos/chronos2/layers.py MHA.forward / MHA._flash_attention_2 (used by TimeSelfAttention and
#   GroupSelfAttention); masks built in src/chronos/chronos2/model.py Chronos2Encoder
#   (_expand_and_invert_time_attention_mask, _construct_and_invert_group_time_mask).
# Bug: with attn_implementation="flash_attention_2" MHA dispatched to flash_attn_func(..., causal=False), which takes no
#   mask, so the additive time mask (NaN left padding of short contexts) and the group-time mask (which series
#   may attend to which, per group_ids) were silently dropped.
# Fix: MHA._mask_supports_flash_attention(mask); flash is used only when the mask is trivial, otherwise the
#   call falls back to the SDPA path with attn_mask=mask.
import sys
from dataclasses import dataclass

import torch
from torch import nn

FIXED = "--fixed" in sys.argv


@dataclass
class Chronos2CoreConfig:
    d_model: int = 32
    d_kv: int = 8
    d_ff: int = 64
    num_layers: int = 2
    num_heads: int = 4
    dropout_rate: float = 0.0
    layer_norm_epsilon: float = 1e-6
    rope_theta: float = 10000.0
    dense_act_fn: str = "relu"
    input_patch_size: int = 4
    _attn_implementation: str = "flash_attention_2"


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False):
    """Plain-torch stand-in for flash_attn.flash_attn_func: q, k, v are [batch, seq, heads, head_dim], no mask."""
    qh, kh, vh = (t.transpose(1, 2).float() for t in (q, k, v))
    scale = softmax_scale if softmax_scale is not None else qh.shape[-1] ** -0.5
    scores = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        L, S = scores.shape[-2:]
        scores = scores.masked_fill(torch.ones(L, S, dtype=torch.bool).triu(S - L + 1), float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = nn.functional.dropout(probs, p=dropout_p)
    return torch.matmul(probs, vh).transpose(1, 2).to(q.dtype)


class RoPE(nn.Module):
    def __init__(self, dim: int, base: float = 10000):
        super().__init__()
        self.dim = dim
        self.base = base
        inv_freq = 1.0 / (self.base ** (torch.arange(0, self.dim, 2, dtype=torch.int64).float() / self.dim))
        self.register_buffer("inv_freq", tensor=inv_freq, persistent=False)

    @torch.no_grad()
    def forward(self, x, position_ids):
        inv_freq_expanded = self.inv_freq[None, :, None].float().expand(position_ids.shape[0], -1, 1)
        position_ids_expanded = position_ids[:, None, :].float()
        freqs = (inv_freq_expanded.float() @ position_ids_expanded.float()).transpose(1, 2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype=x.dtype), emb.sin().to(dtype=x.dtype)

    @staticmethod
    def rotate_half(x):
        x1 = x[..., : x.shape[-1] // 2]
        x2 = x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    @staticmethod
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim: int = 1):
        cos = cos.unsqueeze(unsqueeze_dim)
        sin = sin.unsqueeze(unsqueeze_dim)
        q_embed = (q * cos) + (RoPE.rotate_half(q) * sin)
        k_embed = (k * cos) + (RoPE.rotate_half(k) * sin)
        return q_embed, k_embed


class Chronos2LayerNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        variance = hidden_states.to(torch.float32).pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.wi = nn.Linear(config.d_model, config.d_ff, bias=False)
        self.wo = nn.Linear(config.d_ff, config.d_model, bias=False)
        self.dropout = nn.Dropout(config.dropout_rate)
        self.act = nn.ReLU()

    def forward(self, hidden_states):
        return self.wo(self.dropout(self.act(self.wi(hidden_states))))


class FeedForward(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.mlp = MLP(config)
        self.layer_norm = Chronos2LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states):
        return hidden_states + self.dropout(self.mlp(self.layer_norm(hidden_states)))


class MHA(nn.Module):
    def __init__(self, config: Chronos2CoreConfig, use_rope: bool = True):
        super().__init__()
        self.d_model = config.d_model
        self.kv_proj_dim = config.d_kv
        self.n_heads = config.num_heads
        self.dropout = config.dropout_rate
        self.inner_dim = self.n_heads * self.kv_proj_dim
        self.config = config
        self.q = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.k = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.v = nn.Linear(self.d_model, self.inner_dim, bias=False)
        self.o = nn.Linear(self.inner_dim, self.d_model, bias=False)
        self.use_rope = use_rope
        if use_rope:
            self.rope_embed = RoPE(dim=self.kv_proj_dim, base=config.rope_theta)

    def _eager_attention(self, query_states, key_states, value_states, mask):
        scores = torch.matmul(query_states, key_states.transpose(3, 2))
        scores += mask
        attn_weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        attn_weights = nn.functional.dropout(attn_weights, p=self.dropout, training=self.training)
        return torch.matmul(attn_weights, value_states), attn_weights

    def _sdpa_attention(self, query_states, key_states, value_states, mask):
        attn_output = nn.functional.scaled_dot_product_attention(
            query_states, key_states, value_states, attn_mask=mask,
            dropout_p=self.dropout if self.training else 0.0, scale=1.0,
        )
        return attn_output, None

    def _flash_attention_2(self, query_states, key_states, value_states, mask):
        query_states = query_states.transpose(1, 2)
        key_states = key_states.transpose(1, 2)
        value_states = value_states.transpose(1, 2)
        input_dtype = query_states.dtype
        if input_dtype not in [torch.float16, torch.bfloat16]:
            target_dtype = torch.float16 if torch.cuda.is_available() else torch.bfloat16
            query_states = query_states.to(target_dtype)
            key_states = key_states.to(target_dtype)
            value_states = value_states.to(target_dtype)
        attn_output = flash_attn_func(
            query_states, key_states, value_states,
            dropout_p=self.dropout if self.training else 0.0,
            softmax_scale=1.0,
            causal=False,
        )
        if input_dtype not in [torch.float16, torch.bfloat16]:
            attn_output = attn_output.to(input_dtype)
        return attn_output.transpose(1, 2), None

    @staticmethod
    def _mask_supports_flash_attention(mask):
        if mask is None:
            return True
        if not torch.is_tensor(mask):
            return mask == 0
        if mask.ndim <= 2:
            return False
        if mask.numel() == 0:
            return True
        if mask.dtype == torch.bool:
            return not mask.any()
        return not torch.any(mask)

    def forward(self, hidden_states, mask, encoder_states=None, position_ids=None):
        attn_implementation = self.config._attn_implementation
        B, S = hidden_states.shape[:2]

        def shape(states):
            return states.view(B, S, self.n_heads, self.kv_proj_dim).transpose(1, 2)

        def unshape(states):
            return states.transpose(1, 2).reshape(B, S, self.inner_dim)

        query_states = shape(self.q(hidden_states))
        key_states = shape(self.k(hidden_states))
        value_states = shape(self.v(hidden_states))
        if self.use_rope:
            cos, sin = self.rope_embed(value_states, position_ids)
            query_states, key_states = RoPE.apply_rotary_pos_emb(query_states, key_states, cos, sin)

        if FIXED:
            use_flash_attn = attn_implementation == "flash_attention_2" and self._mask_supports_flash_attention(mask)
            if use_flash_attn:
                attn_output, _ = self._flash_attention_2(query_states, key_states, value_states, mask)
            elif attn_implementation == "sdpa" or attn_implementation == "flash_attention_2":
                attn_output, _ = self._sdpa_attention(query_states, key_states, value_states, mask)
            else:
                attn_output, _ = self._eager_attention(query_states, key_states, value_states, mask)
        else:
            if attn_implementation == "sdpa":
                attn_output, _ = self._sdpa_attention(query_states, key_states, value_states, mask)
            elif attn_implementation == "flash_attention_2":
                attn_output, _ = self._flash_attention_2(query_states, key_states, value_states, mask)
            else:
                attn_output, _ = self._eager_attention(query_states, key_states, value_states, mask)
        return self.o(unshape(attn_output))


class TimeSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.self_attention = MHA(config, use_rope=True)
        self.layer_norm = Chronos2LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, attention_mask, position_ids):
        out = self.self_attention(self.layer_norm(hidden_states), position_ids=position_ids, mask=attention_mask)
        return hidden_states + self.dropout(out)


class GroupSelfAttention(nn.Module):
    """Self-attention applied along the batch axis masked by the group attention mask"""

    def __init__(self, config):
        super().__init__()
        self.self_attention = MHA(config, use_rope=False)
        self.layer_norm = Chronos2LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    def forward(self, hidden_states, attention_mask):
        hidden_states = hidden_states.transpose(0, 1)  # batch time d -> time batch d
        out = self.self_attention(self.layer_norm(hidden_states), mask=attention_mask)
        hidden_states = hidden_states + self.dropout(out)
        return hidden_states.transpose(0, 1)


class Chronos2EncoderBlock(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.layer = nn.ModuleList([TimeSelfAttention(config), GroupSelfAttention(config), FeedForward(config)])

    def forward(self, hidden_states, *, position_ids, attention_mask, group_time_mask):
        hidden_states = self.layer[0](hidden_states, position_ids=position_ids, attention_mask=attention_mask)
        hidden_states = self.layer[1](hidden_states, attention_mask=group_time_mask)
        return self.layer[2](hidden_states)


class Chronos2Encoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.block = nn.ModuleList([Chronos2EncoderBlock(config) for _ in range(config.num_layers)])
        self.final_layer_norm = Chronos2LayerNorm(config.d_model, eps=config.layer_norm_epsilon)
        self.dropout = nn.Dropout(config.dropout_rate)

    @staticmethod
    def _expand_and_invert_time_attention_mask(attention_mask, floating_type):
        assert attention_mask.ndim == 2, "attention_mask must have shape (batch, seq_len)"
        attention_mask = attention_mask[:, None, None, :]
        attention_mask = attention_mask.to(dtype=floating_type)
        attention_mask = (1.0 - attention_mask) * torch.finfo(floating_type).min
        return attention_mask

    @staticmethod
    def _construct_and_invert_group_time_mask(group_ids, attention_mask, floating_type):
        group_mask = group_ids[:, None] == group_ids[None, :]
        group_time_mask = torch.einsum("qb, bt -> qbt", group_mask.to(attention_mask.dtype), attention_mask)
        if torch.is_floating_point(group_time_mask):
            floating_type = group_time_mask.dtype
        group_time_mask = group_time_mask.permute(2, 0, 1).unsqueeze(1)  # "q b t -> t 1 q b"
        group_time_mask = (1.0 - group_time_mask) * torch.finfo(floating_type).min
        return group_time_mask

    def forward(self, inputs_embeds, *, group_ids, attention_mask=None, position_ids=None):
        batch_size, seq_length = inputs_embeds.size()[:-1]
        if position_ids is None:
            position_ids = torch.arange(0, seq_length, dtype=torch.long).unsqueeze(0)
        if attention_mask is None:
            attention_mask = torch.ones(batch_size, seq_length, dtype=inputs_embeds.dtype)
        extended_attention_mask = self._expand_and_invert_time_attention_mask(attention_mask, inputs_embeds.dtype)
        group_time_mask = self._construct_and_invert_group_time_mask(group_ids, attention_mask, inputs_embeds.dtype)
        hidden_states = self.dropout(inputs_embeds)
        for layer_module in self.block:
            hidden_states = layer_module(
                hidden_states, position_ids=position_ids,
                attention_mask=extended_attention_mask, group_time_mask=group_time_mask,
            )
        return self.final_layer_norm(hidden_states)


class ResidualBlock(nn.Module):
    def __init__(self, in_dim, h_dim, out_dim):
        super().__init__()
        self.hidden_layer = nn.Linear(in_dim, h_dim)
        self.act = nn.ReLU()
        self.output_layer = nn.Linear(h_dim, out_dim)
        self.residual_layer = nn.Linear(in_dim, out_dim)

    def forward(self, x):
        return self.output_layer(self.act(self.hidden_layer(x))) + self.residual_layer(x)


def left_pad_and_stack_1D(tensors):
    max_len = max(len(c) for c in tensors)
    padded = []
    for c in tensors:
        padding = torch.full(size=(max_len - len(c),), fill_value=torch.nan, dtype=c.dtype)
        padded.append(torch.concat((padding, c), dim=-1))
    return torch.stack(padded)


def main():
    torch.manual_seed(0)
    config = Chronos2CoreConfig()
    P = config.input_patch_size

    # four series of different lengths: two groups of related series plus one univariate series
    lengths = [24, 12, 20, 8]
    t = torch.arange(24, dtype=torch.float32)
    series = [
        torch.sin(t[:lengths[0]] / 3.0) * 5 + 10,
        torch.sin(t[:lengths[1]] / 3.0 + 0.4) * 4 + 9,
        torch.cos(t[:lengths[2]] / 2.0) * 3 - 2,
        torch.linspace(0, 7, lengths[3]),
    ]
    group_ids = torch.tensor([0, 0, 1, 2])
    context = left_pad_and_stack_1D(series)  # (4, 24), NaN on the left
    context_mask = (~torch.isnan(context)).to(context.dtype)

    # InstanceNorm on observed values, then patching into non-overlapping patches
    loc = torch.nansum(context, dim=-1, keepdim=True) / context_mask.sum(-1, keepdim=True)
    scale = torch.sqrt(torch.nansum((context - loc) ** 2, dim=-1, keepdim=True) / context_mask.sum(-1, keepdim=True))
    scaled = torch.where(context_mask > 0, (context - loc) / scale, torch.zeros_like(context))
    patches = scaled.unfold(-1, P, P)           # (B, N, P)
    patch_mask = context_mask.unfold(-1, P, P)  # (B, N, P)
    attention_mask = (patch_mask.sum(-1) > 0).to(context.dtype)  # (B, N)
    time_enc = torch.arange(patches.shape[1], dtype=torch.float32)[None, :, None].expand(4, -1, P) / patches.shape[1]

    input_patch_embedding = ResidualBlock(3 * P, config.d_ff, config.d_model)
    encoder = Chronos2Encoder(config)
    output_head = ResidualBlock(config.d_model, config.d_ff, P)

    with torch.no_grad():
        inputs_embeds = input_patch_embedding(torch.cat([time_enc, patches, patch_mask], dim=-1))
        hidden = encoder(inputs_embeds, group_ids=group_ids, attention_mask=attention_mask)
        next_patch = output_head(hidden[:, -1]) * scale + loc

    print("patch attention_mask:")
    print(attention_mask)
    print("last hidden state (first 4 dims):")
    print(hidden[:, -1, :4])
    print("next-patch forecast:")
    print(next_patch)


if __name__ == "__main__":
    main()
