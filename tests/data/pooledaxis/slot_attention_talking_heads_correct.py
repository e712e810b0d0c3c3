# Correct programs a softmax-axis rule must leave alone: Slot Attention (Locatello et al., as lucidrains writes it:
# a softmax over the slots, then renormalised over the inputs it sums, `einsum("bjd,bij->bid")`), talking-heads
# attention (Shazeer et al.: the softmaxed weights mixed across heads by a matrix of their own, `einsum("bhij,hg->bgij")`)
# and Fastformer's pooling softmaxed over the tokens it sums.
import torch
import torch.nn as nn

torch.manual_seed(0)
b, n, slots, d = 2, 9, 4, 16
inputs, slot = torch.randn(b, n, d), torch.randn(b, slots, d)
to_q, to_k, to_v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
with torch.no_grad():
    for _ in range(3):  # slot attention's iterations
        dots = torch.einsum("bid,bjd->bij", to_q(slot), to_k(inputs)) * d ** -0.5
        attn = dots.softmax(dim=1) + 1e-8  # over the slots: they compete for each input
        attn = attn / attn.sum(dim=-1, keepdim=True)  # a weighted mean over the inputs
        slot = slot + torch.einsum("bjd,bij->bid", to_v(inputs), attn)
    heads, mix = 3, torch.randn(3, 3)
    q, k, v = (torch.randn(b, heads, n, d) for _ in range(3))
    weights = torch.einsum("bhid,bhjd->bhij", q, k).softmax(dim=-1)
    weights = torch.einsum("bhij,hg->bgij", weights, mix)  # talking heads after the softmax
    out = torch.einsum("bhij,bhjd->bhid", weights, v)
    alphas = torch.randn(b, n, heads).softmax(dim=1)  # Fastformer's pooling over the tokens
    pooled = torch.einsum("bsh,bshd->bhd", alphas, torch.randn(b, n, heads, d))
print(slot.shape, out.shape, pooled.shape)
