# Citation: ming024/FastSpeech2 transformer/Modules.py, transformer/SubLayers.py, transformer/Layers.py,
#   transformer/Models.py, model/modules.py LengthRegulator, utils/tools.py get_mask_from_lengths, model/loss.py
#   (commit d4e79eb52e8b01d24703b2dfc0385544092958f3)
# src/mel masks are bool "True = padding" from get_mask_from_lengths; slf_attn_mask = mask.unsqueeze(1).expand(-1, L, -1)
# blocks padded keys with -inf in an eager softmax (mask repeated head-major to match the (n*b) layout); padded rows
# still see valid keys, and their outputs are zeroed with masked_fill after every block and dropped from the loss.
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


def get_mask_from_lengths(lengths, max_len=None):
    batch_size = lengths.shape[0]
    if max_len is None:
        max_len = torch.max(lengths).item()
    ids = torch.arange(0, max_len).unsqueeze(0).expand(batch_size, -1)
    mask = ids >= lengths.unsqueeze(1).expand(-1, max_len)
    return mask


def pad(input_ele, mel_max_length=None):
    max_len = mel_max_length if mel_max_length else max([x.size(0) for x in input_ele])
    return torch.stack([F.pad(b, (0, 0, 0, max_len - b.size(0)), "constant", 0.0) for b in input_ele])


class ScaledDotProductAttention(nn.Module):
    def __init__(self, temperature):
        super().__init__()
        self.temperature = temperature
        self.softmax = nn.Softmax(dim=2)

    def forward(self, q, k, v, mask=None):
        attn = torch.bmm(q, k.transpose(1, 2))
        attn = attn / self.temperature
        if mask is not None:
            attn = attn.masked_fill(mask, -np.inf)
        attn = self.softmax(attn)
        output = torch.bmm(attn, v)
        return output, attn


class MultiHeadAttention(nn.Module):
    def __init__(self, n_head, d_model, d_k, d_v, dropout=0.1):
        super().__init__()
        self.n_head = n_head
        self.d_k = d_k
        self.d_v = d_v
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
        sz_b, len_k, _ = k.size()
        sz_b, len_v, _ = v.size()
        residual = q
        q = self.w_qs(q).view(sz_b, len_q, n_head, d_k)
        k = self.w_ks(k).view(sz_b, len_k, n_head, d_k)
        v = self.w_vs(v).view(sz_b, len_v, n_head, d_v)
        q = q.permute(2, 0, 1, 3).contiguous().view(-1, len_q, d_k)
        k = k.permute(2, 0, 1, 3).contiguous().view(-1, len_k, d_k)
        v = v.permute(2, 0, 1, 3).contiguous().view(-1, len_v, d_v)
        mask = mask.repeat(n_head, 1, 1)
        output, attn = self.attention(q, k, v, mask=mask)
        output = output.view(n_head, sz_b, len_q, d_v)
        output = output.permute(1, 2, 0, 3).contiguous().view(sz_b, len_q, -1)
        output = self.dropout(self.fc(output))
        output = self.layer_norm(output + residual)
        return output, attn


class PositionwiseFeedForward(nn.Module):
    def __init__(self, d_in, d_hid, kernel_size, dropout=0.1):
        super().__init__()
        self.w_1 = nn.Conv1d(d_in, d_hid, kernel_size=kernel_size[0], padding=(kernel_size[0] - 1) // 2)
        self.w_2 = nn.Conv1d(d_hid, d_in, kernel_size=kernel_size[1], padding=(kernel_size[1] - 1) // 2)
        self.layer_norm = nn.LayerNorm(d_in)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        residual = x
        output = x.transpose(1, 2)
        output = self.w_2(F.relu(self.w_1(output)))
        output = output.transpose(1, 2)
        output = self.dropout(output)
        return self.layer_norm(output + residual)


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


def get_sinusoid_encoding_table(n_position, d_hid):
    def cal_angle(position, hid_idx):
        return position / np.power(10000, 2 * (hid_idx // 2) / d_hid)
    table = np.array([[cal_angle(p, j) for j in range(d_hid)] for p in range(n_position)])
    table[:, 0::2] = np.sin(table[:, 0::2])
    table[:, 1::2] = np.cos(table[:, 1::2])
    return torch.FloatTensor(table)


CONFIG = {"max_seq_len": 100, "transformer": {"encoder_layer": 2, "encoder_head": 2, "encoder_hidden": 64,
          "decoder_layer": 2, "decoder_head": 2, "decoder_hidden": 64, "conv_filter_size": 128,
          "conv_kernel_size": [9, 1], "encoder_dropout": 0.2, "decoder_dropout": 0.2}}


class Encoder(nn.Module):
    def __init__(self, config, n_src_vocab=40):
        super().__init__()
        t = config["transformer"]
        d_model = t["encoder_hidden"]
        self.max_seq_len = config["max_seq_len"]
        self.src_word_emb = nn.Embedding(n_src_vocab, d_model, padding_idx=0)
        self.position_enc = nn.Parameter(get_sinusoid_encoding_table(config["max_seq_len"] + 1, d_model).unsqueeze(0),
                                         requires_grad=False)
        d_k = d_model // t["encoder_head"]
        self.layer_stack = nn.ModuleList([FFTBlock(d_model, t["encoder_head"], d_k, d_k, t["conv_filter_size"],
                                          t["conv_kernel_size"], dropout=t["encoder_dropout"]) for _ in range(t["encoder_layer"])])

    def forward(self, src_seq, mask):
        batch_size, max_len = src_seq.shape[0], src_seq.shape[1]
        slf_attn_mask = mask.unsqueeze(1).expand(-1, max_len, -1)
        enc_output = self.src_word_emb(src_seq) + self.position_enc[:, :max_len, :].expand(batch_size, -1, -1)
        for enc_layer in self.layer_stack:
            enc_output, _ = enc_layer(enc_output, mask=mask, slf_attn_mask=slf_attn_mask)
        return enc_output


class Decoder(nn.Module):
    def __init__(self, config):
        super().__init__()
        t = config["transformer"]
        d_model = t["decoder_hidden"]
        self.max_seq_len = config["max_seq_len"]
        self.position_enc = nn.Parameter(get_sinusoid_encoding_table(config["max_seq_len"] + 1, d_model).unsqueeze(0),
                                         requires_grad=False)
        d_k = d_model // t["decoder_head"]
        self.layer_stack = nn.ModuleList([FFTBlock(d_model, t["decoder_head"], d_k, d_k, t["conv_filter_size"],
                                          t["conv_kernel_size"], dropout=t["decoder_dropout"]) for _ in range(t["decoder_layer"])])

    def forward(self, enc_seq, mask):
        batch_size, max_len = enc_seq.shape[0], enc_seq.shape[1]
        max_len = min(max_len, self.max_seq_len)
        slf_attn_mask = mask.unsqueeze(1).expand(-1, max_len, -1)
        dec_output = enc_seq[:, :max_len, :] + self.position_enc[:, :max_len, :].expand(batch_size, -1, -1)
        mask = mask[:, :max_len]
        slf_attn_mask = slf_attn_mask[:, :, :max_len]
        for dec_layer in self.layer_stack:
            dec_output, _ = dec_layer(dec_output, mask=mask, slf_attn_mask=slf_attn_mask)
        return dec_output, mask


class LengthRegulator(nn.Module):
    def LR(self, x, duration, max_len):
        output, mel_len = [], []
        for batch, expand_target in zip(x, duration):
            expanded = self.expand(batch, expand_target)
            output.append(expanded)
            mel_len.append(expanded.shape[0])
        output = pad(output, max_len) if max_len is not None else pad(output)
        return output, torch.LongTensor(mel_len)

    def expand(self, batch, predicted):
        out = []
        for i, vec in enumerate(batch):
            expand_size = predicted[i].item()
            out.append(vec.expand(max(int(expand_size), 0), -1))
        return torch.cat(out, 0)

    def forward(self, x, duration, max_len):
        return self.LR(x, duration, max_len)


class FastSpeech2(nn.Module):
    def __init__(self, config, n_mel=20):
        super().__init__()
        self.encoder = Encoder(config)
        self.duration_predictor = nn.Linear(config["transformer"]["encoder_hidden"], 1)
        self.length_regulator = LengthRegulator()
        self.decoder = Decoder(config)
        self.mel_linear = nn.Linear(config["transformer"]["decoder_hidden"], n_mel)

    def forward(self, texts, src_lens, max_src_len, mel_lens, max_mel_len, d_targets):
        src_masks = get_mask_from_lengths(src_lens, max_src_len)
        mel_masks = get_mask_from_lengths(mel_lens, max_mel_len)
        output = self.encoder(texts, src_masks)
        log_d_predictions = self.duration_predictor(output).squeeze(-1).masked_fill(src_masks, 0.0)
        output, mel_len = self.length_regulator(output, d_targets, max_mel_len)
        output, mel_masks = self.decoder(output, mel_masks)
        output = self.mel_linear(output)
        return output, log_d_predictions, src_masks, mel_masks


if __name__ == "__main__":
    torch.manual_seed(0)
    src_lens = torch.tensor([9, 5, 7])
    max_src_len = int(src_lens.max())
    texts = torch.randint(1, 40, (3, max_src_len)) * (~get_mask_from_lengths(src_lens)).long()
    d_targets = torch.randint(1, 4, (3, max_src_len)) * (~get_mask_from_lengths(src_lens)).long()
    mel_lens = d_targets.sum(-1)
    max_mel_len = int(mel_lens.max())
    mel_targets = torch.randn(3, max_mel_len, 20)
    model = FastSpeech2(CONFIG)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(2):
        mel_pred, log_d_pred, src_masks, mel_masks = model(texts, src_lens, max_src_len, mel_lens, max_mel_len, d_targets)
        src_keep, mel_keep = ~src_masks, ~mel_masks
        mel_loss = F.l1_loss(mel_pred.masked_select(mel_keep.unsqueeze(-1)), mel_targets.masked_select(mel_keep.unsqueeze(-1)))
        dur_loss = F.mse_loss(log_d_pred.masked_select(src_keep), torch.log(d_targets.float() + 1).masked_select(src_keep))
        loss = mel_loss + dur_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    print("loss %.4f" % loss.item())
