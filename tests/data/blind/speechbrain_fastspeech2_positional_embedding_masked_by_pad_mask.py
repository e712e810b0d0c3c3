# speechbrain/speechbrain#2276, fixed by speechbrain/speechbrain#2283 (landed in 9ca48f290, "Merge Unstable v0.6 into Dev")
# FastSpeech2's PositionalEmbedding multiplied the sinusoids by `srcmask`, which is True on *padding*, and the
# result was then multiplied by `srcmask_inverted`: the positions added before the encoder and decoder
# self-attention were all zero. The fix uses PositionalEncoding (no mask) and builds the mel mask from lengths.
import sys

import math
import torch
from torch import nn

FIXED = "--fixed" in sys.argv


def get_key_padding_mask(padded_input, pad_idx):
    if len(padded_input.shape) == 4:
        bz, time, ch1, ch2 = padded_input.shape
        padded_input = padded_input.reshape(bz, time, ch1 * ch2)

    key_padded_mask = padded_input.eq(pad_idx).to(padded_input.device)

    # if the input is more than 2d, mask the locations where they are silence
    # across all channels
    if len(padded_input.shape) > 2:
        key_padded_mask = key_padded_mask.float().prod(dim=-1).bool()
        return key_padded_mask.detach()

    return key_padded_mask.detach()


def get_mask_from_lengths(lengths, max_len=None):
    if max_len is None:
        max_len = torch.max(lengths).item()
    seq_range = torch.arange(max_len, device=lengths.device, dtype=lengths.dtype)
    return ~(seq_range.unsqueeze(0) < lengths.unsqueeze(1))


class PositionalEmbedding(nn.Module):
    def __init__(self, embed_dim):
        super(PositionalEmbedding, self).__init__()
        self.demb = embed_dim
        inv_freq = 1 / (
            10000 ** (torch.arange(0.0, embed_dim, 2.0) / embed_dim)
        )
        self.register_buffer("inv_freq", inv_freq)

    def forward(self, seq_len, mask, dtype):
        pos_seq = torch.arange(seq_len, device=mask.device).to(dtype)

        sinusoid_inp = torch.matmul(
            torch.unsqueeze(pos_seq, -1), torch.unsqueeze(self.inv_freq, 0)
        )
        pos_emb = torch.cat([sinusoid_inp.sin(), sinusoid_inp.cos()], dim=1)
        return pos_emb[None, :, :] * mask[:, :, None]


class PositionalEncoding(nn.Module):
    def __init__(self, input_size, max_len=2500):
        super().__init__()
        self.max_len = max_len
        pe = torch.zeros(self.max_len, input_size, requires_grad=False)
        positions = torch.arange(0, self.max_len).unsqueeze(1).float()
        denominator = torch.exp(
            torch.arange(0, input_size, 2).float()
            * -(math.log(10000.0) / input_size)
        )
        pe[:, 0::2] = torch.sin(positions * denominator)
        pe[:, 1::2] = torch.cos(positions * denominator)
        pe = pe.unsqueeze(0)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return self.pe[:, : x.size(1)].clone().detach()


class PositionalwiseFeedForward(nn.Module):
    def __init__(self, d_ffn, input_size, dropout=0.0, kernel_size_list=(9, 1)):
        super().__init__()
        self.conv1 = nn.Conv1d(input_size, d_ffn, kernel_size_list[0], padding=kernel_size_list[0] // 2)
        self.conv2 = nn.Conv1d(d_ffn, input_size, kernel_size_list[1], padding=kernel_size_list[1] // 2)
        self.act = nn.ReLU()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = self.conv1(x.transpose(1, 2))
        x = self.dropout(self.act(x))
        return self.conv2(x).transpose(1, 2)


class TransformerEncoderLayer(nn.Module):
    def __init__(self, d_ffn, nhead, d_model, dropout=0.0):
        super().__init__()
        self.self_att = nn.MultiheadAttention(d_model, nhead, dropout=dropout, batch_first=True)
        self.pos_ffn = PositionalwiseFeedForward(d_ffn, d_model, dropout)
        self.norm1 = nn.LayerNorm(d_model, eps=1e-6)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-6)
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, src, src_mask=None, src_key_padding_mask=None):
        output, self_attn = self.self_att(
            src, src, src, attn_mask=src_mask, key_padding_mask=src_key_padding_mask
        )
        src = src + self.dropout1(output)
        src = self.norm1(src)
        output = self.pos_ffn(src)
        src = src + self.dropout2(output)
        src = self.norm2(src)
        return src, self_attn


class TransformerEncoder(nn.Module):
    def __init__(self, num_layers, nhead, d_ffn, d_model, dropout=0.0):
        super().__init__()
        self.layers = nn.ModuleList(
            [TransformerEncoderLayer(d_ffn, nhead, d_model, dropout) for _ in range(num_layers)]
        )

    def forward(self, src, src_mask=None, src_key_padding_mask=None):
        output = src
        attention_lst = []
        for enc_layer in self.layers:
            output, attention = enc_layer(output, src_mask=src_mask, src_key_padding_mask=src_key_padding_mask)
            attention_lst.append(attention)
        return output, attention_lst


class DurationPredictor(nn.Module):
    def __init__(self, in_channels, out_channels, kernel_size=3, dropout=0.0):
        super().__init__()
        self.conv1 = nn.Conv1d(in_channels, out_channels, kernel_size, padding=kernel_size // 2)
        self.conv2 = nn.Conv1d(out_channels, out_channels, kernel_size, padding=kernel_size // 2)
        self.linear = nn.Linear(out_channels, 1)
        self.ln1 = nn.LayerNorm(out_channels)
        self.ln2 = nn.LayerNorm(out_channels)
        self.relu = nn.ReLU()
        self.dropout1 = nn.Dropout(dropout)
        self.dropout2 = nn.Dropout(dropout)

    def forward(self, x, x_mask):
        x = self.relu(self.conv1((x * x_mask).transpose(1, 2)).transpose(1, 2))
        x = self.dropout1(self.ln1(x))
        x = self.relu(self.conv2((x * x_mask).transpose(1, 2)).transpose(1, 2))
        x = self.dropout2(self.ln2(x))
        return self.linear(x * x_mask)


def upsample(feats, durs, pace=1.0, padding_value=0.0):
    upsampled_mels = [
        torch.repeat_interleave(feats[i], (pace * durs[i]).long(), dim=0)
        for i in range(len(durs))
    ]
    mel_lens = [mel.shape[0] for mel in upsampled_mels]
    padded_upsampled_mels = torch.nn.utils.rnn.pad_sequence(
        upsampled_mels, batch_first=True, padding_value=padding_value,
    )
    return padded_upsampled_mels, mel_lens


class FastSpeech2(nn.Module):
    def __init__(self, enc_num_layers, enc_num_head, enc_d_model, enc_ffn_dim, enc_dropout,
                 dec_num_layers, dec_num_head, dec_d_model, dec_ffn_dim, dec_dropout,
                 n_char, n_mels, padding_idx, dur_pred_kernel_size, variance_predictor_dropout):
        super().__init__()
        self.enc_num_head = enc_num_head
        self.dec_num_head = dec_num_head
        self.padding_idx = padding_idx
        if FIXED:
            self.sinusoidal_positional_embed_encoder = PositionalEncoding(enc_d_model)
            self.sinusoidal_positional_embed_decoder = PositionalEncoding(dec_d_model)
        else:
            self.sinusoidal_positional_embed_encoder = PositionalEmbedding(enc_d_model)
            self.sinusoidal_positional_embed_decoder = PositionalEmbedding(dec_d_model)
        self.encPreNet = nn.Embedding(n_char, enc_d_model, padding_idx=padding_idx)
        self.durPred = DurationPredictor(enc_d_model, enc_d_model, dur_pred_kernel_size, variance_predictor_dropout)
        self.encoder = TransformerEncoder(enc_num_layers, enc_num_head, enc_ffn_dim, enc_d_model, enc_dropout)
        self.decoder = TransformerEncoder(dec_num_layers, dec_num_head, dec_ffn_dim, dec_d_model, dec_dropout)
        self.linear = nn.Linear(dec_d_model, n_mels)

    def forward(self, tokens, durations=None, pace=1.0):
        srcmask = get_key_padding_mask(tokens, pad_idx=self.padding_idx)
        srcmask_inverted = (~srcmask).unsqueeze(-1)

        # prenet & encoder
        token_feats = self.encPreNet(tokens)
        if FIXED:
            pos = self.sinusoidal_positional_embed_encoder(token_feats)
        else:
            pos = self.sinusoidal_positional_embed_encoder(
                token_feats.shape[1], srcmask, token_feats.dtype
            )
        token_feats = torch.add(token_feats, pos) * srcmask_inverted
        attn_mask = (
            srcmask.unsqueeze(-1)
            .repeat(self.enc_num_head, 1, token_feats.shape[1])
            .permute(0, 2, 1)
            .bool()
        )
        token_feats, _ = self.encoder(
            token_feats, src_mask=attn_mask, src_key_padding_mask=srcmask
        )
        token_feats = token_feats * srcmask_inverted

        predict_durations = self.durPred(token_feats, srcmask_inverted).squeeze(-1)

        spec_feats, mel_lens = upsample(token_feats, durations, pace=pace)
        if FIXED:
            srcmask = get_mask_from_lengths(torch.tensor(mel_lens))
            srcmask = srcmask.to(spec_feats.device)
        else:
            srcmask = get_key_padding_mask(spec_feats, pad_idx=self.padding_idx)
        srcmask_inverted = (~srcmask).unsqueeze(-1)
        attn_mask = (
            srcmask.unsqueeze(-1)
            .repeat(self.dec_num_head, 1, spec_feats.shape[1])
            .permute(0, 2, 1)
            .bool()
        )

        # decoder
        if FIXED:
            pos = self.sinusoidal_positional_embed_decoder(spec_feats)
        else:
            pos = self.sinusoidal_positional_embed_decoder(
                spec_feats.shape[1], srcmask, spec_feats.dtype
            )
        spec_feats = torch.add(spec_feats, pos) * srcmask_inverted

        output_mel_feats, memory, *_ = self.decoder(
            spec_feats, src_mask=attn_mask, src_key_padding_mask=srcmask
        )
        mel_post = self.linear(output_mel_feats) * srcmask_inverted
        return mel_post, predict_durations, torch.tensor(mel_lens)


def main():
    torch.manual_seed(0)
    model = FastSpeech2(enc_num_layers=2, enc_num_head=2, enc_d_model=64, enc_ffn_dim=128, enc_dropout=0.1,
                        dec_num_layers=2, dec_num_head=2, dec_d_model=64, dec_ffn_dim=128, dec_dropout=0.1,
                        n_char=40, n_mels=20, padding_idx=0, dur_pred_kernel_size=3,
                        variance_predictor_dropout=0.5)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    tokens = torch.tensor([[13, 12, 31, 14, 19, 7, 22, 5],
                           [31, 16, 30, 31, 9, 0, 0, 0]])
    durations = torch.tensor([[2, 4, 1, 5, 3, 2, 2, 3],
                              [1, 2, 4, 3, 2, 0, 0, 0]])
    mel_lens = durations.sum(1)
    mel_target = torch.randn(2, int(mel_lens.max()), 20)
    model.train()
    mel_post, predict_durations, out_lens = model(tokens, durations=durations)
    mel_mask = ~get_mask_from_lengths(out_lens)
    mel_loss = ((mel_post - mel_target) ** 2)[mel_mask].mean()
    tok_mask = tokens != 0
    dur_loss = ((predict_durations - torch.log1p(durations.float())) ** 2)[tok_mask].mean()
    loss = mel_loss + dur_loss
    opt.zero_grad()
    loss.backward()
    opt.step()
    print(f"fixed={FIXED} loss={loss.item():.6f}")


if __name__ == "__main__":
    main()
