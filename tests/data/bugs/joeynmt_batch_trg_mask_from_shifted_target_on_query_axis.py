# joeynmt/joeynmt commit 7ac46a9: "fix trg_mask, update configs"
# Batch built the Transformer decoder's target mask from the shifted *output* `trg` (trg[:, 1:]) and put it on the
# query axis: `(self.trg != pad_index).unsqueeze(-1)` -> (B, T, 1). TransformerDecoder ANDs it with subsequent_mask,
# so pad keys were never masked and every query whose next token is padding (the EOS input and the pad inputs) had
# its whole row masked: with -1e9 it attends uniformly to all target positions, the future included. The fix builds
# it from `trg_input` on the key axis: `(self.trg_input != pad_index).unsqueeze(1)` -> (B, 1, T).
# Torch port of joeynmt at 7ac46a9^ (batch.py, model.py, encoders.py/decoders.py Transformer*, transformer.py).
import copy
import math
import sys
from types import SimpleNamespace

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD_INDEX, BOS_INDEX, EOS_INDEX = 1, 2, 3


# ---------------------------------------------------------------- joeynmt/batch.py
class Batch:
    def __init__(self, torch_batch, pad_index, use_cuda=False):
        self.src, self.src_lengths = torch_batch.src
        self.src_mask = (self.src != pad_index).unsqueeze(-2)
        self.nseqs = self.src.size(0)
        self.trg_input = None
        self.trg = None
        self.trg_mask = None
        self.trg_lengths = None
        self.ntokens = None
        self.use_cuda = use_cuda

        if hasattr(torch_batch, "trg"):
            trg, trg_lengths = torch_batch.trg
            # trg_input is used for teacher forcing, last one is cut off
            self.trg_input = trg[:, :-1]
            self.trg_lengths = trg_lengths
            # trg is used for loss computation, shifted by one since BOS
            self.trg = trg[:, 1:]
            # we exclude the padded areas from the loss computation
            if FIXED:
                self.trg_mask = (self.trg_input != pad_index).unsqueeze(1)
            else:
                self.trg_mask = (self.trg != pad_index).unsqueeze(-1)
            self.ntokens = (self.trg != pad_index).data.sum().item()


# ---------------------------------------------------------------- joeynmt/transformer.py, helpers.py
def clones(module, N):
    return nn.ModuleList([copy.deepcopy(module) for _ in range(N)])


def subsequent_mask(size: int) -> Tensor:
    attn_shape = (1, size, size)
    mask = np.triu(np.ones(attn_shape), k=1).astype('uint8')
    return torch.from_numpy(mask) == 0


class SublayerConnection(nn.Module):
    def __init__(self, size, dropout):
        super(SublayerConnection, self).__init__()
        self.norm = nn.LayerNorm(size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == 0, -1e9)
    p_attn = F.softmax(scores, dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, num_heads: int, hidden_size: int, dropout: float = 0.1):
        super(MultiHeadedAttention, self).__init__()
        assert hidden_size % num_heads == 0
        self.d_k = hidden_size // num_heads
        self.h = num_heads
        self.linears = clones(nn.Linear(hidden_size, hidden_size), 4)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            # Same mask applied to all h heads.
            mask = mask.unsqueeze(1)
        nbatches = query.size(0)
        query, key, value = \
            [l(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
             for l, x in zip(self.linears, (query, key, value))]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        return self.linears[-1](x)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff, dropout=0.1):
        super(PositionwiseFeedForward, self).__init__()
        self.layer = nn.Sequential(nn.Linear(d_model, d_ff), nn.ReLU(), nn.Dropout(dropout), nn.Linear(d_ff, d_model))

    def forward(self, x):
        return self.layer(x)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout, max_len=5000):
        super(PositionalEncoding, self).__init__()
        self.dropout = nn.Dropout(p=dropout)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer('pe', pe.unsqueeze(0))

    def forward(self, x):
        x = x + self.pe[:, :x.size(1)]
        return self.dropout(x)


# ---------------------------------------------------------------- joeynmt/encoders.py
class TransformerEncoderLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward, dropout):
        super(TransformerEncoderLayer, self).__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout), 2)
        self.size = size

    def forward(self, x, mask):
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, mask))
        return self.sublayer[1](x, self.feed_forward)


class TransformerEncoder(nn.Module):
    def __init__(self, hidden_size=512, ff_size=2048, num_layers=8, num_heads=4, dropout=0.1, **kwargs):
        super(TransformerEncoder, self).__init__()
        self.layers = nn.ModuleList([TransformerEncoderLayer(
            hidden_size, MultiHeadedAttention(num_heads, hidden_size),
            PositionwiseFeedForward(hidden_size, ff_size, dropout), dropout) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(hidden_size)
        self.pe = PositionalEncoding(hidden_size, dropout=dropout)

    def forward(self, embed_src, src_length, mask):
        x = self.pe(embed_src)
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x), None


# ---------------------------------------------------------------- joeynmt/decoders.py
class TransformerDecoderLayer(nn.Module):
    def __init__(self, size, self_attn, src_attn, feed_forward, dropout):
        super(TransformerDecoderLayer, self).__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.sublayer = clones(SublayerConnection(size, dropout), 3)

    def forward(self, x=None, memory=None, src_mask=None, trg_mask=None):
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, trg_mask))
        x = self.sublayer[1](x, lambda x: self.src_attn(x, memory, memory, src_mask))
        return self.sublayer[2](x, self.feed_forward)


class TransformerDecoder(nn.Module):
    def __init__(self, num_layers=4, num_heads=8, hidden_size=512, ff_size=2048, dropout=0.1, vocab_size=1,
                 **kwargs):
        super(TransformerDecoder, self).__init__()
        self.layers = nn.ModuleList([TransformerDecoderLayer(
            hidden_size, MultiHeadedAttention(num_heads, hidden_size), MultiHeadedAttention(num_heads, hidden_size),
            PositionwiseFeedForward(hidden_size, ff_size, dropout), dropout) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(hidden_size)
        self.pe = PositionalEncoding(hidden_size, dropout=dropout)
        self.output_layer = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, trg_embed=None, encoder_output=None, encoder_hidden=None, src_mask=None, unroll_steps=None,
                hidden=None, trg_mask=None, **kwargs):
        assert trg_mask is not None, "trg_mask required for Transformer"
        x = trg_embed
        x = self.pe(x)  # add position encoding
        trg_mask = trg_mask & subsequent_mask(trg_embed.size(1)).type_as(trg_mask)
        for layer in self.layers:
            x = layer(x=x, memory=encoder_output, src_mask=src_mask, trg_mask=trg_mask)
        x = self.norm(x)
        output = self.output_layer(x)
        return output, x, None, None


# ---------------------------------------------------------------- joeynmt/model.py
class Model(nn.Module):
    def __init__(self, encoder, decoder, src_embed, trg_embed):
        super(Model, self).__init__()
        self.src_embed, self.trg_embed = src_embed, trg_embed
        self.encoder, self.decoder = encoder, decoder

    def forward(self, src, trg_input, src_mask, src_lengths, trg_mask=None):
        encoder_output, encoder_hidden = self.encode(src=src, src_length=src_lengths, src_mask=src_mask)
        unroll_steps = trg_input.size(1)
        return self.decode(encoder_output=encoder_output, encoder_hidden=encoder_hidden, src_mask=src_mask,
                           trg_input=trg_input, unroll_steps=unroll_steps, trg_mask=trg_mask)

    def encode(self, src, src_length, src_mask):
        return self.encoder(self.src_embed(src), src_length, src_mask)

    def decode(self, encoder_output, encoder_hidden, src_mask, trg_input, unroll_steps, decoder_hidden=None,
               trg_mask=None):
        return self.decoder(trg_embed=self.trg_embed(trg_input), encoder_output=encoder_output,
                            encoder_hidden=encoder_hidden, src_mask=src_mask, unroll_steps=unroll_steps,
                            hidden=decoder_hidden, trg_mask=trg_mask)

    def get_loss_for_batch(self, batch, loss_function):
        out, hidden, att_probs, _ = self.forward(
            src=batch.src, trg_input=batch.trg_input, src_mask=batch.src_mask, src_lengths=batch.src_lengths,
            trg_mask=batch.trg_mask)
        log_probs = F.log_softmax(out, dim=-1)
        batch_loss = loss_function(input=log_probs.contiguous().view(-1, log_probs.size(-1)),
                                   target=batch.trg.contiguous().view(-1))
        return batch_loss


# transformer_small.yaml, shrunk
cfg = dict(hidden_size=32, ff_size=64, num_layers=2, num_heads=4, dropout=0.1)
vocab = 30
model = Model(TransformerEncoder(**cfg), TransformerDecoder(vocab_size=vocab, **cfg),
              nn.Embedding(vocab, 32, padding_idx=PAD_INDEX), nn.Embedding(vocab, 32, padding_idx=PAD_INDEX))

# a torchtext batch (include_lengths=True, batch_first=True), right-padded with <pad>=1; trg has <s> ... </s>
src = torch.tensor([[5, 6, 7, 8, 9, EOS_INDEX], [10, 11, 12, EOS_INDEX, PAD_INDEX, PAD_INDEX]])
trg = torch.tensor([[BOS_INDEX, 13, 14, 15, 16, 17, EOS_INDEX], [BOS_INDEX, 18, 19, EOS_INDEX, PAD_INDEX, PAD_INDEX,
                                                                   PAD_INDEX]])
torch_batch = SimpleNamespace(src=(src, torch.tensor([6, 4])), trg=(trg, torch.tensor([7, 4])))
batch = Batch(torch_batch, pad_index=PAD_INDEX)

loss_function = nn.NLLLoss(ignore_index=PAD_INDEX, reduction='sum')
optimizer = torch.optim.Adam(model.parameters(), lr=2e-4)
model.train()
batch_loss = model.get_loss_for_batch(batch, loss_function)
normalized = batch_loss / batch.ntokens
normalized.backward()
optimizer.step()
optimizer.zero_grad()
print("trg_mask shape:", tuple(batch.trg_mask.shape), "loss/token %.4f" % normalized.item())

# what the decoder self-attention of the short sentence used (layer 0, averaged over heads)
p = model.decoder.layers[0].self_attn.attn[1].mean(0)  # (T, T)
future = torch.triu(torch.ones_like(p), diagonal=1).bool()
pad_keys = (batch.trg_input[1] == PAD_INDEX)[None, :].expand_as(p)
print("short sentence: weight on future keys per query:", [round(v, 3) for v in (p * future).sum(-1).tolist()])
print("short sentence: weight on <pad> keys per query:  ", [round(v, 3) for v in (p * pad_keys).sum(-1).tolist()])
