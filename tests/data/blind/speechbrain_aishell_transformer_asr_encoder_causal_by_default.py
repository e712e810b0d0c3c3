# speechbrain/speechbrain#2606 (commit 7174156): "AISHELL recipe fixes for `TransformerASR` causality, warn if the user doesn't specify `causal`" (issue #2604)
# TransformerASR's `causal` defaults to True, and since v1.0 (#2262) causal=True really gives the encoder's
# self-attention a lookahead mask. The AISHELL transformer hparams never set `causal`, so their offline
# (full-context) encoder got a causal src_mask: every frame stopped attending to the frames after it.
# The fix sets `causal: False` in the AISHELL hparams (and makes TransformerASR warn when `causal` is unset).
import logging
import math
import sys
from typing import Optional

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
logger = logging.getLogger(__name__)


# ---- speechbrain/dataio/dataio.py -------------------------------------------------------------------
def length_to_mask(length, max_len=None, dtype=None, device=None):
    assert len(length.shape) == 1
    if max_len is None:
        max_len = length.max().long().item()
    mask = torch.arange(max_len, device=length.device, dtype=length.dtype).expand(
        len(length), max_len
    ) < length.unsqueeze(1)
    if dtype is None:
        dtype = length.dtype
    if device is None:
        device = length.device
    return torch.as_tensor(mask, dtype=dtype, device=device)


# ---- speechbrain/lobes/models/transformer/Transformer.py --------------------------------------------
def get_key_padding_mask(padded_input, pad_idx):
    if len(padded_input.shape) == 4:
        bz, time, ch1, ch2 = padded_input.shape
        padded_input = padded_input.reshape(bz, time, ch1 * ch2)
    key_padded_mask = padded_input.eq(pad_idx).to(padded_input.device)
    if len(padded_input.shape) > 2:
        key_padded_mask = key_padded_mask.float().prod(dim=-1).bool()
        return key_padded_mask.detach()
    return key_padded_mask.detach()


def get_lookahead_mask(padded_input):
    seq_len = padded_input.shape[1]
    mask = (torch.triu(torch.ones((seq_len, seq_len), device=padded_input.device)) == 1).transpose(0, 1)
    mask = mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0))
    return mask.detach().to(padded_input.device)


class PositionalEncoding(nn.Module):
    def __init__(self, input_size, max_len=2500):
        super().__init__()
        self.max_len = max_len
        pe = torch.zeros(self.max_len, input_size, requires_grad=False)
        positions = torch.arange(0, self.max_len).unsqueeze(1).float()
        denominator = torch.exp(torch.arange(0, input_size, 2).float() * -(math.log(10000.0) / input_size))
        pe[:, 0::2] = torch.sin(positions * denominator)
        pe[:, 1::2] = torch.cos(positions * denominator)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return self.pe[:, : x.size(1)].clone().detach()


# ---- speechbrain/nnet/attention.py ------------------------------------------------------------------
class MultiheadAttention(nn.Module):
    def __init__(self, nhead, d_model, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False, kdim=None, vdim=None):
        super().__init__()
        self.att = nn.MultiheadAttention(
            embed_dim=d_model, num_heads=nhead, dropout=dropout, bias=bias,
            add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn, kdim=kdim, vdim=vdim,
        )

    def forward(self, query, key, value, attn_mask=None, key_padding_mask=None, return_attn_weights=True, pos_embs=None):
        # give tensors of shape (time, batch, fea)
        query = query.permute(1, 0, 2)
        key = key.permute(1, 0, 2)
        value = value.permute(1, 0, 2)
        if pos_embs is not None:
            if attn_mask is not None:
                attn_mask += pos_embs
            else:
                attn_mask = pos_embs
        output, attention_weights = self.att(
            query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
            need_weights=return_attn_weights,
        )
        output = output.permute(1, 0, 2)
        if return_attn_weights:
            return output, attention_weights
        return output


class PositionalwiseFeedForward(nn.Module):
    def __init__(self, d_ffn, input_size, dropout=0.0, activation=nn.ReLU):
        super().__init__()
        self.ffn = nn.Sequential(
            nn.Linear(input_size, d_ffn), activation(), nn.Dropout(dropout), nn.Linear(d_ffn, input_size)
        )

    def forward(self, x):
        x = x.permute(1, 0, 2)
        x = self.ffn(x)
        return x.permute(1, 0, 2)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_ffn, nhead, d_model, dropout=0.0, activation=nn.ReLU, normalize_before=False):
        super().__init__()
        self.self_att = MultiheadAttention(nhead=nhead, d_model=d_model, dropout=dropout)
        self.pos_ffn = PositionalwiseFeedForward(d_ffn=d_ffn, input_size=d_model, dropout=dropout, activation=activation)
        self.norm1 = nn.LayerNorm(d_model, eps=1e-6)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.normalize_before = normalize_before

    def forward(self, src, src_mask: Optional[torch.Tensor] = None, src_key_padding_mask: Optional[torch.Tensor] = None, pos_embs=None):
        src1 = self.norm1(src) if self.normalize_before else src
        output, self_attn = self.self_att(
            src1, src1, src1, attn_mask=src_mask, key_padding_mask=src_key_padding_mask, pos_embs=pos_embs
        )
        src = src + self.dropout1(output)
        if not self.normalize_before:
            src = self.norm1(src)
        src1 = self.norm2(src) if self.normalize_before else src
        output = self.pos_ffn(src1)
        output = src + self.dropout2(output)
        if not self.normalize_before:
            output = self.norm2(output)
        return output, self_attn


class TransformerEncoder(nn.Module):
    def __init__(self, num_layers, nhead, d_ffn, d_model, dropout=0.0, activation=nn.ReLU, normalize_before=False):
        super().__init__()
        self.layers = nn.ModuleList([
            TransformerEncoderLayer(d_ffn=d_ffn, nhead=nhead, d_model=d_model, dropout=dropout,
                                    activation=activation, normalize_before=normalize_before)
            for _ in range(num_layers)
        ])
        self.norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, pos_embs=None):
        output = src
        attention_lst = []
        for enc_layer in self.layers:
            output, attention = enc_layer(output, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, pos_embs=pos_embs)
            attention_lst.append(attention)
        output = self.norm(output)
        return output, attention_lst


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_ffn, nhead, d_model, dropout=0.0, activation=nn.ReLU, normalize_before=False):
        super().__init__()
        self.self_attn = MultiheadAttention(nhead=nhead, d_model=d_model, dropout=dropout)
        self.mutihead_attn = MultiheadAttention(nhead=nhead, d_model=d_model, dropout=dropout)
        self.pos_ffn = PositionalwiseFeedForward(d_ffn=d_ffn, input_size=d_model, dropout=dropout, activation=activation)
        self.norm1 = nn.LayerNorm(d_model, eps=1e-6)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-6)
        self.norm3 = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)
        self.dropout3 = nn.Dropout(dropout)
        self.normalize_before = normalize_before

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, pos_embs_tgt=None, pos_embs_src=None):
        tgt1 = self.norm1(tgt) if self.normalize_before else tgt
        tgt2, self_attn = self.self_attn(
            query=tgt1, key=tgt1, value=tgt1, attn_mask=tgt_mask,
            key_padding_mask=tgt_key_padding_mask, pos_embs=pos_embs_tgt,
        )
        tgt = tgt + self.dropout1(tgt2)
        if not self.normalize_before:
            tgt = self.norm1(tgt)
        tgt1 = self.norm2(tgt) if self.normalize_before else tgt
        tgt2, multihead_attention = self.mutihead_attn(
            query=tgt1, key=memory, value=memory, attn_mask=memory_mask,
            key_padding_mask=memory_key_padding_mask, pos_embs=pos_embs_src,
        )
        tgt = tgt + self.dropout2(tgt2)
        if not self.normalize_before:
            tgt = self.norm2(tgt)
        tgt1 = self.norm3(tgt) if self.normalize_before else tgt
        tgt2 = self.pos_ffn(tgt1)
        tgt = tgt + self.dropout3(tgt2)
        if not self.normalize_before:
            tgt = self.norm3(tgt)
        return tgt, self_attn, multihead_attention


class TransformerDecoder(nn.Module):
    def __init__(self, num_layers, nhead, d_ffn, d_model, dropout=0.0, activation=nn.ReLU, normalize_before=False):
        super().__init__()
        self.layers = nn.ModuleList([
            TransformerDecoderLayer(d_ffn=d_ffn, nhead=nhead, d_model=d_model, dropout=dropout,
                                    activation=activation, normalize_before=normalize_before)
            for _ in range(num_layers)
        ])
        self.norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None, pos_embs_tgt=None, pos_embs_src=None):
        output = tgt
        self_attns, multihead_attns = [], []
        for dec_layer in self.layers:
            output, self_attn, multihead_attn = dec_layer(
                output, memory, tgt_mask=tgt_mask, memory_mask=memory_mask,
                tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=memory_key_padding_mask,
                pos_embs_tgt=pos_embs_tgt, pos_embs_src=pos_embs_src,
            )
            self_attns.append(self_attn)
            multihead_attns.append(multihead_attn)
        output = self.norm(output)
        return output, self_attns, multihead_attns


class NormalizedEmbedding(nn.Module):
    def __init__(self, d_model, vocab):
        super().__init__()
        self.emb = nn.Embedding(vocab, d_model)
        self.d_model = d_model

    def forward(self, x):
        return self.emb(x) * math.sqrt(self.d_model)


# ---- speechbrain/lobes/models/transformer/TransformerASR.py -----------------------------------------
def make_transformer_src_mask(src, causal: bool = False, dynchunktrain_config=None):
    if causal:
        assert dynchunktrain_config is None
        return get_lookahead_mask(src)
    if dynchunktrain_config is None:
        return
    raise NotImplementedError("dynamic chunk training trimmed")


def make_transformer_src_tgt_masks(src, tgt=None, wav_len=None, pad_idx=0, causal: bool = False, dynchunktrain_config=None):
    src_key_padding_mask = None
    # mask out audio beyond the length of audio for each batch
    if wav_len is not None:
        abs_len = torch.round(wav_len * src.shape[1])
        src_key_padding_mask = ~length_to_mask(abs_len).bool()
    # mask out the source
    src_mask = make_transformer_src_mask(src, causal=causal, dynchunktrain_config=dynchunktrain_config)
    if tgt is not None:
        tgt_key_padding_mask = get_key_padding_mask(tgt, pad_idx=pad_idx)
        tgt_mask = get_lookahead_mask(tgt)
    else:
        tgt_key_padding_mask = None
        tgt_mask = None
    return src_key_padding_mask, tgt_key_padding_mask, src_mask, tgt_mask


class TransformerASR(nn.Module):
    if FIXED:
        _CAUSAL_DEFAULT = None
    else:
        _CAUSAL_DEFAULT = True

    def __init__(self, tgt_vocab, input_size, d_model=512, nhead=8, num_encoder_layers=6, num_decoder_layers=6,
                 d_ffn=2048, dropout=0.1, activation=nn.ReLU, positional_encoding="fixed_abs_sine",
                 normalize_before=False, attention_type="regularMHA", max_length=2500,
                 causal: Optional[bool] = _CAUSAL_DEFAULT):
        super().__init__()
        if FIXED and causal is None:
            logger.warning(
                "`causal` not specified for `TransformerASR`, assuming `True` for compatibility. "
                "We strongly recommend that you explicitly set this."
            )
            causal = True
        self.causal = causal
        self.attention_type = attention_type
        self.positional_encoding_type = positional_encoding
        self.positional_encoding = PositionalEncoding(d_model, max_length)
        self.encoder = TransformerEncoder(num_encoder_layers, nhead, d_ffn, d_model, dropout, activation, normalize_before)
        self.decoder = TransformerDecoder(num_decoder_layers, nhead, d_ffn, d_model, dropout, activation, normalize_before)
        self.custom_src_module = nn.Sequential(nn.Linear(input_size, d_model, bias=True), nn.Dropout(dropout))
        self.custom_tgt_module = NormalizedEmbedding(d_model, tgt_vocab)

    def forward(self, src, tgt, wav_len=None, pad_idx=0):
        # reshape the src vector to [Batch, Time, Fea] is a 4d vector is given
        if src.ndim == 4:
            bz, t, ch1, ch2 = src.shape
            src = src.reshape(bz, t, ch1 * ch2)
        src_key_padding_mask, tgt_key_padding_mask, src_mask, tgt_mask = make_transformer_src_tgt_masks(
            src, tgt, wav_len, causal=self.causal, pad_idx=pad_idx
        )
        src = self.custom_src_module(src)
        src = src + self.positional_encoding(src)  # fixed_abs_sine
        encoder_out, self.enc_attns = self.encoder(
            src=src, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask, pos_embs=None
        )
        tgt = self.custom_tgt_module(tgt)
        tgt = tgt + self.positional_encoding(tgt)
        decoder_out, _, _ = self.decoder(
            tgt=tgt, memory=encoder_out, memory_mask=None, tgt_mask=tgt_mask,
            tgt_key_padding_mask=tgt_key_padding_mask, memory_key_padding_mask=src_key_padding_mask,
            pos_embs_tgt=None, pos_embs_src=None,
        )
        return encoder_out, decoder_out


class ConvolutionFrontEnd(nn.Module):
    """Trimmed stand-in for speechbrain.lobes.models.convolution.ConvolutionFrontEnd
    (2 blocks, stride 2 on time and frequency, channels last: (B, T, F) -> (B, T/4, F/4, C))."""

    def __init__(self, input_shape, out_channels=(4, 8)):
        super().__init__()
        chans = [1] + list(out_channels)
        self.convs = nn.ModuleList([nn.Conv2d(chans[i], chans[i + 1], 3, stride=2, padding=1) for i in range(len(out_channels))])

    def forward(self, x):
        x = x.unsqueeze(1)  # (B, 1, T, F)
        for conv in self.convs:
            x = torch.relu(conv(x))
        return x.permute(0, 2, 3, 1)  # (B, T', F', C)


def main():
    torch.manual_seed(0)
    n_mels, vocab, pad_index, bos_index = 16, 20, 0, 1
    # recipes/AISHELL-1/ASR/transformer/hparams/train_ASR_transformer.yaml (sizes shrunk)
    transformer_hparams = dict(
        input_size=8 * 4,  # CNN channels * n_mels / 4
        tgt_vocab=vocab,
        d_model=32,
        nhead=4,
        num_encoder_layers=2,
        num_decoder_layers=2,
        d_ffn=64,
        dropout=0.0,
        activation=nn.GELU,
        normalize_before=True,
    )
    if FIXED:
        transformer_hparams["causal"] = False
    cnn = ConvolutionFrontEnd(input_shape=(None, None, n_mels))
    transformer = TransformerASR(**transformer_hparams)
    ctc_lin = nn.Linear(32, vocab)
    seq_lin = nn.Linear(32, vocab)
    modules = nn.ModuleList([cnn, transformer, ctc_lin, seq_lin])
    opt = torch.optim.Adam(modules.parameters(), lr=1e-3)

    # a padded batch as the dataloader gives it: fbank features + relative lengths, tokens padded with 0
    feats = torch.randn(2, 48, n_mels)
    wav_lens = torch.tensor([1.0, 0.5])
    feats[1, 24:] = 0.0
    tokens_bos = torch.tensor([[bos_index, 5, 6, 7, 8], [bos_index, 9, 3, 0, 0]])
    tokens_eos = torch.tensor([[5, 6, 7, 8, 2], [9, 3, 2, 0, 0]])

    # ASR.compute_forward / compute_objectives (training stage)
    modules.train()
    src = cnn(feats)
    enc_out, pred = transformer(src, tokens_bos, wav_lens, pad_idx=pad_index)
    p_ctc = ctc_lin(enc_out).log_softmax(-1)
    p_seq = seq_lin(pred).log_softmax(-1)
    abs_lens = torch.round(wav_lens * enc_out.shape[1]).long()
    loss_ctc = nn.functional.ctc_loss(p_ctc.transpose(0, 1), tokens_eos[:, :4].clamp(min=1), abs_lens,
                                      torch.tensor([4, 2]), blank=0, zero_infinity=True)
    loss_seq = nn.functional.nll_loss(p_seq.transpose(1, 2), tokens_eos, ignore_index=pad_index)
    loss = 0.4 * loss_ctc + 0.6 * loss_seq
    opt.zero_grad()
    loss.backward()
    opt.step()

    w = transformer.enc_attns[0]  # (B, T', T') averaged over heads
    future = torch.triu(torch.ones_like(w[0], dtype=torch.bool), diagonal=1)
    print(f"encoder causal={transformer.causal} weight on future frames (utt 0, layer 0)={w[0][future].sum().item():.3f} loss={loss.item():.4f}")


if __name__ == "__main__":
    main()
