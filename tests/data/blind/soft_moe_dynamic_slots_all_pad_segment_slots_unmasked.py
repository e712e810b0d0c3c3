# Citation: lucidrains/soft-moe-pytorch commit e80947b ("for dynamic slots, need to mask out
#   slots too, in the case of variable lengthed sequences"), the bug state read at e80947b^ (05c1689).
# Upstream: soft_moe_pytorch/soft_moe_with_dynamic_slots.py, DynamicSlotsSoftMoE.forward
#   (the key-padding mask applied to the token/slot logits before the dispatch and combine softmaxes).
# Bug: with a padding mask for a variable-length batch, only the token axis of the logits was
#   masked. Slots built from segments whose tokens are all padding (their masked mean is zero)
#   stay in the combine softmax over (experts x slots), so real tokens take a share of their
#   output, and the slots' dispatch weights spread over the row's real tokens.
# Fix: derive slots_mask = segmented_mask.any(-1) and also mask_fill the logits on the slot axis
#   (`b s -> b 1 1 s`).
#
# Torch-only port (einops rearrange/reduce/Rearrange written as plain reshapes), tiny sizes.

import math
import sys

import torch
import torch.nn.functional as F
from torch import nn, einsum
from torch.nn import Module

FIXED = "--fixed" in sys.argv

# helper functions

def exists(val):
    return val is not None

def default(val, d):
    return val if exists(val) else d

def l2norm(t):
    return F.normalize(t, dim = -1)

def pad_to_multiple(
    tensor,
    multiple,
    dim = -1,
    value = 0
):
    seqlen = tensor.shape[dim]
    m = seqlen / multiple

    if m.is_integer():
        return False, tensor

    remainder = math.ceil(m) * multiple - seqlen
    pad_offset = (0,) * (-1 - dim) * 2
    return True, F.pad(tensor, (*pad_offset, 0, remainder), value = value)

# stand-in for einops.layers.torch.Rearrange('b n (e d) -> b e n d', e = num_experts)

class Rearrange(Module):
    def __init__(self, e):
        super().__init__()
        self.e = e

    def forward(self, t):
        b, n, ed = t.shape
        return t.view(b, n, self.e, ed // self.e).permute(0, 2, 1, 3)

# norm

class RMSNorm(Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return l2norm(x) * self.scale * self.gamma

# expert

def FeedForward(
    dim,
    mult = 4,
    dropout = 0.
):
    dim_hidden = int(dim * mult)
    return nn.Sequential(
        nn.Linear(dim, dim_hidden),
        nn.GELU(),
        nn.Dropout(dropout),
        nn.Linear(dim_hidden, dim)
    )

# main class

class DynamicSlotsSoftMoE(Module):
    def __init__(
        self,
        dim,
        *,
        num_experts = 4,
        expert_mult = 4,
        dropout = 0.
    ):
        super().__init__()
        self.norm = RMSNorm(dim)

        self.num_experts = num_experts

        self.to_slot_embeds = nn.Sequential(
            nn.Linear(dim, dim * num_experts, bias = False),
            Rearrange(e = num_experts),
            RMSNorm(dim)
        )

        self.experts = nn.ModuleList([
            FeedForward(dim = dim, mult = expert_mult, dropout = dropout) for _ in range(num_experts)
        ])

    def forward(self, x, mask = None):
        """
        einstein notation
        b - batch
        n - sequence length
        e - number of experts
        s - number of slots per expert
        d - feature dimension
        """

        num_experts = self.num_experts
        batch, seq_len = x.shape[:2]

        x = self.norm(x)

        # dynamic slot embeds
        # first average consecutive tokens, by number of experts

        is_padded, x = pad_to_multiple(x, num_experts, dim = -2)

        if is_padded:
            if not exists(mask):
                mask = torch.ones(x.shape[:2], device = x.device, dtype = torch.bool)

            _, mask = pad_to_multiple(mask, num_experts, dim = -1, value = False)

        b, n_total, d = x.shape
        x_segmented = x.view(b, n_total // num_experts, num_experts, d)  # 'b (n e) d -> b n e d'

        if exists(mask):
            segmented_mask = mask.view(b, n_total // num_experts, num_experts)  # 'b (n e) -> b n e'
            x_segmented = x_segmented.masked_fill(~segmented_mask[..., None], 0.)

        # perform a masked mean

        if exists(mask):
            num = x_segmented.sum(dim = 2)
            den = segmented_mask.float().sum(dim = 2, keepdim = True).clamp(min = 1e-5)
            x_consecutive_mean = num / den
            if FIXED:
                slots_mask = segmented_mask.any(dim = -1)
        else:
            x_consecutive_mean = x_segmented.mean(dim = 2)

        # project to get dynamic slots embeddings

        slot_embeds = self.to_slot_embeds(x_consecutive_mean)

        logits = einsum('b n d, b e s d -> b n e s', x, slot_embeds)

        # account for key padding mask

        if exists(mask):
            mask = mask[:, :, None, None]            # 'b n -> b n 1 1'
            if FIXED:
                slots_mask = slots_mask[:, None, None, :]  # 'b s -> b 1 1 s'

            logits = logits.masked_fill(~mask, -torch.finfo(logits.dtype).max)
            if FIXED:
                logits = logits.masked_fill(~slots_mask, -torch.finfo(logits.dtype).max)

        # get dispatch and combine weights (softmax across right dimensions)

        dispatch_weights = logits.softmax(dim = 1)

        combine_weights = logits.reshape(b, n_total, -1)  # 'b n e s -> b n (e s)'
        combine_weights = combine_weights.softmax(dim = -1)

        # derive slots by weighted average of input tokens using the dispatch weights from above

        slots = einsum('b n d, b n e s -> e b s d', x, dispatch_weights)

        # route the slots per expert to each expert

        out = []
        for slots_per_expert, expert in zip(slots, self.experts):
            out.append(expert(slots_per_expert))

        out = torch.stack(out)

        # combine back out

        e_, b_, s_, d_ = out.shape
        out = out.permute(1, 0, 2, 3).reshape(b_, e_ * s_, d_)  # 'e b s d -> b (e s) d'
        out = einsum('b s d, b n s -> b n d', out, combine_weights)

        out = out[:, :seq_len]
        return out

# a tiny language model with the soft MoE as its token mixer / feedforward, as the README uses it

class TinyLM(Module):
    def __init__(self, num_tokens, dim, num_experts):
        super().__init__()
        self.emb = nn.Embedding(num_tokens, dim)
        self.moe = DynamicSlotsSoftMoE(dim, num_experts = num_experts, expert_mult = 2)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(self, ids, mask = None):
        x = self.emb(ids)
        x = x + self.moe(x, mask = mask)
        return self.to_logits(x)


def main():
    torch.manual_seed(0)
    num_tokens, dim, num_experts, pad_id = 32, 16, 4, 0
    model = TinyLM(num_tokens, dim, num_experts)
    model.eval()

    # a right-padded batch of variable-length sequences, 12 positions, 4 experts -> 3 segments
    lengths = torch.tensor([12, 5, 9])
    ids = torch.randint(1, num_tokens, (3, 12))
    mask = torch.arange(12)[None, :] < lengths[:, None]
    ids = ids.masked_fill(~mask, pad_id)
    targets = torch.randint(1, num_tokens, (3, 12)).masked_fill(~mask, -100)

    with torch.no_grad():
        moe_out = model.moe(model.emb(ids), mask = mask)
        logits = model(ids, mask = mask)
        loss = F.cross_entropy(logits.reshape(-1, num_tokens), targets.reshape(-1), ignore_index = -100)

    real = moe_out[mask]
    print("moe out shape:", tuple(moe_out.shape))
    print("moe out[1, :5, 0]:", [round(v, 5) for v in moe_out[1, :5, 0].tolist()])
    print("moe out abs sum over real tokens: %.6f" % real.abs().sum().item())
    print("loss over real tokens: %.6f" % loss.item())


if __name__ == "__main__":
    main()
