# swiss-ai/Megatron-LM#40 (reverted by swiss-ai/Megatron-LM#56): the "BOS xdoc attn" change to
# _get_ltor_masks_and_position_ids masked every BOS column/row and cut documents with [i:, :i+1],
# so each document lost its own BOS; the revert goes back to the EOD-based reset_attention_mask.
import sys
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

BOS, EOD = 1, 2


def _get_ltor_masks_and_position_ids(data, eod_token, bos_token, reset_position_ids,
                                     reset_attention_mask, eod_mask_loss):
    seq_length = data.numel()
    attention_mask = torch.tril(torch.ones((seq_length, seq_length), device=data.device)).unsqueeze(0)
    loss_mask = torch.ones(seq_length, dtype=torch.float, device=data.device)
    if eod_mask_loss:
        loss_mask[data == eod_token] = 0.0
    position_ids = torch.arange(seq_length, dtype=torch.long, device=data.device)
    if reset_position_ids:
        position_ids = position_ids.clone()

    if not FIXED:
        # "Bos xdoc attn"
        bos_indices = position_ids[data == bos_token]
        if bos_indices.numel() > 0:
            prev_index = 0
            for i in bos_indices:
                if attention_mask is not None:
                    attention_mask[0, :, i] = 0  # No tokens can attend to BOS
                    attention_mask[0, i, :] = 0  # BOS can't attend to any tokens
                    if reset_attention_mask:
                        # Block cross document attention
                        attention_mask[0, i:, :i + 1] = 0
                if reset_position_ids:
                    position_ids[i:] -= i - prev_index
                    prev_index = i
    elif reset_position_ids or reset_attention_mask:
        eod_index = position_ids[data == eod_token]
        if reset_position_ids:
            eod_index = eod_index.clone()
        prev_index = 0
        for j in range(eod_index.numel()):
            i = eod_index[j]
            if reset_attention_mask and attention_mask is not None:
                attention_mask[0, (i + 1):, : (i + 1)] = 0
            if reset_position_ids:
                position_ids[(i + 1):] -= i + 1 - prev_index
                prev_index = i + 1

    attention_mask = attention_mask < 0.5  # True = masked out
    return attention_mask, loss_mask, position_ids


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


class CoreAttention(torch.nn.Module):
    def __init__(self, hidden, heads):
        super().__init__()
        self.heads, self.hd = heads, hidden // heads
        self.qkv = torch.nn.Linear(hidden, 3 * hidden)
        self.dense = torch.nn.Linear(hidden, hidden)

    def forward(self, x, attention_mask):
        s, b, h = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, self.heads, self.hd).unbind(2)
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # b, np, s, hn
        scores = torch.matmul(q, k.transpose(-1, -2)) / self.hd ** 0.5
        probs = F.softmax(attention_mask_func(scores, attention_mask), dim=-1)
        ctx = torch.matmul(probs, v).permute(2, 0, 1, 3).reshape(s, b, h)
        return self.dense(ctx)


class GPTModel(torch.nn.Module):
    def __init__(self, vocab=32, hidden=32, heads=4, layers=2, max_pos=64):
        super().__init__()
        self.word = torch.nn.Embedding(vocab, hidden)
        self.pos = torch.nn.Embedding(max_pos, hidden)
        self.layers = torch.nn.ModuleList(CoreAttention(hidden, heads) for _ in range(layers))
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(hidden) for _ in range(layers))
        self.head = torch.nn.Linear(hidden, vocab)

    def forward(self, tokens, position_ids, attention_mask):
        x = (self.word(tokens) + self.pos(position_ids)).transpose(0, 1)
        for ln, layer in zip(self.norms, self.layers):
            x = x + layer(ln(x), attention_mask)
        return self.head(x.transpose(0, 1))


# two packed documents: [BOS a b c EOD][BOS d e f g EOD] ...
doc1 = [BOS, 5, 6, 7, 8, EOD]
doc2 = [BOS, 9, 10, 11, 12, 13, EOD]
tokens = torch.tensor(doc1 + doc2)
attention_mask, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
    tokens, EOD, BOS, reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)

model = GPTModel().eval()
labels = torch.roll(tokens, -1)
with torch.no_grad():
    logits = model(tokens[None], position_ids[None], attention_mask[None])
    # reference: doc2 run alone, causal, positions from 0
    d2 = torch.tensor(doc2)
    ref_mask = torch.triu(torch.ones(len(d2), len(d2), dtype=torch.bool), 1)[None, None]
    ref = model(d2[None], torch.arange(len(d2))[None], ref_mask)
loss = (F.cross_entropy(logits[0], labels, reduction="none") * loss_mask).sum() / loss_mask.sum()
print("mode:", "fixed" if FIXED else "buggy", "loss %.4f" % loss.item())
print("doc2 logits vs doc2 alone, max abs diff: %.5f" % (logits[0, len(doc1):] - ref[0]).abs().max().item())
