# slime (THUDM/slime#1686, commit 1d31a49): the packed-sequence (thd) Qwen3-Next hybrid layer passed cu_seqlens to the
# ShortConvolution but not to chunk_gated_delta_rule, so the Gated DeltaNet recurrence ran across the boundaries of
# the packed samples and each sample's linear-attention output leaked state from the previous one.
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# transformers.activations.ACT2FN / transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextRMSNorm, copied
# (importing transformers takes ~10 s here)
ACT2FN = {"silu": nn.SiLU()}


class Qwen3NextRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1.0 + self.weight.float())
        return output.type_as(x)


# ---- CPU stand-ins for the fla ops slime imports (fla.modules.ShortConvolution, fla.modules.FusedRMSNormGated,
# fla.ops.gated_delta_rule.chunk_gated_delta_rule), following their documented semantics, including cu_seqlens:
# with cu_seqlens the batch is 1 and every [cu_seqlens[i], cu_seqlens[i+1]) span starts from an empty state.
def _spans(T, cu_seqlens):
    if cu_seqlens is None:
        return [(0, T)]
    c = cu_seqlens.tolist()
    return list(zip(c[:-1], c[1:]))


class ShortConvolution(nn.Conv1d):
    def __init__(self, hidden_size, kernel_size, bias=False, activation='silu'):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, padding=kernel_size - 1, bias=bias)
        self.activation = activation

    def forward(self, x, cu_seqlens=None, **kwargs):  # x: [B, T, D]
        outs = []
        for s, e in _spans(x.shape[1], cu_seqlens):
            seg = x[:, s:e].transpose(1, 2)
            y = F.conv1d(seg, self.weight, self.bias, padding=self.kernel_size[0] - 1, groups=self.groups)[..., :e - s]
            outs.append(y.transpose(1, 2))
        y = torch.cat(outs, dim=1)
        return (F.silu(y) if self.activation == 'silu' else y), None


class FusedRMSNormGated(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, activation='swish', device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x, o):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight
        return x * F.silu(o)


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None):
    # q, k: [B, T, H, K]; v: [B, T, H, V]; g, beta: [B, T, H]
    if use_qk_l2norm_in_kernel:
        q = F.normalize(q, p=2, dim=-1)
        k = F.normalize(k, p=2, dim=-1)
    B, T, H, K = k.shape
    V = v.shape[-1]
    scale = K ** -0.5 if scale is None else scale
    o = torch.zeros(B, T, H, V)
    for s, e in _spans(T, cu_seqlens):
        h = torch.zeros(B, H, K, V)
        for t in range(s, e):
            h = h * g[:, t].exp()[..., None, None]
            v_t = v[:, t] - (h * k[:, t][..., None]).sum(-2)
            v_t = v_t * beta[:, t][..., None]
            h = h + k[:, t][..., None] * v_t[..., None, :]
            o[:, t] = torch.einsum('bhk,bhkv->bhv', q[:, t] * scale, h)
    return o, (h if output_final_state else None)


# ---- slime_plugins/models/qwen3_next.py
class Qwen3NextGatedDeltaNet(nn.Module):
    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.hidden_size = config.hidden_size
        self.num_v_heads = config.linear_num_value_heads
        self.num_k_heads = config.linear_num_key_heads
        self.head_k_dim = config.linear_key_head_dim
        self.head_v_dim = config.linear_value_head_dim
        self.key_dim = self.head_k_dim * self.num_k_heads
        self.value_dim = self.head_v_dim * self.num_v_heads
        self.conv_kernel_size = config.linear_conv_kernel_dim
        self.layer_idx = layer_idx
        self.activation = config.hidden_act
        self.act = ACT2FN[config.hidden_act]
        self.layer_norm_epsilon = config.rms_norm_eps
        self.conv_dim = self.key_dim * 2 + self.value_dim
        self.conv1d = ShortConvolution(hidden_size=self.conv_dim, bias=False, kernel_size=self.conv_kernel_size)
        projection_size_qkvz = self.key_dim * 2 + self.value_dim * 2
        projection_size_ba = self.num_v_heads * 2
        self.in_proj_qkvz = nn.Linear(self.hidden_size, projection_size_qkvz, bias=False)
        self.in_proj_ba = nn.Linear(self.hidden_size, projection_size_ba, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.num_v_heads))
        A = torch.empty(self.num_v_heads).uniform_(0, 16)
        self.A_log = nn.Parameter(torch.log(A))
        self.norm = FusedRMSNormGated(self.head_v_dim, eps=self.layer_norm_epsilon, activation=self.activation)
        self.out_proj = nn.Linear(self.value_dim, self.hidden_size, bias=False)

    def fix_query_key_value_ordering(self, mixed_qkvz, mixed_ba):
        new_tensor_shape_qkvz = mixed_qkvz.size()[:-1] + (
            self.num_k_heads,
            2 * self.head_k_dim + 2 * self.head_v_dim * self.num_v_heads // self.num_k_heads,
        )
        new_tensor_shape_ba = mixed_ba.size()[:-1] + (self.num_k_heads, 2 * self.num_v_heads // self.num_k_heads)
        mixed_qkvz = mixed_qkvz.view(*new_tensor_shape_qkvz)
        mixed_ba = mixed_ba.view(*new_tensor_shape_ba)
        split_arg_list_qkvz = [
            self.head_k_dim,
            self.head_k_dim,
            (self.num_v_heads // self.num_k_heads * self.head_v_dim),
            (self.num_v_heads // self.num_k_heads * self.head_v_dim),
        ]
        split_arg_list_ba = [self.num_v_heads // self.num_k_heads, self.num_v_heads // self.num_k_heads]
        query, key, value, z = torch.split(mixed_qkvz, split_arg_list_qkvz, dim=3)
        b, a = torch.split(mixed_ba, split_arg_list_ba, dim=3)
        value = value.reshape(value.size(0), value.size(1), -1, self.head_v_dim)
        z = z.reshape(z.size(0), z.size(1), -1, self.head_v_dim)
        b = b.reshape(b.size(0), b.size(1), self.num_v_heads)
        a = a.reshape(a.size(0), a.size(1), self.num_v_heads)
        return query, key, value, z, b, a

    def forward(self, hidden_states, cu_seqlens=None):
        projected_states_qkvz = self.in_proj_qkvz(hidden_states)
        projected_states_ba = self.in_proj_ba(hidden_states)
        query, key, value, z, b, a = self.fix_query_key_value_ordering(projected_states_qkvz, projected_states_ba)
        query, key, value = (x.reshape(x.shape[0], x.shape[1], -1) for x in (query, key, value))
        mixed_qkv = torch.cat((query, key, value), dim=-1)
        mixed_qkv, _ = self.conv1d(x=mixed_qkv, cu_seqlens=cu_seqlens)
        query, key, value = torch.split(mixed_qkv, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        query = query.reshape(query.shape[0], query.shape[1], -1, self.head_k_dim)
        key = key.reshape(key.shape[0], key.shape[1], -1, self.head_k_dim)
        value = value.reshape(value.shape[0], value.shape[1], -1, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if self.num_v_heads // self.num_k_heads > 1:
            query = query.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)
            key = key.repeat_interleave(self.num_v_heads // self.num_k_heads, dim=2)

        if not FIXED:
            core_attn_out, last_recurrent_state = chunk_gated_delta_rule(
                query, key, value, g=g, beta=beta,
                initial_state=None,
                output_final_state=False,
                use_qk_l2norm_in_kernel=True,
            )
        else:
            core_attn_out, last_recurrent_state = chunk_gated_delta_rule(
                query, key, value, g=g, beta=beta,
                initial_state=None,
                output_final_state=False,
                use_qk_l2norm_in_kernel=True,
                cu_seqlens=cu_seqlens,
            )

        z_shape_og = z.shape
        core_attn_out = core_attn_out.reshape(-1, core_attn_out.shape[-1])
        z = z.reshape(-1, z.shape[-1])
        core_attn_out = self.norm(core_attn_out, z)
        core_attn_out = core_attn_out.reshape(z_shape_og)
        core_attn_out = core_attn_out.reshape(core_attn_out.shape[0], core_attn_out.shape[1], -1)
        return self.out_proj(core_attn_out)


class PackedSeqParams:  # megatron.core.packed_seq_params.PackedSeqParams
    def __init__(self, **kwargs):
        for key, value in kwargs.items():
            setattr(self, key, value)


# ---- slime_plugins/models/hf_attention.py HuggingfaceAttention.forward (no SP / CP) + qwen3_next.Attention
class Attention(nn.Module):
    def __init__(self, hf_config, layer_number):
        super().__init__()
        self.hf_config = hf_config
        self.hf_layer_idx = layer_number - 1
        self.linear_attn = Qwen3NextGatedDeltaNet(self.hf_config, self.hf_layer_idx)
        self.input_layernorm = Qwen3NextRMSNorm(self.hf_config.hidden_size, eps=self.hf_config.rms_norm_eps)

    def forward(self, hidden_states, attention_mask, packed_seq_params=None):
        assert packed_seq_params is not None
        hidden_states = hidden_states.permute(1, 0, 2)  # [bsz, seq_len, hidden_dim]
        output = self.hf_forward(hidden_states, packed_seq_params)
        output = output.permute(1, 0, 2)  # [seq_len, bsz, hidden_dim]
        return output, None

    def hf_forward(self, hidden_states, packed_seq_params):
        hidden_states = self.input_layernorm(hidden_states)
        return self.linear_attn(hidden_states=hidden_states, cu_seqlens=packed_seq_params.cu_seqlens_q)


config = SimpleNamespace(hidden_size=32, linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
                         linear_value_head_dim=8, linear_conv_kernel_dim=4, hidden_act="silu", rms_norm_eps=1e-6,
                         dtype=torch.float32)
layer = Attention(config, layer_number=1)

# a packed (thd) micro-batch of three samples: Megatron layout [total_tokens, 1, hidden]
lengths = [7, 9, 6]
samples = [torch.randn(n, 1, config.hidden_size) for n in lengths]
packed = torch.cat(samples, dim=0)
cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
params = PackedSeqParams(cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths),
                         qkv_format="thd")

packed_out, _ = layer(packed, None, packed_seq_params=params)
packed_out.sum().backward()  # the training step's backward runs on the same packed graph

with torch.no_grad():
    worst = 0.0
    for i, x in enumerate(samples):
        one = torch.tensor([0, lengths[i]], dtype=torch.int32)
        ref, _ = layer(x, None, packed_seq_params=PackedSeqParams(cu_seqlens_q=one, cu_seqlens_kv=one))
        got = packed_out[cu[i]:cu[i + 1]]
        worst = max(worst, (got - ref).abs().max().item())

print(f"fixed={FIXED} packed samples {lengths}: max |packed layer output - each sample run alone| = {worst:.6f}")
