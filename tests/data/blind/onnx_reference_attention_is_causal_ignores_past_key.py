"""ONNX reference `Attention` (opset 23): `is_causal` builds a top-left tril that ignores `past_key`.

Citation: onnx/onnx PR #7297, "Fix causal mask in reference implementation of Attention" (merged,
commit 984500afc71273a7c02e1cc54187d8d36aaf2cff); the diff of onnx/reference/ops/op_attention.py and
the parent version of that file were read. ("Past should not be impacted by the causal mask.")

Bug: `_compute_attention` concatenates `past_key`/`past_value` in front of the new K/V, then for
`is_causal` builds `np.tril(ones((q_sequence_length, kv_sequence_length)), k=0)`, where
kv_sequence_length is past + new. Query i of the new tokens (absolute position past + i) may attend only
keys [0, i]: the newest past keys and its own key are hidden at every cached step.

Fix: `_apply_causal(mask, past_sequence_length)` leaves the past columns visible and lays the triangle
on the new columns only: `mask[..., :, past:] += triu(-inf, k=1)`.

Reproduction: a torch port of the reference (`np` -> `torch`, same names) used as the attention op of
a tiny ONNX-style decoder graph in 4D (batch, heads, seq, head) layout, run as prefill of 5 tokens,
then a 2-token continuation and a 1-token decode step feeding `present_key` back as `past_key`.
"""
import sys

import torch

FIXED = "--fixed" in sys.argv


def _softmax(x, axis=-1):
    x_max = torch.amax(x, dim=axis, keepdim=True)
    tmp = torch.exp(x - x_max)
    return tmp / torch.sum(tmp, dim=axis, keepdim=True)


def _apply_causal(mask, past_sequence_length):
    """mask[i, j] = -inf if past_sequence_length + i < j else unchanged (in place)."""
    q_sequence_length, total_sequence_length = mask.shape[-2:]
    triu = torch.triu(torch.ones((q_sequence_length, total_sequence_length - past_sequence_length),
                                 dtype=mask.dtype), diagonal=1)
    triu[triu == 1] = -float("inf")
    mask[..., :, past_sequence_length:] += triu
    return mask


def _compute_attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, scale=None,
                       is_causal=False):
    if scale is None:
        scale = 1 / (Q.shape[3] ** 0.5)
    scale = scale ** 0.5

    present_key = torch.cat((past_key, K), dim=2) if past_key is not None else K
    present_value = torch.cat((past_value, V), dim=2) if past_value is not None else V
    K, V = present_key, present_value

    q_sequence_length = Q.shape[2]
    kv_sequence_length = K.shape[2]
    attn_bias = torch.zeros((q_sequence_length, kv_sequence_length), dtype=Q.dtype)

    if is_causal:
        if attn_mask is None:
            if FIXED:
                temp_mask = torch.zeros((q_sequence_length, kv_sequence_length), dtype=Q.dtype)
                attn_bias = _apply_causal(
                    temp_mask,
                    past_sequence_length=past_key.shape[2] if past_key is not None else 0)
            else:
                temp_mask = torch.ones((q_sequence_length, kv_sequence_length), dtype=torch.bool)
                temp_mask = torch.tril(temp_mask, diagonal=0)
                temp_mask = torch.logical_not(temp_mask)
                attn_bias = attn_bias.masked_fill(temp_mask, float("-inf"))
    elif attn_mask is not None:
        attn_bias = attn_bias + attn_mask

    k_transpose = K.permute(0, 1, 3, 2)
    qk_matmul_output = torch.matmul(Q * scale, k_transpose * scale)
    qk_with_bias = qk_matmul_output + attn_bias
    qk_softmax = _softmax(qk_with_bias)
    output = torch.matmul(qk_softmax, V)
    return output, present_key, present_value, qk_matmul_output


class Attention:
    """OpRun-style wrapper: attributes are fixed at node construction, inputs at run time."""

    def __init__(self, is_causal=1, scale=None):
        self.is_causal = bool(is_causal)
        self.scale = scale

    def run(self, Q, K, V, attn_mask=None, past_key=None, past_value=None):
        return _compute_attention(Q, K, V, attn_mask=attn_mask, past_key=past_key,
                                  past_value=past_value, scale=self.scale, is_causal=self.is_causal)


class DecoderGraph:
    """What the exported graph does around its one Attention node."""

    def __init__(self, vocab=40, hidden=16, num_heads=2):
        self.num_heads, self.head_size = num_heads, hidden // num_heads
        self.embed = torch.randn(vocab, hidden)
        self.w_qkv = torch.randn(hidden, 3 * hidden) / hidden ** 0.5
        self.w_o = torch.randn(hidden, hidden) / hidden ** 0.5
        self.attention = Attention(is_causal=1)

    def run(self, input_ids, past_key=None, past_value=None):
        b, s = input_ids.shape
        x = self.embed[input_ids]
        q, k, v = (x @ self.w_qkv).split(x.shape[-1], dim=-1)
        q, k, v = (t.view(b, s, self.num_heads, self.head_size).transpose(1, 2) for t in (q, k, v))
        y, present_key, present_value, _ = self.attention.run(q, k, v, past_key=past_key,
                                                              past_value=past_value)
        logits = (y.transpose(1, 2).reshape(b, s, -1) @ self.w_o) @ self.embed.T
        return logits, present_key, present_value


def main():
    torch.manual_seed(0)
    graph = DecoderGraph()
    prompt = torch.randint(0, 40, (1, 5))
    logits, past_key, past_value = graph.run(prompt)
    chunk = torch.randint(0, 40, (1, 2))
    logits2, past_key, past_value = graph.run(chunk, past_key, past_value)
    next_token = logits2[:, -1:].argmax(-1)
    logits3, past_key, past_value = graph.run(next_token, past_key, past_value)
    print("present_key", tuple(past_key.shape), "step logits sums %.4f %.4f"
          % (logits2.sum().item(), logits3.sum().item()))


if __name__ == "__main__":
    main()
