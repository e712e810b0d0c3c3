# seanswyi/sasrec-pytorch#1 ("Official attn", commit d991df5): SelfAttn's scaled_dotprod_attn computed `q @ k` (no
# transpose; it runs because hidden_dim == max_seq_len) and added the triu(-1e9) causal mask to that matrix, so the
# "future" mask sits on the wrong axes and every position sees later items. Fix: nn.MultiheadAttention + ~tril attn_mask.
import math
import sys

import torch
from torch import nn
from torch.nn import functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
NUM_ITEMS, HIDDEN, MAX_SEQ_LEN, NUM_BLOCKS = 60, 32, 32, 2  # arguments.py defaults: hidden_dim == max_seq_len == 50


def scaled_dotprod_attn(q, k, v, d):
    """Perform scaled dot-product attention as described in the paper."""
    qk = q @ k
    qk /= math.sqrt(d)
    # To prevent peaking.
    ones = torch.ones(size=qk.shape)
    mask_matrix = torch.triu(ones, diagonal=1) * (-1e9)
    qk += mask_matrix
    softmax_qk = F.softmax(qk, dim=-1)
    attn = softmax_qk @ v
    return attn


class SelfAttn(nn.Module):
    def __init__(self, hidden_dim):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.W_q = nn.Linear(hidden_dim, hidden_dim)
        self.W_k = nn.Linear(hidden_dim, hidden_dim)
        self.W_v = nn.Linear(hidden_dim, hidden_dim)

    def forward(self, q, k, v):
        return scaled_dotprod_attn(q=self.W_q(q), k=self.W_k(k), v=self.W_v(v), d=self.hidden_dim)


class PointWiseFFNN(nn.Module):
    def __init__(self, hidden_dim):
        super().__init__()
        self.W1 = nn.Linear(hidden_dim, hidden_dim)
        self.W2 = nn.Linear(hidden_dim, hidden_dim)
        self.relu = nn.ReLU()

    def forward(self, x):
        return self.W2(self.relu(self.W1(x)))


class SelfAttnBlock(nn.Module):
    def __init__(self, max_seq_len, hidden_dim, dropout_p, device):
        super().__init__()
        self.max_seq_len = max_seq_len
        self.layer_norm = nn.LayerNorm(normalized_shape=hidden_dim)
        self.dropout = nn.Dropout(p=dropout_p)
        if FIXED:
            self.self_attn = nn.MultiheadAttention(embed_dim=hidden_dim, num_heads=1, dropout=dropout_p,
                                                   batch_first=True)
        else:
            self.self_attn = SelfAttn(hidden_dim=hidden_dim)
        self.ffnn = PointWiseFFNN(hidden_dim=hidden_dim)

    def dropout_layernorm(self, x):
        return self.dropout(self.layer_norm(x))

    def forward(self, x, padding_mask):
        if FIXED:
            seq_len = x.shape[1]
            attention_mask = ~torch.tril(torch.ones(size=(seq_len, seq_len), dtype=torch.bool))
            x_attn, _ = self.self_attn(key=x, query=x, value=x, attn_mask=attention_mask)
        else:
            x_attn = self.self_attn(q=x, k=x, v=x)
        x_attn_output = x + self.dropout_layernorm(x_attn)
        x_ffnn = self.ffnn(x_attn_output)
        x_ffnn_output = x_attn_output + self.dropout_layernorm(x_ffnn)
        return x_ffnn_output * padding_mask.unsqueeze(-1)


class EmbeddingLayer(nn.Module):
    def __init__(self, num_items, hidden_dim, max_seq_len):
        super().__init__()
        self.hidden_dim = hidden_dim
        self.item_emb_matrix = nn.Embedding(num_items + 1, hidden_dim)
        self.positional_emb = nn.Embedding(max_seq_len, hidden_dim)

    def forward(self, x):
        x = self.item_emb_matrix(x)
        x *= math.sqrt(self.hidden_dim)
        batch_size, seq_len = x.shape[0], x.shape[1]
        positions = torch.tile(torch.tensor(range(seq_len)), dims=(batch_size, 1))
        return x + self.positional_emb(positions)


class SASRec(nn.Module):
    def __init__(self, num_items, num_blocks, hidden_dim, max_seq_len, dropout_p, device="cpu"):
        super().__init__()
        self.embedding_layer = EmbeddingLayer(num_items, hidden_dim, max_seq_len)
        self.self_attn_blocks = nn.Sequential(
            *[SelfAttnBlock(max_seq_len, hidden_dim, dropout_p, device) for _ in range(num_blocks)]
        )
        self.dropout = nn.Dropout(p=dropout_p)
        self.layer_norm = nn.LayerNorm(normalized_shape=hidden_dim)

    def get_padding_mask(self, seqs):
        return ~(seqs == 0)

    def forward(self, input_seqs, positive_seqs, negative_seqs):
        padding_mask = self.get_padding_mask(seqs=input_seqs)
        input_embs = self.dropout(self.embedding_layer(input_seqs))
        input_embs *= padding_mask.unsqueeze(-1)
        attn_output = input_embs
        for block in self.self_attn_blocks:
            attn_output = block(x=attn_output, padding_mask=padding_mask)
        attn_output = self.layer_norm(attn_output)
        positive_embs = self.dropout(self.embedding_layer(positive_seqs))
        negative_embs = self.dropout(self.embedding_layer(negative_seqs))
        positive_logits = (attn_output * positive_embs).sum(dim=-1)
        negative_logits = (attn_output * negative_embs).sum(dim=-1)
        return positive_logits, negative_logits


model = SASRec(NUM_ITEMS, NUM_BLOCKS, HIDDEN, MAX_SEQ_LEN, dropout_p=0.0).eval()

# left-padded training sequences: input = items[:-1], positives = items[1:] (next item), random negatives
lens = [32, 20]
seqs = torch.zeros(2, MAX_SEQ_LEN + 1, dtype=torch.long)
for b, L in enumerate(lens):
    seqs[b, MAX_SEQ_LEN + 1 - L:] = torch.randint(1, NUM_ITEMS + 1, (L,))
input_seqs, positive_seqs = seqs[:, :-1], seqs[:, 1:]
negative_seqs = torch.randint(1, NUM_ITEMS + 1, positive_seqs.shape) * (positive_seqs != 0)

with torch.no_grad():
    pos_logits, neg_logits = model(input_seqs, positive_seqs, negative_seqs)
    # change only the items after position T; a causal model's logits at positions <= T must not move
    T = 20
    changed = input_seqs.clone()
    changed[:, T + 1:] = torch.randint(1, NUM_ITEMS + 1, changed[:, T + 1:].shape) * (input_seqs[:, T + 1:] != 0)
    pos_logits2, _ = model(changed, positive_seqs, negative_seqs)
    leak = (pos_logits[:, : T + 1] - pos_logits2[:, : T + 1]).abs().max()
    print("max |positive logit change at positions <= T| after changing only future items:", float(leak))
