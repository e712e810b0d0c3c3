"""AllenNLP's BidirectionalLanguageModelTransformer (the "Calypso" transformer
used by the bidirectional language model), shrunk to tiny sizes.

Ported from allenai/allennlp
  allennlp/modules/seq2seq_encoders/bidirectional_language_model_transformer.py
  @0ed7fa3ad85412ec0f51d232abe806aad7afa219
  (attention, subsequent_mask, MultiHeadedAttention, EncoderLayer,
   SublayerConnection, TransformerEncoder, get_attention_masks, forward)
and allennlp/nn/util.py (min_value_of_dtype, get_text_field_mask-style
mask from token ids != 0).

Masks are boolean, True = may attend, filled with the dtype's finite minimum.
  forward_mask  = mask.unsqueeze(-1) & tril       (B, T, T): row i (query) is
                  masked by the *query's* padding, columns by causality. With
                  right padding a real query i only reaches keys j <= i, which
                  are all real, so no key padding term is needed.
  backward_mask = forward_mask.transpose(1, 2)    (B, T, T): query i sees keys
                  j >= i that are real (key padding + anti-causal).
Padded query rows are fully masked in both directions (finite fill -> uniform
softmax); their outputs are never used: the LM loss below is masked.

Checks: every real position of a right-padded batch equals the same sequence
run alone, unpadded; the forward stream at i equals the prefix [:i+1] run
alone; the backward stream at i does not move when tokens before i change;
the masked LM loss of the batch equals the sum of the per-sentence losses.
"""
import copy
import math

import torch
import torch.nn.functional as F

torch.manual_seed(0)


def min_value_of_dtype(dtype):
    return torch.finfo(dtype).min


def clone(module, num_copies):
    return torch.nn.ModuleList(copy.deepcopy(module) for _ in range(num_copies))


def attention(query, key, value, mask=None, dropout=None):
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(~mask, min_value_of_dtype(scores.dtype))
    p_attn = F.softmax(scores, dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


def subsequent_mask(size, device="cpu"):
    return torch.tril(torch.ones(size, size, device=device, dtype=torch.bool)).unsqueeze(0)


class PositionalEncoding(torch.nn.Module):
    def __init__(self, input_dim, max_len=64):
        super().__init__()
        pe = torch.zeros(max_len, input_dim)
        position = torch.arange(0, max_len).unsqueeze(1).float()
        div_term = torch.exp(torch.arange(0, input_dim, 2).float() * -(math.log(10000.0) / input_dim))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("positional_encoding", pe.unsqueeze(0))

    def forward(self, x):
        return x + self.positional_encoding[:, : x.size(1)]


class PositionwiseFeedForward(torch.nn.Module):
    def __init__(self, input_dim, ff_dim, dropout=0.0):
        super().__init__()
        self.w_1 = torch.nn.Linear(input_dim, ff_dim)
        self.w_2 = torch.nn.Linear(ff_dim, input_dim)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x):
        return self.w_2(self.dropout(F.relu(self.w_1(x))))


class TransformerEncoder(torch.nn.Module):
    def __init__(self, layer, num_layers):
        super().__init__()
        self.layers = clone(layer, num_layers)
        self.norm = torch.nn.LayerNorm(layer.size)

    def forward(self, x, mask):
        for layer in self.layers:
            x = layer(x, mask)
        return self.norm(x)


class SublayerConnection(torch.nn.Module):
    def __init__(self, size, dropout):
        super().__init__()
        self.norm = torch.nn.LayerNorm(size)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x, sublayer):
        return x + self.dropout(sublayer(self.norm(x)))


class EncoderLayer(torch.nn.Module):
    def __init__(self, size, self_attn, feed_forward, dropout):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.sublayer = clone(SublayerConnection(size, dropout), 2)
        self.size = size

    def forward(self, x, mask):
        x = self.sublayer[0](x, lambda x: self.self_attn(x, x, x, mask))
        return self.sublayer[1](x, self.feed_forward)


class MultiHeadedAttention(torch.nn.Module):
    def __init__(self, num_heads, input_dim, dropout=0.0):
        super().__init__()
        self.d_k = input_dim // num_heads
        self.num_heads = num_heads
        self.linears = clone(torch.nn.Linear(input_dim, input_dim), 4)
        self.dropout = torch.nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            # Same mask applied to all h heads. (batch, heads, timesteps, timesteps)
            mask = mask.unsqueeze(1).expand([-1, self.num_heads, -1, -1])
        nbatches = query.size(0)
        query, key, value = [
            layer(x).view(nbatches, -1, self.num_heads, self.d_k).transpose(1, 2)
            for layer, x in zip(self.linears, (query, key, value))
        ]
        x, _ = attention(query, key, value, mask=mask, dropout=self.dropout)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.num_heads * self.d_k)
        return self.linears[-1](x)


def make_model(num_layers, input_size, hidden_size, heads, dropout=0.0):
    attn = MultiHeadedAttention(heads, input_size, dropout)
    ff = PositionwiseFeedForward(input_size, hidden_size, dropout)
    model = TransformerEncoder(EncoderLayer(input_size, attn, ff, dropout), num_layers)
    for p in model.parameters():
        if p.dim() > 1:
            torch.nn.init.xavier_uniform_(p)
    return model


class BidirectionalLanguageModelTransformer(torch.nn.Module):
    def __init__(self, input_dim, hidden_dim, num_layers, heads=4, dropout=0.0):
        super().__init__()
        self._forward_transformer = make_model(num_layers, input_dim, hidden_dim, heads, dropout)
        self._backward_transformer = make_model(num_layers, input_dim, hidden_dim, heads, dropout)
        self._position = PositionalEncoding(input_dim)

    def get_attention_masks(self, mask):
        timesteps = mask.size(1)
        subsequent = subsequent_mask(timesteps, mask.device)  # (1, T, T)
        forward_mask = mask.unsqueeze(-1) & subsequent  # (B, T, T)
        backward_mask = forward_mask.transpose(1, 2)
        return forward_mask, backward_mask

    def forward(self, token_embeddings, mask):
        forward_mask, backward_mask = self.get_attention_masks(mask)
        token_embeddings = self._position(token_embeddings)
        forward_output = self._forward_transformer(token_embeddings, forward_mask)
        backward_output = self._backward_transformer(token_embeddings, backward_mask)
        return torch.cat([forward_output, backward_output], -1)


class TinyBidirectionalLM(torch.nn.Module):
    """LanguageModel-style wrapper (written for this test, not ported): the forward
    half predicts token i+1, the backward half token i-1, loss over real tokens."""

    def __init__(self, vocab, dim):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim, padding_idx=0)
        self.contextualizer = BidirectionalLanguageModelTransformer(dim, 2 * dim, num_layers=2)
        self.softmax_w = torch.nn.Linear(dim, vocab)
        self.dim = dim

    def forward(self, tokens):
        mask = tokens != 0  # get_text_field_mask
        contextual = self.contextualizer(self.embed(tokens), mask)
        fwd, bwd = contextual.split(self.dim, dim=-1)
        # next-token targets for the forward stream, previous-token for the backward stream
        fwd_targets = torch.zeros_like(tokens)
        fwd_targets[:, :-1] = tokens[:, 1:]
        bwd_targets = torch.zeros_like(tokens)
        bwd_targets[:, 1:] = tokens[:, :-1]
        fwd_nll = F.cross_entropy(self.softmax_w(fwd).transpose(1, 2), fwd_targets, reduction="none")
        bwd_nll = F.cross_entropy(self.softmax_w(bwd).transpose(1, 2), bwd_targets, reduction="none")
        # only real positions with a real target count (the first padded position
        # would otherwise get the last real token as a backward target)
        fwd_loss = (fwd_nll * (mask & (fwd_targets != 0))).sum()
        bwd_loss = (bwd_nll * (mask & (bwd_targets != 0))).sum()
        return contextual, fwd_loss + bwd_loss


def main():
    vocab, dim = 17, 16
    model = TinyBidirectionalLM(vocab, dim).eval()
    seqs = [[3, 5, 9, 2, 14, 7], [4, 11, 6], [8, 2, 13, 10, 5], [12]]
    T = max(len(s) for s in seqs)
    tokens = torch.zeros(len(seqs), T, dtype=torch.long)
    for i, s in enumerate(seqs):
        tokens[i, : len(s)] = torch.tensor(s)

    ok = True
    with torch.no_grad():
        out_b, loss_b = model(tokens)
        loss_sum = 0.0
        for i, s in enumerate(seqs):
            out_1, loss_1 = model(torch.tensor([s]))
            loss_sum += loss_1.item()
            ok &= (out_b[i, : len(s)] - out_1[0]).abs().max().item() < 1e-5
        print(f"padded batch vs each sequence alone: {'match' if ok else 'MISMATCH'}")
        loss_ok = abs(loss_b.item() - loss_sum) < 1e-3
        print(f"masked LM loss batch vs sum alone: {'match' if loss_ok else 'MISMATCH'}")
        ok &= loss_ok

        # forward stream is causal: position i == prefix [:i+1] alone
        # backward stream is anti-causal: position i ignores tokens before i
        s = seqs[0]
        full, _ = model(torch.tensor([s]))
        dir_ok = True
        for i in range(len(s)):
            pre, _ = model(torch.tensor([s[: i + 1]]))
            dir_ok &= (pre[0, i, :dim] - full[0, i, :dim]).abs().max().item() < 1e-5
            changed = list(s)
            for j in range(i):
                changed[j] = changed[j] % (vocab - 1) + 1  # a different non-pad token
            alt, _ = model(torch.tensor([changed]))
            dir_ok &= (alt[0, i, dim:] - full[0, i, dim:]).abs().max().item() < 1e-5
        print(f"forward causal / backward anti-causal per position: {'match' if dir_ok else 'MISMATCH'}")
        ok &= dir_ok

    print("ALL MATCH" if ok else "MISMATCH")
    assert ok


if __name__ == "__main__":
    main()
