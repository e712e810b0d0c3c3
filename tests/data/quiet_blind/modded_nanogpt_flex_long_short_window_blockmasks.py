"""modded-nanogpt style FlexAttention: per-batch document masks, long and short sliding windows per layer.

Follows KellerJordan/modded-nanogpt train_gpt.py (GPT.forward builds BlockMasks from the token stream every
step: documents are delimited by the BOS token 50256, `docs = (input_seq == 50256).cumsum(0)`, the mask_mod is
causal AND same document AND within a sliding window; a long window and a short window mask are made and each
layer is given one of them, e.g. [long, short, short, short, long, ...]).

Masks meant, recomputed for every batch (the document boundaries move):
- long-window layers: q sees kv when kv <= q, same document, q - kv < 128;
- short-window layers: the same with q - kv < 32.
The batch is one packed stream of documents (batch size 1, as in modded-nanogpt).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

BOS = 63


class CausalSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.c_proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x, block_mask: BlockMask):
        B, T = x.size(0), x.size(1)
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        q, k = F.rms_norm(q, (q.size(-1),)), F.rms_norm(k, (k.size(-1),))
        y = flex_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), block_mask=block_mask,
                           scale=0.12)
        y = y.transpose(1, 2).contiguous().view(B, T, -1)
        return self.c_proj(y)


class Block(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.attn = CausalSelfAttention(dim, num_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim, bias=False), nn.ReLU(), nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x, block_mask):
        x = x + self.attn(F.rms_norm(x, (x.size(-1),)), block_mask)
        return x + self.mlp(F.rms_norm(x, (x.size(-1),)))


class GPT(nn.Module):
    def __init__(self, vocab_size=64, num_layers=4, num_heads=2, model_dim=32, long_window=128, short_window=32):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, model_dim)
        self.blocks = nn.ModuleList([Block(model_dim, num_heads) for _ in range(num_layers)])
        self.lm_head = nn.Linear(model_dim, vocab_size, bias=False)
        self.long_window = long_window
        self.short_window = short_window

    def create_blockmasks(self, input_seq: torch.Tensor):
        docs = (input_seq == BOS).cumsum(0)

        def make(window):
            def document_sliding_causal(b, h, q_idx, kv_idx):
                causal = q_idx >= kv_idx
                document = docs[q_idx] == docs[kv_idx]
                in_window = q_idx - kv_idx < window
                return causal & document & in_window
            L = len(input_seq)
            return create_block_mask(document_sliding_causal, None, None, L, L, device=input_seq.device)

        return make(self.long_window), make(self.short_window)

    def forward(self, input_seq: torch.Tensor, target_seq: torch.Tensor):
        assert input_seq.ndim == 1
        long_bm, short_bm = self.create_blockmasks(input_seq)
        block_masks = [long_bm, short_bm, short_bm, long_bm]
        assert len(block_masks) == len(self.blocks)
        x = self.embed(input_seq)[None]
        for block, bm in zip(self.blocks, block_masks):
            x = block(x, bm)
        logits = self.lm_head(F.rms_norm(x, (x.size(-1),))).float()
        return F.cross_entropy(logits.view(-1, logits.size(-1)), target_seq)


def next_batch(gen, seq_len=256):
    """A packed stream of documents of random lengths, each starting with BOS."""
    tokens = []
    while len(tokens) < seq_len + 1:
        n = int(torch.randint(20, 120, (1,), generator=gen))
        tokens += [BOS] + torch.randint(0, BOS, (n,), generator=gen).tolist()
    buf = torch.tensor(tokens[: seq_len + 1])
    return buf[:-1], buf[1:]


def main():
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    model = GPT()
    # the validation loop of train_gpt.py (FlexAttention has no backward on CPU, so no training step here)
    model.eval()
    val_steps, val_loss = 2, 0.0
    with torch.no_grad():
        for _ in range(val_steps):
            inputs, targets = next_batch(gen)
            val_loss += model(inputs, targets)
    val_loss /= val_steps
    print(f"val_loss {val_loss.item():.4f}")


if __name__ == "__main__":
    main()
