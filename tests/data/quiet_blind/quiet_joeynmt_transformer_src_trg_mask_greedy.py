# Correct program (quiet batch quiet-r79b).
#
# Ported from joeynmt/joeynmt @cdc4d03d430a1b0f29793a0d95743c5e72ae2f6c:
#   joeynmt/batch.py              Batch.__init__ (src_mask, trg_input with EOS -> pad and cut, trg = trg[:, 1:],
#                                 trg_mask = (trg != pad_index).unsqueeze(1))
#   joeynmt/transformer_layers.py MultiHeadedAttention (masked_fill(~mask.unsqueeze(1), -inf)), PositionwiseFeedForward,
#                                 PositionalEncoding, TransformerEncoderLayer, TransformerDecoderLayer
#   joeynmt/encoders.py / decoders.py  TransformerEncoder.forward, TransformerDecoder.forward
#                                 (trg_mask & subsequent_mask(trg_len))
#   joeynmt/helpers.py            subsequent_mask
#   joeynmt/model.py              Model.forward(return_type="loss"), XentLoss (NLLLoss ignore_index=pad, sum)
#   joeynmt/search.py             transformer_greedy (re-runs the decoder over ys each step, trg_mask ones [1, 1, 1])
# Trimmed: dropout 0, no prompts / lang tags / repetition blockers, tied vocab.
#
# Translation batch with right-padded sources and targets (pad 1, bos 2, eos 3, JoeyNMT's ids): the encoder and the
# decoder's source attention take src_mask (B, 1, S); the decoder's self-attention takes trg_mask (B, 1, T) & tril.
#
# Self-check: each sentence pair run alone without padding gives the same log-probs at its real target positions and
# the batch loss (sum NLL) equals a double loop over sentence x target token; greedy decoding of the padded batch
# gives each sentence the tokens it gets alone (up to its own EOS) and its step log-probs.
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

PAD, BOS, EOS, UNK = 1, 2, 3, 0


def subsequent_mask(size):
    ones = torch.ones(size, size, dtype=torch.bool)
    return torch.tril(ones, out=ones).unsqueeze(0)


class MultiHeadedAttention(nn.Module):
    def __init__(self, num_heads, size, dropout=0.0):
        super().__init__()
        self.head_size = head_size = size // num_heads
        self.model_size = size
        self.num_heads = num_heads
        self.k_layer = nn.Linear(size, num_heads * head_size)
        self.v_layer = nn.Linear(size, num_heads * head_size)
        self.q_layer = nn.Linear(size, num_heads * head_size)
        self.output_layer = nn.Linear(size, size)
        self.softmax = nn.Softmax(dim=-1)
        self.dropout = nn.Dropout(dropout)

    def forward(self, k, v, q, mask=None):
        batch_size = k.size(0)
        k = self.k_layer(k)
        v = self.v_layer(v)
        q = self.q_layer(q)
        k = k.view(batch_size, -1, self.num_heads, self.head_size).transpose(1, 2)
        v = v.view(batch_size, -1, self.num_heads, self.head_size).transpose(1, 2)
        q = q.view(batch_size, -1, self.num_heads, self.head_size).transpose(1, 2)
        q = q / math.sqrt(self.head_size)
        scores = torch.matmul(q, k.transpose(2, 3))
        if mask is not None:
            scores = scores.masked_fill(~mask.unsqueeze(1), float("-inf"))
        attention_weights = self.softmax(scores)
        attention_probs = self.dropout(attention_weights)
        context = torch.matmul(attention_probs, v)
        context = context.transpose(1, 2).contiguous().view(batch_size, -1, self.num_heads * self.head_size)
        return self.output_layer(context), None


class PositionwiseFeedForward(nn.Module):
    def __init__(self, input_size, ff_size, dropout=0.0, layer_norm="pre"):
        super().__init__()
        self.layer_norm = nn.LayerNorm(input_size, eps=1e-6)
        self.pwff_layer = nn.Sequential(nn.Linear(input_size, ff_size), nn.ReLU(), nn.Dropout(dropout),
                                        nn.Linear(ff_size, input_size), nn.Dropout(dropout))
        self._layer_norm_position = layer_norm

    def forward(self, x):
        residual = x
        if self._layer_norm_position == "pre":
            x = self.layer_norm(x)
        x = self.pwff_layer(x) + residual
        if self._layer_norm_position == "post":
            x = self.layer_norm(x)
        return x


class PositionalEncoding(nn.Module):
    def __init__(self, size=0, max_len=5000):
        super().__init__()
        pe = torch.zeros(max_len, size)
        position = torch.arange(0, max_len).unsqueeze(1)
        div_term = torch.exp((torch.arange(0, size, 2, dtype=torch.float) * -(math.log(10000.0) / size)))
        pe[:, 0::2] = torch.sin(position.float() * div_term)
        pe[:, 1::2] = torch.cos(position.float() * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, emb):
        return emb + self.pe[:, :emb.size(1)]


class TransformerEncoderLayer(nn.Module):
    def __init__(self, size, ff_size, num_heads, layer_norm="pre"):
        super().__init__()
        self.layer_norm = nn.LayerNorm(size, eps=1e-6)
        self.src_src_att = MultiHeadedAttention(num_heads, size)
        self.feed_forward = PositionwiseFeedForward(size, ff_size, layer_norm=layer_norm)
        self.dropout = nn.Dropout(0.0)
        self._layer_norm_position = layer_norm

    def forward(self, x, mask):
        residual = x
        if self._layer_norm_position == "pre":
            x = self.layer_norm(x)
        x, _ = self.src_src_att(x, x, x, mask)
        x = self.dropout(x) + residual
        if self._layer_norm_position == "post":
            x = self.layer_norm(x)
        return self.feed_forward(x)


class TransformerDecoderLayer(nn.Module):
    def __init__(self, size, ff_size, num_heads, layer_norm="pre"):
        super().__init__()
        self.trg_trg_att = MultiHeadedAttention(num_heads, size)
        self.src_trg_att = MultiHeadedAttention(num_heads, size)
        self.feed_forward = PositionwiseFeedForward(size, ff_size, layer_norm=layer_norm)
        self.x_layer_norm = nn.LayerNorm(size, eps=1e-6)
        self.dec_layer_norm = nn.LayerNorm(size, eps=1e-6)
        self.dropout = nn.Dropout(0.0)
        self._layer_norm_position = layer_norm

    def forward(self, x, memory, src_mask, trg_mask):
        residual = x
        if self._layer_norm_position == "pre":
            x = self.x_layer_norm(x)
        h1, _ = self.trg_trg_att(x, x, x, mask=trg_mask)
        h1 = self.dropout(h1) + residual
        if self._layer_norm_position == "post":
            h1 = self.x_layer_norm(h1)
        h1_residual = h1
        if self._layer_norm_position == "pre":
            h1 = self.dec_layer_norm(h1)
        h2, att = self.src_trg_att(memory, memory, h1, mask=src_mask)
        h2 = self.dropout(h2) + h1_residual
        if self._layer_norm_position == "post":
            h2 = self.dec_layer_norm(h2)
        return self.feed_forward(h2), att


class TransformerEncoder(nn.Module):
    def __init__(self, hidden_size, ff_size, num_layers, num_heads):
        super().__init__()
        self.layers = nn.ModuleList([TransformerEncoderLayer(hidden_size, ff_size, num_heads) for _ in range(num_layers)])
        self.layer_norm = nn.LayerNorm(hidden_size, eps=1e-6)
        self.pe = PositionalEncoding(hidden_size)
        self.emb_dropout = nn.Dropout(0.0)

    def forward(self, src_embed, src_length, mask=None):
        x = self.pe(src_embed)
        x = self.emb_dropout(x)
        for layer in self.layers:
            x = layer(x, mask)
        return self.layer_norm(x), None


class TransformerDecoder(nn.Module):
    def __init__(self, hidden_size, ff_size, num_layers, num_heads, vocab_size):
        super().__init__()
        self.layers = nn.ModuleList([TransformerDecoderLayer(hidden_size, ff_size, num_heads) for _ in range(num_layers)])
        self.pe = PositionalEncoding(hidden_size)
        self.layer_norm = nn.LayerNorm(hidden_size, eps=1e-6)
        self.emb_dropout = nn.Dropout(0.0)
        self.output_layer = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, trg_embed, encoder_output, encoder_hidden, src_mask, unroll_steps, hidden, trg_mask, **kwargs):
        assert trg_mask is not None, "trg_mask required for Transformer"
        x = self.pe(trg_embed)
        x = self.emb_dropout(x)
        trg_mask = trg_mask & subsequent_mask(trg_embed.size(1)).type_as(trg_mask)
        for layer in self.layers:
            x, att = layer(x=x, memory=encoder_output, src_mask=src_mask, trg_mask=trg_mask)
        if self.layer_norm is not None:
            x = self.layer_norm(x)
        out = self.output_layer(x)
        return out, x, att, None


class Model(nn.Module):
    def __init__(self, vocab_size=30, hidden=32, ff=64, layers=2, heads=4):
        super().__init__()
        self.src_embed = nn.Embedding(vocab_size, hidden, padding_idx=PAD)
        self.trg_embed = nn.Embedding(vocab_size, hidden, padding_idx=PAD)
        self.encoder = TransformerEncoder(hidden, ff, layers, heads)
        self.decoder = TransformerDecoder(hidden, ff, layers, heads, vocab_size)
        self.pad_index, self.bos_index, self.eos_index = PAD, BOS, EOS
        self.criterion = nn.NLLLoss(ignore_index=PAD, reduction="sum")

    def forward(self, return_type, **kwargs):
        if return_type == "loss":
            out, _, _, _ = self._encode_decode(**kwargs)
            log_probs = F.log_softmax(out, dim=-1)
            batch_loss = self.criterion(log_probs.contiguous().view(-1, log_probs.size(-1)),
                                        kwargs["trg"].contiguous().view(-1))
            return batch_loss, log_probs
        if return_type == "encode":
            return self._encode(kwargs["src"], kwargs["src_length"], kwargs["src_mask"])
        if return_type == "decode":
            out, hidden, att, _ = self._decode(**kwargs)
            return F.log_softmax(out, dim=-1), hidden, att, None
        raise ValueError(return_type)

    def _encode_decode(self, src, trg_input, src_mask, src_length, trg_mask=None, **kwargs):
        encoder_output, encoder_hidden = self._encode(src, src_length, src_mask)
        return self._decode(encoder_output=encoder_output, encoder_hidden=encoder_hidden, src_mask=src_mask,
                            trg_input=trg_input, trg_mask=trg_mask)

    def _encode(self, src, src_length, src_mask):
        return self.encoder(self.src_embed(src), src_length, src_mask)

    def _decode(self, encoder_output, encoder_hidden, src_mask, trg_input, unroll_steps=None, decoder_hidden=None,
                trg_mask=None, **kwargs):
        return self.decoder(trg_embed=self.trg_embed(trg_input), encoder_output=encoder_output,
                            encoder_hidden=encoder_hidden, src_mask=src_mask, unroll_steps=unroll_steps,
                            hidden=decoder_hidden, trg_mask=trg_mask)


class Batch:
    def __init__(self, src, src_length, trg, pad_index=PAD, eos_index=EOS):
        self.src = src
        self.src_length = src_length
        self.src_mask = (self.src != pad_index).unsqueeze(1)
        has_eos = torch.any(trg == eos_index).item()
        trg_input = torch.where(trg == eos_index, pad_index, trg)
        self.trg_input = trg_input[:, :-1] if has_eos else trg_input
        self.trg = trg[:, 1:]
        self.trg_mask = (self.trg != pad_index).unsqueeze(1)
        self.ntokens = self.trg_mask.sum().item()


def transformer_greedy(src_mask, max_output_length, model, encoder_output, encoder_hidden, min_output_length=1):
    bos_index, eos_index = model.bos_index, model.eos_index
    batch_size, _, src_len = src_mask.size()
    ys = encoder_output.new_full((batch_size, 1), bos_index, dtype=torch.long)
    trg_mask = src_mask.new_ones([1, 1, 1])
    finished = src_mask.new_zeros((batch_size, 1)).byte()
    step_log_probs = []
    for step in range(max_output_length):
        with torch.no_grad():
            log_probs, _, att, _ = model(return_type="decode", trg_input=ys, encoder_output=encoder_output,
                                         encoder_hidden=None, src_mask=src_mask, unroll_steps=None,
                                         decoder_hidden=None, trg_mask=trg_mask)
        log_probs = log_probs[:, -1].clone()
        log_probs[:, bos_index] = float("-inf")
        if step < min_output_length:
            log_probs[:, eos_index] = float("-inf")
        step_log_probs.append(log_probs)
        prob, next_word = torch.max(log_probs, dim=1)
        next_word = next_word.data.unsqueeze(-1)
        ys = torch.cat([ys, next_word], dim=1)
        is_eos = torch.eq(next_word, eos_index)
        finished += is_eos
        if (finished >= 1).sum() == batch_size:
            break
    return ys[:, 1:], torch.stack(step_log_probs, 1)


def pad_rows(rows, pad=PAD):
    out = torch.full((len(rows), max(len(r) for r in rows)), pad, dtype=torch.long)
    for b, r in enumerate(rows):
        out[b, :len(r)] = torch.tensor(r)
    return out


def main():
    torch.manual_seed(0)
    model = Model().eval()
    srcs = [[5, 6, 7, 8, 9, 10, EOS], [11, 12, EOS], [13, 14, 15, 16, EOS]]
    trgs = [[BOS, 20, 21, 22, EOS], [BOS, 23, 24, 25, 26, 27, EOS], [BOS, 28, EOS]]
    batch = Batch(pad_rows(srcs), torch.tensor([len(s) for s in srcs]), pad_rows(trgs))

    with torch.no_grad():
        batch_loss, log_probs = model(return_type="loss", src=batch.src, trg=batch.trg, trg_input=batch.trg_input,
                                      src_mask=batch.src_mask, src_length=batch.src_length, trg_mask=batch.trg_mask)
    ref_loss, ntok = 0.0, 0
    for b in range(len(srcs)):
        one = Batch(torch.tensor([srcs[b]]), torch.tensor([len(srcs[b])]), torch.tensor([trgs[b]]))
        with torch.no_grad():
            _, lp = model(return_type="loss", src=one.src, trg=one.trg, trg_input=one.trg_input,
                          src_mask=one.src_mask, src_length=one.src_length, trg_mask=one.trg_mask)
        n = len(trgs[b]) - 1
        torch.testing.assert_close(log_probs[b, :n], lp[0], atol=1e-5, rtol=1e-5)
        for t in range(n):
            ref_loss += -float(lp[0, t, trgs[b][t + 1]])
            ntok += 1
    assert ntok == batch.ntokens
    torch.testing.assert_close(batch_loss, torch.tensor(ref_loss), atol=1e-4, rtol=1e-5)

    # greedy decoding of the padded batch vs each source alone
    with torch.no_grad():
        enc_out, enc_hidden = model(return_type="encode", src=batch.src, src_length=batch.src_length,
                                    src_mask=batch.src_mask)
    hyps, step_lp = transformer_greedy(batch.src_mask, 7, model, enc_out, enc_hidden)
    for b in range(len(srcs)):
        src_b = torch.tensor([srcs[b]])
        mask_b = (src_b != PAD).unsqueeze(1)
        with torch.no_grad():
            enc_b, hid_b = model(return_type="encode", src=src_b, src_length=torch.tensor([len(srcs[b])]),
                                 src_mask=mask_b)
        hyp_b, lp_b = transformer_greedy(mask_b, 7, model, enc_b, hid_b)
        k = hyp_b.shape[1]
        assert torch.equal(hyps[b, :k], hyp_b[0]), (b, hyps[b], hyp_b)
        torch.testing.assert_close(step_lp[b, :k], lp_b[0], atol=1e-4, rtol=1e-4)

    print("ok: padded batch = each sentence pair alone (log-probs, summed NLL, greedy hypotheses)")


if __name__ == "__main__":
    main()
