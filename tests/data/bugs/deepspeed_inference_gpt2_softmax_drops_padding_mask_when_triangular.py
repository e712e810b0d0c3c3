"""DeepSpeed-Inference GPT-2 (kernel injection): the fused softmax drops the padding mask for causal models.

deepspeedai/DeepSpeed#1466 ("Inference kernels don't handle Huggingface attention_mask correctly"),
fixed in #1491 (commit ee6a92c06). `attention_unfused` calls `attn_softmax_v2` with
`triangular = triangular && new_size == 0` and `recompute = new_size == 0`; the kernel added the
attention mask only `if (mask && !triangular && recompute)`, so a GPT-style (triangular) prompt pass
ignores the HF padding mask and left pads are attended. Fix: `if (mask && recompute)`.
Torch port of the injected layer's `compute_attention` and of the softmax kernel (prompt pass).
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
minus_infinity = -10000.0


def attn_softmax_v2(vals, mask, triangular, recompute, scale):
    # vals: [B, H, q, k]; mask: additive [B, k] (HF extended mask) or None
    vals = vals * scale
    q, k = vals.shape[-2:]
    if triangular:
        causal = torch.ones(q, k, dtype=torch.bool).triu(k - q + 1)
        vals = vals.masked_fill(causal, minus_infinity)
    apply_mask = (mask is not None and recompute) if FIXED else (mask is not None and not triangular and recompute)
    if apply_mask:
        vals = vals + mask[:, None, None, :]
    return torch.softmax(vals, dim=-1)


def ds_softmax_context(query, key, value, attn_mask, heads, norm_factor, triangular, no_masking, new_size=0):
    probs = attn_softmax_v2(query @ key.transpose(-1, -2), None if no_masking else attn_mask,
                            triangular=(triangular and new_size == 0), recompute=(new_size == 0), scale=norm_factor)
    return probs @ value


class DeepSpeedSelfAttention(nn.Module):
    def __init__(self, hidden=32, heads=4):
        super().__init__()
        self.heads = heads
        self.attn_qkvw = nn.Linear(hidden, 3 * hidden)
        self.attn_ow = nn.Linear(hidden, hidden)
        self.triangular_masking = True
        self.norm_factor = (hidden // heads) ** -0.5

    def forward(self, x, input_mask):
        B, L, D = x.shape
        q, k, v = self.attn_qkvw(x).view(B, L, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        no_masking = input_mask is None
        if no_masking:
            input_mask = torch.empty(1)
        ctx = ds_softmax_context(q, k, v, input_mask if no_masking else input_mask.view(B, L),
                                 self.heads, self.norm_factor, self.triangular_masking, no_masking)
        return self.attn_ow(ctx.transpose(1, 2).reshape(B, L, D))


class GPT2Model(nn.Module):
    def __init__(self, vocab=40, hidden=32, layers=2, n_pos=16):
        super().__init__()
        self.wte = nn.Embedding(vocab, hidden)
        self.wpe = nn.Embedding(n_pos, hidden)
        self.h = nn.ModuleList(DeepSpeedSelfAttention(hidden) for _ in range(layers))
        self.lm_head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids, attention_mask):
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        # HF GPT2Model: extended additive mask [B, 1, 1, S]
        ext = (1.0 - attention_mask[:, None, None, :].float()) * -10000.0
        x = self.wte(input_ids) + self.wpe(position_ids)
        for block in self.h:
            x = x + block(x, ext)
        return self.lm_head(x)


def main():
    model = GPT2Model().eval()
    prompt = [5, 9, 13, 2]
    ids = torch.tensor([[0, 0, 0] + prompt, [7, 3, 11, 2, 8, 6, 1]])  # left-padded batch
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1], [1] * 7])
    with torch.no_grad():
        batched = model(ids, mask)[0, 3:]
        alone = model(torch.tensor([prompt]), torch.ones(1, 4, dtype=torch.long))[0]
    print(f"padded row vs unpadded prompt pass, max |logit diff| = {(batched - alone).abs().max():.4f}")


if __name__ == "__main__":
    main()
