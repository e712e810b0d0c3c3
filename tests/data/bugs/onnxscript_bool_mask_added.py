"""microsoft/onnxscript#580, fixed by #656: torch_lib's aten::scaled_dot_product_attention for a bool attn_mask added
the mask to the scores as it was, so True (attend) counted as 1 and False as 0: nothing was masked. The fix casts it
first: where(attn_mask, 0, -inf). Written as that function (onnxscript/function_libs/torch_lib/ops/nn.py) with its ONNX
ops as torch calls: MatMul, Mul, Add, Softmax."""

import math
import sys

import torch

FIXED = "--fixed" in sys.argv


def _aten_scaled_dot_product_attention_bool_mask_onnx(query, key, value, attn_mask):
    scale = 1.0 / math.sqrt(query.shape[-1])
    key_transposed = key.transpose(-2, -1)
    query_scaled = query * math.sqrt(scale)
    key_transposed_scaled = key_transposed * math.sqrt(scale)
    if FIXED:
        attn_mask = torch.where(attn_mask, torch.tensor(0.0), torch.tensor(float("-inf")))
    attn_weight = torch.softmax(torch.matmul(query_scaled, key_transposed_scaled) + attn_mask, dim=-1)
    return torch.matmul(attn_weight, value)


torch.manual_seed(0)
q = k = v = torch.randn(1, 2, 5, 4)
causal = torch.ones(5, 5, dtype=torch.bool).tril()
_aten_scaled_dot_product_attention_bool_mask_onnx(q, k, v, causal)
