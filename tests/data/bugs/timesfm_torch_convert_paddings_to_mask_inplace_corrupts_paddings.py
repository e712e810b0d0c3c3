# TimesFM (PyTorch patched decoder), google-research/timesfm commit 1b95563 ("Full pytorch support"):
# convert_paddings_to_mask multiplies a VIEW of `paddings` in place by -0.7*finfo.max, so the padding tensor the
# StackedDecoder then hands to every layer's MLP (outputs * (1 - paddings)) is corrupted; left-padded series blow up.
import dataclasses
import math
import sys
from typing import List, Tuple

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclasses.dataclass
class TimesFMConfig:
    num_layers: int = 3
    num_heads: int = 4
    num_kv_heads: int = 4
    hidden_size: int = 32
    intermediate_size: int = 32
    head_dim: int = 8
    rms_norm_eps: float = 1e-6
    patch_len: int = 8
    horizon_len: int = 8
    quantiles: List[float] = dataclasses.field(default_factory=lambda: [0.1, 0.25, 0.5, 0.75, 0.9])
    pad_val: float = 1123581321.0
    tolerance: float = 1e-6
    use_positional_embedding: bool = True


def _masked_mean_std(inputs, padding):
    pad_sum = torch.sum(1 - padding, dim=2)

    def _get_patch_index(arr):
        indices = torch.argmax((arr >= 3).to(torch.int32), dim=1)
        row_sum = (arr >= 3).to(torch.int32).sum(dim=1)
        return torch.where(row_sum == 0, arr.shape[1] - 1, indices)

    patch_indices = _get_patch_index(pad_sum)
    bidxs = torch.arange(inputs.shape[0])
    arr = inputs[bidxs, patch_indices, :]
    pad = padding[bidxs, patch_indices, :]
    mask = 1 - pad
    num_valid_elements = torch.sum(mask, dim=1)
    num_valid_elements = torch.where(num_valid_elements == 0, torch.tensor(1, dtype=num_valid_elements.dtype),
                                     num_valid_elements)
    masked_sum = torch.sum(arr * mask, dim=1)
    masked_squared_sum = torch.sum((arr * mask) ** 2, dim=1)
    masked_mean = masked_sum / num_valid_elements
    masked_var = masked_squared_sum / num_valid_elements - masked_mean ** 2
    masked_var = torch.where(masked_var < 0.0, torch.tensor(0.0, dtype=masked_var.dtype), masked_var)
    return masked_mean, torch.sqrt(masked_var)


def _shift_padded_seq(mask, seq):
    batch_size, num_seq, feature_dim = seq.shape
    new_mask = mask == 0
    indices = new_mask.to(torch.int32).argmax(dim=1)
    indices[~new_mask.any(dim=1)] = -1
    idx_range = torch.arange(num_seq).unsqueeze(0).unsqueeze(-1).expand(batch_size, -1, feature_dim)
    shifted_idx = (idx_range - indices[:, None, None]) % num_seq
    return seq.gather(1, shifted_idx)


def get_large_negative_number(dtype):
    dtype_max = torch.finfo(dtype).max if dtype.is_floating_point else torch.iinfo(dtype).max
    return torch.tensor(-0.7 * dtype_max, dtype=dtype)


def convert_paddings_to_mask(paddings: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Converts binary paddings to a logit mask ready to add to attention matrix."""
    if FIXED:
        attention_mask = paddings.detach().clone()
        attention_mask = attention_mask[:, None, None, :]  # Equivalent to jnp.newaxis
    else:
        attention_mask = paddings[:, None, None, :]  # Equivalent to jnp.newaxis
    attention_mask *= get_large_negative_number(dtype)
    return attention_mask


def causal_mask(input_t: torch.Tensor) -> torch.Tensor:
    large_negative_number = get_large_negative_number(input_t.dtype)
    t = input_t.shape[1]
    col_idx = torch.arange(t).unsqueeze(0).repeat(t, 1)
    row_idx = torch.arange(t).unsqueeze(1).repeat(1, t)
    mask = (row_idx < col_idx).to(input_t.dtype) * large_negative_number
    return mask.unsqueeze(0).unsqueeze(0).to(input_t.device)


def merge_masks(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    def expand_t(key_mask):
        query_mask = key_mask.transpose(-1, -2)
        return torch.minimum(query_mask, key_mask)

    if a.shape[2] != b.shape[2]:
        if a.shape[2] == 1:
            a = expand_t(a)
        else:
            b = expand_t(b)
    return torch.minimum(a, b)


class ResidualBlock(nn.Module):
    def __init__(self, input_dims, hidden_dims, output_dims):
        super().__init__()
        self.hidden_layer = nn.Linear(input_dims, hidden_dims)
        self.act = nn.SiLU()
        self.output_layer = nn.Linear(hidden_dims, output_dims)
        self.residual_layer = nn.Linear(input_dims, output_dims)

    def forward(self, x):
        return self.output_layer(self.act(self.hidden_layer(x))) + self.residual_layer(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-6, add_unit_offset=False):
        super().__init__()
        self.eps = eps
        self.add_unit_offset = add_unit_offset
        self.weight = nn.Parameter(torch.zeros(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float())
        output = output * (1 + self.weight.float()) if self.add_unit_offset else output * self.weight.float()
        return output.type_as(x)


class TransformerMLP(nn.Module):
    def __init__(self, hidden_size, intermediate_size):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size)
        self.down_proj = nn.Linear(intermediate_size, hidden_size)
        self.layer_norm = nn.LayerNorm(normalized_shape=hidden_size, eps=1e-6)

    def forward(self, x, paddings=None):
        gate = F.relu(self.gate_proj(self.layer_norm(x)))
        outputs = self.down_proj(gate)
        if paddings is not None:
            outputs = outputs * (1.0 - paddings[:, :, None])
        return outputs + x


class TimesFMAttention(nn.Module):
    def __init__(self, hidden_size, num_heads, num_kv_heads, head_dim):
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.hidden_size = hidden_size
        self.head_dim = head_dim
        self.q_size = num_heads * head_dim
        self.kv_size = num_kv_heads * head_dim
        self.scaling = nn.Parameter(torch.empty((head_dim,), dtype=torch.float32))
        self.qkv_proj = nn.Linear(hidden_size, (num_heads + 2 * num_kv_heads) * head_dim)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size)

    def _per_dim_scaling(self, query):
        r_softplus_0 = 1.442695041
        scale = r_softplus_0 / math.sqrt(self.head_dim)
        scale = scale * torch.nn.Softplus()(self.scaling)
        return query * scale[None, None, None, :]

    def forward(self, hidden_states, mask, kv_write_indices=None, kv_cache=None):
        batch_size, input_len, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        xq = xq.view(batch_size, -1, self.num_heads, self.head_dim)
        xk = xk.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xv = xv.view(batch_size, -1, self.num_kv_heads, self.head_dim)
        xq = self._per_dim_scaling(xq)
        key, value = xk, xv
        q = xq.transpose(1, 2)
        k = key.transpose(1, 2)
        v = value.transpose(1, 2)
        scores = torch.matmul(q, k.transpose(2, 3))
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        output = torch.matmul(scores, v)
        output = output.transpose(1, 2).contiguous().view(batch_size, input_len, -1)
        return scores, self.o_proj(output)


class TimesFMDecoderLayer(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, rms_norm_eps=1e-6):
        super().__init__()
        self.self_attn = TimesFMAttention(hidden_size, num_heads, num_kv_heads, head_dim)
        self.mlp = TransformerMLP(hidden_size, intermediate_size)
        self.input_layernorm = RMSNorm(hidden_size, eps=rms_norm_eps)

    def forward(self, hidden_states, mask, paddings, kv_write_indices=None, kv_cache=None):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        scores, hidden_states = self.self_attn(hidden_states=hidden_states, mask=mask)
        hidden_states = residual + hidden_states
        hidden_states = self.mlp(hidden_states, paddings=paddings)
        return scores, hidden_states


class StackedDecoder(nn.Module):
    def __init__(self, hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, num_layers,
                 rms_norm_eps=1e-6):
        super().__init__()
        self.layers = nn.ModuleList([
            TimesFMDecoderLayer(hidden_size, intermediate_size, num_heads, num_kv_heads, head_dim, rms_norm_eps)
            for _ in range(num_layers)])

    def forward(self, hidden_states, paddings, kv_write_indices=None, kv_caches=None):
        padding_mask = convert_paddings_to_mask(paddings, hidden_states.dtype)
        atten_mask = causal_mask(hidden_states)
        mask = merge_masks(padding_mask, atten_mask)
        for i in range(len(self.layers)):
            _, hidden_states = self.layers[i](hidden_states=hidden_states, mask=mask, paddings=paddings)
        return hidden_states


class PositionalEmbedding(nn.Module):
    def __init__(self, embedding_dims, min_timescale=1, max_timescale=10_000):
        super().__init__()
        self.min_timescale = min_timescale
        self.max_timescale = max_timescale
        self.embedding_dims = embedding_dims

    def forward(self, seq_length=None, position=None):
        if position is None:
            position = torch.arange(seq_length, dtype=torch.float32).unsqueeze(0)
        num_timescales = self.embedding_dims // 2
        log_timescale_increment = math.log(float(self.max_timescale) / float(self.min_timescale)) / max(
            num_timescales - 1, 1)
        inv_timescales = self.min_timescale * torch.exp(
            torch.arange(num_timescales, dtype=torch.float32) * -log_timescale_increment)
        scaled_time = position.unsqueeze(2) * inv_timescales.unsqueeze(0).unsqueeze(0)
        signal = torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=2)
        return F.pad(signal, (0, 0, 0, self.embedding_dims % 2))


class PatchedTimeSeriesDecoder(nn.Module):
    def __init__(self, config: TimesFMConfig):
        super().__init__()
        self.config = config
        self.input_ff_layer = ResidualBlock(2 * config.patch_len, config.intermediate_size, config.hidden_size)
        self.freq_emb = nn.Embedding(num_embeddings=3, embedding_dim=config.hidden_size)
        self.horizon_ff_layer = ResidualBlock(config.hidden_size, config.intermediate_size,
                                              config.horizon_len * (1 + len(config.quantiles)))
        self.stacked_transformer = StackedDecoder(config.hidden_size, config.intermediate_size, config.num_heads,
                                                  config.num_kv_heads, config.head_dim, config.num_layers,
                                                  config.rms_norm_eps)
        if config.use_positional_embedding:
            self.position_emb = PositionalEmbedding(config.hidden_size)

    def _forward_transform(self, inputs, patched_pads):
        mu, sigma = _masked_mean_std(inputs, patched_pads)
        sigma = torch.where(sigma < self.config.tolerance, torch.tensor(1.0, dtype=sigma.dtype), sigma)
        outputs = (inputs - mu[:, None, None]) / sigma[:, None, None]
        outputs = torch.where(torch.abs(inputs - self.config.pad_val) < self.config.tolerance,
                              torch.tensor(self.config.pad_val, dtype=outputs.dtype), outputs)
        return outputs, (mu, sigma)

    def _reverse_transform(self, outputs, stats):
        mu, sigma = stats
        return outputs * sigma[:, None, None, None] + mu[:, None, None, None]

    def _preprocess_input(self, input_ts, input_padding):
        bsize = input_ts.shape[0]
        patched_inputs = input_ts.view(bsize, -1, self.config.patch_len)
        patched_pads = input_padding.view(bsize, -1, self.config.patch_len)
        patched_inputs = torch.where(torch.abs(patched_pads - 1.0) < self.config.tolerance,
                                     torch.tensor(0.0, dtype=patched_inputs.dtype), patched_inputs)
        patched_pads = torch.where(torch.abs(patched_inputs - self.config.pad_val) < self.config.tolerance,
                                   torch.tensor(1.0, dtype=patched_pads.dtype), patched_pads)
        patched_inputs, stats = self._forward_transform(patched_inputs, patched_pads)
        patched_inputs = patched_inputs * (1.0 - patched_pads)
        concat_inputs = torch.cat([patched_inputs, patched_pads], dim=-1)
        model_input = self.input_ff_layer(concat_inputs)
        patched_padding = torch.min(patched_pads, dim=-1)[0]
        if self.config.use_positional_embedding:
            pos_emb = self.position_emb(model_input.shape[1])
            pos_emb = torch.concat([pos_emb] * model_input.shape[0], dim=0)
            pos_emb = _shift_padded_seq(patched_padding, pos_emb)
            model_input += pos_emb
        return model_input, patched_padding, stats, patched_inputs

    def _postprocess_output(self, model_output, num_outputs, stats):
        output_ts = self.horizon_ff_layer(model_output)
        b, n, _ = output_ts.shape
        output_ts = output_ts.view(b, n, self.config.horizon_len, num_outputs)
        return self._reverse_transform(output_ts, stats)

    def forward(self, input_ts, input_padding, freq):
        num_outputs = len(self.config.quantiles) + 1
        model_input, patched_padding, stats, _ = self._preprocess_input(input_ts, input_padding)
        model_input += self.freq_emb(freq)
        model_output = self.stacked_transformer(model_input, patched_padding)
        return self._postprocess_output(model_output, num_outputs, stats)

    def decode(self, input_ts, paddings, freq, horizon_len, output_patch_len=None, max_len=512):
        final_out = input_ts
        full_outputs = []
        if output_patch_len is None:
            output_patch_len = self.config.horizon_len
        num_decode_patches = (horizon_len + output_patch_len - 1) // output_patch_len
        for step_index in range(num_decode_patches):
            current_padding = paddings[:, 0:final_out.shape[1]]
            input_ts = final_out[:, -max_len:]
            input_padding = current_padding[:, -max_len:]
            fprop_outputs = self(input_ts, input_padding, freq)
            new_ts = fprop_outputs[:, -1, :output_patch_len, 0]
            full_outputs.append(fprop_outputs[:, -1, :output_patch_len, :])
            final_out = torch.concatenate([final_out, new_ts], axis=-1)
        full_outputs = torch.concatenate(full_outputs, axis=1)[:, 0:horizon_len, :]
        return full_outputs[:, :, 0], full_outputs


cfg = TimesFMConfig()
model = PatchedTimeSeriesDecoder(cfg).eval()
with torch.no_grad():
    for m in model.modules():
        if isinstance(m, RMSNorm):
            m.weight.normal_(0.0, 1.0)
        if isinstance(m, TimesFMAttention):
            m.scaling.normal_(0.0, 1.0)

P, horizon = cfg.patch_len, 16
long_ts = torch.randn(1, 4 * P).cumsum(-1)      # 4 patches of context
short_ts = torch.randn(1, 2 * P).cumsum(-1)     # 2 patches of context, left-padded to 4 in the batch
batch_ts = torch.cat([long_ts, torch.cat([torch.zeros(1, 2 * P), short_ts], dim=1)], dim=0)
batch_pad = torch.zeros(2, 4 * P + horizon)
batch_pad[1, :2 * P] = 1.0
freq = torch.zeros(2, 1, dtype=torch.long)

with torch.no_grad():
    batched, _ = model.decode(batch_ts, batch_pad, freq, horizon_len=horizon)
    alone, _ = model.decode(short_ts, torch.zeros(1, 2 * P + horizon), freq[:1], horizon_len=horizon)

diff = (batched[1] - alone[0]).abs().max().item()
print(f"max |forecast(left-padded in batch) - forecast(alone)|: {diff}")
