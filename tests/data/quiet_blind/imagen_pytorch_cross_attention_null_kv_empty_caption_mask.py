"""imagen-pytorch text-conditioned cross-attention with a null key/value.

Follows lucidrains/imagen-pytorch imagen_pytorch/imagen_pytorch.py (CrossAttention:
`null_kv` prepended to the text keys/values and `mask = F.pad(mask, (1, 0),
value=True)`; Unet.forward's cond_drop_prob, which drops the caption of some samples
for classifier-free guidance by turning their whole text_mask off), not pinned.
The text memory (6 T5 tokens, padded) is shorter than the 16 image tokens that query
it. One sample has an empty caption (all of its memory is padding) and one has its
caption dropped: their rows attend only to the learned null key, which is exactly
the unconditional branch the model is meant to learn. Reference: each sample alone
with its real text tokens only (none for the empty/dropped ones).
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)
DIM, CTX, HEADS, DH = 32, 24, 4, 8


class CrossAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Linear(DIM, HEADS * DH, bias=False)
        self.to_kv = torch.nn.Linear(CTX, 2 * HEADS * DH, bias=False)
        self.null_kv = torch.nn.Parameter(torch.randn(2, DH))
        self.to_out = torch.nn.Linear(HEADS * DH, DIM, bias=False)

    def forward(self, x, context, mask=None):
        b, n, _ = x.shape
        q = self.to_q(x).view(b, n, HEADS, DH).transpose(1, 2)
        k, v = self.to_kv(context).chunk(2, dim=-1)
        k, v = (t.view(b, -1, HEADS, DH).transpose(1, 2) for t in (k, v))
        nk, nv = (t.view(1, 1, 1, DH).expand(b, HEADS, 1, DH) for t in self.null_kv.unbind(0))
        k, v = torch.cat([nk, k], dim=2), torch.cat([nv, v], dim=2)
        sim = q @ k.transpose(-1, -2) * DH ** -0.5
        if mask is not None:
            mask = F.pad(mask, (1, 0), value=True)          # the null key is always there
            sim = sim.masked_fill(~mask[:, None, None, :], -torch.finfo(sim.dtype).max)
        out = sim.softmax(-1) @ v
        return self.to_out(out.transpose(1, 2).reshape(b, n, HEADS * DH))


attn = CrossAttention()
B, N_IMG, N_TXT = 4, 16, 6
x = torch.randn(B, N_IMG, DIM)
text_embeds = torch.randn(B, N_TXT, CTX)
text_lens = torch.tensor([6, 3, 0, 4])                   # sample 2: empty caption
text_mask = torch.arange(N_TXT)[None] < text_lens[:, None]
text_embeds = text_embeds * text_mask[..., None]           # T5 padding is zeroed, as encoded

# classifier-free guidance dropout: sample 3 loses its caption this step
keep = torch.tensor([True, True, True, False])
text_mask = text_mask & keep[:, None]

with torch.no_grad():
    out = attn(x, text_embeds, mask=text_mask)
    worst = 0.0
    for i in range(B):
        n_real = int(text_mask[i].sum())
        ctx_i = text_embeds[i:i + 1, :n_real]                 # may have zero tokens
        ref = attn(x[i:i + 1], ctx_i, mask=None)
        worst = max(worst, (ref[0] - out[i]).abs().max().item())

    # the unconditional rows must agree with each other up to their image input
    same_x = attn(x[2:3].expand(2, -1, -1), text_embeds[2:4], mask=text_mask[2:4])
    worst = max(worst, (same_x[0] - same_x[1]).abs().max().item())

print(f"masked cross-attention vs real text tokens only, max diff {worst:.2e}")
assert worst < 1e-5
assert torch.isfinite(out).all()
