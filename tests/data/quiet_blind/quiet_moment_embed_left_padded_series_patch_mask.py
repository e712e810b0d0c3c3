# Correct program (quiet batch quiet-r66a).
# Citation: moment-timeseries-foundation-model/moment @38f7310ad594100747ca2a8357e9c7ca7d323e0e
#   momentfm/models/moment.py (MOMENT.__init__, _get_transformer_backbone, embed with reduction="mean"),
#   momentfm/models/layers/embed.py (PatchEmbedding, Patching, PositionalEmbedding),
#   momentfm/models/layers/revin.py (RevIN with a mask, nanstd), momentfm/utils/masking.py
#   (Masking.convert_seq_to_patch_view), momentfm/data/classification_dataset.py (left zero padding to seq_len,
#   input_mask[: seq_len - len] = 0).
# Short multichannel series are left-padded with zeros to seq_len and input_mask marks the observed timesteps.
# RevIN takes its statistics over observed timesteps only; the series is cut into patches of 8; a patch counts as
# observed only if all 8 of its steps are; the patch mask (repeated over channels, batch-major) is the T5
# encoder's attention_mask; the embedding is the mean over channels, then the mean over observed patches only.
# The check: every series' embedding and its observed patches' outputs equal a reference that normalises with
# numpy over the observed values, embeds only the observed patches (at their own patch positions) and runs the T5
# encoder over them alone, with no attention mask.
import math
from argparse import Namespace

import numpy as np
import torch
from torch import nn
from transformers import T5Config, T5EncoderModel

torch.manual_seed(0)
np.random.seed(0)
torch.set_default_dtype(torch.float64)


class NamespaceWithDefaults(Namespace):
    def getattr(self, key, default=None):
        return getattr(self, key, default)


def nanvar(tensor, dim=None, keepdim=False):
    tensor_mean = tensor.nanmean(dim=dim, keepdim=True)
    output = (tensor - tensor_mean).square().nanmean(dim=dim, keepdim=keepdim)
    return output


def nanstd(tensor, dim=None, keepdim=False):
    output = nanvar(tensor, dim=dim, keepdim=keepdim)
    output = output.sqrt()
    return output


class RevIN(nn.Module):
    def __init__(self, num_features: int, eps: float = 1e-5, affine: bool = False):
        super().__init__()
        self.num_features = num_features
        self.eps = eps
        self.affine = affine

    def forward(self, x, mode="norm", mask=None):
        if mode == "norm":
            self._get_statistics(x, mask=mask)
            x = self._normalize(x)
        else:
            raise NotImplementedError
        return x

    def _get_statistics(self, x, mask=None):
        if mask is None:
            mask = torch.ones((x.shape[0], x.shape[-1]))
        n_channels = x.shape[1]
        mask = mask.unsqueeze(1).repeat(1, n_channels, 1).bool()
        masked_x = torch.where(mask, x, torch.nan)
        self.mean = torch.nanmean(masked_x, dim=-1, keepdim=True).detach()
        self.stdev = nanstd(masked_x, dim=-1, keepdim=True).detach() + self.eps

    def _normalize(self, x):
        x = x - self.mean
        x = x / self.stdev
        return x


class Masking:
    @staticmethod
    def convert_seq_to_patch_view(mask, patch_len=8, stride=None):
        stride = patch_len if stride is None else stride
        mask = mask.unfold(dimension=-1, size=patch_len, step=stride)
        return (mask.sum(dim=-1) == patch_len).long()


class PositionalEmbedding(nn.Module):
    def __init__(self, d_model, max_len=5000, model_name="MOMENT"):
        super().__init__()
        self.model_name = model_name
        pe = torch.zeros(max_len, d_model).float()
        position = torch.arange(0, max_len).float().unsqueeze(1)
        div_term = (torch.arange(0, d_model, 2).float() * -(math.log(10000.0) / d_model)).exp()
        pe[:, 0::2] = torch.sin(position * div_term)
        pe[:, 1::2] = torch.cos(position * div_term)
        pe = pe.unsqueeze(0)
        self.register_buffer("pe", pe)

    def forward(self, x):
        return self.pe[:, : x.size(2)]


class PatchEmbedding(nn.Module):
    def __init__(self, d_model=768, seq_len=512, patch_len=8, stride=8, patch_dropout=0.1,
                 add_positional_embedding=False, value_embedding_bias=False, orth_gain=1.41):
        super().__init__()
        self.patch_len = patch_len
        self.seq_len = seq_len
        self.stride = stride
        self.d_model = d_model
        self.add_positional_embedding = add_positional_embedding
        self.value_embedding = nn.Linear(patch_len, d_model, bias=value_embedding_bias)
        self.mask_embedding = nn.Parameter(torch.zeros(d_model))
        if orth_gain is not None:
            torch.nn.init.orthogonal_(self.value_embedding.weight, gain=orth_gain)
        if self.add_positional_embedding:
            self.position_embedding = PositionalEmbedding(d_model)
        self.dropout = nn.Dropout(patch_dropout)

    def forward(self, x, mask=None):
        mask = Masking.convert_seq_to_patch_view(mask, patch_len=self.patch_len).unsqueeze(-1)
        n_channels = x.shape[1]
        mask = mask.repeat_interleave(self.d_model, dim=-1).unsqueeze(1).repeat(1, n_channels, 1, 1)
        x = mask * self.value_embedding(x) + (1 - mask) * self.mask_embedding
        if self.add_positional_embedding:
            x = x + self.position_embedding(x)
        return self.dropout(x)


class Patching(nn.Module):
    def __init__(self, patch_len, stride):
        super().__init__()
        self.patch_len = patch_len
        self.stride = stride

    def forward(self, x):
        return x.unfold(dimension=-1, size=self.patch_len, step=self.stride)


class MOMENT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.task_name = config.task_name
        self.seq_len = config.seq_len
        self.patch_len = config.patch_len
        self.normalizer = RevIN(num_features=1, affine=config.getattr("revin_affine", False))
        self.tokenizer = Patching(patch_len=config.patch_len, stride=config.patch_stride_len)
        self.patch_embedding = PatchEmbedding(
            d_model=config.d_model, seq_len=config.seq_len, patch_len=config.patch_len,
            stride=config.patch_stride_len, patch_dropout=config.getattr("patch_dropout", 0.1),
            add_positional_embedding=config.getattr("add_positional_embedding", True),
            value_embedding_bias=config.getattr("value_embedding_bias", False),
            orth_gain=config.getattr("orth_gain", 1.41))
        self.encoder = self._get_transformer_backbone(config)
        self.head = nn.Identity()

    def _get_transformer_backbone(self, config):
        model_config = T5Config.from_dict(config.t5_config)
        transformer_backbone = T5EncoderModel(model_config)
        transformer_backbone = transformer_backbone.get_encoder()
        if config.getattr("enable_gradient_checkpointing", True):
            transformer_backbone.gradient_checkpointing_enable()
        return transformer_backbone

    def embed(self, *, x_enc, input_mask=None, reduction="mean", **kwargs):
        batch_size, n_channels, seq_len = x_enc.shape
        if input_mask is None:
            input_mask = torch.ones((batch_size, seq_len)).to(x_enc.device)

        x_enc = self.normalizer(x=x_enc, mask=input_mask, mode="norm")
        x_enc = torch.nan_to_num(x_enc, nan=0, posinf=0, neginf=0)

        input_mask_patch_view = Masking.convert_seq_to_patch_view(input_mask, self.patch_len)

        x_enc = self.tokenizer(x=x_enc)
        enc_in = self.patch_embedding(x_enc, mask=input_mask)

        n_patches = enc_in.shape[2]
        enc_in = enc_in.reshape((batch_size * n_channels, n_patches, self.config.d_model))

        patch_view_mask = Masking.convert_seq_to_patch_view(input_mask, self.patch_len)
        attention_mask = patch_view_mask.repeat_interleave(n_channels, dim=0)
        outputs = self.encoder(inputs_embeds=enc_in, attention_mask=attention_mask)
        enc_out = outputs.last_hidden_state

        enc_out = enc_out.reshape((-1, n_channels, n_patches, self.config.d_model))

        if reduction == "mean":
            enc_out = enc_out.mean(dim=1, keepdim=False)
            input_mask_patch_view = input_mask_patch_view.unsqueeze(-1).repeat(1, 1, self.config.d_model)
            enc_out = (input_mask_patch_view * enc_out).sum(dim=1) / input_mask_patch_view.sum(dim=1)
        elif reduction == "none":
            pass
        return enc_out


config = NamespaceWithDefaults(
    task_name="embedding", seq_len=64, patch_len=8, patch_stride_len=8, d_model=32, transformer_type="encoder_only",
    transformer_backbone="google/flan-t5-small", randomly_initialize_backbone=False,
    enable_gradient_checkpointing=False, add_positional_embedding=True,
    t5_config=dict(d_model=32, d_kv=8, num_heads=4, d_ff=64, num_layers=2, relative_attention_num_buckets=8,
                   relative_attention_max_distance=16, dropout_rate=0.0, feed_forward_proj="gated-gelu",
                   is_encoder_decoder=False, use_cache=False))
model = MOMENT(config).eval()

# ClassificationDataset.__getitem__: each series left-padded with zeros to seq_len.
n_channels, lengths = 3, [64, 40, 27, 51]
series = [np.random.randn(n_channels, n) * (1 + i) + 3 * i for i, n in enumerate(lengths)]
x_enc, input_mask = [], []
for ts in series:
    timeseries_len = ts.shape[-1]
    m = np.ones(config.seq_len)
    m[: config.seq_len - timeseries_len] = 0
    x_enc.append(np.pad(ts, ((0, 0), (config.seq_len - timeseries_len, 0))))
    input_mask.append(m)
x_enc = torch.from_numpy(np.stack(x_enc))
input_mask = torch.from_numpy(np.stack(input_mask)).long()

with torch.no_grad():
    emb = model.embed(x_enc=x_enc, input_mask=input_mask, reduction="mean")
    per_patch = model.embed(x_enc=x_enc, input_mask=input_mask, reduction="none")

# Reference: observed patches only, each series alone, no attention mask.
n_patches = config.seq_len // config.patch_len
worst = 0.0
with torch.no_grad():
    for b, ts in enumerate(series):
        n = ts.shape[-1]
        mean = ts.mean(-1, keepdims=True)
        std = ts.std(-1, keepdims=True) + 1e-5                      # RevIN: population std over observed steps
        first = n_patches - n // config.patch_len                   # first patch whose 8 steps are all observed
        obs = torch.from_numpy((ts - mean) / std)[:, n - (n_patches - first) * config.patch_len:]
        patches = obs.reshape(n_channels, n_patches - first, config.patch_len)
        pe = model.patch_embedding.position_embedding.pe[0, first:n_patches]
        enc_in = model.patch_embedding.value_embedding(patches) + pe   # (C, P_obs, d)
        out = model.encoder(inputs_embeds=enc_in).last_hidden_state    # no attention_mask
        worst = max(worst, (per_patch[b, :, first:] - out).abs().max().item())
        worst = max(worst, (emb[b] - out.mean(0).mean(0)).abs().max().item())

print("observed patches", Masking.convert_seq_to_patch_view(input_mask, 8).sum(-1).tolist(),
      "embeddings", tuple(emb.shape), "max diff %.2e" % worst)
assert worst < 1e-10, worst
