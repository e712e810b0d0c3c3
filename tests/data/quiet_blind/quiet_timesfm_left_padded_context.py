# Citation: google-research/timesfm src/timesfm/pytorch_patched_decoder.py (convert_paddings_to_mask, causal_mask,
#   merge_masks, TimesFMAttention, StackedDecoder, PatchedTimeSeriesDecoder._preprocess_input).
# Short contexts are left-padded (paddings = 1.0); a patch counts as padding only if all its points are padding.
# The padding mask (-0.7*finfo.max on padded keys) and the causal mask (same value above the diagonal) are merged with
# torch.minimum (no overflow) and added to eager scores. A fully padded leading patch may have every key masked: on
# purpose its finite large-negative row softmaxes to a harmless uniform row and its output is never read (only the last
# patch's output is decoded, and later non-padded patches never attend to padded ones).
import torch
import torch.nn.functional as F
from torch import nn

torch.manual_seed(0)


def get_large_negative_number(dtype):
    """Returns a large negative value for the given dtype."""
    if dtype.is_floating_point:
        dtype_max = torch.finfo(dtype).max
    else:
        dtype_max = torch.iinfo(dtype).max
    return torch.tensor(-0.7 * dtype_max, dtype=dtype)


def convert_paddings_to_mask(paddings, dtype=torch.float32):
    attention_mask = paddings.detach().clone()
    attention_mask = attention_mask[:, None, None, :]  # Equivalent to jnp.newaxis
    attention_mask *= get_large_negative_number(dtype)
    return attention_mask


def causal_mask(input_t):
    assert input_t.dtype.is_floating_point, input_t.dtype
    large_negative_number = get_large_negative_number(input_t.dtype)
    t = input_t.shape[1]
    col_idx = torch.arange(t).unsqueeze(0).repeat(t, 1)
    row_idx = torch.arange(t).unsqueeze(1).repeat(1, t)
    mask = (row_idx < col_idx).to(input_t.dtype) * large_negative_number
    return mask.unsqueeze(0).unsqueeze(0).to(input_t.device)


def merge_masks(a, b):
    def expand_t(key_mask):
        query_mask = key_mask.transpose(-1, -2)
        return torch.minimum(query_mask, key_mask)

    if a.shape[2] != b.shape[2]:
        if a.shape[2] == 1:
            a = expand_t(a)
        else:
            assert b.shape[2] == 1
            b = expand_t(b)
    assert a.shape[1:] == b.shape[1:], f"a.shape={a.shape}, b.shape={b.shape}."
    return torch.minimum(a, b)


class TimesFMAttention(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.scaling = nn.Parameter(torch.empty((self.head_dim,), dtype=torch.float32).zero_())
        self.qkv_proj = nn.Linear(hidden_size, 3 * hidden_size)
        self.o_proj = nn.Linear(hidden_size, hidden_size)

    def _per_dim_scaling(self, query):
        r_softplus_0 = 1.442695041
        softplus_func = torch.nn.Softplus()
        scale = r_softplus_0 / (self.head_dim ** 0.5)
        scale = scale * softplus_func(self.scaling)
        return query * scale[None, None, None, :]

    def forward(self, hidden_states, mask):
        b, n, _ = hidden_states.shape
        qkv = self.qkv_proj(hidden_states)
        xq, xk, xv = qkv.split(qkv.shape[-1] // 3, dim=-1)
        xq = xq.view(b, -1, self.num_heads, self.head_dim).transpose(1, 2)
        xk = xk.view(b, -1, self.num_heads, self.head_dim).transpose(1, 2)
        xv = xv.view(b, -1, self.num_heads, self.head_dim).transpose(1, 2)
        xq = self._per_dim_scaling(xq)
        scores = torch.matmul(xq, xk.transpose(2, 3))
        scores = scores + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, xv)
        output = output.transpose(1, 2).contiguous().view(b, n, -1)
        return self.o_proj(output)


class TimesFMDecoderLayer(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.input_layernorm = nn.RMSNorm(hidden_size, eps=1e-6)
        self.self_attn = TimesFMAttention(hidden_size, num_heads)
        self.mlp = nn.Sequential(nn.LayerNorm(hidden_size), nn.Linear(hidden_size, 64), nn.ReLU(),
                                 nn.Linear(64, hidden_size))

    def forward(self, hidden_states, mask, paddings):
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states = residual + self.self_attn(hidden_states, mask)
        return hidden_states + self.mlp(hidden_states) * (1.0 - paddings[..., None])


class StackedDecoder(nn.Module):
    def __init__(self, hidden_size, num_heads, num_layers):
        super().__init__()
        self.layers = nn.ModuleList([TimesFMDecoderLayer(hidden_size, num_heads) for _ in range(num_layers)])

    def forward(self, hidden_states, paddings):
        padding_mask = convert_paddings_to_mask(paddings, hidden_states.dtype)
        atten_mask = causal_mask(hidden_states)
        mask = merge_masks(padding_mask, atten_mask)
        for layer in self.layers:
            hidden_states = layer(hidden_states, mask, paddings)
        return hidden_states


patch_len, horizon_len, hidden = 8, 16, 32
input_ff = nn.Sequential(nn.Linear(2 * patch_len, 64), nn.SiLU(), nn.Linear(64, hidden))
horizon_ff = nn.Linear(hidden, horizon_len)
decoder = StackedDecoder(hidden, 4, 2)

# three series with different context lengths, left-padded to 48 points like TimesFmTorch._forecast
lengths = [48, 30, 13]
ctx = 48
input_ts = torch.zeros(3, ctx)
input_padding = torch.ones(3, ctx)
for i, L in enumerate(lengths):
    input_ts[i, ctx - L:] = torch.sin(torch.arange(L) * 0.3 + i) + 0.1 * torch.randn(L)
    input_padding[i, ctx - L:] = 0.0

# _preprocess_input: patch, normalise on unpadded values, patch padding = all points padded
patched_inputs = input_ts.view(3, -1, patch_len)
patched_pads = input_padding.view(3, -1, patch_len)
keep = 1.0 - input_padding
mu = (input_ts * keep).sum(1) / keep.sum(1)
sigma = (((input_ts - mu[:, None]) ** 2 * keep).sum(1) / keep.sum(1)).sqrt()
patched_inputs = (patched_inputs - mu[:, None, None]) / sigma[:, None, None] * (1.0 - patched_pads)
concat_inputs = torch.cat([patched_inputs, patched_pads], dim=-1)
model_input = input_ff(concat_inputs)
patched_padding = torch.min(patched_pads, dim=-1)[0]
out = decoder(model_input, patched_padding)
forecast = horizon_ff(out[:, -1]) * sigma[:, None] + mu[:, None]
print("patch padding", patched_padding.tolist())
print("forecast norm %.4f" % forecast.norm().item())
