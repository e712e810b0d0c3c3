"""tinygrad ONNX runner: `Attention(is_causal=1)` anchors the causal mask at key 0, ignoring past_key.

Citation: tinygrad/tinygrad PR #15949 ("fix: ONNX Attention is_causal mask ignores past_key/past_value
length"; description read, the PR is marked closed, so `--fixed` applies the change it proposes). The op
below is a PyTorch port of tinygrad's ONNX `Attention` implementation as quoted in that PR (tinygrad
Tensor ops replaced by their torch equivalents); the decode loop is how an exported decoder with an
external KV cache (`past_key` / `past_value` inputs, `present_*` outputs) is driven.

Bug: with `is_causal=1` the op built `ones(Q_len, K_len).tril(0)` on the key axis that already includes
the `past_key` rows. Query i may then only see keys [0, i], i.e. the oldest cached tokens: at every
decode step (Q_len == 1) the new token attends only key 0, and a multi-token continuation never sees
its own recent past. Without past inputs the mask is unchanged, so single-shot runs look fine.

Fix: offset the diagonal by `past_len = K_len - Q_len`: `tril(past_len)`.

Reproduction: one attention layer exported ONNX-style (op called with past_key/past_value), prefill of
4 tokens, then 4 single-token decode steps feeding `present_*` back as `past_*`.
"""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def Attention(Q, K, V, attn_mask=None, past_key=None, past_value=None, is_causal=0, scale=None):
    """ONNX Attention (opset 23 semantics used here: 4D [B, H, S, D] inputs, no GQA)."""
    if past_key is not None:
        K = torch.cat([past_key, K], dim=-2)
        V = torch.cat([past_value, V], dim=-2)
    present_key, present_value = K, V
    scale = scale if scale is not None else 1.0 / Q.shape[-1] ** 0.5
    scores = (Q @ K.transpose(-1, -2)) * scale
    if attn_mask is not None:
        scores = scores + attn_mask if attn_mask.dtype != torch.bool else scores.masked_fill(~attn_mask, -float("inf"))
    if is_causal:
        if FIXED:
            # offset the diagonal by past_len so query position i can attend to all keys [0, past_len + i]
            past_len = K.shape[-2] - Q.shape[-2]
            causal_mask = torch.ones(Q.shape[-2], K.shape[-2], dtype=torch.bool).tril(past_len)
        else:
            causal_mask = torch.ones(Q.shape[-2], K.shape[-2], dtype=torch.bool).tril(0)
        scores = scores.masked_fill(causal_mask.logical_not(), -float("inf"))
    Y = scores.softmax(-1) @ V
    return Y, present_key, present_value


class ExportedDecoderLayer:
    """What the ONNX graph of one decoder layer computes around its Attention node."""

    def __init__(self, hidden, heads, vocab):
        self.heads, self.head_dim = heads, hidden // heads
        self.embed = torch.randn(vocab, hidden)
        self.wq, self.wk, self.wv = (torch.randn(hidden, hidden) / hidden ** 0.5 for _ in range(3))
        self.lm_head = torch.randn(hidden, vocab)

    def __call__(self, input_ids, past_key, past_value):
        x = self.embed[input_ids]                      # [B, S, hidden]
        B, S, _ = x.shape
        split = lambda t: t.view(B, S, self.heads, self.head_dim).transpose(1, 2)
        Y, present_key, present_value = Attention(split(x @ self.wq), split(x @ self.wk), split(x @ self.wv),
                                                  past_key=past_key, past_value=past_value, is_causal=1)
        h = x + Y.transpose(1, 2).reshape(B, S, -1)
        return h @ self.lm_head, present_key, present_value


def main():
    layer = ExportedDecoderLayer(hidden=32, heads=4, vocab=50)
    past_key = torch.zeros(1, 4, 0, 8)
    past_value = torch.zeros(1, 4, 0, 8)
    tokens = torch.randint(0, 50, (1, 4))
    logits, past_key, past_value = layer(tokens, past_key, past_value)
    generated = []
    for _ in range(4):
        next_id = logits[:, -1].argmax(-1, keepdim=True)
        generated.append(int(next_id))
        logits, past_key, past_value = layer(next_id, past_key, past_value)
    print("generated", generated)


if __name__ == "__main__":
    main()
