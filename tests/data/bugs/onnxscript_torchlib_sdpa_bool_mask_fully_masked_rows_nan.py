# microsoft/onnxscript PR #2479 (commit ecb7677): torch_lib's exported aten::scaled_dot_product_attention with a
# boolean attn_mask turns False into -inf and runs a plain ONNX Softmax, so a fully-masked query row (a left-pad
# token under a causal+padding mask) becomes NaN instead of aten's zeros, and the NaN then leaks into real tokens.
import math
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
_INT64_MAX = 9223372036854775807
_INT64_MIN = -9223372036854775808


class op:
    """The ONNX operators used by torch_lib, evaluated eagerly (what onnxruntime computes for the graph)."""

    Shape = staticmethod(lambda x: torch.tensor(x.shape, dtype=torch.int64))
    Concat = staticmethod(lambda *xs, axis=0: torch.cat([torch.as_tensor(x, dtype=torch.int64) for x in xs], axis))
    Reshape = staticmethod(lambda x, s: x.reshape([int(v) for v in s]))
    Transpose = staticmethod(lambda x, perm: x.permute(*perm))
    Mul = staticmethod(torch.mul)
    Add = staticmethod(torch.add)
    MatMul = staticmethod(torch.matmul)
    Sqrt = staticmethod(torch.sqrt)
    Softmax = staticmethod(lambda x, axis=-1: torch.softmax(x, axis))  # ONNX Softmax: no masked/safe variant
    Where = staticmethod(torch.where)
    IsNaN = staticmethod(torch.isnan)
    Dropout = staticmethod(lambda x, p: (x, None))  # inference graph

    @staticmethod
    def Constant(value=None, value_ints=None):
        return torch.tensor(value_ints, dtype=torch.int64) if value_ints is not None else value

    @staticmethod
    def Slice(x, starts, ends):
        n = len(x)
        s, e = int(torch.as_tensor(starts).reshape(-1)[0]), int(torch.as_tensor(ends).reshape(-1)[0])
        s = max(s + n, 0) if s < 0 else min(s, n)
        e = max(e + n, 0) if e < 0 else min(e, n)
        return x[s:e]

    @staticmethod
    def CastLike(x, like):
        return torch.as_tensor(x, dtype=like.dtype)


def _attention_scale(query):
    return 1.0 / math.sqrt(query.shape[-1])


def _aten_scaled_dot_product_attention_bool_mask_onnx(query, key, value, attn_mask, scale, dropout_p):
    # Swap the last two axes of key
    key_shape = op.Shape(key)
    key_last_dim = op.Slice(key_shape, [-1], op.Constant(value_ints=[_INT64_MAX]))
    key_second_last_dim = op.Slice(key_shape, [-2], [-1])
    key_first_dims = op.Slice(key_shape, op.Constant(value_ints=[_INT64_MIN]), [-2])
    key_squeezed_shape = op.Concat(op.Constant(value_ints=[-1]), key_second_last_dim, key_last_dim, axis=0)
    key_squeezed = op.Reshape(key, key_squeezed_shape)
    key_squeezed_transposed = op.Transpose(key_squeezed, perm=[0, 2, 1])
    key_transposed_shape = op.Concat(key_first_dims, key_last_dim, key_second_last_dim, axis=0)
    key_transposed = op.Reshape(key_squeezed_transposed, key_transposed_shape)

    query_scaled = op.Mul(query, op.Sqrt(scale))
    key_transposed_scaled = op.Mul(key_transposed, op.Sqrt(scale))
    # Turn the Boolean mask to float: attn_mask.masked_fill(not attn_mask, -float('inf'))
    zero = op.Constant(value=torch.tensor(0.0, dtype=query.dtype))
    neg_inf = op.Constant(value=torch.tensor(-float("inf"), dtype=query.dtype))
    attn_mask = op.Where(attn_mask, zero, neg_inf)
    attn_weight = op.Softmax(op.Add(op.MatMul(query_scaled, key_transposed_scaled), attn_mask), axis=-1)
    if FIXED:
        # When using scaled dot product attention with a boolean mask, the softmax operation might return NaN
        # values due to the presence of -inf in an entire row (padding tokens)
        attn_weight = op.Where(op.IsNaN(attn_weight), zero, attn_weight)
    attn_weight, _ = op.Dropout(attn_weight, dropout_p)
    return op.MatMul(attn_weight, value)


def aten_scaled_dot_product_attention_bool_mask(query, key, value, attn_mask=None, dropout_p=0.0,
                                                is_causal=False, scale=None):
    assert (not is_causal) or (is_causal and attn_mask is None)
    if scale is None:
        scale = _attention_scale(query)
    scale = op.CastLike(scale, query)
    return _aten_scaled_dot_product_attention_bool_mask_onnx(query, key, value, attn_mask, scale, dropout_p)


class Block(nn.Module):
    def __init__(self, d=32, h=4):
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x, mask, sdpa):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.h, C // self.h).transpose(1, 2) for t in (q, k, v))
        y = sdpa(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, T, C)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


class TinyDecoder(nn.Module):
    def __init__(self, vocab=50, d=32, n_layers=2, max_len=16):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab, d), nn.Embedding(max_len, d)
        self.blocks = nn.ModuleList(Block(d) for _ in range(n_layers))

    def forward(self, input_ids, attention_mask, sdpa):
        T = input_ids.shape[1]
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        x = self.wte(input_ids) + self.wpe(position_ids)
        # boolean causal + padding mask, True = attend (the 4D bool mask sdpa-style models build)
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        mask = causal[None, None] & attention_mask[:, None, None, :].bool()
        for blk in self.blocks:
            x = blk(x, mask, sdpa)
        return x


model = TinyDecoder().eval()
input_ids = torch.tensor([[0, 0, 7, 3, 9, 4], [5, 8, 2, 6, 1, 3]])  # left-padded batch
attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1]])
with torch.no_grad():
    ref = model(input_ids, attention_mask, F.scaled_dot_product_attention)  # eager aten sdpa
    onnx_out = model(input_ids, attention_mask, aten_scaled_dot_product_attention_bool_mask)  # exported graph
real = attention_mask.bool()
diff = (onnx_out - ref)[real].abs()
print(f"NaNs in exported-graph hidden states of real tokens: {int(torch.isnan(onnx_out[real]).sum())}")
print(f"max |exported - eager| over real tokens: {diff.max().item():.6f}")
