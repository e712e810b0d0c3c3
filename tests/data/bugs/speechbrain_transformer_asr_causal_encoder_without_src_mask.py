# speechbrain/speechbrain#2182, fixed by PR #2262 (commit c7a82129f): TransformerASR(causal=True) only
# masked the decoder; make_masks left src_mask=None, so the "causal" encoder attended to future frames.
import math
import sys

import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def length_to_mask(length, max_len=None):
    max_len = int(length.max().item()) if max_len is None else max_len
    return torch.arange(max_len, dtype=length.dtype)[None, :] < length[:, None]


def get_key_padding_mask(padded_input, pad_idx):
    return padded_input.eq(pad_idx)


def get_lookahead_mask(padded_input):
    seq_len = padded_input.shape[1]
    mask = (torch.triu(torch.ones((seq_len, seq_len))) == 1).transpose(0, 1)
    return mask.float().masked_fill(mask == 0, float("-inf")).masked_fill(mask == 1, float(0.0)).detach()


class PositionalEncoding(nn.Module):
    def __init__(self, d_model, max_len=200):
        super().__init__()
        pe = torch.zeros(max_len, d_model)
        positions = torch.arange(0, max_len).unsqueeze(1).float()
        denominator = torch.exp(torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model))
        pe[:, 0::2] = torch.sin(positions * denominator)
        pe[:, 1::2] = torch.cos(positions * denominator)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return self.pe[:, : x.size(1)].clone().detach()


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_ffn, nhead, d_model):
        super().__init__()
        self.self_att = nn.MultiheadAttention(d_model, nhead, batch_first=True)
        self.pos_ffn = nn.Sequential(nn.Linear(d_model, d_ffn), nn.ReLU(), nn.Linear(d_ffn, d_model))
        self.norm1, self.norm2 = nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, src, src_mask=None, src_key_padding_mask=None):
        src1 = self.norm1(src)  # normalize_before=True
        output, _ = self.self_att(src1, src1, src1, attn_mask=src_mask, key_padding_mask=src_key_padding_mask)
        src = src + output
        return src + self.pos_ffn(self.norm2(src))


class TransformerDecoderLayer(nn.Module):
    def __init__(self, d_ffn, nhead, d_model):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(d_model, nhead, batch_first=True)
        self.mutihead_attn = nn.MultiheadAttention(d_model, nhead, batch_first=True)
        self.pos_ffn = nn.Sequential(nn.Linear(d_model, d_ffn), nn.ReLU(), nn.Linear(d_ffn, d_model))
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(d_model), nn.LayerNorm(d_model), nn.LayerNorm(d_model)

    def forward(self, tgt, memory, tgt_mask=None, memory_mask=None, tgt_key_padding_mask=None,
                memory_key_padding_mask=None):
        tgt1 = self.norm1(tgt)
        tgt = tgt + self.self_attn(tgt1, tgt1, tgt1, attn_mask=tgt_mask, key_padding_mask=tgt_key_padding_mask)[0]
        tgt2 = self.norm2(tgt)
        tgt = tgt + self.mutihead_attn(tgt2, memory, memory, attn_mask=memory_mask,
                                       key_padding_mask=memory_key_padding_mask)[0]
        return tgt + self.pos_ffn(self.norm3(tgt))


class TransformerASR(nn.Module):
    def __init__(self, tgt_vocab, input_size, d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=1,
                 d_ffn=64, causal=False):
        super().__init__()
        self.causal = causal
        self.custom_src_module = nn.Linear(input_size, d_model)
        self.custom_tgt_module = nn.Embedding(tgt_vocab, d_model)
        self.positional_encoding = PositionalEncoding(d_model)
        self.encoder = nn.ModuleList([TransformerEncoderLayer(d_ffn, nhead, d_model)
                                      for _ in range(num_encoder_layers)])
        self.encoder_norm = nn.LayerNorm(d_model)
        self.decoder = nn.ModuleList([TransformerDecoderLayer(d_ffn, nhead, d_model)
                                      for _ in range(num_decoder_layers)])
        self.decoder_norm = nn.LayerNorm(d_model)

    def make_masks(self, src, tgt=None, wav_len=None, pad_idx=0):
        src_key_padding_mask = None
        if wav_len is not None:
            abs_len = torch.round(wav_len * src.shape[1])
            src_key_padding_mask = ~length_to_mask(abs_len).bool()

        src_mask = None
        if FIXED and self.causal:
            src_mask = get_lookahead_mask(src)

        if tgt is not None:
            tgt_key_padding_mask = get_key_padding_mask(tgt, pad_idx=pad_idx)
            tgt_mask = get_lookahead_mask(tgt)
        else:
            tgt_key_padding_mask, tgt_mask = None, None
        return src_key_padding_mask, tgt_key_padding_mask, src_mask, tgt_mask

    def forward(self, src, tgt, wav_len=None, pad_idx=0):
        src_key_padding_mask, tgt_key_padding_mask, src_mask, tgt_mask = self.make_masks(src, tgt, wav_len, pad_idx)
        src = self.custom_src_module(src)
        src = src + self.positional_encoding(src)
        encoder_out = src
        for layer in self.encoder:
            encoder_out = layer(encoder_out, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask)
        encoder_out = self.encoder_norm(encoder_out)

        tgt = self.custom_tgt_module(tgt)
        tgt = tgt + self.positional_encoding(tgt)
        decoder_out = tgt
        for layer in self.decoder:
            # memory_mask=None in the decoder cross-attention (speechbrain's later form; the (S, S) src_mask
            # cannot be used for T target queries)
            decoder_out = layer(decoder_out, encoder_out, tgt_mask=tgt_mask, memory_mask=None,
                                tgt_key_padding_mask=tgt_key_padding_mask,
                                memory_key_padding_mask=src_key_padding_mask)
        return encoder_out, self.decoder_norm(decoder_out)


n_feats, vocab = 20, 30
asr = TransformerASR(vocab, n_feats, causal=True).eval()

# a training batch: fbank features (B, T, F) with relative lengths, BOS-prefixed token targets
src = torch.randn(2, 24, n_feats)
wav_len = torch.tensor([1.0, 0.75])
src[1, 18:] = 0.0
tokens_bos = torch.tensor([[1, 5, 9, 4, 7, 3], [1, 6, 2, 8, 0, 0]])
with torch.no_grad():
    enc, dec = asr(src, tokens_bos, wav_len=wav_len)
    # streaming check: frames 0..11 of a causal encoder must not depend on frames 12..
    src_future = src.clone()
    src_future[0, 12:] = torch.randn(12, n_feats)
    enc2, _ = asr(src_future, tokens_bos, wav_len=wav_len)
leak = (enc[0, :12] - enc2[0, :12]).abs().max().item()
print(f"fixed={FIXED} causal encoder: max change of frames 0..11 when frames 12.. change = {leak:.4e}")
