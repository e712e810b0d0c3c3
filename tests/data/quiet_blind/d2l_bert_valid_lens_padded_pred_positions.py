# Follows d2l-ai/d2l-en d2l/torch.py BERTEncoder/MaskLM/NextSentencePred, _pad_bert_inputs and _get_batch_loss_bert: 1-D
# valid_lens (pair length incl. <cls>/<sep>) go to masked_softmax (-1e6 fill, repeat_interleave'd over heads); pred_positions are
# padded with 0 (a real <cls> index!) and neutralised only by mlm_weights = 0 in the loss; padded query rows are never read.
import math
import torch
from torch import nn

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def masked_softmax(X, valid_lens):
    def _sequence_mask(X, valid_len, value=0):
        maxlen = X.size(1)
        mask = torch.arange((maxlen), dtype=torch.float32, device=X.device)[None, :] < valid_len[:, None]
        X[~mask] = value
        return X
    if valid_lens is None:
        return nn.functional.softmax(X, dim=-1)
    shape = X.shape
    if valid_lens.dim() == 1:
        valid_lens = torch.repeat_interleave(valid_lens, shape[1])
    else:
        valid_lens = valid_lens.reshape(-1)
    X = _sequence_mask(X.reshape(-1, shape[-1]), valid_lens, value=-1e6)
    return nn.functional.softmax(X.reshape(shape), dim=-1)


def transpose_qkv(X, num_heads):
    X = X.reshape(X.shape[0], X.shape[1], num_heads, -1).permute(0, 2, 1, 3)
    return X.reshape(-1, X.shape[2], X.shape[3])


def transpose_output(X, num_heads):
    X = X.reshape(-1, num_heads, X.shape[1], X.shape[2]).permute(0, 2, 1, 3)
    return X.reshape(X.shape[0], X.shape[1], -1)


class MultiHeadAttention(nn.Module):
    def __init__(self, num_hiddens, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.W_q, self.W_k, self.W_v, self.W_o = (nn.LazyLinear(num_hiddens, bias=False) for _ in range(4))

    def forward(self, queries, keys, values, valid_lens):
        queries, keys, values = (transpose_qkv(f(x), self.num_heads) for f, x in
                                 ((self.W_q, queries), (self.W_k, keys), (self.W_v, values)))
        if valid_lens is not None:
            valid_lens = torch.repeat_interleave(valid_lens, repeats=self.num_heads, dim=0)
        scores = torch.bmm(queries, keys.transpose(1, 2)) / math.sqrt(queries.shape[-1])
        out = torch.bmm(masked_softmax(scores, valid_lens), values)
        return self.W_o(transpose_output(out, self.num_heads))




class PositionWiseFFN(nn.Module):
    def __init__(self, ffn_num_hiddens, ffn_num_outputs):
        super().__init__()
        self.dense1, self.relu, self.dense2 = nn.LazyLinear(ffn_num_hiddens), nn.ReLU(), nn.LazyLinear(ffn_num_outputs)

    def forward(self, X):
        return self.dense2(self.relu(self.dense1(X)))


class AddNorm(nn.Module):
    def __init__(self, norm_shape):
        super().__init__()
        self.ln = nn.LayerNorm(norm_shape)

    def forward(self, X, Y):
        return self.ln(Y + X)


class TransformerEncoderBlock(nn.Module):
    def __init__(self, num_hiddens, ffn_num_hiddens, num_heads):
        super().__init__()
        self.attention = MultiHeadAttention(num_hiddens, num_heads)
        self.addnorm1, self.ffn, self.addnorm2 = AddNorm(num_hiddens), PositionWiseFFN(ffn_num_hiddens, num_hiddens), AddNorm(num_hiddens)

    def forward(self, X, valid_lens):
        Y = self.addnorm1(X, self.attention(X, X, X, valid_lens))
        return self.addnorm2(Y, self.ffn(Y))


class BERTEncoder(nn.Module):
    def __init__(self, vocab_size, num_hiddens, ffn_num_hiddens, num_heads, num_blks, max_len=64):
        super().__init__()
        self.token_embedding = nn.Embedding(vocab_size, num_hiddens)
        self.segment_embedding = nn.Embedding(2, num_hiddens)
        self.blks = nn.Sequential(*[TransformerEncoderBlock(num_hiddens, ffn_num_hiddens, num_heads) for _ in range(num_blks)])
        self.pos_embedding = nn.Parameter(torch.randn(1, max_len, num_hiddens))

    def forward(self, tokens, segments, valid_lens):
        X = self.token_embedding(tokens) + self.segment_embedding(segments)
        X = X + self.pos_embedding[:, :X.shape[1], :]
        for blk in self.blks:
            X = blk(X, valid_lens)
        return X


class MaskLM(nn.Module):
    def __init__(self, vocab_size, num_hiddens):
        super().__init__()
        self.mlp = nn.Sequential(nn.LazyLinear(num_hiddens), nn.ReLU(), nn.LayerNorm(num_hiddens), nn.LazyLinear(vocab_size))

    def forward(self, X, pred_positions):
        num_pred_positions = pred_positions.shape[1]
        pred_positions = pred_positions.reshape(-1)
        batch_size = X.shape[0]
        batch_idx = torch.repeat_interleave(torch.arange(0, batch_size), num_pred_positions)
        masked_X = X[batch_idx, pred_positions].reshape((batch_size, num_pred_positions, -1))
        return self.mlp(masked_X)


V, D = 30, 32
encoder, mlm = BERTEncoder(V, D, 48, 4, 2), MaskLM(V, D)
hidden, nsp = nn.Sequential(nn.LazyLinear(D), nn.Tanh()), nn.LazyLinear(2)
PAD, CLS, SEP = 0, 1, 2
pairs = [([5, 6, 7], [8, 9]), ([10], [11, 12, 13, 14]), ([15, 16], [17])]
max_len, max_preds = 10, 3
preds = [[2, 5], [1, 3, 6], [4]]
toks, segs, vls, pps, ws, labels = [], [], [], [], [], []
for (a, b), p in zip(pairs, preds):
    t = [CLS] + a + [SEP] + b + [SEP]
    s = [0] * (len(a) + 2) + [1] * (len(b) + 1)
    toks.append(t + [PAD] * (max_len - len(t))); segs.append(s + [0] * (max_len - len(s))); vls.append(len(t))
    pps.append(p + [0] * (max_preds - len(p))); ws.append([1.0] * len(p) + [0.0] * (max_preds - len(p)))
    labels.append([int(x) for x in torch.randint(3, V, (len(p),))] + [0] * (max_preds - len(p)))
tokens, segments, valid_lens = torch.tensor(toks), torch.tensor(segs), torch.tensor(vls)
pred_positions, mlm_weights, mlm_Y = torch.tensor(pps), torch.tensor(ws), torch.tensor(labels)
loss = nn.CrossEntropyLoss(reduction="none")
with torch.no_grad():
    X = encoder(tokens, segments, valid_lens)
    mlm_Y_hat = mlm(X, pred_positions)
    nsp_Y_hat = nsp(hidden(X[:, 0, :]))
    mlm_l = loss(mlm_Y_hat.reshape(-1, V), mlm_Y.reshape(-1)) * mlm_weights.reshape(-1)
    mlm_l = mlm_l.sum() / (mlm_weights.sum() + 1e-8)
    # reference: each pair alone, unpadded, no valid_lens, only its real prediction positions
    diff, tot, n = 0.0, 0.0, 0
    for i, ((a, b), p) in enumerate(zip(pairs, preds)):
        L = vls[i]
        Xi = encoder(tokens[i:i + 1, :L], segments[i:i + 1, :L], None)
        diff = max(diff, (X[i, :L] - Xi[0]).abs().max().item())
        yi = mlm(Xi, torch.tensor([p]))
        diff = max(diff, (mlm_Y_hat[i, :len(p)] - yi[0]).abs().max().item())
        diff = max(diff, (nsp_Y_hat[i] - nsp(hidden(Xi[:, 0, :]))[0]).abs().max().item())
        tot += loss(yi[0], mlm_Y[i, :len(p)]).sum().item(); n += len(p)
    diff = max(diff, abs(mlm_l.item() - tot / (n + 1e-8)))
print("max |padded BERT batch (valid_lens, padded pred_positions, mlm_weights) - each pair alone| =", diff)
assert diff < 1e-10
