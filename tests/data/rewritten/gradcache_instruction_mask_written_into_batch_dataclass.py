# The same bug as sentence-transformers#3944 (a pooling mask written back into the batch the encoder reads), written
# as an INSTRUCTOR-style embedder trained with GradCache: the batch is a dataclass, the encoder a hand-written one
# calling F.scaled_dot_product_attention with a key mask made from `batch.attention_mask`, and the embedder's forward
# excludes the instruction tokens from its mean pooling by assigning the narrowed mask to `batch.attention_mask`.
# GradCache embeds each batch twice (once without grad to cache the representations, once with grad to back-propagate
# them), so the second pass attends with the instruction tokens masked as keys. The fix keeps the pooling mask local.
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class Batch:
    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    instruction_lengths: torch.Tensor


class Block(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.qkv, self.out = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)

    def forward(self, x, key_mask):
        b, n, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        keep = key_mask[:, None, None, :].bool()  # (B, 1, 1, L): True = a key to attend
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return x + self.out(y.transpose(1, 2).reshape(b, n, d))


class InstructionEmbedder(nn.Module):
    def __init__(self, vocab=50, dim=32, heads=4, depth=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))

    def forward(self, batch: Batch):
        x = self.embed(batch.input_ids)
        for block in self.blocks:
            x = block(x, batch.attention_mask)
        positions = torch.arange(batch.input_ids.size(1))[None, :]
        pooling_mask = batch.attention_mask * (positions >= batch.instruction_lengths[:, None])
        if not FIXED:
            batch.attention_mask = pooling_mask  # "so that later modules see the instruction-free mask"
        weights = pooling_mask.unsqueeze(-1).float()
        return (x * weights).sum(1) / weights.sum(1).clamp(min=1.0)


def make_batch(instruction, texts):
    rows = [instruction + t for t in texts]
    width = max(map(len, rows))
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, :len(row)], mask[i, :len(row)] = torch.tensor(row), 1  # right padding
    return Batch(ids, mask, torch.full((len(rows),), len(instruction)))


model = InstructionEmbedder().eval()
queries = make_batch([3, 4, 5], [[10, 11, 12, 13], [14, 15], [16, 17, 18]])
passages = make_batch([6, 7], [[20, 21, 22, 23, 24], [25, 26, 27], [28, 29, 30, 31]])


def contrastive(q, p):
    scores = F.normalize(q, dim=-1) @ F.normalize(p, dim=-1).T / 0.05
    return F.cross_entropy(scores, torch.arange(q.size(0)))


# GradCache: a first pass without grad caches the representations and their gradients ...
with torch.no_grad():
    q_cached, p_cached = model(queries), model(passages)
q_cached.requires_grad_(), p_cached.requires_grad_()
contrastive(q_cached, p_cached).backward()
# ... and a second pass over the same batches, with grad, back-propagates them through the encoder
q, p = model(queries), model(passages)
surrogate = ((q * q_cached.grad).sum() + (p * p_cached.grad).sum()).detach()
print(f"fixed={FIXED} drift={float((q - q_cached).detach().abs().max()):.6f} surrogate={surrogate.item():.6f}")
