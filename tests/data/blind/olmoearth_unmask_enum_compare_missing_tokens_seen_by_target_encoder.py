# Citation: allenai/olmoearth_pretrain PR #457 ("Fix unmask bug, add tests to check it"),
#   merge commit cf471021, fix in the branch commit efaaea31 (parent code read at cf471021^1).
# Upstream: olmoearth_pretrain/datatypes.py MaskedOlmoEarthSample.unmask(), used by
#   train/train_module/latent_mim.py LatentMIMTrainModule.model_forward to build the
#   target encoder's input; the token mask then decides which tokens the encoder keeps
#   (nn/flexi_vit.py Encoder.apply_attn -> remove_masked_tokens / _maybe_get_attn_mask
#   -> nn/attention.py Attention.sdpa, attn_mask[:, None, None].repeat(...)).
# Bug: unmask() compares the mask tensor with the Enum member `MaskValue.MISSING`
#   (a plain Enum, not an int), which is the Python bool False, so `val * False`
#   sets every mask entry to ONLINE_ENCODER (0): MISSING tokens (absent modality,
#   absent time steps, filled with MISSING_VALUE) are kept and attended by the
#   target encoder, and the latent-MIM targets change.
# Fix: compare with `MaskValue.MISSING.value`, so MISSING entries stay MISSING.
#
# Shrunk port: two spatial time-series modalities at patch size 1, a tiny encoder
# (patch embedding and composite encodings replaced by per-bandset Linear layers and
# learned (modality, time) embeddings), a one-block cross-attention predictor as in
# Predictor.apply_attn, and PatchDiscriminationLossNew.
import copy
import sys
from enum import Enum
from typing import Any, NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

MISSING_VALUE = -99999


class MaskValue(Enum):
    """Masks can take 4 possible values."""

    ONLINE_ENCODER = 0
    TARGET_ENCODER_ONLY = 1
    DECODER = 2
    MISSING = 3


# modality -> number of bands, band sets (as band indices)
MODALITIES = {
    "sentinel2_l2a": [[0, 1, 2], [3, 4, 5]],
    "sentinel1": [[0, 1]],
}


class MaskedOlmoEarthSample(NamedTuple):
    timestamps: torch.Tensor  # [B, T, 3]
    sentinel2_l2a: torch.Tensor | None = None  # [B, H, W, T, C]
    sentinel2_l2a_mask: torch.Tensor | None = None  # [B, H, W, T, num_bandsets]
    sentinel1: torch.Tensor | None = None
    sentinel1_mask: torch.Tensor | None = None

    def as_dict(self, return_none: bool = True) -> dict[str, Any]:
        return_dict = {}
        for field in self._fields:
            val = getattr(self, field)
            if return_none:
                return_dict[field] = val
            else:
                if val is not None:
                    return_dict[field] = val
        return return_dict

    def unmask(self) -> "MaskedOlmoEarthSample":
        """All mask values are ONLINE_ENCODER except for MISSING, which remain MISSING."""
        return_dict: dict[str, torch.Tensor] = {}
        for key, val in self.as_dict().items():
            if val is None:
                continue
            if key.endswith("mask"):
                # 1s where it is missing, 0 elsewhere
                if FIXED:
                    all_but_missing = val == MaskValue.MISSING.value
                else:
                    all_but_missing = val == MaskValue.MISSING
                return_dict[key] = val * all_but_missing
            else:
                return_dict[key] = val
        return MaskedOlmoEarthSample(**return_dict)

    @staticmethod
    def get_masked_modality_name(modality: str) -> str:
        return f"{modality}_mask"


class TokensAndMasks(NamedTuple):
    sentinel2_l2a: torch.Tensor | None = None
    sentinel2_l2a_mask: torch.Tensor | None = None
    sentinel1: torch.Tensor | None = None
    sentinel1_mask: torch.Tensor | None = None

    def flatten_tokens_and_masks(self):
        xs, ms = [], []
        for m in MODALITIES:
            xs.append(getattr(self, m).flatten(1, -2))
            ms.append(getattr(self, m + "_mask").flatten(1))
        return torch.cat(xs, dim=1), torch.cat(ms, dim=1)


def random_masking(sample: MaskedOlmoEarthSample, encode_ratio=0.5) -> MaskedOlmoEarthSample:
    """RandomMaskingStrategy-style: non-missing tokens become ONLINE_ENCODER or DECODER."""
    d = sample.as_dict()
    for m in MODALITIES:
        mask = d[m + "_mask"]
        flat = mask.flatten(1)
        new = flat.clone()
        for b in range(flat.shape[0]):
            present = (flat[b] != MaskValue.MISSING.value).nonzero().flatten()
            perm = present[torch.randperm(len(present))]
            n_enc = int(len(present) * encode_ratio)
            new[b, perm[:n_enc]] = MaskValue.ONLINE_ENCODER.value
            new[b, perm[n_enc:]] = MaskValue.DECODER.value
        d[m + "_mask"] = new.view_as(mask)
    return MaskedOlmoEarthSample(**d)


class Attention(nn.Module):
    def __init__(self, dim, num_heads=2, cross_attn=False):
        super().__init__()
        self.num_heads = num_heads
        self.cross_attn = cross_attn
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.proj = nn.Linear(dim, dim)

    def sdpa(self, q, k, v, n, attn_mask=None):
        if attn_mask is not None:
            attn_mask = attn_mask[:, None, None].repeat((1, self.num_heads, n, 1))
        return F.scaled_dot_product_attention(
            q, k, v,
            # a value of True indicates that the element should take part in attention
            attn_mask=attn_mask,
        )

    def forward(self, x, y=None, attn_mask=None):
        original_shape = x.shape
        q = self.q(x)
        if y is None:
            k, v = self.k(x), self.v(x)
        else:
            k, v = self.k(y), self.v(y)
        h = self.num_heads
        q, k, v = (t.unflatten(-1, (h, -1)).transpose(1, 2) for t in (q, k, v))
        x = self.sdpa(q, k, v, n=original_shape[-2], attn_mask=attn_mask)
        x = x.transpose(1, 2).reshape(original_shape)
        return self.proj(x)


class Block(nn.Module):
    def __init__(self, dim, num_heads=2, cross_attn=False):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = Attention(dim, num_heads, cross_attn)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, y=None, attn_mask=None):
        x = x + self.attn(self.norm1(x), y=y, attn_mask=attn_mask)
        return x + self.mlp(self.norm2(x))


class FlexiVitBase(nn.Module):
    def __init__(self, dim, depth, max_t, cross_attn=False):
        super().__init__()
        self.blocks = nn.ModuleList([Block(dim, 2, cross_attn) for _ in range(depth)])
        self.norm = nn.LayerNorm(dim)
        # stand-in for CompositeEncodings: learned (modality, bandset) and time embeddings
        self.channel_embed = nn.ParameterDict(
            {m: nn.Parameter(torch.randn(len(bs), dim) * 0.1) for m, bs in MODALITIES.items()}
        )
        self.time_embed = nn.Parameter(torch.randn(max_t, dim) * 0.1)

    def composite_encodings(self, tokens_only_dict):
        out = {}
        for m, t in tokens_only_dict.items():  # [B, H, W, T, S, D]
            T = t.shape[3]
            out[m] = t + self.channel_embed[m] + self.time_embed[:T, None, :]
        return out

    def split_tokens_masks_and_dims(self, x):
        tokens_only, masks, dims = {}, {}, {}
        for m in MODALITIES:
            tokens_only[m] = x[m]
            masks[m + "_mask"] = x[m + "_mask"]
            dims[m] = x[m].shape
        return tokens_only, masks, dims

    def collapse_and_combine_hwtc(self, x):
        tokens, masks = [], []
        for m in MODALITIES:
            tokens.append(x[m].flatten(1, -2))
            masks.append(x[m + "_mask"].flatten(1))
        return torch.cat(tokens, dim=1), torch.cat(masks, dim=1)

    def split_and_expand_per_modality(self, tokens, dims):
        out, start = {}, 0
        for m in MODALITIES:
            shape = dims[m]
            n = shape[1] * shape[2] * shape[3] * shape[4]
            out[m] = tokens[:, start:start + n].reshape(shape)
            start += n
        return out


class Encoder(FlexiVitBase):
    def __init__(self, dim=16, depth=2, max_t=3):
        super().__init__(dim, depth, max_t)
        # stand-in for MultiModalPatchEmbeddings at patch size 1: one Linear per band set
        self.per_modality_embeddings = nn.ModuleDict(
            {m: nn.ModuleList([nn.Linear(len(b), dim) for b in bs]) for m, bs in MODALITIES.items()}
        )

    def patch_embeddings(self, x: MaskedOlmoEarthSample):
        out = {}
        for m, bandsets in MODALITIES.items():
            data = getattr(x, m)
            mask = getattr(x, m + "_mask")
            toks = [emb(data[..., idx]) for emb, idx in zip(self.per_modality_embeddings[m], bandsets)]
            out[m] = torch.stack(toks, dim=-2)  # [B, H, W, T, S, D]
            out[m + "_mask"] = mask
        return out

    @staticmethod
    def remove_masked_tokens(x, mask):
        sorted_mask, indices = torch.sort(mask, dim=1, descending=True, stable=True)
        x = x.gather(1, indices[:, :, None].expand_as(x))
        x = x * sorted_mask.unsqueeze(-1)
        seq_lengths = sorted_mask.sum(-1)
        max_length = seq_lengths.max()
        x = x[:, :max_length]
        updated_mask = sorted_mask[:, :max_length]
        return x, indices, updated_mask, seq_lengths, max_length

    @staticmethod
    def add_removed_tokens(x, indices, mask):
        masked_tokens = torch.zeros_like(x[0, 0, :]).expand(x.shape[0], indices.shape[1], -1)
        full_mask = torch.cat(
            (mask, torch.zeros((x.shape[0], indices.shape[1] - x.shape[1]), dtype=mask.dtype)),
            dim=-1,
        )
        out = masked_tokens.clone()
        out[full_mask] = x[mask]
        out = out.scatter(1, indices[:, :, None].expand_as(out), out)
        full_mask = full_mask.scatter(1, indices.expand_as(full_mask), full_mask)
        return out, full_mask

    def _maybe_get_attn_mask(self, new_mask, fast_pass):
        if fast_pass or not self.training:
            return None
        return new_mask

    def apply_attn(self, x, fast_pass=False):
        tokens_only_dict, original_masks_dict, dims = self.split_tokens_masks_and_dims(x)
        tokens_dict = self.composite_encodings(tokens_only_dict)
        tokens_dict.update(original_masks_dict)
        tokens, mask = self.collapse_and_combine_hwtc(tokens_dict)

        bool_mask = mask == MaskValue.ONLINE_ENCODER.value
        tokens, indices, new_mask, seq_lengths, max_seqlen = self.remove_masked_tokens(tokens, bool_mask)
        attn_mask = self._maybe_get_attn_mask(new_mask, fast_pass=fast_pass)
        for blk in self.blocks:
            tokens = blk(x=tokens, attn_mask=attn_mask)
        tokens = self.norm(tokens)
        tokens, _ = self.add_removed_tokens(tokens, indices, new_mask)
        out = self.split_and_expand_per_modality(tokens, dims)
        out.update(original_masks_dict)
        return out

    def forward(self, x: MaskedOlmoEarthSample, patch_size: int = 1):
        patchified = self.patch_embeddings(x)
        out = self.apply_attn(patchified)
        return {"tokens_and_masks": TokensAndMasks(**out)}


class Predictor(FlexiVitBase):
    def __init__(self, dim=16, depth=1, max_t=3):
        super().__init__(dim, depth, max_t, cross_attn=True)
        self.mask_token = nn.Parameter(torch.randn(dim) * 0.1)

    def add_masks(self, x):
        out = {}
        for m in MODALITIES:
            t, mk = x[m], x[m + "_mask"]
            out[m] = torch.where((mk == MaskValue.DECODER.value).unsqueeze(-1), self.mask_token, t)
            out[m + "_mask"] = mk
        return out

    @staticmethod
    def split_x_y(tokens, mask):
        org_mask_dtype = mask.dtype
        mask = mask.clone()
        missing_mask = mask == MaskValue.MISSING.value
        mask[missing_mask] = MaskValue.TARGET_ENCODER_ONLY.value
        sorted_mask, indices = torch.sort(mask.int(), dim=1, descending=True, stable=True)
        tokens = tokens.gather(1, indices[:, :, None].expand_as(tokens))
        binarized_decoder_mask = sorted_mask == MaskValue.DECODER.value
        binarized_online_encoder_mask = sorted_mask == MaskValue.ONLINE_ENCODER.value
        max_dec = binarized_decoder_mask.sum(-1).max()
        max_enc = binarized_online_encoder_mask.sum(-1).max()
        tokens_to_decode = tokens[:, :max_dec]
        tokens_to_decode_mask = binarized_decoder_mask[:, :max_dec].to(org_mask_dtype)
        unmasked_tokens = tokens[:, -max_enc:]
        unmasked_tokens_mask = binarized_online_encoder_mask[:, -max_enc:].to(org_mask_dtype)
        return tokens_to_decode, unmasked_tokens, tokens_to_decode_mask, unmasked_tokens_mask, indices

    @staticmethod
    def combine_x_y(tokens_to_decode, unmasked_tokens, tokens_to_decode_mask, unmasked_tokens_mask, indices):
        B, T = indices.shape
        D = tokens_to_decode.shape[-1]
        tokens = torch.zeros((B, T, D), dtype=tokens_to_decode.dtype)
        tokens[:, -unmasked_tokens.shape[1]:] = unmasked_tokens * unmasked_tokens_mask.unsqueeze(-1)
        tokens[:, : tokens_to_decode.shape[1]] += tokens_to_decode * tokens_to_decode_mask.unsqueeze(-1)
        return tokens.scatter(1, indices[:, :, None].expand_as(tokens), tokens)

    def forward(self, latent: TokensAndMasks):
        x = self.add_masks(latent._asdict())
        tokens_only_dict, original_masks_dict, dims = self.split_tokens_masks_and_dims(x)
        tokens_dict = self.composite_encodings(tokens_only_dict)
        tokens_dict.update(original_masks_dict)
        all_tokens, mask = self.collapse_and_combine_hwtc(tokens_dict)
        x_, y_, x_mask, y_mask, indices = self.split_x_y(all_tokens, mask)
        for blk in self.blocks:
            x_ = blk(x=x_, y=y_, attn_mask=y_mask.bool())
        x_ = self.norm(x_)
        tokens = self.combine_x_y(x_, y_, x_mask, y_mask, indices)
        out = self.split_and_expand_per_modality(tokens, dims)
        out.update(original_masks_dict)
        return TokensAndMasks(**out)


class PatchDiscriminationLossNew:
    def __init__(self, tau=0.1, weight=1.0):
        self.tau = tau
        self.weight = weight

    def compute(self, predictions: TokensAndMasks, targets: TokensAndMasks):
        all_preds, all_masks = predictions.flatten_tokens_and_masks()
        all_targets = targets.flatten_tokens_and_masks()[0]
        pred = all_preds[all_masks == MaskValue.DECODER.value].unsqueeze(dim=0)
        target = all_targets[all_masks == MaskValue.DECODER.value].unsqueeze(dim=0)
        pred = F.normalize(pred, p=2, dim=-1)
        target = F.normalize(target, p=2, dim=-1)
        count = (all_masks == MaskValue.DECODER.value).sum(dim=-1)
        losses, start = [], 0
        for c in count:
            end = start + c
            if c == 0:
                continue
            score = torch.einsum("npd,nqd->npq", pred[:, start:end], target[:, start:end]) / self.tau
            labels = torch.arange(c)[None]
            loss = F.cross_entropy(score.flatten(0, 1), labels.flatten(0, 1), reduction="none") * (self.tau * 2)
            losses.append(loss.mean())
            start = end
        return self.weight * torch.stack(losses).mean()


class LatentMIM(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Encoder()
        self.decoder = Predictor()
        self.target_encoder = copy.deepcopy(self.encoder)
        for p in self.target_encoder.parameters():
            p.requires_grad = False

    def forward(self, x: MaskedOlmoEarthSample, patch_size: int):
        latent = self.encoder(x, patch_size)["tokens_and_masks"]
        decoded = self.decoder(latent)
        return latent, decoded


def make_batch(B=2, H=2, W=2, T=3):
    s2 = torch.randn(B, H, W, T, 6)
    s1 = torch.randn(B, H, W, T, 2)
    s2_mask = torch.full((B, H, W, T, 2), MaskValue.ONLINE_ENCODER.value, dtype=torch.long)
    s1_mask = torch.full((B, H, W, T, 1), MaskValue.ONLINE_ENCODER.value, dtype=torch.long)
    # sample 1: no Sentinel-1 at all, and its last Sentinel-2 time step is missing
    s1[1] = MISSING_VALUE
    s1_mask[1] = MaskValue.MISSING.value
    s2[1, :, :, 2] = MISSING_VALUE
    s2_mask[1, :, :, 2] = MaskValue.MISSING.value
    # sample 0: its first Sentinel-1 time step is missing
    s1[0, :, :, 0] = MISSING_VALUE
    s1_mask[0, :, :, 0] = MaskValue.MISSING.value
    timestamps = torch.tensor([[[1, m, 2023] for m in range(T)]] * B)
    return MaskedOlmoEarthSample(timestamps, s2, s2_mask, s1, s1_mask)


model = LatentMIM()
model.train()
loss_fn = PatchDiscriminationLossNew(tau=0.1)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)

batch = make_batch()
for step in range(3):
    masked_batch = random_masking(batch)
    latent, decoded = model(masked_batch, patch_size=1)
    with torch.no_grad():
        output_dict = model.target_encoder.forward(masked_batch.unmask(), patch_size=1)
        target_output = output_dict["tokens_and_masks"]
    loss = loss_fn.compute(decoded, target_output)
    opt.zero_grad()
    loss.backward()
    opt.step()
    t_flat, t_mask = target_output.flatten_tokens_and_masks()
    print(f"step {step}: loss {loss.item():.6f}  "
          f"target-token mean norm {t_flat.norm(dim=-1).mean().item():.6f}")

unm = masked_batch.unmask()
print("unmasked sentinel1 mask values (sample 1):", unm.sentinel1_mask[1].unique().tolist())
