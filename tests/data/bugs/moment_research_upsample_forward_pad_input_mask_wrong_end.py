# MOMENT research code (moment-timeseries-foundation-model/moment-research#3, commit d86ec3f "fix: forward padding"):
# upsample_timeseries(direction="forward") right-pads the series but zeroes input_mask[:seq_len - len] (the start),
# so the T5 encoder's patch attention mask hides real patches and attends to the zero padding; fix zeroes input_mask[len:].
import sys

import numpy as np
import torch
from torch import nn
from transformers import T5Config, T5EncoderModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
np.random.seed(0)


# ---- moment/utils/data.py -------------------------------------------------------------------------------
def upsample_timeseries(timeseries, seq_len, sampling_type="pad", direction="backward", **kwargs):
    timeseries_len = len(timeseries)
    input_mask = np.ones(seq_len)
    if timeseries_len >= seq_len:
        return timeseries, input_mask
    if sampling_type == "pad" and direction == "forward":
        timeseries = np.pad(timeseries, (0, seq_len - timeseries_len), **kwargs)
        if FIXED:
            input_mask[timeseries_len:] = 0
        else:
            input_mask[: seq_len - timeseries_len] = 0
    elif sampling_type == "pad" and direction == "backward":
        timeseries = np.pad(timeseries, (seq_len - timeseries_len, 0), **kwargs)
        input_mask[: seq_len - timeseries_len] = 0
    else:
        raise ValueError("Direction must be one of 'forward' or 'backward'")
    assert len(timeseries) == seq_len, "Padding failed"
    return timeseries, input_mask


def nanvar(tensor, dim=None, keepdim=False):
    tensor_mean = tensor.nanmean(dim=dim, keepdim=True)
    return (tensor - tensor_mean).square().nanmean(dim=dim, keepdim=keepdim)


def nanstd(tensor, dim=None, keepdim=False):
    return nanvar(tensor, dim=dim, keepdim=keepdim).sqrt()


# ---- moment/utils/masking.py --------------------------------------------------------------------------
class Masking:
    @staticmethod
    def convert_seq_to_patch_view(mask, patch_len=8, stride=None):
        stride = patch_len if stride is None else stride
        mask = mask.unfold(dimension=-1, size=patch_len, step=stride)
        return (mask.sum(dim=-1) == patch_len).long()


# ---- moment/models/layers/revin.py -------------------------------------------------------------------------
class RevIN(nn.Module):
    def __init__(self, num_features, eps=1e-5, affine=False):
        super().__init__()
        self.num_features, self.eps, self.affine = num_features, eps, affine

    def forward(self, x, mode="norm", mask=None):
        if mode == "norm":
            self._get_statistics(x, mask=mask)
            return (x - self.mean) / self.stdev
        raise NotImplementedError

    def _get_statistics(self, x, mask=None):
        if mask is None:
            mask = torch.ones((x.shape[0], x.shape[-1]))
        n_channels = x.shape[1]
        mask = mask.unsqueeze(1).repeat(1, n_channels, 1).bool()
        masked_x = torch.where(mask, x, torch.nan)
        self.mean = torch.nanmean(masked_x, dim=-1, keepdim=True).detach()
        self.stdev = nanstd(masked_x, dim=-1, keepdim=True).detach() + self.eps


# ---- moment/models/layers/embed.py ---------------------------------------------------------------------
class PatchEmbedding(nn.Module):
    def __init__(self, d_model=768, seq_len=512, patch_len=8, stride=8, dropout=0.1, orth_gain=1.41):
        super().__init__()
        self.patch_len, self.seq_len, self.stride, self.d_model = patch_len, seq_len, stride, d_model
        self.value_embedding = nn.Linear(patch_len, d_model, bias=False)
        self.mask_embedding = nn.Parameter(torch.zeros(d_model))
        torch.nn.init.orthogonal_(self.value_embedding.weight, gain=orth_gain)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, mask=None):
        mask = Masking.convert_seq_to_patch_view(mask, patch_len=self.patch_len).unsqueeze(-1)
        n_channels = x.shape[1]
        mask = mask.repeat_interleave(self.d_model, dim=-1).unsqueeze(1).repeat(1, n_channels, 1, 1)
        x = mask * self.value_embedding(x) + (1 - mask) * self.mask_embedding
        return self.dropout(x)


class Patching(nn.Module):
    def __init__(self, patch_len, stride):
        super().__init__()
        self.patch_len, self.stride = patch_len, stride

    def forward(self, x):
        return x.unfold(dimension=-1, size=self.patch_len, step=self.stride)


# ---- moment/models/moment.py (embed path, T5 encoder backbone, randomly initialised) --------------------
class MOMENT(nn.Module):
    def __init__(self, seq_len=32, patch_len=4, d_model=32):
        super().__init__()
        self.seq_len, self.patch_len, self.d_model = seq_len, patch_len, d_model
        self.normalizer = RevIN(num_features=1, affine=False)
        self.tokenizer = Patching(patch_len=patch_len, stride=patch_len)
        self.patch_embedding = PatchEmbedding(d_model=d_model, seq_len=seq_len, patch_len=patch_len, stride=patch_len)
        cfg = T5Config(vocab_size=8, d_model=d_model, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                       relative_attention_num_buckets=8, dropout_rate=0.0)
        self.encoder = T5EncoderModel(cfg).get_encoder()

    def embed(self, x_enc, input_mask=None, reduction="mean"):
        batch_size, n_channels, seq_len = x_enc.shape
        if input_mask is None:
            input_mask = torch.ones((batch_size, seq_len)).to(x_enc.device)
        x_enc = self.normalizer(x=x_enc, mask=input_mask, mode="norm")
        x_enc = torch.nan_to_num(x_enc, nan=0, posinf=0, neginf=0)
        input_mask_patch_view = Masking.convert_seq_to_patch_view(input_mask, self.patch_len)
        x_enc = self.tokenizer(x=x_enc)
        enc_in = self.patch_embedding(x_enc, mask=input_mask)
        n_patches = enc_in.shape[2]
        enc_in = enc_in.reshape((batch_size * n_channels, n_patches, self.d_model))
        attention_mask = Masking.convert_seq_to_patch_view(input_mask, self.patch_len).repeat_interleave(
            n_channels, dim=0)
        outputs = self.encoder(inputs_embeds=enc_in, attention_mask=attention_mask)
        enc_out = outputs.last_hidden_state
        enc_out = enc_out.reshape((-1, n_channels, n_patches, self.d_model))
        enc_out = enc_out.mean(dim=1, keepdim=False)
        input_mask_patch_view = input_mask_patch_view.unsqueeze(-1).repeat(1, 1, self.d_model)
        enc_out = (input_mask_patch_view * enc_out).sum(dim=1) / input_mask_patch_view.sum(dim=1)
        return enc_out


# ---- ClassificationDataset.__getitem__ with upsampling_pad_direction="forward", then a batch ----------------
SEQ_LEN = 32
model = MOMENT(seq_len=SEQ_LEN).eval()
raw = [np.cumsum(np.random.randn(n)) + 5.0 for n in (20, 12, 28)]
items = [upsample_timeseries(ts, SEQ_LEN, direction="forward", sampling_type="pad", mode="constant") for ts in raw]
x = torch.tensor(np.stack([ts for ts, _ in items]), dtype=torch.float32).unsqueeze(1)  # [B, 1, seq_len]
input_mask = torch.tensor(np.stack([m for _, m in items]), dtype=torch.float32)

with torch.no_grad():
    batched = model.embed(x_enc=x, input_mask=input_mask)
    # reference: each series embedded alone, unpadded (T5 relative positions; observed patches start at 0 either way)
    ref = torch.cat([model.embed(x_enc=torch.tensor(ts, dtype=torch.float32)[None, None]) for ts in raw])

print("input_mask zeros at positions (series 0):", np.where(items[0][1] == 0)[0].tolist())
print(f"max |padded-batch embedding - unpadded single-series embedding|: {(batched - ref).abs().max().item():.6f}")
