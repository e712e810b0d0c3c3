# reczoo/FuxiCTR#30, fixed in commit abd5182 ("Fix split heads issue in multi-head attention (#30)"; diff of
# fuxictr/pytorch/layers/attention.py and models/AutoInt.py read). AutoInt split heads with
# query.view(batch_size * num_heads, -1, attention_dim) on a (batch, fields, heads*dim) tensor, so the "tokens" of
# each head were slices cut across fields (and heads of one sample), and each field's query attended to the wrong set.
import sys

import numpy as np
import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

# config/model_config/AutoInt.yaml: AutoInt_base (sizes kept small)
params = {
    "model": "AutoInt",
    "learning_rate": 1.e-3,
    "embedding_dim": 16,
    "dnn_hidden_units": [64, 64],
    "net_dropout": 0,
    "num_heads": 2,
    "attention_layers": 3,
    "attention_dim": 16,
    "use_residual": True,
    "batch_norm": False,
    "layer_norm": False,
    "use_scale": False,
    "use_wide": False,
}
NUM_FIELDS, VOCAB = 8, 30


class ScaledDotProductAttention(nn.Module):
    """ Scaled Dot-Product Attention """
    def __init__(self, dropout_rate=0.):
        super(ScaledDotProductAttention, self).__init__()
        self.dropout = None
        if dropout_rate > 0:
            self.dropout = nn.Dropout(dropout_rate)
        if not FIXED:
            self.softmax = nn.Softmax(dim=2)

    def forward(self, Q, K, V, scale=None, mask=None):
        if FIXED:
            scores = torch.matmul(Q, K.transpose(-1, -2))
            if scale:
                scores = scores / scale
            if mask:
                scores = scores.masked_fill_(mask, -1e-10)
            attention = scores.softmax(dim=-1)
            if self.dropout is not None:
                attention = self.dropout(attention)
            output = torch.matmul(attention, V)
            return output, attention
        W_q, W_k, W_v = Q, K, V
        attention = torch.bmm(W_q, W_k.transpose(1, 2))
        if scale:
            attention = attention / scale
        if mask:
            attention = attention.masked_fill_(mask, -np.inf)
        attention = self.softmax(attention)
        if self.dropout is not None:
            attention = self.dropout(attention)
        output = torch.bmm(attention, W_v)
        return output, attention


class MultiHeadAttention(nn.Module):
    """ Multi-head attention module (fuxictr/pytorch/layers/attention.py before the fix) """

    def __init__(self, input_dim, attention_dim=None, num_heads=1, dropout_rate=0.,
                 use_residual=True, use_scale=False, layer_norm=False, align_to="input"):
        super(MultiHeadAttention, self).__init__()
        if attention_dim is None:
            attention_dim = input_dim // num_heads
        self.attention_dim = attention_dim
        self.output_dim = num_heads * attention_dim
        self.num_heads = num_heads
        self.use_residual = use_residual
        self.align_to = align_to
        self.scale = attention_dim ** 0.5 if use_scale else None
        self.W_q = nn.Linear(input_dim, self.output_dim, bias=False)
        self.W_k = nn.Linear(input_dim, self.output_dim, bias=False)
        self.W_v = nn.Linear(input_dim, self.output_dim, bias=False)
        if input_dim != self.output_dim:
            if align_to == "output":
                self.W_res = nn.Linear(input_dim, self.output_dim, bias=False)
            elif align_to == "input":
                self.W_res = nn.Linear(self.output_dim, input_dim, bias=False)
        else:
            self.W_res = None
        self.dot_product_attention = ScaledDotProductAttention(dropout_rate)
        self.layer_norm = nn.LayerNorm(self.output_dim) if layer_norm else None
        self.dropout = nn.Dropout(dropout_rate) if dropout_rate > 0 else None

    def forward(self, query, key, value, mask=None):
        residual = query

        # linear projection
        query = self.W_q(query)
        key = self.W_k(key)
        value = self.W_v(value)

        # split by heads
        batch_size = query.size(0)
        query = query.view(batch_size * self.num_heads, -1, self.attention_dim)
        key = key.view(batch_size * self.num_heads, -1, self.attention_dim)
        value = value.view(batch_size * self.num_heads, -1, self.attention_dim)
        if mask:
            mask = mask.repeat(self.num_heads, 1, 1)
        # scaled dot product attention
        output, attention = self.dot_product_attention(query, key, value, self.scale, mask)
        # concat heads
        output = output.view(batch_size, -1, self.output_dim)
        # final linear projection
        if self.W_res is not None:
            if self.align_to == "output":  # AutoInt style
                residual = self.W_res(residual)
            elif self.align_to == "input":  # Transformer stype
                output = self.W_res(output)
        if self.dropout is not None:
            output = self.dropout(output)
        if self.use_residual:
            output = output + residual
        if self.layer_norm is not None:
            output = self.layer_norm(output)
        output = output.relu()
        return output, attention


class MultiHeadSelfAttention(MultiHeadAttention):
    def forward(self, X):
        output, attention = super(MultiHeadSelfAttention, self).forward(X, X, X)
        return output


class MultiHeadSelfAttentionFixed(nn.Module):
    """ Multi-head attention module (models/AutoInt.py after the fix) """

    def __init__(self, input_dim, attention_dim=None, num_heads=1, dropout_rate=0.,
                 use_residual=True, use_scale=False, layer_norm=False):
        super(MultiHeadSelfAttentionFixed, self).__init__()
        if attention_dim is None:
            attention_dim = input_dim
        assert attention_dim % num_heads == 0, \
            "attention_dim={} is not divisible by num_heads={}".format(attention_dim, num_heads)
        self.head_dim = attention_dim // num_heads
        self.num_heads = num_heads
        self.use_residual = use_residual
        self.scale = self.head_dim ** 0.5 if use_scale else None
        self.W_q = nn.Linear(input_dim, attention_dim, bias=False)
        self.W_k = nn.Linear(input_dim, attention_dim, bias=False)
        self.W_v = nn.Linear(input_dim, attention_dim, bias=False)
        if self.use_residual and input_dim != attention_dim:
            self.W_res = nn.Linear(input_dim, attention_dim, bias=False)
        else:
            self.W_res = None
        self.dot_attention = ScaledDotProductAttention(dropout_rate)
        self.layer_norm = nn.LayerNorm(attention_dim) if layer_norm else None

    def forward(self, X):
        residual = X

        # linear projection
        query = self.W_q(X)
        key = self.W_k(X)
        value = self.W_v(X)

        # split by heads
        batch_size = query.size(0)
        query = query.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, self.num_heads, self.head_dim).transpose(1, 2)

        # scaled dot product attention
        output, attention = self.dot_attention(query, key, value, scale=self.scale)
        # concat heads
        output = output.transpose(1, 2).contiguous().view(batch_size, -1, self.num_heads * self.head_dim)

        if self.W_res is not None:
            residual = self.W_res(residual)
        if self.use_residual:
            output += residual
        if self.layer_norm is not None:
            output = self.layer_norm(output)
        output = output.relu()
        return output


class AutoInt(nn.Module):
    def __init__(self, num_fields, vocab_size, learning_rate=1e-3, embedding_dim=10, dnn_hidden_units=[64, 64, 64],
                 attention_layers=2, num_heads=1, attention_dim=8, net_dropout=0, batch_norm=False,
                 layer_norm=False, use_scale=False, use_wide=False, use_residual=True, **kwargs):
        super(AutoInt, self).__init__()
        self.num_fields = num_fields
        self.embedding_layer = nn.ModuleList([nn.Embedding(vocab_size, embedding_dim) for _ in range(num_fields)])
        layers, in_dim = [], embedding_dim * num_fields
        for h in dnn_hidden_units:
            layers += [nn.Linear(in_dim, h), nn.ReLU()]
            in_dim = h
        layers += [nn.Linear(in_dim, 1)]
        self.dnn = nn.Sequential(*layers) if dnn_hidden_units else None  # in case no DNN used
        if FIXED:
            self.self_attention = nn.Sequential(
                *[MultiHeadSelfAttentionFixed(embedding_dim if i == 0 else attention_dim,
                                              attention_dim=attention_dim,
                                              num_heads=num_heads,
                                              dropout_rate=net_dropout,
                                              use_residual=use_residual,
                                              use_scale=use_scale,
                                              layer_norm=layer_norm)
                  for i in range(attention_layers)])
            self.fc = nn.Linear(num_fields * attention_dim, 1)
        else:
            self.self_attention = nn.Sequential(
                *[MultiHeadSelfAttention(embedding_dim if i == 0 else num_heads * attention_dim,
                                         attention_dim=attention_dim,
                                         num_heads=num_heads,
                                         dropout_rate=net_dropout,
                                         use_residual=use_residual,
                                         use_scale=use_scale,
                                         layer_norm=layer_norm,
                                         align_to="output")
                  for i in range(attention_layers)])
            self.fc = nn.Linear(num_fields * attention_dim * num_heads, 1)
        self.output_activation = nn.Sigmoid()

    def forward(self, X):
        feature_emb = torch.stack([emb(X[:, i]) for i, emb in enumerate(self.embedding_layer)], dim=1)
        attention_out = self.self_attention(feature_emb)
        attention_out = torch.flatten(attention_out, start_dim=1)
        y_pred = self.fc(attention_out)
        if self.dnn is not None:
            y_pred += self.dnn(feature_emb.flatten(start_dim=1))
        y_pred = self.output_activation(y_pred)
        return y_pred


model = AutoInt(NUM_FIELDS, VOCAB, **params)
optimizer = torch.optim.Adam(model.parameters(), lr=params["learning_rate"])
loss_fn = nn.BCELoss()
for step in range(5):
    X = torch.randint(0, VOCAB, (32, NUM_FIELDS))
    y = torch.randint(0, 2, (32, 1)).float()
    y_pred = model(X)
    loss = loss_fn(y_pred, y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
print("AutoInt fixed=%s loss %.5f" % (FIXED, loss.item()))
