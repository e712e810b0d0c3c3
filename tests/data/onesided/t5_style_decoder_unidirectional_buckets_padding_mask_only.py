# Written another way (the bug of lucidrains/audiolm-pytorch 9cd86d2, as a Hugging Face T5-style decoder writes it):
# the decoder's self-attention adds T5's unidirectional bucketed bias (`bidirectional=False`: every key after the
# query lands in bucket 0, its own) and an extended mask built as an encoder's is, from the batch's right padding alone
# (get_extended_attention_mask without is_decoder), so each real token attends to the tokens after it. The fix
# multiplies in the causal triangle, as the decoder's mask is built.
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

D_MODEL, N_HEADS, D_KV, BUCKETS, MAX_DISTANCE, VOCAB, PAD = 32, 4, 8, 32, 128, 50, 0


def relative_position_bucket(relative_position, bidirectional=True, num_buckets=32, max_distance=128):
    relative_buckets = 0
    if bidirectional:
        num_buckets //= 2
        relative_buckets += (relative_position > 0).to(torch.long) * num_buckets
        relative_position = torch.abs(relative_position)
    else:
        relative_position = -torch.min(relative_position, torch.zeros_like(relative_position))
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    large = max_exact + (torch.log(relative_position.float() / max_exact) / math.log(max_distance / max_exact)
                         * (num_buckets - max_exact)).to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return relative_buckets + torch.where(is_small, relative_position, large)


class T5SelfAttention(nn.Module):
    def __init__(self, relative_bidirectional):
        super().__init__()
        self.relative_bidirectional = relative_bidirectional
        self.q = nn.Linear(D_MODEL, N_HEADS * D_KV, bias=False)
        self.k = nn.Linear(D_MODEL, N_HEADS * D_KV, bias=False)
        self.v = nn.Linear(D_MODEL, N_HEADS * D_KV, bias=False)
        self.o = nn.Linear(N_HEADS * D_KV, D_MODEL, bias=False)
        self.relative_attention_bias = nn.Embedding(BUCKETS, N_HEADS)

    def compute_bias(self, query_length, key_length):
        context = torch.arange(query_length)[:, None]
        memory = torch.arange(key_length)[None, :]
        buckets = relative_position_bucket(memory - context, bidirectional=self.relative_bidirectional, num_buckets=BUCKETS,
                                           max_distance=MAX_DISTANCE)
        return self.relative_attention_bias(buckets).permute([2, 0, 1]).unsqueeze(0)  # (1, H, Lq, Lk)

    def forward(self, hidden, mask):
        b, n, _ = hidden.shape

        def shape(x):
            return x.view(b, -1, N_HEADS, D_KV).transpose(1, 2)

        q, k, v = shape(self.q(hidden)), shape(self.k(hidden)), shape(self.v(hidden))
        scores = torch.matmul(q, k.transpose(3, 2))
        position_bias = self.compute_bias(n, n) + mask  # (B, H, Lq, Lk), as T5Attention adds the mask to its bias
        scores += position_bias
        weights = nn.functional.softmax(scores.float(), dim=-1).type_as(scores)
        out = torch.matmul(weights, v).transpose(1, 2).reshape(b, n, -1)
        return self.o(out)


class Decoder(nn.Module):
    def __init__(self, layers=2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D_MODEL, padding_idx=PAD)
        self.block = nn.ModuleList([T5SelfAttention(relative_bidirectional=False) for _ in range(layers)])
        self.lm_head = nn.Linear(D_MODEL, VOCAB, bias=False)

    def extended_mask(self, attention_mask):
        n = attention_mask.shape[1]
        mask = attention_mask[:, None, None, :].float()  # (B, 1, 1, Lk): the encoder's form
        if FIXED:
            causal = torch.tril(torch.ones(n, n))[None, None]
            mask = mask * causal  # (B, 1, Lq, Lk): the decoder's
        return (1.0 - mask) * torch.finfo(torch.float32).min

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids)
        mask = self.extended_mask(attention_mask)
        for layer in self.block:
            x = x + layer(x, mask)
        return self.lm_head(x)


model = Decoder().eval()
lengths = [7, 4]
ids = torch.full((2, 7), PAD)
for row, n in enumerate(lengths):
    ids[row, :n] = torch.randint(1, VOCAB, (n,))
attention_mask = (ids != PAD).long()
with torch.no_grad():
    logits = model(ids, attention_mask)
    prefix = model(ids[:, :3], attention_mask[:, :3])
print(f"max |logits[:, :3] of the whole batch - of its 3-token prefix|: {(logits[:, :3] - prefix).abs().max():.6f}")
