"""x-transformers 1.16.11: Attend.flash_attn handed its "True = mask out" mask straight to SDPA.

Citation: lucidrains/x-transformers#160 ("Incorrect boolean mask in flash attention", closed).
Fixed by commit d731d82b99fbb3491b6a5f0d2012ea2f523411d8 ("fix masking logic for flash attention";
an earlier attempt 2a5bbdd was reverted in 186335a).  Read: the issue thread and
x_transformers/attend.py + x_transformers.py at 4fd11a5 (1.16.11) and the diff of d731d82.

Bug: `Attention.forward` builds `final_attn_mask = or_reduce([~input_mask, ...])` (True = do not
attend, the convention of the non-flash path's `dots.masked_fill(mask, ...)`); with `causal=True`
`flash_attn` ORs in the causal triangle (`mask | causal_mask`) and passes the result to
`F.scaled_dot_product_attention(attn_mask=mask)`, where a boolean True means *take part* — so the
flash path attends exactly to the padding and future keys it meant to hide.
Fix (d731d82): when no attn_bias is used, invert before the call: `else: mask = ~mask`.

Reproduction: one x-transformers `Attention(causal=True, flash=True)` written after 1.16.11
(to_q/to_k/to_v, `mask` argument of shape (b, n) with True = keep, `Attend.flash_attn`), batch 2
of 6 tokens, the second sequence with 2 padded positions.  The CUDA sdp_kernel context is omitted
(CPU run) and einops `rearrange` calls are written as the equivalent view/transpose (einops is not
installed here).
"""
import sys
import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


def exists(val):
    return val is not None


def or_reduce(masks):
    head, *body = masks
    for rest in body:
        head = head | rest
    return head


class Attend(nn.Module):
    def __init__(self, *, dropout=0., causal=False, heads=None, scale=None, flash=False):
        super().__init__()
        self.scale = scale
        self.causal = causal
        self.dropout = dropout
        self.flash = flash

    def flash_attn(self, q, k, v, mask=None, attn_bias=None):
        batch, heads, q_len, _, k_len, is_cuda, device = *q.shape, k.shape[-2], q.is_cuda, q.device

        # Check if mask exists and expand to compatible shape
        # The mask is B L, so it would have to be expanded to B H N L
        causal = self.causal
        if exists(mask):
            assert mask.ndim == 4
            mask = mask.expand(batch, heads, q_len, k_len)
            # manually handle causal mask, if another mask was given
            if causal:
                causal_mask = torch.ones((q_len, k_len), dtype=torch.bool, device=device).triu(k_len - q_len + 1)
                mask = mask | causal_mask
                causal = False

        if exists(attn_bias):
            attn_bias = attn_bias.unsqueeze(0).expand(batch, -1, -1, -1)  # 'h i j -> 1 h i j'
            mask_value = -torch.finfo(q.dtype).max
            if exists(mask):
                attn_bias = attn_bias.masked_fill(mask, mask_value // 2)
            mask = attn_bias
        elif FIXED:
            mask = ~mask

        # pytorch 2.0 flash attn: q, k, v, mask, dropout, causal, softmax_scale
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             dropout_p=self.dropout if self.training else 0., is_causal=causal)
        return out

    def forward(self, q, k, v, mask=None, attn_bias=None, prev_attn=None):
        if self.flash:
            assert not exists(prev_attn), 'residual attention not compatible with flash attention'
            return self.flash_attn(q, k, v, mask=mask, attn_bias=attn_bias)
        raise NotImplementedError('only the flash path is reproduced here')


class Attention(nn.Module):
    def __init__(self, dim, dim_head=8, heads=2, causal=False, flash=False):
        super().__init__()
        self.heads = heads
        self.causal = causal
        inner = dim_head * heads
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.attend = Attend(heads=heads, causal=causal, flash=flash)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def forward(self, x, context=None, mask=None, context_mask=None, attn_mask=None):
        h = self.heads
        kv_input = context if exists(context) else x
        q, k, v = self.to_q(x), self.to_k(kv_input), self.to_v(kv_input)
        b, n = x.shape[:2]
        q, k, v = map(lambda t: t.view(b, t.shape[1], h, -1).transpose(1, 2), (q, k, v))  # 'b n (h d) -> b h n d'

        input_mask = context_mask if exists(context_mask) else mask
        masks = []
        final_attn_mask = None
        if exists(input_mask):
            input_mask = input_mask[:, None, None, :]  # 'b j -> b 1 1 j'
            masks.append(~input_mask)
        if exists(attn_mask):
            masks.append(~attn_mask[None, None])  # 'i j -> 1 1 i j'
        if len(masks) > 0:
            final_attn_mask = or_reduce(masks)

        out = self.attend(q, k, v, mask=final_attn_mask)
        out = out.transpose(1, 2).reshape(b, n, -1)  # 'b h n d -> b n (h d)'
        return self.to_out(out)


def main():
    torch.manual_seed(0)
    attn = Attention(dim=16, causal=True, flash=True).eval()
    x = torch.randn(2, 6, 16)
    mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    with torch.no_grad():
        out = attn(x, mask=mask)
    print("first token of each sequence", [round(v, 4) for v in out[:, 0].sum(-1).tolist()])


if __name__ == "__main__":
    main()
