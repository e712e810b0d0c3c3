# lifeiteng/vall-e commit c611592 ("[VALL-E] Fix attention mask"): in the AR stage the
# text/audio prefix mask was padded with the wrong values: text rows could see audio, audio rows could not see text.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
NUM_AUDIO_TOKENS = 64
NUM_TEXT_TOKENS = 40


def make_pad_mask(lengths: torch.Tensor, max_len: int = 0) -> torch.Tensor:
    n = lengths.size(0)
    max_len = max(max_len, lengths.max())
    expaned_lengths = torch.arange(max_len).expand(n, max_len).to(lengths)
    return expaned_lengths >= lengths.unsqueeze(1)


class SinePositionalEmbedding(nn.Module):
    def __init__(self, dim_model: int):
        super().__init__()
        self.dim_model = dim_model
        self.x_scale = 1.0
        self.alpha = nn.Parameter(torch.ones(1))

    def forward(self, x):
        t = torch.arange(x.size(1), dtype=torch.float32).unsqueeze(1)
        div = torch.exp(torch.arange(0, self.dim_model, 2, dtype=torch.float32) * -(torch.log(torch.tensor(10000.0)) / self.dim_model))
        pe = torch.zeros(x.size(1), self.dim_model)
        pe[:, 0::2] = torch.sin(t * div)
        pe[:, 1::2] = torch.cos(t * div)
        return x * self.x_scale + self.alpha * pe.unsqueeze(0)


class VALLE(nn.Module):
    def __init__(self, d_model=32, nhead=4, num_layers=2):
        super().__init__()
        self.text_embedding = nn.Embedding(NUM_TEXT_TOKENS, d_model)
        self.text_position = SinePositionalEmbedding(d_model)
        self.audio_embedding = nn.Embedding(NUM_AUDIO_TOKENS + 1, d_model)
        self.audio_position = SinePositionalEmbedding(d_model)
        self.ar_decoder = nn.TransformerEncoder(
            nn.TransformerEncoderLayer(d_model, nhead, dim_feedforward=64, dropout=0.0, batch_first=True, norm_first=True),
            num_layers=num_layers,
            enable_nested_tensor=False,
        )
        self.ar_predict_layer = nn.Linear(d_model, NUM_AUDIO_TOKENS + 1)

    def forward(self, x, x_lens, y, y_lens):
        # NOTE: x has been padded in TextTokenCollater
        x_mask = make_pad_mask(x_lens).to(x.device)
        y_mask = make_pad_mask(y_lens).to(y.device)
        y_mask_int = y_mask.type(torch.int64)
        codes = y.type(torch.int64) * (1 - y_mask_int)

        x = self.text_embedding(x)
        x = self.text_position(x)

        xy_padding_mask = torch.concat([x_mask, y_mask], dim=1)

        x_len = int(x_lens.max())
        y_len = int(y_lens.max())
        x_attn_mask = F.pad(
            torch.zeros((x_len, x_len), dtype=torch.bool),
            (0, y_len),
            value=True if FIXED else False,
        )
        y_attn_mask = F.pad(
            torch.triu(torch.ones(y_len, y_len, dtype=torch.bool), diagonal=1),
            (x_len, 0),
            value=False if FIXED else True,
        )
        xy_attn_mask = torch.concat([x_attn_mask, y_attn_mask], dim=0).to(y.device)

        def pad_y_eos(y, eos_id):
            y = F.pad(y, (0, 1)) + eos_id * F.pad(y_mask_int, (0, 1), value=1)
            return y[:, :-1], y[:, 1:]

        y_in, targets = pad_y_eos(codes, eos_id=NUM_AUDIO_TOKENS)
        y_emb = self.audio_embedding(y_in)
        y_pos = self.audio_position(y_emb)
        xy_pos = torch.concat([x, y_pos], dim=1)

        xy_dec = self.ar_decoder(xy_pos, mask=xy_attn_mask, src_key_padding_mask=xy_padding_mask)
        logits = self.ar_predict_layer(xy_dec[:, x_len:])
        loss = F.cross_entropy(logits.permute(0, 2, 1), targets, reduction="sum")
        return logits, loss


def main():
    torch.manual_seed(0)
    model = VALLE().eval()
    x_lens = torch.tensor([7, 5])
    y_lens = torch.tensor([9, 6])
    x = torch.randint(1, NUM_TEXT_TOKENS, (2, 7)) * (~make_pad_mask(x_lens))
    y = torch.randint(0, NUM_AUDIO_TOKENS, (2, 9))
    with torch.no_grad():
        logits, loss = model(x, x_lens, y, y_lens)
        # the AR stage must be conditioned on the phonemes: change them and see if the audio logits move
        x2 = torch.randint(1, NUM_TEXT_TOKENS, (2, 7)) * (~make_pad_mask(x_lens))
        logits2, _ = model(x2, x_lens, y, y_lens)
    dep = (logits - logits2).abs().max().item()
    print(f"{'fixed' if FIXED else 'buggy'}: loss={loss.item():.4f} "
          f"max |audio logit change| when the text changes = {dep:.6f}")


if __name__ == "__main__":
    main()
