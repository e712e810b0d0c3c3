# bojone/bert4keras commit 184f10d (reported in bojone/bert4keras#387): "修复T5的变长pad问题" (fix T5's variable-length pad problem)
# bert4keras' T5_Decoder gets its cross-attention key mask from `Masking(mask_value=0.0)` over the context,
# i.e. a source position counts as padding only if its encoder output vector is all zeros. T5_Encoder ended with
# Norm + Dropout, so padded positions carried non-zero vectors: the decoder's context mask was all ones and every
# cross-attention (training and decoding) attended to the padded source. The fix adds `Encoder-Output-Masked`
# (sequence_masking with the encoder's token mask) so padded outputs are zeroed and the decoder's Masking recovers them.
# Torch port of bert4keras/models.py (T5_Encoder, T5_Decoder, LM_Mask) and layers.py (MultiHeadAttention,
# RelativePositionEmbeddingT5, LayerNormalization center=False); Keras masks are carried explicitly.
import sys

import numpy as np
import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def sequence_masking(x, mask, value=0.0, axis=None):
    """bert4keras.backend.sequence_masking"""
    if mask is None:
        return x
    mask = mask.to(x.dtype)
    if value == '-inf':
        value = -1e12
    elif value == 'inf':
        value = 1e12
    if axis is None:
        axis = 1
    elif axis < 0:
        axis = x.ndim + axis
    for _ in range(axis - 1):
        mask = mask.unsqueeze(1)
    for _ in range(x.ndim - mask.ndim):
        mask = mask.unsqueeze(mask.ndim)
    return x * mask + value * (1 - mask)


class LayerNormalization(nn.Module):
    """center=False: T5's RMS norm"""

    def __init__(self, hidden, center=False, epsilon=1e-6):
        super().__init__()
        self.center, self.epsilon = center, epsilon
        self.gamma = nn.Parameter(torch.ones(hidden))

    def forward(self, x):
        if self.center:
            x = x - x.mean(-1, keepdim=True)
        variance = (x ** 2).mean(-1, keepdim=True)
        return x / torch.sqrt(variance + self.epsilon) * self.gamma


class RelativePositionEmbeddingT5(nn.Module):
    def __init__(self, input_dim, output_dim, max_distance=128, bidirectional=True):
        super().__init__()
        self.input_dim, self.max_distance, self.bidirectional = input_dim, max_distance, bidirectional
        self.embeddings = nn.Parameter(torch.randn(input_dim, output_dim) * 0.1)

    def compute_position_ids(self, q, v):
        q_idxs = torch.arange(q.shape[1])[:, None]
        v_idxs = torch.arange(v.shape[1])[None, :]
        pos_ids = v_idxs - q_idxs
        num_buckets, max_distance = self.input_dim, self.max_distance
        ret = 0
        n = -pos_ids
        if self.bidirectional:
            num_buckets //= 2
            ret = ret + (n < 0).long() * num_buckets
            n = n.abs()
        else:
            n = n.clamp(min=0)
        max_exact = num_buckets // 2
        is_small = n < max_exact
        val_if_large = max_exact + (
            torch.log(n.float().clamp(min=1) / max_exact) / np.log(max_distance / max_exact)
            * (num_buckets - max_exact)).long()
        val_if_large = val_if_large.clamp(max=num_buckets - 1)
        return ret + torch.where(is_small, n, val_if_large)

    def forward(self, inputs):
        q, v = inputs
        return self.embeddings[self.compute_position_ids(q, v)]  # (q_len, v_len, heads)


class MultiHeadAttention(nn.Module):
    def __init__(self, heads, head_size, out_dim, key_size):
        super().__init__()
        self.heads, self.head_size, self.key_size = heads, head_size, key_size
        self.q_dense = nn.Linear(out_dim, key_size * heads, bias=False)
        self.k_dense = nn.Linear(out_dim, key_size * heads, bias=False)
        self.v_dense = nn.Linear(out_dim, head_size * heads, bias=False)
        self.o_dense = nn.Linear(head_size * heads, out_dim, bias=False)
        self.attention_scale = False
        self.last_A = None

    def forward(self, inputs, mask=None, a_bias=None, p_bias=None):
        q, k, v = inputs[:3]
        q_mask, v_mask = (mask[0], mask[2]) if mask is not None else (None, None)
        qw = self.q_dense(q).reshape(q.shape[0], q.shape[1], self.heads, self.key_size)
        kw = self.k_dense(k).reshape(k.shape[0], k.shape[1], self.heads, self.key_size)
        vw = self.v_dense(v).reshape(v.shape[0], v.shape[1], self.heads, self.head_size)
        o = self.pay_attention_to([qw, kw, vw] + list(inputs[3:]), [q_mask, v_mask], a_bias=a_bias, p_bias=p_bias)
        o = o.reshape(o.shape[0], o.shape[1], self.head_size * self.heads)
        return self.o_dense(o)

    def pay_attention_to(self, inputs, mask=None, **kwargs):
        (qw, kw, vw), n = inputs[:3], 3
        q_mask, v_mask = mask
        a_bias, p_bias = kwargs.get('a_bias'), kwargs.get('p_bias')
        if a_bias:
            a_bias = inputs[n]
            n += 1
        a = torch.einsum('bjhd,bkhd->bhjk', qw, kw)
        if p_bias == 't5_relative':
            position_bias = inputs[n].permute(2, 0, 1)
            a = a + position_bias.unsqueeze(0)
        if self.attention_scale:
            a = a / self.key_size ** 0.5
        if a_bias is not None:
            a = a + a_bias
        a = sequence_masking(a, v_mask, '-inf', -1)
        A = torch.softmax(a, dim=-1)
        self.last_A = A.detach()
        return torch.einsum('bhjk,bkhd->bjhd', A, vw)


class FeedForward(nn.Module):
    def __init__(self, hidden, units):
        super().__init__()
        self.i0_dense = nn.Linear(hidden, units, bias=False)
        self.o_dense = nn.Linear(units, hidden, bias=False)

    def forward(self, x):
        return self.o_dense(torch.relu(self.i0_dense(x)))


class T5_Encoder(nn.Module):
    def __init__(self, vocab_size, hidden_size, num_attention_heads, attention_head_size, intermediate_size,
                 num_hidden_layers, dropout_rate=0.1):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_size)  # mask_zero=True
        self.dropout = nn.Dropout(dropout_rate)
        self.rel = RelativePositionEmbeddingT5(32, num_attention_heads, bidirectional=True)
        self.att_norms = nn.ModuleList(LayerNormalization(hidden_size) for _ in range(num_hidden_layers))
        self.atts = nn.ModuleList(MultiHeadAttention(num_attention_heads, attention_head_size, hidden_size,
                                                     attention_head_size) for _ in range(num_hidden_layers))
        self.ffn_norms = nn.ModuleList(LayerNormalization(hidden_size) for _ in range(num_hidden_layers))
        self.ffns = nn.ModuleList(FeedForward(hidden_size, intermediate_size) for _ in range(num_hidden_layers))
        self.output_norm = LayerNormalization(hidden_size)

    def forward(self, token_ids):
        mask = token_ids != 0  # Embedding-Token, mask_zero=True (propagated Keras mask)
        x = self.dropout(self.embedding(token_ids))
        position_bias = self.rel([x, x])
        for norm, att, fnorm, ffn in zip(self.att_norms, self.atts, self.ffn_norms, self.ffns):
            xi = x
            x = norm(x)
            x = att([x, x, x, position_bias], mask=[mask, mask, mask], p_bias='t5_relative')
            x = xi + self.dropout(x)
            xi = x
            x = xi + self.dropout(ffn(fnorm(x)))
        x = self.output_norm(x)                        # Encoder-Output-Norm
        x = self.dropout(x)                            # Encoder-Output-Dropout
        if FIXED:
            x = sequence_masking(x, mask)              # Encoder-Output-Masked (the fix)
        return x


class T5_Decoder(nn.Module):
    def __init__(self, vocab_size, hidden_size, num_attention_heads, attention_head_size, intermediate_size,
                 num_hidden_layers, dropout_rate=0.1):
        super().__init__()
        self.embedding = nn.Embedding(vocab_size, hidden_size)
        self.dropout = nn.Dropout(dropout_rate)
        self.rel = RelativePositionEmbeddingT5(32, num_attention_heads, bidirectional=False)
        mk = lambda: MultiHeadAttention(num_attention_heads, attention_head_size, hidden_size, attention_head_size)
        self.self_norms = nn.ModuleList(LayerNormalization(hidden_size) for _ in range(num_hidden_layers))
        self.self_atts = nn.ModuleList(mk() for _ in range(num_hidden_layers))
        self.cross_norms = nn.ModuleList(LayerNormalization(hidden_size) for _ in range(num_hidden_layers))
        self.cross_atts = nn.ModuleList(mk() for _ in range(num_hidden_layers))
        self.ffn_norms = nn.ModuleList(LayerNormalization(hidden_size) for _ in range(num_hidden_layers))
        self.ffns = nn.ModuleList(FeedForward(hidden_size, intermediate_size) for _ in range(num_hidden_layers))
        self.output_norm = LayerNormalization(hidden_size)
        self.lm = nn.Linear(hidden_size, vocab_size, bias=False)

    @staticmethod
    def compute_attention_bias(s):
        """LM_Mask.compute_attention_bias"""
        seq_len = s.shape[1]
        idxs = torch.arange(seq_len)
        mask = (idxs[None, :] <= idxs[:, None]).float()
        return -(1 - mask[None, None]) * 1e12

    def forward(self, inputs):
        c, x_ids = inputs
        c_mask = (c != 0.0).any(dim=-1)               # Masked-Context: Masking(mask_value=0.0)
        c = c * c_mask[..., None].to(c.dtype)
        x_mask = x_ids != 0                            # Embedding-Token, mask_zero=True
        x = self.dropout(self.embedding(x_ids))
        attention_mask = self.compute_attention_bias(x_ids)
        position_bias = [self.rel([x, x]), self.rel([x, c])]
        for i in range(len(self.self_atts)):
            xi = x
            x = self.self_norms[i](x)
            x = self.self_atts[i]([x, x, x, attention_mask, position_bias[0]], mask=[x_mask, x_mask, x_mask],
                                  a_bias=True, p_bias='t5_relative')
            x = xi + self.dropout(x)
            xi = x
            x = self.cross_norms[i](x)
            x = self.cross_atts[i]([x, c, c, position_bias[1]], mask=[x_mask, c_mask, c_mask],
                                   a_bias=None, p_bias='t5_relative')
            x = xi + self.dropout(x)
            xi = x
            x = xi + self.dropout(self.ffns[i](self.ffn_norms[i](x)))
        x = self.dropout(self.output_norm(x))
        return self.lm(x), c_mask


class T5(nn.Module):
    def __init__(self, **kwargs):
        super().__init__()
        self.encoder = T5_Encoder(**kwargs)
        self.decoder = T5_Decoder(**kwargs)

    def forward(self, inputs):
        x_in, y_in = inputs
        return self.decoder([self.encoder(x_in), y_in])


config = dict(vocab_size=40, hidden_size=32, num_attention_heads=4, attention_head_size=8, intermediate_size=64,
              num_hidden_layers=2, dropout_rate=0.1)
model = T5(**config)

# summarization-style batch, right-padded with 0 (bert4keras sequence_padding); row 1 is shorter
batch_token_ids = torch.tensor([[2, 11, 12, 13, 14, 15, 16, 3],
                                [2, 21, 22, 23, 3, 0, 0, 0]])
batch_summary_ids = torch.tensor([[2, 31, 32, 33, 3],
                                  [2, 34, 35, 3, 0]])

# one training step (model.fit on [token_ids, summary_ids], CrossEntropy on y_true = summary[:, 1:])
opt = torch.optim.Adam(model.parameters(), lr=1e-3)
model.train()
logits, _ = model([batch_token_ids, batch_summary_ids])
y_true, y_pred = batch_summary_ids[:, 1:], logits[:, :-1]
y_mask = (y_true != 0).float()
loss = (nn.functional.cross_entropy(y_pred.reshape(-1, y_pred.shape[-1]), y_true.reshape(-1),
                                    reduction='none') * y_mask.reshape(-1)).sum() / y_mask.sum()
loss.backward()
opt.step()
opt.zero_grad()
print("train loss %.4f" % loss.item())

# AutoRegressiveDecoder-style greedy decoding: encoder.predict once, then decoder.predict([c, y]) each step
model.eval()
with torch.no_grad():
    c = model.encoder(batch_token_ids)
    y = torch.full((2, 1), 2)
    for _ in range(4):
        logits, c_mask = model.decoder([c, y])
        y = torch.cat([y, logits[:, -1].argmax(-1, keepdim=True)], 1)
    A = model.decoder.cross_atts[0].last_A  # (batch, heads, tgt, src)
    print("decoder context mask row 1:", c_mask[1].int().tolist())
    print("cross-attention weight on padded source of row 1: %.4f" % A[1, :, :, 5:].sum(-1).mean().item())
    print("greedy output:", y.tolist())
