# bigscience-workshop/Megatron-DeepSpeed commit 538c30b ("Fix decoder-only attention mask shape", pretrain_ul2.py, UL2 branch).
# get_batch handed the decoder-only (prefix-LM) UL2 model dec_mask as [b, s, s]; GPTModel's attention broadcasts it against
# [b, np, s, s] scores, so with micro_batch_size == num_heads head h silently uses sample h's prefix-LM mask.
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
rng = np.random.RandomState(0)

bos_id, eos_id, sep_id, pad_id = 1, 2, 3, 0
max_seq_length = 24


def make_history_mask(block):
    length = block.shape[0]
    arange = np.arange(length)
    history_mask = (arange[None, ] <= arange[:, None])
    history_mask = history_mask.astype(np.int64)
    return history_mask


def build_decoder_only_sample(tokens_enc, tokens_dec_in, labels, prefix_lm=True):
    # tail of ul2_dataset.build_training_sample for decoder-only models (after merge_subsequent_masks)
    num_labels = len(labels)
    tokens_dec_in = tokens_dec_in[1:]
    tokens = [bos_id] + tokens_enc + [sep_id] + tokens_dec_in
    padding_length = max_seq_length - len(tokens)
    filler = [pad_id] * padding_length
    tokens = np.array(tokens + filler, dtype=np.int64)
    labels = np.array((tokens_enc + [sep_id] + labels + filler), dtype=np.int64)
    loss_mask = np.zeros(len(tokens), dtype=np.int64)
    labels_start_neg_index = -(num_labels + padding_length)
    labels_end_neg_index = -padding_length if padding_length > 0 else None
    loss_mask[labels_start_neg_index:labels_end_neg_index] = 1
    dec_mask = make_history_mask(tokens)
    if prefix_lm:
        dec_mask[:labels_start_neg_index, :labels_start_neg_index] = 1
    return {'text': tokens, 'labels': labels, 'loss_mask': loss_mask, 'dec_mask': dec_mask}


def get_batch(data_b):
    tokens = data_b['text'].long()
    labels = data_b['labels'].long()
    loss_mask = data_b['loss_mask'].float()
    dec_mask = (data_b['dec_mask'] < 0.5)
    if FIXED:
        dec_mask = dec_mask.unsqueeze(1)
    return tokens, loss_mask, labels, dec_mask


def attention_mask_func(attention_scores, attention_mask):
    attention_scores.masked_fill_(attention_mask, -10000.0)
    return attention_scores


class GPTModel(torch.nn.Module):
    # Megatron GPTModel (prefix_lm=True), trimmed; torch-softmax path of FusedScaleMaskSoftmax
    def __init__(self, vocab=40, hidden=32, heads=4, layers=2):
        super().__init__()
        self.heads = heads
        self.word_embeddings = torch.nn.Embedding(vocab, hidden)
        self.position_embeddings = torch.nn.Embedding(max_seq_length, hidden)
        self.layers = torch.nn.ModuleList(torch.nn.ModuleDict(dict(
            input_layernorm=torch.nn.LayerNorm(hidden), query_key_value=torch.nn.Linear(hidden, 3 * hidden),
            dense=torch.nn.Linear(hidden, hidden), post_attention_layernorm=torch.nn.LayerNorm(hidden),
            dense_h_to_4h=torch.nn.Linear(hidden, 4 * hidden), dense_4h_to_h=torch.nn.Linear(4 * hidden, hidden)))
            for _ in range(layers))
        self.final_layernorm = torch.nn.LayerNorm(hidden)

    def forward(self, input_ids, position_ids, attention_mask):
        h = self.word_embeddings(input_ids) + self.position_embeddings(position_ids)
        b, s, d = h.shape
        hd = d // self.heads
        for layer in self.layers:
            x = layer["input_layernorm"](h)
            q, k, v = layer["query_key_value"](x).view(b, s, self.heads, 3 * hd).split(hd, dim=-1)
            q, k, v = (t.transpose(1, 2) for t in (q, k, v))
            scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(hd)   # [b, np, sq, sk]
            probs = torch.softmax(attention_mask_func(scores, attention_mask), dim=-1)
            ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, d)
            h = h + layer["dense"](ctx)
            h = h + layer["dense_4h_to_h"](F.gelu(layer["dense_h_to_4h"](layer["post_attention_layernorm"](h))))
        return self.final_layernorm(h) @ self.word_embeddings.weight.t()


def t5_position_ids(token_ids):
    seq_length = token_ids.size(1)
    position_ids = torch.arange(seq_length, dtype=torch.long, device=token_ids.device)
    return position_ids.unsqueeze(0).expand_as(token_ids)


# micro batch of 4 UL2 samples (R/S/X-style splits -> different prefix lengths); 4 attention heads
samples = []
for enc_len, dec_len in ((4, 10), (12, 5), (7, 8), (15, 3)):
    enc = rng.randint(5, 40, enc_len).tolist()
    lab = rng.randint(5, 40, dec_len).tolist()
    samples.append(build_decoder_only_sample(enc, [bos_id] + lab[:-1], lab))
data_b = {k: torch.from_numpy(np.stack([s[k] for s in samples])) for k in samples[0]}

model = GPTModel().eval()
tokens, loss_mask, labels, dec_mask = get_batch(data_b)
with torch.no_grad():
    logits = model(tokens, t5_position_ids(tokens), dec_mask)
    diff = 0.0
    for i in range(len(samples)):
        ti, li, _, mi = get_batch({k: v[i:i + 1] for k, v in data_b.items()})
        ref = model(ti, t5_position_ids(ti), mi.view(1, 1, max_seq_length, max_seq_length))
        sel = loss_mask[i].bool()
        diff = max(diff, (logits[i][sel] - ref[0][sel]).abs().max().item())
print(f"max |micro-batch logits - per-sample logits| on loss positions: {diff:.6f}")
