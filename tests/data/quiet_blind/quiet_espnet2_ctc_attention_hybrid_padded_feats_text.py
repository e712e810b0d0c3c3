# Citation: espnet/espnet espnet2/asr/espnet_model.py @b77e7dd55f1d3d4a071a3216407eb55029e3dc57 (ESPnetASRModel.forward
#   ctc_weight mix, encode, nll, _calc_att_loss, _calc_ctc_loss, _calc_batch_ctc_loss), espnet2/asr/decoder/
#   transformer_decoder.py @51ca44eae4a8be3385d27e25239008ef495049a2 (BaseTransformerDecoder.forward: tgt_mask =
#   ~make_pad_mask(ys_in_lens)[:, None, :] & subsequent_mask, memory_mask = ~make_pad_mask(hlens, maxlen)[:, None, :]),
#   espnet2/asr/encoder/transformer_encoder.py @9edb24b9 (input_layer="linear", masks = ~make_pad_mask(ilens)[:, None, :],
#   olens = masks.squeeze(1).sum(1)), espnet/nets/pytorch_backend/transformer/attention.py (forward_attention:
#   mask.unsqueeze(1).eq(0), masked_fill min, softmax, masked_fill 0), encoder_layer.py, decoder_layer.py, mask.py
#   subsequent_mask, add_sos_eos.py, label_smoothing_loss.py, nets_utils.py make_pad_mask / pad_list, espnet2/asr/ctc.py.
# A joint CTC/attention ASR model trained on right-padded features (pad 0.0) and right-padded text (pad ignore_id -1):
# the encoder masks padded frames as keys; the decoder masks later and padded tokens (B, L, L) and padded encoder
# frames (B, 1, T) in source attention; CTC gets the encoder's olens and the text lengths.
import math

import torch
from torch import nn

IGNORE_ID = -1


def make_pad_mask(lengths, maxlen=None):
    if not isinstance(lengths, list):
        lengths = lengths.long().tolist()
    bs = int(len(lengths))
    if maxlen is None:
        maxlen = int(max(lengths))
    seq_range = torch.arange(0, maxlen, dtype=torch.int64)
    seq_range_expand = seq_range.unsqueeze(0).expand(bs, maxlen)
    seq_length_expand = seq_range_expand.new(lengths).unsqueeze(-1)
    mask = seq_range_expand >= seq_length_expand
    return mask


def subsequent_mask(size, device="cpu", dtype=torch.bool):
    ret = torch.ones(size, size, device=device, dtype=dtype)
    return torch.tril(ret, out=ret)


def pad_list(xs, pad_value):
    n_batch = len(xs)
    max_len = max(x.size(0) for x in xs)
    pad = xs[0].new(n_batch, max_len, *xs[0].size()[1:]).fill_(pad_value)
    for i in range(n_batch):
        pad[i, : xs[i].size(0)] = xs[i]
    return pad


def add_sos_eos(ys_pad, sos, eos, ignore_id):
    _sos = ys_pad.new([sos])
    _eos = ys_pad.new([eos])
    ys = [y[y != ignore_id] for y in ys_pad]  # parse padded ys
    ys_in = [torch.cat([_sos, y], dim=0) for y in ys]
    ys_out = [torch.cat([y, _eos], dim=0) for y in ys]
    return pad_list(ys_in, eos), pad_list(ys_out, ignore_id)


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, dropout_rate, max_len=5000):
        super().__init__()
        self.d_model = d_model
        self.xscale = math.sqrt(self.d_model)
        self.dropout = nn.Dropout(p=dropout_rate)
        pe = torch.zeros(max_len, d_model)
        position = torch.arange(0, max_len, dtype=torch.float32).unsqueeze(1)
        div_term = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.pe = pe.unsqueeze(0)

    def forward(self, x):
        x = x * self.xscale + self.pe[:, : x.size(1)]
        return self.dropout(x)


class MultiHeadedAttention(nn.Module):
    def __init__(self, n_head, n_feat, dropout_rate):
        super().__init__()
        assert n_feat % n_head == 0
        self.d_k = n_feat // n_head
        self.h = n_head
        self.linear_q = nn.Linear(n_feat, n_feat)
        self.linear_k = nn.Linear(n_feat, n_feat)
        self.linear_v = nn.Linear(n_feat, n_feat)
        self.linear_out = nn.Linear(n_feat, n_feat)
        self.attn = None
        self.dropout = nn.Dropout(p=dropout_rate)

    def forward_qkv(self, query, key, value):
        n_batch = query.size(0)
        q = self.linear_q(query).view(n_batch, -1, self.h, self.d_k)
        k = self.linear_k(key).view(n_batch, -1, self.h, self.d_k)
        v = self.linear_v(value).view(n_batch, -1, self.h, self.d_k)
        q = q.transpose(1, 2)  # (batch, head, time1, d_k)
        k = k.transpose(1, 2)  # (batch, head, time2, d_k)
        v = v.transpose(1, 2)  # (batch, head, time2, d_k)
        return q, k, v

    def forward_attention(self, value, scores, mask):
        n_batch = value.size(0)
        if mask is not None:
            mask = mask.unsqueeze(1).eq(0)  # (batch, 1, *, time2)
            min_value = torch.finfo(scores.dtype).min
            scores = scores.masked_fill(mask, min_value)
            self.attn = torch.softmax(scores, dim=-1).masked_fill(mask, 0.0)  # (batch, head, time1, time2)
        else:
            self.attn = torch.softmax(scores, dim=-1)  # (batch, head, time1, time2)
        p_attn = self.dropout(self.attn)
        x = torch.matmul(p_attn, value)  # (batch, head, time1, d_k)
        x = x.transpose(1, 2).contiguous().view(n_batch, -1, self.h * self.d_k)
        return self.linear_out(x)

    def forward(self, query, key, value, mask):
        q, k, v = self.forward_qkv(query, key, value)
        scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(self.d_k)
        return self.forward_attention(v, scores, mask)


class PositionwiseFeedForward(nn.Module):
    def __init__(self, idim, hidden_units, dropout_rate):
        super().__init__()
        self.w_1 = nn.Linear(idim, hidden_units)
        self.w_2 = nn.Linear(hidden_units, idim)
        self.dropout = nn.Dropout(dropout_rate)

    def forward(self, x):
        return self.w_2(self.dropout(torch.relu(self.w_1(x))))


class EncoderLayer(nn.Module):
    def __init__(self, size, self_attn, feed_forward, dropout_rate, normalize_before=True):
        super().__init__()
        self.self_attn = self_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size, eps=1e-12)
        self.norm2 = nn.LayerNorm(size, eps=1e-12)
        self.dropout = nn.Dropout(dropout_rate)
        self.size = size
        self.normalize_before = normalize_before

    def forward(self, x, mask):
        residual = x
        if self.normalize_before:
            x = self.norm1(x)
        x = residual + self.dropout(self.self_attn(x, x, x, mask))
        if not self.normalize_before:
            x = self.norm1(x)
        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x = residual + self.dropout(self.feed_forward(x))
        if not self.normalize_before:
            x = self.norm2(x)
        return x, mask


class DecoderLayer(nn.Module):
    def __init__(self, size, self_attn, src_attn, feed_forward, dropout_rate, normalize_before=True):
        super().__init__()
        self.size = size
        self.self_attn = self_attn
        self.src_attn = src_attn
        self.feed_forward = feed_forward
        self.norm1 = nn.LayerNorm(size, eps=1e-12)
        self.norm2 = nn.LayerNorm(size, eps=1e-12)
        self.norm3 = nn.LayerNorm(size, eps=1e-12)
        self.dropout = nn.Dropout(dropout_rate)
        self.normalize_before = normalize_before

    def forward(self, tgt, tgt_mask, memory, memory_mask):
        residual = tgt
        if self.normalize_before:
            tgt = self.norm1(tgt)
        tgt_q = tgt
        tgt_q_mask = tgt_mask
        x = residual + self.dropout(self.self_attn(tgt_q, tgt, tgt, tgt_q_mask))
        if not self.normalize_before:
            x = self.norm1(x)
        residual = x
        if self.normalize_before:
            x = self.norm2(x)
        x = residual + self.dropout(self.src_attn(x, memory, memory, memory_mask))
        if not self.normalize_before:
            x = self.norm2(x)
        residual = x
        if self.normalize_before:
            x = self.norm3(x)
        x = residual + self.dropout(self.feed_forward(x))
        if not self.normalize_before:
            x = self.norm3(x)
        return x, tgt_mask, memory, memory_mask


class TransformerEncoder(nn.Module):
    def __init__(self, input_size, output_size=256, attention_heads=4, linear_units=2048, num_blocks=6,
                 dropout_rate=0.1, positional_dropout_rate=0.1, attention_dropout_rate=0.0,
                 input_layer="linear", normalize_before=True):
        super().__init__()
        self._output_size = output_size
        assert input_layer == "linear"
        self.embed = nn.Sequential(
            nn.Linear(input_size, output_size),
            nn.LayerNorm(output_size),
            nn.Dropout(dropout_rate),
            nn.ReLU(),
            PositionalEncoding(output_size, positional_dropout_rate),
        )
        self.normalize_before = normalize_before
        self.encoders = nn.ModuleList([
            EncoderLayer(output_size, MultiHeadedAttention(attention_heads, output_size, attention_dropout_rate),
                         PositionwiseFeedForward(output_size, linear_units, dropout_rate), dropout_rate,
                         normalize_before)
            for _ in range(num_blocks)
        ])
        if self.normalize_before:
            self.after_norm = nn.LayerNorm(output_size, eps=1e-12)

    def output_size(self):
        return self._output_size

    def forward(self, xs_pad, ilens, prev_states=None):
        masks = (~make_pad_mask(ilens)[:, None, :]).to(xs_pad.device)
        xs_pad = self.embed(xs_pad)
        for layer in self.encoders:
            xs_pad, masks = layer(xs_pad, masks)
        if self.normalize_before:
            xs_pad = self.after_norm(xs_pad)
        olens = masks.squeeze(1).sum(1)
        return xs_pad, olens, None


class TransformerDecoder(nn.Module):
    def __init__(self, vocab_size, encoder_output_size, attention_heads=4, linear_units=2048, num_blocks=6,
                 dropout_rate=0.1, positional_dropout_rate=0.1, self_attention_dropout_rate=0.0,
                 src_attention_dropout_rate=0.0, normalize_before=True):
        super().__init__()
        attention_dim = encoder_output_size
        self.embed = nn.Sequential(
            nn.Embedding(vocab_size, attention_dim),
            PositionalEncoding(attention_dim, positional_dropout_rate),
        )
        self.normalize_before = normalize_before
        if self.normalize_before:
            self.after_norm = nn.LayerNorm(attention_dim, eps=1e-12)
        self.output_layer = nn.Linear(attention_dim, vocab_size)
        self.decoders = nn.ModuleList([
            DecoderLayer(attention_dim,
                         MultiHeadedAttention(attention_heads, attention_dim, self_attention_dropout_rate),
                         MultiHeadedAttention(attention_heads, attention_dim, src_attention_dropout_rate),
                         PositionwiseFeedForward(attention_dim, linear_units, dropout_rate),
                         dropout_rate, normalize_before)
            for _ in range(num_blocks)
        ])

    def forward(self, hs_pad, hlens, ys_in_pad, ys_in_lens):
        tgt = ys_in_pad
        # tgt_mask: (B, 1, L)
        tgt_mask = (~make_pad_mask(ys_in_lens)[:, None, :]).to(tgt.device)
        # m: (1, L, L)
        m = subsequent_mask(tgt_mask.size(-1), device=tgt_mask.device).unsqueeze(0)
        # tgt_mask: (B, L, L)
        tgt_mask = tgt_mask & m

        memory = hs_pad
        memory_mask = (~make_pad_mask(hlens, maxlen=memory.size(1)))[:, None, :].to(memory.device)

        x = self.embed(tgt)
        for layer in self.decoders:
            x, tgt_mask, memory, memory_mask = layer(x, tgt_mask, memory, memory_mask)
        if self.normalize_before:
            x = self.after_norm(x)
        x = self.output_layer(x)
        olens = tgt_mask.sum(1)
        return x, olens


class CTC(nn.Module):
    def __init__(self, odim, encoder_output_size, dropout_rate=0.0, reduce=True):
        super().__init__()
        self.dropout_rate = dropout_rate
        self.ctc_lo = nn.Linear(encoder_output_size, odim)
        self.ctc_loss = nn.CTCLoss(reduction="none")
        self.reduce = reduce

    def loss_fn(self, th_pred, th_target, th_ilen, th_olen):
        th_pred = th_pred.log_softmax(2)
        loss = self.ctc_loss(th_pred, th_target, th_ilen, th_olen)
        size = th_pred.size(1)
        if self.reduce:
            loss = loss.sum() / size
        else:
            loss = loss / size
        return loss

    def forward(self, hs_pad, hlens, ys_pad, ys_lens):
        ys_hat = self.ctc_lo(nn.functional.dropout(hs_pad, p=self.dropout_rate))
        ys_hat = ys_hat.transpose(0, 1)  # (L, B, NProj)
        ys_true = torch.cat([ys_pad[i, :l] for i, l in enumerate(ys_lens)])
        loss = self.loss_fn(ys_hat, ys_true, hlens, ys_lens).to(device=hs_pad.device, dtype=hs_pad.dtype)
        return loss

    def log_softmax(self, hs_pad):
        return nn.functional.log_softmax(self.ctc_lo(hs_pad), dim=2)


class LabelSmoothingLoss(nn.Module):
    def __init__(self, size, padding_idx, smoothing, normalize_length=False):
        super().__init__()
        self.criterion = nn.KLDivLoss(reduction="none")
        self.padding_idx = padding_idx
        self.confidence = 1.0 - smoothing
        self.smoothing = smoothing
        self.size = size
        self.normalize_length = normalize_length

    def forward(self, x, target):
        assert x.size(2) == self.size
        batch_size = x.size(0)
        x = x.view(-1, self.size)
        target = target.view(-1)
        with torch.no_grad():
            true_dist = x.clone()
            true_dist.fill_(self.smoothing / (self.size - 1))
            ignore = target == self.padding_idx  # (B,)
            total = len(target) - ignore.sum().item()
            target = target.masked_fill(ignore, 0)  # avoid -1 index
            true_dist.scatter_(1, target.unsqueeze(1), self.confidence)
        kl = self.criterion(torch.log_softmax(x, dim=1), true_dist)
        denom = total if self.normalize_length else batch_size
        return kl.masked_fill(ignore.unsqueeze(1), 0).sum() / denom


class ESPnetASRModel(nn.Module):
    def __init__(self, vocab_size, encoder, decoder, ctc, ctc_weight=0.3, ignore_id=-1, lsm_weight=0.1):
        super().__init__()
        self.blank_id = 0
        self.sos = vocab_size - 1
        self.eos = vocab_size - 1
        self.vocab_size = vocab_size
        self.ignore_id = ignore_id
        self.ctc_weight = ctc_weight
        self.encoder = encoder
        self.decoder = decoder
        self.ctc = ctc
        self.criterion_att = LabelSmoothingLoss(size=vocab_size, padding_idx=ignore_id, smoothing=lsm_weight)

    def forward(self, speech, speech_lengths, text, text_lengths):
        batch_size = speech.shape[0]
        # for data-parallel
        text = text[:, : text_lengths.max()]
        encoder_out, encoder_out_lens = self.encode(speech, speech_lengths)
        loss_ctc, _ = self._calc_ctc_loss(encoder_out, encoder_out_lens, text, text_lengths)
        loss_att, _ = self._calc_att_loss(encoder_out, encoder_out_lens, text, text_lengths)
        loss = self.ctc_weight * loss_ctc + (1 - self.ctc_weight) * loss_att
        stats = dict(loss_ctc=loss_ctc.detach(), loss_att=loss_att.detach(), loss=loss.detach())
        return loss, stats, batch_size

    def encode(self, speech, speech_lengths):
        speech = speech[:, : speech_lengths.max()]  # _extract_feats, no frontend
        feats, feats_lengths = speech, speech_lengths
        encoder_out, encoder_out_lens, _ = self.encoder(feats, feats_lengths)
        assert encoder_out.size(0) == speech.size(0)
        assert encoder_out.size(-2) <= encoder_out_lens.max()
        return encoder_out, encoder_out_lens

    def nll(self, encoder_out, encoder_out_lens, ys_pad, ys_pad_lens):
        ys_in_pad, ys_out_pad = add_sos_eos(ys_pad, self.sos, self.eos, self.ignore_id)
        ys_in_lens = ys_pad_lens + 1
        decoder_out, _ = self.decoder(encoder_out, encoder_out_lens, ys_in_pad, ys_in_lens)
        batch_size = decoder_out.size(0)
        decoder_num_class = decoder_out.size(2)
        nll = torch.nn.functional.cross_entropy(
            decoder_out.view(-1, decoder_num_class), ys_out_pad.view(-1),
            ignore_index=self.ignore_id, reduction="none",
        )
        nll = nll.view(batch_size, -1)
        nll = nll.sum(dim=1)
        assert nll.size(0) == batch_size
        return nll

    def _calc_att_loss(self, encoder_out, encoder_out_lens, ys_pad, ys_pad_lens):
        ys_in_pad, ys_out_pad = add_sos_eos(ys_pad, self.sos, self.eos, self.ignore_id)
        ys_in_lens = ys_pad_lens + 1
        decoder_out, _ = self.decoder(encoder_out, encoder_out_lens, ys_in_pad, ys_in_lens)
        loss_att = self.criterion_att(decoder_out, ys_out_pad)
        return loss_att, decoder_out

    def _calc_ctc_loss(self, encoder_out, encoder_out_lens, ys_pad, ys_pad_lens):
        loss_ctc = self.ctc(encoder_out, encoder_out_lens, ys_pad, ys_pad_lens)
        return loss_ctc, None

    def _calc_batch_ctc_loss(self, speech, speech_lengths, text, text_lengths):
        text = text[:, : text_lengths.max()]
        encoder_out, encoder_out_lens = self.encode(speech, speech_lengths)
        do_reduce = self.ctc.reduce
        self.ctc.reduce = False
        loss_ctc = self.ctc(encoder_out, encoder_out_lens, text, text_lengths)
        self.ctc.reduce = do_reduce
        return loss_ctc


def main():
    torch.manual_seed(0)
    idim, vocab_size, adim = 20, 15, 32
    encoder = TransformerEncoder(idim, output_size=adim, attention_heads=4, linear_units=64, num_blocks=2)
    decoder = TransformerDecoder(vocab_size, adim, attention_heads=4, linear_units=64, num_blocks=2)
    ctc = CTC(vocab_size, adim)
    model = ESPnetASRModel(vocab_size, encoder, decoder, ctc, ctc_weight=0.3).eval()

    # CommonCollateFn: speech padded with 0.0, text padded with -1
    speech_lens = [37, 24, 16, 30]
    text_lens = [6, 3, 5, 1]
    g = torch.Generator().manual_seed(1)
    feats = [torch.randn(n, idim, generator=g) for n in speech_lens]
    texts = [torch.randint(1, vocab_size - 1, (n,), generator=g) for n in text_lens]
    speech = pad_list(feats, 0.0)
    text = pad_list(texts, IGNORE_ID)
    speech_lengths = torch.tensor(speech_lens)
    text_lengths = torch.tensor(text_lens)

    with torch.no_grad():
        loss, stats, _ = model(speech, speech_lengths, text, text_lengths)
        enc, enc_lens = model.encode(speech, speech_lengths)
        _, dec_out = model._calc_att_loss(enc, enc_lens, text, text_lengths)
        nll = model.nll(enc, enc_lens, text, text_lengths)
        ctc_per_utt = model._calc_batch_ctc_loss(speech, speech_lengths, text, text_lengths)
        ctc_lp = model.ctc.log_softmax(enc)

        B = len(feats)
        ref_att, ref_ctc = [], []
        for i in range(B):
            s_i, sl_i = feats[i].unsqueeze(0), torch.tensor([speech_lens[i]])
            t_i, tl_i = texts[i].unsqueeze(0), torch.tensor([text_lens[i]])
            enc_i, enc_lens_i = model.encode(s_i, sl_i)
            assert int(enc_lens[i]) == int(enc_lens_i[0]) == speech_lens[i]
            torch.testing.assert_close(enc[i, : speech_lens[i]], enc_i[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(ctc_lp[i, : speech_lens[i]], model.ctc.log_softmax(enc_i)[0],
                                       atol=1e-5, rtol=1e-5)
            la_i, dec_i = model._calc_att_loss(enc_i, enc_lens_i, t_i, tl_i)
            torch.testing.assert_close(dec_out[i, : text_lens[i] + 1], dec_i[0], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(nll[i], model.nll(enc_i, enc_lens_i, t_i, tl_i)[0], atol=1e-5, rtol=1e-5)
            lc_i = model._calc_batch_ctc_loss(s_i, sl_i, t_i, tl_i)
            # reduce=False divides by the batch size: undo it on both sides
            torch.testing.assert_close(ctc_per_utt[i] * B, lc_i[0], atol=1e-4, rtol=1e-5)
            ref_att.append(la_i)
            ref_ctc.append(lc_i[0])
        # reduce=True / LabelSmoothingLoss(normalize_length=False) divide the batch sums by the batch size
        ref_loss_ctc = torch.stack(ref_ctc).mean()
        ref_loss_att = torch.stack(ref_att).mean()
        torch.testing.assert_close(stats["loss_ctc"], ref_loss_ctc, atol=1e-4, rtol=1e-5)
        torch.testing.assert_close(stats["loss_att"], ref_loss_att, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss, 0.3 * ref_loss_ctc + 0.7 * ref_loss_att, atol=1e-4, rtol=1e-5)
    print("ok: padded CTC/attention losses, encoder and decoder outputs match per-utterance runs")


if __name__ == "__main__":
    main()
