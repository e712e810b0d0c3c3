# neuralforecast (Nixtla/neuralforecast#1014, commit 8fad5f4 "Make MOMENT aware of insample mask"):
# MOMENT.forward called self.moment(x_enc) without input_mask, so the T5 encoder's attention_mask was all ones
# and left-padded (insample_mask == 0) steps were attended to and used in the RevIN statistics.
import sys
import math
import torch
import torch.nn as nn
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def nanvar(tensor, dim=None, keepdim=False):
    tensor_mean = tensor.nanmean(dim=dim, keepdim=True)
    output = (tensor - tensor_mean).square().nanmean(dim=dim, keepdim=keepdim)
    return output


def nanstd(tensor, dim=None, keepdim=False):
    return nanvar(tensor, dim=dim, keepdim=keepdim).sqrt()


class RevIN(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-5, affine: bool = False):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.affine = affine

    def forward(self, x, mode="norm", mask=None):
        if mode == "norm":
            self._get_statistics(x, mask=mask)
            x = (x - self.mean) / self.stdev
        elif mode == "denorm":
            x = x * self.stdev + self.mean
        return x

    def _get_statistics(self, x, mask=None):
        if mask is None:
            mask = torch.ones((x.shape[0], x.shape[-1]))
        n_channels = x.shape[1]
        mask = mask.unsqueeze(1).repeat(1, n_channels, 1).bool()
        masked_x = torch.where(mask, x, torch.nan)
        self.mean = torch.nanmean(masked_x, dim=-1, keepdim=True).detach()
        self.stdev = nanstd(masked_x, dim=-1, keepdim=True).detach() + self.eps


class Masking:
    @staticmethod
    def convert_seq_to_patch_view(mask, patch_len=8, stride=None):
        stride = patch_len if stride is None else stride
        mask = mask.unfold(dimension=-1, size=patch_len, step=stride)
        return (mask.sum(dim=-1) == patch_len).long()


class PositionalEmbedding(nn.Module):
    def __init__(self, d_model, max_len=512):
        super().__init__()
        pe = torch.zeros(max_len, d_model).float()
        position = torch.arange(0, max_len).float().unsqueeze(1)
        div_term = (torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model)).exp()
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        self.register_buffer("pe", pe.unsqueeze(0))

    def forward(self, x):
        return self.pe[:, : x.size(2)]


class PatchEmbedding(nn.Module):
    def __init__(self, d_model, patch_len):
        super().__init__()
        self.patch_len = patch_len
        self.d_model = d_model
        self.value_embedding = nn.Linear(patch_len, d_model, bias=False)
        torch.nn.init.orthogonal_(self.value_embedding.weight, gain=1.41)
        self.mask_embedding = nn.Parameter(torch.zeros(d_model))
        self.position_embedding = PositionalEmbedding(d_model)
        self.dropout = nn.Dropout(0.1)

    def forward(self, x, mask=None):
        mask = Masking.convert_seq_to_patch_view(mask, patch_len=self.patch_len).unsqueeze(-1)
        n_channels = x.shape[1]
        mask = mask.repeat_interleave(self.d_model, dim=-1).unsqueeze(1).repeat(1, n_channels, 1, 1)
        x = mask * self.value_embedding(x) + (1 - mask) * self.mask_embedding
        x = x + self.position_embedding(x)
        return self.dropout(x)


class Patching(nn.Module):
    def __init__(self, patch_len, stride):
        super().__init__()
        self.patch_len, self.stride = patch_len, stride

    def forward(self, x):
        return x.unfold(dimension=-1, size=self.patch_len, step=self.stride)


class ForecastingHead(nn.Module):
    def __init__(self, head_nf, forecast_horizon):
        super().__init__()
        self.flatten = nn.Flatten(start_dim=-2)
        self.linear = nn.Linear(head_nf, forecast_horizon)

    def forward(self, x, input_mask=None):
        return self.linear(self.flatten(x))


class MOMENT_module(nn.Module):
    def __init__(self, seq_len=32, patch_len=8, d_model=32, h=4):
        super().__init__()
        self.seq_len, self.patch_len, self.d_model = seq_len, patch_len, d_model
        self.normalizer = RevIN(num_features=1)
        self.tokenizer = Patching(patch_len, patch_len)
        self.patch_embedding = PatchEmbedding(d_model, patch_len)
        cfg = T5Config(d_model=d_model, d_kv=8, num_heads=4, d_ff=64, num_layers=2, dropout_rate=0.0,
                       vocab_size=8, feed_forward_proj="gated-gelu")
        self.encoder = T5EncoderModel(cfg).get_encoder()
        self.head = ForecastingHead(d_model * (seq_len // patch_len), h)
        self.last_enc_out = None

    def forecast(self, x_enc, input_mask=None):
        batch_size, n_channels, seq_len = x_enc.shape
        x_enc = self.normalizer(x=x_enc, mask=input_mask, mode="norm")
        x_enc = torch.nan_to_num(x_enc, nan=0, posinf=0, neginf=0)
        x_enc = self.tokenizer(x=x_enc)
        enc_in = self.patch_embedding(x_enc, mask=torch.ones_like(input_mask))
        n_patches = enc_in.shape[2]
        enc_in = enc_in.reshape((batch_size * n_channels, n_patches, self.d_model))
        patch_view_mask = Masking.convert_seq_to_patch_view(input_mask, self.patch_len)
        attention_mask = patch_view_mask.repeat_interleave(n_channels, dim=0)
        outputs = self.encoder(inputs_embeds=enc_in, attention_mask=attention_mask)
        enc_out = outputs.last_hidden_state
        self.last_enc_out = enc_out
        enc_out = enc_out.reshape((-1, n_channels, n_patches, self.d_model))
        dec_out = self.head(enc_out)
        dec_out = self.normalizer(x=dec_out, mode="denorm")
        return dec_out

    def forward(self, x_enc, mask=None, input_mask=None):
        if input_mask is None:
            input_mask = torch.ones_like(x_enc[:, 0, :])
        return self.forecast(x_enc=x_enc, input_mask=input_mask)


class MOMENT(nn.Module):  # neuralforecast BaseWindows model, forward only
    def __init__(self):
        super().__init__()
        self.moment = MOMENT_module()

    def forward(self, windows_batch):
        if FIXED:
            x_enc = windows_batch["insample_y"].unsqueeze(-2)      # [B, L] -> [B, 1, L]
            input_mask = windows_batch["insample_mask"]            # [B, L]
            output = self.moment(x_enc=x_enc, input_mask=input_mask)
        else:
            x = windows_batch["insample_y"].unsqueeze(-1)          # [B, L, 1]
            x_enc = x.permute(0, 2, 1)                             # [B, 1, L]
            output = self.moment(x_enc)
        return output


model = MOMENT().eval()
L, pad = 32, 8
y = torch.randn(2, L).cumsum(-1) + 10.0
insample_mask = torch.ones(2, L)
insample_mask[1, :pad] = 0.0          # series 1 is short: neuralforecast left-pads its window
y[1, :pad] = 0.0                      # padded values are zeros

with torch.no_grad():
    model({"insample_y": y, "insample_mask": insample_mask})
    h_zero_pad = model.moment.last_enc_out.clone()
    y2 = y.clone()
    y2[1, :pad] = 3.0                 # same observed values, different padding content
    model({"insample_y": y2, "insample_mask": insample_mask})
    h_other_pad = model.moment.last_enc_out.clone()

n_pad_patches = pad // 8
diff = (h_zero_pad[1, n_pad_patches:] - h_other_pad[1, n_pad_patches:]).abs().max().item()
print(f"observed-patch encoder states change with padding content: max |diff| = {diff:.6f}")
