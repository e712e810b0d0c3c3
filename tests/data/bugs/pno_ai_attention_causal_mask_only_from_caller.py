# pno-ai (chathasphere/pno-ai commit 316faa3, "Fix: subsequent masking bug"), Music Transformer.
# Bug: MultiheadedAttention applied the subsequent (causal) mask only when the caller passed one, so
# generate.sample(), which calls model(input_tensor) with no mask, ran fully bidirectional attention.
import sys
import copy
import math

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
np.random.seed(0)


# ---- helpers.py ----
def clones(module, N):
    "Clone N identical layers of a module"
    return torch.nn.ModuleList([copy.deepcopy(module) for i in range(N)])


def d(tensor=None):
    if tensor is None:
        return 'cuda' if torch.cuda.is_available() else 'cpu'
    return 'cuda' if tensor.is_cuda else 'cpu'


def subsequent_mask(size):
    attn_shape = (1, size, size)
    subsequent_mask = np.tril(np.ones(attn_shape), k=0).astype('uint8')
    return torch.from_numpy(subsequent_mask)


# ---- attention.py ----
class MultiheadedAttention(nn.Module):
    def __init__(self, d_model, heads=8, dropout=0.1):
        super().__init__()
        self.d_model = d_model
        self.heads = heads
        s = d_model // heads
        self.linears = torch.nn.ModuleList([nn.Linear(s, s, bias=False) for i in range(3)])
        self.unifyheads = nn.Linear(heads * s, d_model)
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, x, mask):
        b, t, e = x.size()
        h = self.heads
        s = e // h
        x = x.view(b, t, h, s)
        queries, keys, values = [linear(x).transpose(1, 2).contiguous().view(b * h, t, s)
                                 for linear, x in zip(self.linears, (x, x, x))]
        queries = queries / (e ** (1 / 4))
        keys = keys / (e ** (1 / 4))

        if not FIXED:
            # Compatibility scores of queries and keys via dot product
            scores = torch.bmm(queries, keys.transpose(1, 2))
            # mask out the upper half of the dot matrix, excluding the diagonal
            if mask is not None:
                # repeat mask per head...
                mask = torch.repeat_interleave(mask, h, 0)
                scores = scores.masked_fill(mask == 0, -1e9)
        else:
            # mask out the upper half of the dot matrix, excluding the diagonal
            scores = torch.bmm(queries, keys.transpose(1, 2))
            subsequent_mask = torch.triu(torch.ones(1, t, t, device=d()), 0)
            scores = scores.masked_fill(subsequent_mask.transpose(1, 2) == 0, -1e9)

        attn_probs = F.softmax(scores, dim=2)
        attn_probs = self.dropout(attn_probs)
        out = torch.bmm(attn_probs, values).view(b, h, t, s)
        out = out.transpose(1, 2).contiguous().view(b, t, s * h)
        return self.unifyheads(out)


# ---- model.py ----
class MusicTransformer(nn.Module):
    def __init__(self, n_tokens, seq_length, d_model=64, n_heads=4, depth=2, d_feedforward=512, dropout=0.1):
        super().__init__()
        self.n_tokens = n_tokens
        self.embed = SequenceEmbedding(n_tokens, d_model)
        self.pos = nn.Embedding(seq_length, d_model)
        self.to_scores = nn.Linear(d_model, n_tokens)
        self.layers = clones(DecoderLayer(d_model, n_heads, d_feedforward, dropout), depth)
        self.norm = nn.LayerNorm(d_model)

    def forward(self, x, mask=None):
        x = self.embed(x)
        b, t, e = x.size()
        positions = self.pos(torch.arange(t, device=d()))[None, :, :].expand(b, t, e)
        x = x + positions
        for layer in self.layers:
            x = layer(x, mask)
        z = self.norm(x)
        return self.to_scores(z)


class DecoderLayer(nn.Module):
    def __init__(self, size, n_heads, d_feedforward, dropout):
        super().__init__()
        self.self_attn = MultiheadedAttention(size, n_heads, dropout)
        self.feed_forward = PositionwiseFeedForward(size, d_feedforward, dropout)
        self.size = size
        self.norm1 = nn.LayerNorm(size)
        self.norm2 = nn.LayerNorm(size)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x, mask):
        attn = self.self_attn(x, mask)
        x = x + self.dropout1(attn)
        x = self.norm1(x)
        ff = self.feed_forward(x)
        x = x + self.dropout2(ff)
        x = self.norm2(x)
        return x


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        return self.w_2(self.dropout(F.relu(self.w_1(x))))


class SequenceEmbedding(nn.Module):
    def __init__(self, vocab_size, model_size):
        super().__init__()
        self.d_model = model_size
        self.emb = nn.Embedding(vocab_size, model_size)

    def forward(self, x):
        return self.emb(x) * math.sqrt(self.d_model)


# ---- train.py ----
def make_batch(input_sequences, target_sequences, n_tokens, padded_length):
    sequence_lengths = [len(s) for s in input_sequences]
    batch_size = len(input_sequences)
    x = torch.zeros(batch_size, padded_length, dtype=torch.long)
    y = torch.zeros(batch_size, padded_length, dtype=torch.long)
    for i, sequence in enumerate(input_sequences):
        seq_length = sequence_lengths[i]
        x[i, :seq_length] = torch.Tensor(sequence).unsqueeze(0)
    x_mask = (x != 0).unsqueeze(1)
    sm = subsequent_mask(padded_length)
    x_mask = (x_mask.type(torch.uint8) & sm)
    for i, sequence in enumerate(target_sequences):
        seq_length = sequence_lengths[i]
        y[i, :seq_length] = torch.Tensor(sequence).unsqueeze(0)
    return x, y, x_mask


# ---- generate.py ----
def sample(model, sample_length, prime_sequence=[], temperature=1, topk=None, trace=None):
    model.eval()
    input_sequence = list(prime_sequence)
    for i in range(sample_length):
        input_tensor = torch.LongTensor(input_sequence)
        input_tensor = input_tensor.unsqueeze(0)
        out = model(input_tensor)
        probs = F.softmax(out / temperature, dim=-1)
        probs = probs[:, -1, :]
        if trace is not None:
            trace.append((input_tensor.clone(), out[:, -1, :].clone()))
        next_char_ix = torch.multinomial(probs, 1).item()
        input_sequence.append(next_char_ix)
    return input_sequence


if __name__ == "__main__":
    n_tokens, seq_length = 40, 32
    model = MusicTransformer(n_tokens, seq_length, d_model=32, n_heads=4, depth=2, d_feedforward=64, dropout=0.1)

    # one training step, as train.train() does (mask built by make_batch)
    seqs = [list(np.random.randint(1, n_tokens, size=L)) for L in (25, 19, 13)]
    inputs = [s[:-1] for s in seqs]
    targets = [s[1:] for s in seqs]
    x, y, x_mask = make_batch(inputs, targets, model.n_tokens, 24)
    optimizer = torch.optim.Adam(model.parameters())
    model.train()
    y_hat = model(x, x_mask).transpose(1, 2)
    loss = nn.CrossEntropyLoss()(y_hat, y)
    model.zero_grad()
    loss.backward()
    optimizer.step()

    # generate.sample(): model(input_tensor) with no mask
    trace = []
    gen = sample(model, 12, prime_sequence=[5, 9, 3, 17, 22, 8], trace=trace)

    # reference: the next-token distribution under the causal mask the model was trained with
    maxdiff = 0.0
    with torch.no_grad():
        for inp, logits in trace:
            t = inp.size(1)
            ref = model(inp, subsequent_mask(t))[:, -1, :]
            maxdiff = max(maxdiff, (ref - logits).abs().max().item())
    print("generated:", gen)
    print(f"max |logits_sample - logits_causal| at the sampled position: {maxdiff:.6e}")
