# speechbrain (speechbrain/speechbrain#915, commit f541989): TransformerASR.encode() built src_key_padding_mask only
# `if wav_len is not None and self.training`, so at inference (beam search / EncoderWrapper) padded frames were attended.
import sys, math
import torch
from torch import nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def length_to_mask(length, max_len=None, dtype=None, device=None):
    assert len(length.shape) == 1
    if max_len is None:
        max_len = length.max().long().item()
    mask = torch.arange(max_len, device=length.device, dtype=length.dtype).expand(
        len(length), max_len) < length.unsqueeze(1)
    if dtype is None:
        dtype = length.dtype
    return torch.as_tensor(mask, dtype=dtype)


class PositionalEncoding(nn.Module):
    def __init__(self, input_size, max_len=2500):
        super().__init__()
        pe = torch.zeros(max_len, input_size, requires_grad=False)
        positions = torch.arange(0, max_len).unsqueeze(1).float()
        denominator = torch.exp(torch.arange(0, input_size, 2).float() * -(math.log(10000.0) / input_size))
        pe[:, 0::2] = torch.sin(positions * denominator)
        pe[:, 1::2] = torch.cos(positions * denominator)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return self.pe[:, : x.size(1)].clone().detach()


class MultiheadAttention(nn.Module):
    """speechbrain.nnet.attention.MultiheadAttention: batch-first wrapper of nn.MultiheadAttention."""

    def __init__(self, nhead, d_model, dropout=0.0):
        super().__init__()
        self.att = nn.MultiheadAttention(embed_dim=d_model, num_heads=nhead, dropout=dropout)

    def forward(self, query, key, value, attn_mask=None, key_padding_mask=None, return_attn_weights=True,
                pos_embs=None):
        query, key, value = query.permute(1, 0, 2), key.permute(1, 0, 2), value.permute(1, 0, 2)
        output, attention = self.att(query, key, value, attn_mask=attn_mask, key_padding_mask=key_padding_mask,
                                     need_weights=return_attn_weights)
        return output.permute(1, 0, 2), attention


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_ffn, nhead, d_model):
        super().__init__()
        self.self_att = MultiheadAttention(nhead, d_model)
        self.pos_ffn = nn.Sequential(nn.Linear(d_model, d_ffn), nn.ReLU(), nn.Linear(d_ffn, d_model))
        self.norm1 = nn.LayerNorm(d_model, eps=1e-6)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, pos_embs=None):
        src1 = self.norm1(src)  # normalize_before=True
        output, self_attn = self.self_att(src1, src1, src1, attn_mask=src_mask,
                                          key_padding_mask=src_key_padding_mask, pos_embs=pos_embs)
        src = src + output
        src1 = self.norm2(src)
        output = src + self.pos_ffn(src1)
        return output, self_attn


class TransformerEncoder(nn.Module):
    def __init__(self, num_layers, nhead, d_ffn, d_model):
        super().__init__()
        self.layers = nn.ModuleList([TransformerEncoderLayer(d_ffn, nhead, d_model) for _ in range(num_layers)])
        self.norm = nn.LayerNorm(d_model, eps=1e-6)

    def forward(self, src, src_mask=None, src_key_padding_mask=None, pos_embs=None):
        output = src
        attention_lst = []
        for enc_layer in self.layers:
            output, attention = enc_layer(output, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask,
                                          pos_embs=pos_embs)
            attention_lst.append(attention)
        return self.norm(output), attention_lst


class TransformerASR(nn.Module):
    def __init__(self, input_size=20, d_model=32, nhead=4, num_encoder_layers=2, d_ffn=64):
        super().__init__()
        self.attention_type = "regularMHA"
        self.positional_encoding_type = "fixed_abs_sine"
        self.custom_src_module = nn.Sequential(nn.Linear(input_size, d_model))
        self.positional_encoding = PositionalEncoding(d_model)
        self.encoder = TransformerEncoder(num_encoder_layers, nhead, d_ffn, d_model)

    def encode(self, src, wav_len=None):
        if src.dim() == 4:
            bz, t, ch1, ch2 = src.shape
            src = src.reshape(bz, t, ch1 * ch2)

        src_key_padding_mask = None
        if FIXED:
            if wav_len is not None:
                abs_len = torch.floor(wav_len * src.shape[1])
                src_key_padding_mask = (torch.arange(src.shape[1])[None, :].to(abs_len) > abs_len[:, None])
        else:
            if wav_len is not None and self.training:
                abs_len = torch.round(wav_len * src.shape[1])
                src_key_padding_mask = (1 - length_to_mask(abs_len)).bool()

        src = self.custom_src_module(src)
        if self.attention_type == "RelPosMHAXL":
            pos_embs_source = self.positional_encoding(src)
        elif self.positional_encoding_type == "fixed_abs_sine":
            src = src + self.positional_encoding(src)
            pos_embs_source = None

        encoder_out, _ = self.encoder(src=src, src_key_padding_mask=src_key_padding_mask, pos_embs=pos_embs_source)
        return encoder_out


model = TransformerASR().eval()   # inference: S2STransformerBeamSearch calls model.encode(src, wav_lens)
T = 20
lens = [20, 13, 8]
src = torch.zeros(3, T, 20)
for b, L in enumerate(lens):
    src[b, :L] = torch.randn(L, 20)
wav_lens = torch.tensor([L / T for L in lens])
with torch.no_grad():
    enc = model.encode(src, wav_lens)
    diff = 0.0
    for b, L in enumerate(lens):
        alone = model.encode(src[b:b + 1, :L], torch.ones(1))
        diff = max(diff, (enc[b, :L] - alone[0]).abs().max().item())
print(f"max |batched encode - single-utterance encode| over valid frames: {diff:.6f}")
