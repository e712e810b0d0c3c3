"""FastSpeech 2 (non-autoregressive TTS): phoneme encoder and mel decoder both attend both ways under padding masks.

Follows ming024/FastSpeech2 (https://github.com/ming024/FastSpeech2: model/fastspeech2.py ``FastSpeech2.forward``,
transformer/Models.py ``Encoder`` / ``Decoder``, transformer/SubLayers.py ``MultiHeadAttention``,
transformer/Modules.py ``ScaledDotProductAttention``, model/modules.py ``LengthRegulator``, utils/tools.py
``get_mask_from_lengths``), with its model.yaml-style nested config dict.

Mask meant: ``src_masks = get_mask_from_lengths(src_lens)`` (True = padding) hides the padded phoneme KEYS from every
query, with no causal mask: the whole utterance is synthesised in parallel. After the length regulator repeats each
phoneme ``duration`` times, the mel sequence is much longer than the phoneme sequence and ``mel_masks`` (from
``mel_lens = sum(durations)``) hides the padded FRAME keys in the decoder the same way. Padded query rows are
computed but zeroed by ``masked_fill(mask.unsqueeze(-1), 0)`` after each sublayer.
"""
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

model_config = {
    "transformer": {
        "encoder_layer": 2, "encoder_head": 2, "encoder_hidden": 32,
        "decoder_layer": 2, "decoder_head": 2, "decoder_hidden": 32,
        "conv_filter_size": 64, "conv_kernel_size": [9, 1],
        "encoder_dropout": 0.2, "decoder_dropout": 0.2,
    },
    "max_seq_len": 200,
}
n_mel_channels = 20
PAD = 0


def get_mask_from_lengths(lengths, max_len=None):
    batch_size = lengths.shape[0]
    if max_len is None:
        max_len = int(torch.max(lengths).item())
    ids = torch.arange(0, max_len).unsqueeze(0).expand(batch_size, -1)
    return ids >= lengths.unsqueeze(1).expand(-1, max_len)


def get_sinusoid_encoding_table(n_position, d_hid):
    def cal_angle(position, hid_idx):
        return position / np.power(10000, 2 * (hid_idx // 2) / d_hid)

    table = np.array([[cal_angle(pos, j) for j in range(d_hid)] for pos in range(n_position)])
    table[:, 0::2] = np.sin(table[:, 0::2])
    table[:, 1::2] = np.cos(table[:, 1::2])
    return torch.FloatTensor(table)


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
    def __init__(self, n_head, d_model, d_k, d_v, dropout=0.1):
        super().__init__()
        self.n_head, self.d_k, self.d_v = n_head, d_k, d_v
        self.w_qs = nn.Linear(d_model, n_head * d_k)
        self.w_ks = nn.Linear(d_model, n_head * d_k)
        self.w_vs = nn.Linear(d_model, n_head * d_v)
        self.attention = ScaledDotProductAttention(temperature=np.power(d_k, 0.5))
        self.layer_norm = nn.LayerNorm(d_model)
        self.fc = nn.Linear(n_head * d_v, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, q, k, v, mask=None):
        d_k, d_v, n_head = self.d_k, self.d_v, self.n_head
        sz_b, len_q, _ = q.size()
        len_k = k.size(1)
        residual = q
        q = self.w_qs(q).view(sz_b, len_q, n_head, d_k).permute(2, 0, 1, 3).contiguous().view(-1, len_q, d_k)
        k = self.w_ks(k).view(sz_b, len_k, n_head, d_k).permute(2, 0, 1, 3).contiguous().view(-1, len_k, d_k)
        v = self.w_vs(v).view(sz_b, len_k, n_head, d_v).permute(2, 0, 1, 3).contiguous().view(-1, len_k, d_v)
        mask = mask.repeat(n_head, 1, 1)  # (n*b) x .. x ..
        output, attn = self.attention(q, k, v, mask=mask)
        output = output.view(n_head, sz_b, len_q, d_v).permute(1, 2, 0, 3).contiguous().view(sz_b, len_q, -1)
        output = self.dropout(self.fc(output))
        return self.layer_norm(output + residual), attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_in, d_hid, kernel_size, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Conv1d(d_in, d_hid, kernel_size=kernel_size[0], padding=(kernel_size[0] - 1) // 2)
        self.w_2 = nn.Conv1d(d_hid, d_in, kernel_size=kernel_size[1], padding=(kernel_size[1] - 1) // 2)
        self.layer_norm = nn.LayerNorm(d_in)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        residual = x
        output = self.w_2(F.relu(self.w_1(x.transpose(1, 2)))).transpose(1, 2)
        return self.layer_norm(self.dropout(output) + residual)


class FFTBlock(nn.Module):
    def __init__(self, d_model, n_head, d_k, d_v, d_inner, kernel_size, dropout=0.1):
        super().__init__()
        self.slf_attn = MultiHeadAttention(n_head, d_model, d_k, d_v, dropout=dropout)
        self.pos_ffn = PositionwiseFeedForward(d_model, d_inner, kernel_size, dropout=dropout)

    def forward(self, enc_input, mask=None, slf_attn_mask=None):
        enc_output, enc_slf_attn = self.slf_attn(enc_input, enc_input, enc_input, mask=slf_attn_mask)
        enc_output = enc_output.masked_fill(mask.unsqueeze(-1), 0)
        enc_output = self.pos_ffn(enc_output)
        enc_output = enc_output.masked_fill(mask.unsqueeze(-1), 0)
        return enc_output, enc_slf_attn


class _Stack(nn.Module):
    def __init__(self, config, prefix):
        super().__init__()
        t = config["transformer"]
        d_model, n_head = t[f"{prefix}_hidden"], t[f"{prefix}_head"]
        self.max_seq_len = config["max_seq_len"]
        self.d_model = d_model
        self.position_enc = nn.Parameter(
            get_sinusoid_encoding_table(config["max_seq_len"] + 1, d_model).unsqueeze(0), requires_grad=False)
        self.layer_stack = nn.ModuleList(
            FFTBlock(d_model, n_head, d_model // n_head, d_model // n_head, t["conv_filter_size"],
                     t["conv_kernel_size"], dropout=t[f"{prefix}_dropout"])
            for _ in range(t[f"{prefix}_layer"]))

    def run(self, x, mask):
        batch_size, max_len = x.shape[0], x.shape[1]
        # -- Prepare masks: every query row hides the padded keys of its utterance
        slf_attn_mask = mask.unsqueeze(1).expand(-1, max_len, -1)
        x = x + self.position_enc[:, :max_len, :].expand(batch_size, -1, -1)
        for layer in self.layer_stack:
            x, _ = layer(x, mask=mask, slf_attn_mask=slf_attn_mask)
        return x


class Encoder(_Stack):
    def __init__(self, config, n_src_vocab=40):
        super().__init__(config, "encoder")
        self.src_word_emb = nn.Embedding(n_src_vocab, self.d_model, padding_idx=PAD)

    def forward(self, src_seq, mask):
        return self.run(self.src_word_emb(src_seq), mask)


class Decoder(_Stack):
    def __init__(self, config):
        super().__init__(config, "decoder")

    def forward(self, enc_seq, mask):
        return self.run(enc_seq, mask), mask


class LengthRegulator(nn.Module):
    def forward(self, x, duration, max_len=None):
        output, mel_len = [], []
        for batch, expand_target in zip(x, duration):
            expanded = torch.repeat_interleave(batch, expand_target, dim=0)
            output.append(expanded)
            mel_len.append(expanded.shape[0])
        max_len = max_len or max(mel_len)
        output = torch.stack([F.pad(o, (0, 0, 0, max_len - o.size(0))) for o in output])
        return output, torch.LongTensor(mel_len)


class FastSpeech2(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.encoder = Encoder(config)
        self.length_regulator = LengthRegulator()
        self.decoder = Decoder(config)
        self.mel_linear = nn.Linear(config["transformer"]["decoder_hidden"], n_mel_channels)

    def forward(self, speakers, texts, src_lens, max_src_len, d_targets):
        src_masks = get_mask_from_lengths(src_lens, max_src_len)
        output = self.encoder(texts, src_masks)
        output, mel_lens = self.length_regulator(output, d_targets)
        mel_masks = get_mask_from_lengths(mel_lens)
        output, mel_masks = self.decoder(output, mel_masks)
        output = self.mel_linear(output)
        return output, src_masks, mel_masks, src_lens, mel_lens


def main():
    torch.manual_seed(0)
    model = FastSpeech2(model_config).eval()
    texts = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, PAD, PAD, PAD], [14, 15, 16, 17, PAD, PAD]])
    src_lens = torch.tensor([6, 3, 4])
    # durations of padded phonemes are 0, as in the preprocessed duration targets
    d_targets = torch.tensor([[2, 3, 1, 4, 2, 3], [5, 6, 4, 0, 0, 0], [1, 1, 2, 1, 0, 0]])
    with torch.no_grad():
        mel, src_masks, mel_masks, _, mel_lens = model(None, texts, src_lens, 6, d_targets)
        assert mel_lens.tolist() == [15, 15, 5]
        # Reference: each utterance synthesised alone, with no padding at all.
        for i in range(texts.shape[0]):
            n = int(src_lens[i])
            alone, _, _, _, alone_len = model(None, texts[i:i + 1, :n], src_lens[i:i + 1], n, d_targets[i:i + 1, :n])
            assert torch.allclose(mel[i, : alone_len[0]], alone[0], atol=1e-4), i
    print("mel", tuple(mel.shape), "mel_lens", mel_lens.tolist())


if __name__ == "__main__":
    main()
