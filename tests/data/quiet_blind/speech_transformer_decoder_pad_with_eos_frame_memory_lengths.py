"""Speech-Transformer (ASR) training step: decoder inputs padded WITH the eos id, cross-attention over fbank frames.

Follows kaituoxu/Speech-Transformer (https://github.com/kaituoxu/Speech-Transformer: src/transformer/decoder.py
``Decoder.preprocess`` / ``Decoder.forward``, src/transformer/encoder.py ``Encoder.forward``,
src/transformer/attention.py ``MultiHeadAttention`` / ``ScaledDotProductAttention``, src/utils/utils.py
``pad_list``, ``get_non_pad_mask``, ``get_subsequent_mask``, ``get_attn_key_pad_mask``, ``get_attn_pad_mask``).

Masks meant: ``ys_in = [sos] + y`` never contains eos, so the project pads ``ys_in_pad`` with ``eos_id`` and builds
the decoder key-padding mask from ``ys_in_pad == eos_id``: those positions ARE the padding (while ``ys_out`` gets
``y + [eos]``, padded with IGNORE_ID). Decoder self-attention = that key-padding mask OR the subsequent (future)
mask. Encoder self-attention and decoder->encoder attention hide the padded acoustic frames of each utterance, from
``input_lengths``; the memory (frames) is several times longer than the token sequence and differs per row.
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

IGNORE_ID = -1


def pad_list(xs, pad_value):
    n_batch = len(xs)
    max_len = max(x.size(0) for x in xs)
    pad = xs[0].new(n_batch, max_len, *xs[0].size()[1:]).fill_(pad_value)
    for i in range(n_batch):
        pad[i, :xs[i].size(0)] = xs[i]
    return pad


def get_non_pad_mask(padded_input, input_lengths=None, pad_idx=None):
    assert input_lengths is not None or pad_idx is not None
    if input_lengths is not None:
        N = padded_input.size(0)
        non_pad_mask = padded_input.new_ones(padded_input.size()[:-1])  # B x T
        for i in range(N):
            non_pad_mask[i, input_lengths[i]:] = 0
    if pad_idx is not None:
        non_pad_mask = padded_input.ne(pad_idx).float()
    return non_pad_mask.unsqueeze(-1)


def get_subsequent_mask(seq):
    sz_b, len_s = seq.size()
    subsequent_mask = torch.triu(torch.ones((len_s, len_s), dtype=torch.uint8), diagonal=1)
    return subsequent_mask.unsqueeze(0).expand(sz_b, -1, -1)


def get_attn_key_pad_mask(seq_k, seq_q, pad_idx):
    len_q = seq_q.size(1)
    padding_mask = seq_k.eq(pad_idx)
    return padding_mask.unsqueeze(1).expand(-1, len_q, -1)


def get_attn_pad_mask(padded_input, input_lengths, expand_length):
    non_pad_mask = get_non_pad_mask(padded_input, input_lengths=input_lengths)
    pad_mask = non_pad_mask.squeeze(-1).lt(1)
    return pad_mask.unsqueeze(1).expand(-1, expand_length, -1)


class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature):
        super().__init__()
        self.temperature = temperature
        self.softmax = nn.Softmax(dim=2)

    def forward(self, q, k, v, mask=None):
        attn = torch.bmm(q, k.transpose(1, 2)) / self.temperature
        if mask is not None:
            attn = attn.masked_fill(mask, -np.inf)
        attn = self.softmax(attn)
        return torch.bmm(attn, v), attn


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, d_k, d_v):
        super().__init__()
        self.n_head, self.d_k, self.d_v = n_head, d_k, d_v
        self.w_qs = nn.Linear(d_model, n_head * d_k)
        self.w_ks = nn.Linear(d_model, n_head * d_k)
        self.w_vs = nn.Linear(d_model, n_head * d_v)
        self.attention = ScaledDotProductAttention(temperature=np.power(d_k, 0.5))
        self.layer_norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(n_head * d_v, d_model)

    def forward(self, q, k, v, mask=None):
        d_k, d_v, n_head = self.d_k, self.d_v, self.n_head
        sz_b, len_q, _ = q.size()
        sz_b, len_k, _ = k.size()
        residual = q
        q = self.w_qs(q).view(sz_b, len_q, n_head, d_k).permute(2, 0, 1, 3).contiguous().view(-1, len_q, d_k)
        k = self.w_ks(k).view(sz_b, len_k, n_head, d_k).permute(2, 0, 1, 3).contiguous().view(-1, len_k, d_k)
        v = self.w_vs(v).view(sz_b, len_k, n_head, d_v).permute(2, 0, 1, 3).contiguous().view(-1, len_k, d_v)
        if mask is not None:
            mask = mask.repeat(n_head, 1, 1)  # (n*b) x .. x ..
        output, attn = self.attention(q, k, v, mask=mask)
        output = output.view(n_head, sz_b, len_q, d_v).permute(1, 2, 0, 3).contiguous().view(sz_b, len_q, -1)
        return self.layer_norm(self.fc(output) + residual), attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_model, d_ff):
        super().__init__()
        self.w_1, self.w_2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.layer_norm = nn.LayerNorm(d_model)

    def forward(self, x):
        return self.layer_norm(self.w_2(F.relu(self.w_1(x))) + x)


def positional_encoding(length, d_model):
    pe = torch.zeros(length, d_model)
    position = torch.arange(0, length).unsqueeze(1).float()
    div_term = torch.exp(torch.arange(0, d_model, 2).float() * -(np.log(10000.0) / d_model))
    pe[:, 0::2] = torch.sin(position * div_term)
    pe[:, 1::2] = torch.cos(position * div_term)
    return pe.unsqueeze(0)


class Encoder(nn.Module):
    def __init__(self, d_input, n_layers, n_head, d_k, d_v, d_model, d_inner):
        super().__init__()
        self.linear_in = nn.Linear(d_input, d_model)
        self.layer_norm_in = nn.LayerNorm(d_model)
        self.d_model = d_model
        self.layer_stack = nn.ModuleList(
            nn.ModuleList([MultiHeadAttention(n_head, d_model, d_k, d_v), PositionwiseFeedForward(d_model, d_inner)])
            for _ in range(n_layers))

    def forward(self, padded_input, input_lengths):
        non_pad_mask = get_non_pad_mask(padded_input, input_lengths=input_lengths)
        length = padded_input.size(1)
        slf_attn_mask = get_attn_pad_mask(padded_input, input_lengths, length)
        enc_output = self.layer_norm_in(self.linear_in(padded_input)) + positional_encoding(length, self.d_model)
        for slf_attn, pos_ffn in self.layer_stack:
            enc_output, _ = slf_attn(enc_output, enc_output, enc_output, mask=slf_attn_mask)
            enc_output = pos_ffn(enc_output * non_pad_mask) * non_pad_mask
        return enc_output


class Decoder(nn.Module):
    def __init__(self, sos_id, eos_id, n_tgt_vocab, d_word_vec, n_layers, n_head, d_k, d_v, d_model, d_inner):
        super().__init__()
        self.sos_id, self.eos_id = sos_id, eos_id
        self.d_model = d_model
        self.tgt_word_emb = nn.Embedding(n_tgt_vocab, d_word_vec)
        self.layer_stack = nn.ModuleList(
            nn.ModuleList([MultiHeadAttention(n_head, d_model, d_k, d_v), MultiHeadAttention(n_head, d_model, d_k, d_v),
                           PositionwiseFeedForward(d_model, d_inner)])
            for _ in range(n_layers))
        self.tgt_word_prj = nn.Linear(d_model, n_tgt_vocab, bias=False)
        self.tgt_word_prj.weight = self.tgt_word_emb.weight
        self.x_logit_scale = d_model ** -0.5

    def preprocess(self, padded_input):
        """Generate decoder input and output label from padded_input: add <sos> to input, <eos> to output."""
        ys = [y[y != IGNORE_ID] for y in padded_input]  # parse padded ys
        eos = ys[0].new([self.eos_id])
        sos = ys[0].new([self.sos_id])
        ys_in = [torch.cat([sos, y], dim=0) for y in ys]
        ys_out = [torch.cat([y, eos], dim=0) for y in ys]
        ys_in_pad = pad_list(ys_in, self.eos_id)
        ys_out_pad = pad_list(ys_out, IGNORE_ID)
        assert ys_in_pad.size() == ys_out_pad.size()
        return ys_in_pad, ys_out_pad

    def forward(self, padded_input, encoder_padded_outputs, encoder_input_lengths):
        ys_in_pad, ys_out_pad = self.preprocess(padded_input)
        non_pad_mask = get_non_pad_mask(ys_in_pad, pad_idx=self.eos_id)
        slf_attn_mask_subseq = get_subsequent_mask(ys_in_pad)
        slf_attn_mask_keypad = get_attn_key_pad_mask(seq_k=ys_in_pad, seq_q=ys_in_pad, pad_idx=self.eos_id)
        slf_attn_mask = (slf_attn_mask_keypad + slf_attn_mask_subseq).gt(0)
        output_length = ys_in_pad.size(1)
        dec_enc_attn_mask = get_attn_pad_mask(encoder_padded_outputs, encoder_input_lengths, output_length)
        dec_output = self.tgt_word_emb(ys_in_pad) * self.x_logit_scale
        dec_output = dec_output + positional_encoding(output_length, self.d_model)
        for slf_attn, enc_attn, pos_ffn in self.layer_stack:
            dec_output, _ = slf_attn(dec_output, dec_output, dec_output, mask=slf_attn_mask)
            dec_output = dec_output * non_pad_mask
            dec_output, _ = enc_attn(dec_output, encoder_padded_outputs, encoder_padded_outputs, mask=dec_enc_attn_mask)
            dec_output = dec_output * non_pad_mask
            dec_output = pos_ffn(dec_output) * non_pad_mask
        return self.tgt_word_prj(dec_output), ys_out_pad


def main():
    torch.manual_seed(0)
    vocab, sos_id, eos_id = 30, 28, 29  # kaituoxu's dictionary puts <sos> and <eos> at the end
    d_model = 32
    encoder = Encoder(d_input=40, n_layers=2, n_head=4, d_k=8, d_v=8, d_model=d_model, d_inner=64).eval()
    decoder = Decoder(sos_id, eos_id, vocab, d_model, n_layers=2, n_head=4, d_k=8, d_v=8, d_model=d_model,
                      d_inner=64).eval()

    input_lengths = torch.tensor([20, 13, 17])
    padded_input = pad_list([torch.randn(int(n), 40) for n in input_lengths], 0)
    targets = [torch.tensor([3, 4, 5, 6]), torch.tensor([7, 8, 9, 10, 11, 12, 13]), torch.tensor([14, 15])]
    padded_target = pad_list(targets, IGNORE_ID)

    with torch.no_grad():
        encoder_padded_outputs = encoder(padded_input, input_lengths)
        pred, gold = decoder(padded_target, encoder_padded_outputs, input_lengths)
        loss = F.cross_entropy(pred.view(-1, vocab), gold.view(-1), ignore_index=IGNORE_ID)
        assert torch.isfinite(loss)
        # Reference: each utterance alone (no padding anywhere): same logits on its real target positions.
        for i, n in enumerate(input_lengths.tolist()):
            enc_alone = encoder(padded_input[i:i + 1, :n], input_lengths[i:i + 1])
            pred_alone, gold_alone = decoder(targets[i][None], enc_alone, input_lengths[i:i + 1])
            t = gold_alone.shape[1]
            assert torch.equal(gold[i, :t], gold_alone[0])
            assert torch.allclose(pred[i, :t], pred_alone[0], atol=1e-4), i
    print(f"ce loss {loss.item():.3f}, decoder steps {pred.shape[1]}, frames {padded_input.shape[1]}")


if __name__ == "__main__":
    main()
