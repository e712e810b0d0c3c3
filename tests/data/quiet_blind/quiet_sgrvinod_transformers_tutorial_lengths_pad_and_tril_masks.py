"""A Transformer for translation as sgrvinod's "a-PyTorch-Tutorial-to-Transformers" writes it.

Ported from sgrvinod/a-PyTorch-Tutorial-to-Transformers @4a38c2184b9e466a447175050e894d213d411590: model.py
(MultiHeadAttention, PositionWiseFCNetwork, Encoder, Decoder, Transformer, LabelSmoothedCE), utils.py
(get_positional_encoding), train.py (the teacher-forced loss over predicted_sequences[:, :-1] and lengths - 1) and
dataloader.py (SequenceLoader: pad_sequence(batch_first=True, padding_value=0) with the true lengths kept beside).
Masks come from lengths: every MultiHeadAttention hides keys at positions >= key_value_sequence_lengths (repeated
over heads with repeat_interleave, masked_fill -inf), and the decoder's self-attention also keeps to a
torch.ones_like(...).tril() mask. Tiny sizes, CPU, no dropout at eval; the batch is checked against each sentence
pair run alone with no padding.
"""
import math

import torch
from torch import nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pack_padded_sequence, pad_sequence

device = torch.device("cpu")


class MultiHeadAttention(nn.Module):
    def __init__(self, d_model, n_heads, d_queries, d_values, dropout, in_decoder=False):
        super(MultiHeadAttention, self).__init__()
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_queries = d_queries
        self.d_values = d_values
        self.d_keys = d_queries
        self.in_decoder = in_decoder
        self.cast_queries = nn.Linear(d_model, n_heads * d_queries)
        self.cast_keys_values = nn.Linear(d_model, n_heads * (d_queries + d_values))
        self.cast_output = nn.Linear(n_heads * d_values, d_model)
        self.softmax = nn.Softmax(dim=-1)
        self.layer_norm = nn.LayerNorm(d_model)
        self.apply_dropout = nn.Dropout(dropout)

    def forward(self, query_sequences, key_value_sequences, key_value_sequence_lengths):
        batch_size = query_sequences.size(0)
        query_sequence_pad_length = query_sequences.size(1)
        key_value_sequence_pad_length = key_value_sequences.size(1)

        # Is this self-attention?
        self_attention = torch.equal(key_value_sequences, query_sequences)

        input_to_add = query_sequences.clone()
        query_sequences = self.layer_norm(query_sequences)
        if self_attention:
            key_value_sequences = self.layer_norm(key_value_sequences)

        queries = self.cast_queries(query_sequences)
        keys, values = self.cast_keys_values(key_value_sequences).split(split_size=self.n_heads * self.d_keys, dim=-1)

        queries = queries.contiguous().view(batch_size, query_sequence_pad_length, self.n_heads, self.d_queries)
        keys = keys.contiguous().view(batch_size, key_value_sequence_pad_length, self.n_heads, self.d_keys)
        values = values.contiguous().view(batch_size, key_value_sequence_pad_length, self.n_heads, self.d_values)

        queries = queries.permute(0, 2, 1, 3).contiguous().view(-1, query_sequence_pad_length, self.d_queries)
        keys = keys.permute(0, 2, 1, 3).contiguous().view(-1, key_value_sequence_pad_length, self.d_keys)
        values = values.permute(0, 2, 1, 3).contiguous().view(-1, key_value_sequence_pad_length, self.d_values)

        attention_weights = torch.bmm(queries, keys.permute(0, 2, 1))
        attention_weights = (1. / math.sqrt(self.d_keys)) * attention_weights

        # MASK 1: keys that are pads
        not_pad_in_keys = torch.LongTensor(range(key_value_sequence_pad_length)).unsqueeze(0).unsqueeze(0).expand_as(
            attention_weights).to(device)
        not_pad_in_keys = not_pad_in_keys < key_value_sequence_lengths.repeat_interleave(self.n_heads).unsqueeze(
            1).unsqueeze(2).expand_as(attention_weights)
        attention_weights = attention_weights.masked_fill(~not_pad_in_keys, -float('inf'))

        # MASK 2: if this is self-attention in the decoder, keys chronologically ahead of queries
        if self.in_decoder and self_attention:
            not_future_mask = torch.ones_like(attention_weights).tril().bool().to(device)
            attention_weights = attention_weights.masked_fill(~not_future_mask, -float('inf'))

        attention_weights = self.softmax(attention_weights)
        attention_weights = self.apply_dropout(attention_weights)
        sequences = torch.bmm(attention_weights, values)

        sequences = sequences.contiguous().view(batch_size, self.n_heads, query_sequence_pad_length,
                                                self.d_values).permute(0, 2, 1, 3)
        sequences = sequences.contiguous().view(batch_size, query_sequence_pad_length, -1)
        sequences = self.cast_output(sequences)
        sequences = self.apply_dropout(sequences) + input_to_add
        return sequences


class PositionWiseFCNetwork(nn.Module):
    def __init__(self, d_model, d_inner, dropout):
        super(PositionWiseFCNetwork, self).__init__()
        self.layer_norm = nn.LayerNorm(d_model)
        self.fc1 = nn.Linear(d_model, d_inner)
        self.relu = nn.ReLU()
        self.fc2 = nn.Linear(d_inner, d_model)
        self.apply_dropout = nn.Dropout(dropout)

    def forward(self, sequences):
        input_to_add = sequences.clone()
        sequences = self.layer_norm(sequences)
        sequences = self.apply_dropout(self.relu(self.fc1(sequences)))
        sequences = self.fc2(sequences)
        sequences = self.apply_dropout(sequences) + input_to_add
        return sequences


class Encoder(nn.Module):
    def __init__(self, vocab_size, positional_encoding, d_model, n_heads, d_queries, d_values, d_inner, n_layers,
                 dropout):
        super(Encoder, self).__init__()
        self.vocab_size = vocab_size
        self.positional_encoding = positional_encoding
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_queries = d_queries
        self.d_values = d_values
        self.d_inner = d_inner
        self.n_layers = n_layers
        self.dropout = dropout
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.positional_encoding.requires_grad = False
        self.encoder_layers = nn.ModuleList([self.make_encoder_layer() for i in range(n_layers)])
        self.apply_dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model)

    def make_encoder_layer(self):
        return nn.ModuleList([MultiHeadAttention(d_model=self.d_model, n_heads=self.n_heads,
                                                 d_queries=self.d_queries, d_values=self.d_values,
                                                 dropout=self.dropout, in_decoder=False),
                              PositionWiseFCNetwork(d_model=self.d_model, d_inner=self.d_inner,
                                                    dropout=self.dropout)])

    def forward(self, encoder_sequences, encoder_sequence_lengths):
        pad_length = encoder_sequences.size(1)
        encoder_sequences = self.embedding(encoder_sequences) * math.sqrt(self.d_model) + self.positional_encoding[:,
                                                                                          :pad_length, :].to(device)
        encoder_sequences = self.apply_dropout(encoder_sequences)
        for encoder_layer in self.encoder_layers:
            encoder_sequences = encoder_layer[0](query_sequences=encoder_sequences,
                                                 key_value_sequences=encoder_sequences,
                                                 key_value_sequence_lengths=encoder_sequence_lengths)
            encoder_sequences = encoder_layer[1](sequences=encoder_sequences)
        encoder_sequences = self.layer_norm(encoder_sequences)
        return encoder_sequences


class Decoder(nn.Module):
    def __init__(self, vocab_size, positional_encoding, d_model, n_heads, d_queries, d_values, d_inner, n_layers,
                 dropout):
        super(Decoder, self).__init__()
        self.vocab_size = vocab_size
        self.positional_encoding = positional_encoding
        self.d_model = d_model
        self.n_heads = n_heads
        self.d_queries = d_queries
        self.d_values = d_values
        self.d_inner = d_inner
        self.n_layers = n_layers
        self.dropout = dropout
        self.embedding = nn.Embedding(vocab_size, d_model)
        self.positional_encoding.requires_grad = False
        self.decoder_layers = nn.ModuleList([self.make_decoder_layer() for i in range(n_layers)])
        self.apply_dropout = nn.Dropout(dropout)
        self.layer_norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, vocab_size)

    def make_decoder_layer(self):
        return nn.ModuleList([MultiHeadAttention(d_model=self.d_model, n_heads=self.n_heads,
                                                 d_queries=self.d_queries, d_values=self.d_values,
                                                 dropout=self.dropout, in_decoder=True),
                              MultiHeadAttention(d_model=self.d_model, n_heads=self.n_heads,
                                                 d_queries=self.d_queries, d_values=self.d_values,
                                                 dropout=self.dropout, in_decoder=True),
                              PositionWiseFCNetwork(d_model=self.d_model, d_inner=self.d_inner,
                                                    dropout=self.dropout)])

    def forward(self, decoder_sequences, decoder_sequence_lengths, encoder_sequences, encoder_sequence_lengths):
        pad_length = decoder_sequences.size(1)
        decoder_sequences = self.embedding(decoder_sequences) * math.sqrt(self.d_model) + self.positional_encoding[:,
                                                                                          :pad_length, :].to(device)
        decoder_sequences = self.apply_dropout(decoder_sequences)
        for decoder_layer in self.decoder_layers:
            decoder_sequences = decoder_layer[0](query_sequences=decoder_sequences,
                                                 key_value_sequences=decoder_sequences,
                                                 key_value_sequence_lengths=decoder_sequence_lengths)
            decoder_sequences = decoder_layer[1](query_sequences=decoder_sequences,
                                                 key_value_sequences=encoder_sequences,
                                                 key_value_sequence_lengths=encoder_sequence_lengths)
            decoder_sequences = decoder_layer[2](sequences=decoder_sequences)
        decoder_sequences = self.layer_norm(decoder_sequences)
        decoder_sequences = self.fc(decoder_sequences)
        return decoder_sequences


class Transformer(nn.Module):
    def __init__(self, vocab_size, positional_encoding, d_model=512, n_heads=8, d_queries=64, d_values=64,
                 d_inner=2048, n_layers=6, dropout=0.1):
        super(Transformer, self).__init__()
        self.vocab_size = vocab_size
        self.positional_encoding = positional_encoding
        self.d_model = d_model
        self.encoder = Encoder(vocab_size=vocab_size, positional_encoding=positional_encoding, d_model=d_model,
                               n_heads=n_heads, d_queries=d_queries, d_values=d_values, d_inner=d_inner,
                               n_layers=n_layers, dropout=dropout)
        self.decoder = Decoder(vocab_size=vocab_size, positional_encoding=positional_encoding, d_model=d_model,
                               n_heads=n_heads, d_queries=d_queries, d_values=d_values, d_inner=d_inner,
                               n_layers=n_layers, dropout=dropout)
        self.init_weights()

    def init_weights(self):
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.xavier_uniform_(p, gain=1.)
        nn.init.normal_(self.encoder.embedding.weight, mean=0., std=math.pow(self.d_model, -0.5))
        self.decoder.embedding.weight = self.encoder.embedding.weight
        self.decoder.fc.weight = self.decoder.embedding.weight

    def forward(self, encoder_sequences, decoder_sequences, encoder_sequence_lengths, decoder_sequence_lengths):
        encoder_sequences = self.encoder(encoder_sequences, encoder_sequence_lengths)
        decoder_sequences = self.decoder(decoder_sequences, decoder_sequence_lengths, encoder_sequences,
                                         encoder_sequence_lengths)
        return decoder_sequences


class LabelSmoothedCE(torch.nn.Module):
    def __init__(self, eps=0.1):
        super(LabelSmoothedCE, self).__init__()
        self.eps = eps

    def forward(self, inputs, targets, lengths):
        inputs, _, _, _ = pack_padded_sequence(input=inputs, lengths=lengths, batch_first=True, enforce_sorted=False)
        targets, _, _, _ = pack_padded_sequence(input=targets, lengths=lengths, batch_first=True,
                                                enforce_sorted=False)
        target_vector = torch.zeros_like(inputs).scatter(dim=1, index=targets.unsqueeze(1), value=1.).to(device)
        target_vector = target_vector * (1. - self.eps) + self.eps / target_vector.size(1)
        loss = (-1 * target_vector * F.log_softmax(inputs, dim=1)).sum(dim=1)
        loss = torch.mean(loss)
        return loss


def get_positional_encoding(d_model, max_length=100):
    positional_encoding = torch.zeros((max_length, d_model))
    for i in range(max_length):
        for j in range(d_model):
            if j % 2 == 0:
                positional_encoding[i, j] = math.sin(i / math.pow(10000, j / d_model))
            else:
                positional_encoding[i, j] = math.cos(i / math.pow(10000, (j - 1) / d_model))
    positional_encoding = positional_encoding.unsqueeze(0)
    return positional_encoding


def collate(pairs):
    # SequenceLoader: pad both sides at the end with 0 (<PAD>) and keep the true lengths
    source_data = [torch.LongTensor(s) for s, _ in pairs]
    target_data = [torch.LongTensor(t) for _, t in pairs]
    source_sequence_lengths = torch.LongTensor([len(s) for s in source_data])
    target_sequence_lengths = torch.LongTensor([len(t) for t in target_data])
    source_data = pad_sequence(sequences=source_data, batch_first=True, padding_value=0)
    target_data = pad_sequence(sequences=target_data, batch_first=True, padding_value=0)
    return source_data, target_data, source_sequence_lengths, target_sequence_lengths


def main():
    torch.manual_seed(0)
    vocab_size, BOS, EOS = 40, 1, 2
    positional_encoding = get_positional_encoding(d_model=32, max_length=64)
    model = Transformer(vocab_size=vocab_size, positional_encoding=positional_encoding, d_model=32, n_heads=4,
                        d_queries=8, d_values=8, d_inner=64, n_layers=2, dropout=0.1).to(device)
    model.eval()
    criterion = LabelSmoothedCE(eps=0.1).to(device)

    g = torch.Generator().manual_seed(1)
    pairs = []
    for src_len, tgt_len in [(7, 5), (3, 9), (11, 4), (5, 7)]:
        src = torch.randint(3, vocab_size, (src_len,), generator=g).tolist()
        tgt = [BOS] + torch.randint(3, vocab_size, (tgt_len - 2,), generator=g).tolist() + [EOS]
        pairs.append((src, tgt))
    source_sequences, target_sequences, source_sequence_lengths, target_sequence_lengths = collate(pairs)

    with torch.no_grad():
        predicted_sequences = model(source_sequences, target_sequences, source_sequence_lengths,
                                    target_sequence_lengths)
        # train.py: teacher forcing, the logits at t predict the token at t + 1
        loss = criterion(inputs=predicted_sequences[:, :-1, :], targets=target_sequences[:, 1:],
                         lengths=target_sequence_lengths - 1)

        ref_losses, ref_count = [], 0
        for b, (src, tgt) in enumerate(pairs):
            s = torch.LongTensor(src).unsqueeze(0)
            t = torch.LongTensor(tgt).unsqueeze(0)
            alone = model(s, t, torch.LongTensor([len(src)]), torch.LongTensor([len(tgt)]))
            got = predicted_sequences[b, :len(tgt)]
            assert torch.allclose(got, alone[0], atol=1e-5), (b, (got - alone[0]).abs().max())
            # encoder states of the real source tokens
            enc_batch = model.encoder(source_sequences, source_sequence_lengths)[b, :len(src)]
            enc_alone = model.encoder(s, torch.LongTensor([len(src)]))[0]
            assert torch.allclose(enc_batch, enc_alone, atol=1e-5)
            # a prefix of the target gives the same logits on that prefix (no key ahead of a query)
            cut = len(tgt) - 2
            prefix = model(s, t[:, :cut], torch.LongTensor([len(src)]), torch.LongTensor([cut]))
            assert torch.allclose(prefix[0], alone[0, :cut], atol=1e-5)
            logp = F.log_softmax(alone[0, :-1], dim=-1)
            smooth = torch.full_like(logp, 0.1 / vocab_size)
            smooth.scatter_(1, t[0, 1:].unsqueeze(1), 0.9 + 0.1 / vocab_size)
            ref_losses.append((-smooth * logp).sum())
            ref_count += len(tgt) - 1
        ref_loss = torch.stack(ref_losses).sum() / ref_count
        assert torch.allclose(loss, ref_loss, atol=1e-5), (loss, ref_loss)

        # greedy decoding as translate.py does it for one sentence (beam size 1): the decoder re-run over the
        # tokens so far, its last position read; checked against the full teacher-forced run of the result
        src = pairs[0][0]
        s = torch.LongTensor(src).unsqueeze(0)
        sl = torch.LongTensor([len(src)])
        encoder_sequences = model.encoder(s, sl)
        hyp = [BOS]
        for step in range(6):
            d = torch.LongTensor([hyp])
            scores = model.decoder(d, torch.LongTensor([len(hyp)]), encoder_sequences, sl)
            hyp.append(int(scores[0, -1].argmax()))
        full = model(s, torch.LongTensor([hyp]), sl, torch.LongTensor([len(hyp)]))
        assert full[0, :-1].argmax(-1).tolist() == hyp[1:]
    print("ok: batched logits, encoder states, loss and greedy decode match the per-pair runs; loss %.4f"
          % loss.item())


if __name__ == "__main__":
    main()
