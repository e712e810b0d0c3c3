"""DeepSpeed-Inference BLOOM (kernel injection): a float32 padding mask reaches the softmax unconverted.

deepspeedai/DeepSpeed#2851 ("Fix Bloom logits mismatch", commit 17fa0876a, for issue #2730).
`BloomSelfAttention.compute_attention` turned the 0/1 padding mask into an additive -10000 mask
only `if input_mask.dtype == torch.int64`; the mask arrives as float32, so the 0/1 values are
added to the scores as they are and padded keys stay visible. Fix: always `(1 - input_mask).half() * minus_inf`.
Torch port: the CUDA softmax kernel (scale, alibi, additive mask, triangular causal) written out.
"""
import math
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
minus_inf = -10000.0


def get_alibi_slopes(n_heads):
    start = 2 ** (-(2 ** -(math.log2(n_heads) - 3)))
    return torch.tensor([start ** (i + 1) for i in range(n_heads)])


def softmax_func(attn_scores, attn_mask, alibi, triangular, layer_scale):
    # stand-in for inference_cuda_module.softmax_fp16 (attn_softmax_v2)
    scores = attn_scores * layer_scale
    if alibi is not None:
        scores = scores + alibi
    if attn_mask is not None:
        scores = scores + attn_mask[:, None, None, :].to(scores.dtype)
    if triangular:
        q, k = scores.shape[-2:]
        causal = torch.ones(q, k, dtype=torch.bool).triu(k - q + 1)
        scores = scores.masked_fill(causal, minus_inf)
    return torch.softmax(scores, dim=-1)


class BloomSelfAttention(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads, self.head_dim = heads, hidden // heads
        self.norm_factor = math.sqrt(math.sqrt(self.head_dim))
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.dense = nn.Linear(hidden, hidden)
        self.triangular_masking = True

    def compute_attention(self, x, input_mask, layer_past, alibi):
        B, L, _ = x.shape
        q, k, v = self.qkv(x).view(B, L, self.heads, 3 * self.head_dim).split(self.head_dim, dim=-1)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if layer_past is not None:
            k = torch.cat((layer_past[0], k), dim=-2)
            v = torch.cat((layer_past[1], v), dim=-2)
        presents = (k, v)
        attention_scores = q @ k.transpose(-1, -2)
        if FIXED:
            attn_mask = (1 - input_mask).half() * minus_inf
        else:
            attn_mask = ((1 - input_mask).half() * minus_inf) if input_mask.dtype == torch.int64 else input_mask
        probs = softmax_func(attention_scores, attn_mask, alibi,
                             triangular=(self.triangular_masking and attention_scores.shape[-2] > 1),
                             layer_scale=1 / (self.norm_factor * self.norm_factor))
        ctx = (probs @ v).transpose(1, 2).reshape(B, L, -1)
        return self.dense(ctx), presents


class BloomForCausalLM(nn.Module):
    def __init__(self, vocab=40, hidden=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(BloomSelfAttention(hidden, heads) for _ in range(layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, attention_mask, past=None):
        # ds-inference path: the 2D padding mask is handed to the injected layers, as float32
        input_mask = attention_mask.to(torch.float32)
        positions = (attention_mask.cumsum(-1) - 1).clamp(min=0).float()
        alibi = get_alibi_slopes(self.heads)[None, :, None, None] * positions[:, None, None, :]
        h = self.emb(input_ids)
        presents = []
        for i, layer in enumerate(self.layers):
            out, p = layer.compute_attention(h, input_mask, None if past is None else past[i], alibi)
            h = h + out
            presents.append(p)
        return self.lm_head(h[:, -1]), presents


def greedy(model, ids, mask, steps=3):
    logits, past = model(ids, mask)
    outs = [logits]
    for _ in range(steps):
        nxt = logits.argmax(-1, keepdim=True)
        mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=-1)
        logits, past = model(nxt, mask, past)
        outs.append(logits)
    return torch.stack(outs, 1)


def main():
    model = BloomForCausalLM().eval()
    pad = 0
    short = [5, 9, 13]
    long = [7, 3, 11, 2, 8, 6]
    ids = torch.tensor([[pad] * 3 + short, long])  # left padded batch
    mask = torch.tensor([[0, 0, 0, 1, 1, 1], [1] * 6])
    with torch.no_grad():
        batched = greedy(model, ids, mask)
        alone = greedy(model, torch.tensor([short]), torch.ones(1, 3, dtype=torch.long))
    print(f"padded row vs unpadded run, max |logit diff| = {(batched[0] - alone[0]).abs().max():.4f}")


if __name__ == "__main__":
    main()
