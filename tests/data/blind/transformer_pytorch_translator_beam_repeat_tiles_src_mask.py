"""attention-is-all-you-need-pytorch: beam search tiles the source batch while hypotheses are grouped.

Citation: jadore801120/attention-is-all-you-need-pytorch issue #28 ("Bug in translating"), fixed in
commit defe385d68ec9c36c2fc8148b9fe58a4ea059337 ("fix incorrect repeating"); the issue and the diff of
transformer/Translator.py were read, and Models.py's get_attn_padding_mask at the parent commit.

Bug: `Translator.translate_batch` repeated the source for the beam with `src_seq.repeat(beam_size, 1)`
(and `enc_output.repeat(beam_size, 1, 1)`), which tiles the batch (s1, s2, s1, s2, ...), while the
decoder input is stacked beam by beam (s1h1, s1h2, s2h1, s2h2, ...). The decoder builds its
encoder-decoder padding mask from the repeated `src_seq`, so a hypothesis of sentence 1 attends over
sentence 2's encoder states under sentence 2's padding, and the other way round.

Fix: repeat each sentence beam_size times in place:
`src_seq.repeat(1, beam_size).view(src_seq.size(0) * beam_size, src_seq.size(1))` (same for the
encoder outputs), so row i of the decoder batch is sentence i // beam_size.

Reproduction: modern-torch port of the 2017 model (one encoder and one decoder layer, the project's
ScaledDotProductAttention with masked_fill(-inf) then softmax), two source sentences of lengths 6 and
3 (PAD = 0), beam_size 2, three decoding steps of a small Beam class.
"""
import sys

import numpy as np
import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv

PAD, BOS = 0, 2


def get_attn_padding_mask(seq_q, seq_k):
    """Indicate the padding-related part to mask."""
    mb_size, len_q = seq_q.size()
    mb_size, len_k = seq_k.size()
    pad_attn_mask = seq_k.eq(PAD).unsqueeze(1)  # bx1xsk
    return pad_attn_mask.expand(mb_size, len_q, len_k)  # bxsqxsk


def get_attn_subsequent_mask(seq):
    attn_shape = (seq.size(0), seq.size(1), seq.size(1))
    subsequent_mask = np.triu(np.ones(attn_shape), k=1).astype("uint8")
    return torch.from_numpy(subsequent_mask).bool()


class ScaledDotProductAttention(nn.Module):
    def __init__(self, d_model):
        super().__init__()
        self.temper = np.power(d_model, 0.5)
        self.softmax = nn.Softmax(dim=-1)

    def forward(self, q, k, v, attn_mask=None):
        attn = torch.bmm(q, k.transpose(1, 2)) / self.temper
        if attn_mask is not None:
            attn = attn.masked_fill(attn_mask, -float("inf"))
        attn = self.softmax(attn)
        return torch.bmm(attn, v), attn


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, d_k):
        super().__init__()
        self.n_head, self.d_k = n_head, d_k
        self.w_qs = nn.Parameter(torch.randn(n_head, d_model, d_k) * 0.3)
        self.w_ks = nn.Parameter(torch.randn(n_head, d_model, d_k) * 0.3)
        self.w_vs = nn.Parameter(torch.randn(n_head, d_model, d_k) * 0.3)
        self.attention = ScaledDotProductAttention(d_model)
        self.proj = nn.Linear(n_head * d_k, d_model)

    def forward(self, q, k, v, attn_mask=None):
        n_head, d_k = self.n_head, self.d_k
        mb_size, len_q, d_model = q.size()
        len_k = k.size(1)
        q_s = q.repeat(n_head, 1, 1).view(n_head, -1, d_model)
        k_s = k.repeat(n_head, 1, 1).view(n_head, -1, d_model)
        v_s = v.repeat(n_head, 1, 1).view(n_head, -1, d_model)
        q_s = torch.bmm(q_s, self.w_qs).view(-1, len_q, d_k)
        k_s = torch.bmm(k_s, self.w_ks).view(-1, len_k, d_k)
        v_s = torch.bmm(v_s, self.w_vs).view(-1, len_k, d_k)
        outputs, attns = self.attention(q_s, k_s, v_s, attn_mask=attn_mask.repeat(n_head, 1, 1))
        outputs = torch.cat(torch.split(outputs, mb_size, dim=0), dim=-1)
        return self.proj(outputs) + q, attns


class Encoder(nn.Module):
    def __init__(self, n_src_vocab, n_max_seq, d_model, n_head, d_k):
        super().__init__()
        self.src_word_emb = nn.Embedding(n_src_vocab, d_model, padding_idx=PAD)
        self.position_enc = nn.Embedding(n_max_seq + 1, d_model, padding_idx=PAD)
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k)

    def forward(self, src_seq, src_pos):
        enc_input = self.src_word_emb(src_seq) + self.position_enc(src_pos)
        enc_slf_attn_mask = get_attn_padding_mask(src_seq, src_seq)
        enc_output, enc_slf_attn = self.slf_attn(enc_input, enc_input, enc_input,
                                                 attn_mask=enc_slf_attn_mask)
        return [enc_output], [enc_slf_attn]


class Decoder(nn.Module):
    def __init__(self, n_tgt_vocab, n_max_seq, d_model, n_head, d_k):
        super().__init__()
        self.tgt_word_emb = nn.Embedding(n_tgt_vocab, d_model, padding_idx=PAD)
        self.position_enc = nn.Embedding(n_max_seq + 1, d_model, padding_idx=PAD)
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k)
        self.enc_attn = MultiHeadAttention(n_head, d_model, d_k)

    def forward(self, tgt_seq, tgt_pos, src_seq, enc_outputs):
        dec_input = self.tgt_word_emb(tgt_seq) + self.position_enc(tgt_pos)
        dec_slf_attn_pad_mask = get_attn_padding_mask(tgt_seq, tgt_seq)
        dec_slf_attn_sub_mask = get_attn_subsequent_mask(tgt_seq)
        dec_slf_attn_mask = dec_slf_attn_pad_mask | dec_slf_attn_sub_mask
        dec_enc_attn_pad_mask = get_attn_padding_mask(tgt_seq, src_seq)
        dec_output, _ = self.slf_attn(dec_input, dec_input, dec_input, attn_mask=dec_slf_attn_mask)
        dec_output, _ = self.enc_attn(dec_output, enc_outputs[0], enc_outputs[0],
                                      attn_mask=dec_enc_attn_pad_mask)
        return [dec_output], None, None


class Beam:
    def __init__(self, size):
        self.size = size
        self.scores = torch.zeros(size)
        self.next_ys = [torch.full((size,), BOS, dtype=torch.long)]
        self.prev_ks = []

    def get_current_state(self):
        """The partial hypotheses, one row per beam (token ids, BOS first)."""
        hyps = [torch.stack([self.next_ys[0][k]]) for k in range(self.size)]
        if self.prev_ks:
            hyps = [torch.tensor(self.get_hypothesis(k), dtype=torch.long) for k in range(self.size)]
            hyps = [torch.cat([torch.tensor([BOS]), h]) for h in hyps]
        return torch.stack(hyps)

    def advance(self, word_lk):
        beam_lk = word_lk + (self.scores.unsqueeze(1) if self.prev_ks else 0)
        if not self.prev_ks:
            beam_lk = word_lk[0]
        flat = beam_lk.reshape(-1)
        best, best_ids = flat.topk(self.size)
        self.scores = best
        self.prev_ks.append(best_ids // word_lk.size(1))
        self.next_ys.append(best_ids % word_lk.size(1))
        return False

    def get_hypothesis(self, k):
        hyp = []
        for j in range(len(self.prev_ks) - 1, -1, -1):
            hyp.append(int(self.next_ys[j + 1][k]))
            k = int(self.prev_ks[j][k])
        return hyp[::-1]


def translate_batch(encoder, decoder, tgt_word_proj, src_seq, src_pos, beam_size, max_len):
    batch_size = src_seq.size(0)
    enc_outputs, _ = encoder(src_seq, src_pos)

    #--- Repeat data for beam
    if FIXED:
        src_seq = src_seq.repeat(1, beam_size).view(src_seq.size(0) * beam_size, src_seq.size(1))
        enc_outputs = [enc.repeat(1, beam_size, 1).view(enc.size(0) * beam_size, enc.size(1),
                                                        enc.size(2)) for enc in enc_outputs]
    else:
        src_seq = src_seq.repeat(beam_size, 1)
        enc_outputs = [enc_output.repeat(beam_size, 1, 1) for enc_output in enc_outputs]

    beams = [Beam(beam_size) for _ in range(batch_size)]
    for i in range(max_len):
        len_dec_seq = i + 1
        input_data = torch.stack([b.get_current_state() for b in beams])  # mb x bm x sq
        input_data = input_data.view(-1, len_dec_seq)                     # (mb*bm) x sq
        input_pos = torch.arange(1, len_dec_seq + 1).unsqueeze(0).repeat(batch_size * beam_size, 1)
        dec_outputs, _, _ = decoder(input_data, input_pos, src_seq, enc_outputs)
        out = torch.log_softmax(tgt_word_proj(dec_outputs[-1][:, -1, :]), dim=-1)
        word_lk = out.view(batch_size, beam_size, -1)
        for b in range(batch_size):
            beams[b].advance(word_lk[b])
    return [[b.get_hypothesis(k) for k in range(beam_size)] for b in beams], \
        [b.scores for b in beams]


def main():
    torch.manual_seed(0)
    d_model, n_head, d_k, vocab, n_max_seq = 16, 2, 8, 20, 10
    encoder = Encoder(vocab, n_max_seq, d_model, n_head, d_k).eval()
    decoder = Decoder(vocab, n_max_seq, d_model, n_head, d_k).eval()
    tgt_word_proj = nn.Linear(d_model, vocab, bias=False)
    src_seq = torch.tensor([[5, 9, 4, 7, 3, 8],
                            [6, 11, 12, PAD, PAD, PAD]])
    src_pos = torch.tensor([[1, 2, 3, 4, 5, 6],
                            [1, 2, 3, 0, 0, 0]])
    with torch.no_grad():
        hyps, scores = translate_batch(encoder, decoder, tgt_word_proj, src_seq, src_pos,
                                       beam_size=2, max_len=3)
    print("hyps", hyps, "scores", [[round(float(s), 3) for s in sc] for sc in scores])


if __name__ == "__main__":
    main()
