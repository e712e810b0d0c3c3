# p-doom/jasmine commit 3ec820d ("minor bugfixes in the create_flash_atn function"): the cuDNN-padding attention_fn
# padded T/S up to a multiple of 4 but built its mask with .at[Q:, :] / .at[:, K:] (the padded lengths), which masks
# nothing, so spatial (non-causal) attention attended to the zero-padded keys; the fix masks from T: / S:.
import sys
import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


def _create_flash_attention_fn(use_flash_attention: bool, is_causal: bool):
    """Port of utils/nn.py::_create_flash_attention_fn (jax.nn.dot_product_attention -> SDPA)."""

    def attention_fn(query_BTHD, key_BSHD, value_BSHD, bias=None, mask_B111=None, **kwargs):
        def _merge_batch_dims(x):
            return x.reshape(-1, *x.shape[-3:])

        def _pad(x, pad_size):
            return F.pad(x, (0, 0, 0, 0, 0, pad_size))

        original_shape = query_BTHD.shape
        T = query_BTHD.shape[-3]
        S = key_BSHD.shape[-3]

        # Pad to nearest multiple of 4
        Q = ((T + 3) // 4) * 4
        pad_size_Q = Q - T
        K = ((S + 3) // 4) * 4
        pad_size_K = K - S

        query_BQHD = _pad(_merge_batch_dims(query_BTHD), pad_size_Q)
        key_BKHD = _pad(_merge_batch_dims(key_BSHD), pad_size_K)
        value_BKHD = _pad(_merge_batch_dims(value_BSHD), pad_size_K)
        B = query_BQHD.shape[0]

        attention_mask = torch.ones((Q, K), dtype=torch.bool)
        if FIXED:
            attention_mask[T:, :] = False
            attention_mask[:, S:] = False
        else:
            attention_mask[Q:, :] = False
            attention_mask[:, K:] = False

        mask_11TS = attention_mask[None, None, :, :]
        mask_B1TS = mask_11TS.expand(B, 1, Q, K)

        # jax.nn.dot_product_attention(mask=..., is_causal=...) ANDs both masks
        if is_causal:
            mask_B1TS = mask_B1TS & torch.ones(Q, K, dtype=torch.bool).tril()
        q, k, v = (t.transpose(1, 2) for t in (query_BQHD, key_BKHD, value_BKHD))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_B1TS)
        output_4d = out.transpose(1, 2)
        return output_4d[..., :T, :, :].reshape(original_shape)

    return attention_fn


class MultiHeadAttention(nn.Module):
    """flax.nnx.MultiHeadAttention, trimmed: projections + pluggable attention_fn."""

    def __init__(self, num_heads, in_features, attention_fn):
        super().__init__()
        self.h, self.d = num_heads, in_features // num_heads
        self.q, self.k, self.v = (nn.Linear(in_features, in_features) for _ in range(3))
        self.out = nn.Linear(in_features, in_features)
        self.attention_fn = attention_fn

    def forward(self, x):
        sh = x.shape[:-1] + (self.h, self.d)
        o = self.attention_fn(self.q(x).view(sh), self.k(x).view(sh), self.v(x).view(sh))
        return self.out(o.reshape(x.shape))


class TransformerBlock(nn.Module):
    def __init__(self, model_dim, num_heads, use_flash_attention):
        super().__init__()
        self.spatial_norm = nn.LayerNorm(model_dim)
        self.spatial_attention = MultiHeadAttention(
            num_heads, model_dim, _create_flash_attention_fn(use_flash_attention, is_causal=False))
        self.temporal_norm = nn.LayerNorm(model_dim)
        self.temporal_attention = MultiHeadAttention(
            num_heads, model_dim, _create_flash_attention_fn(use_flash_attention, is_causal=True))
        self.ffn_norm = nn.LayerNorm(model_dim)
        self.ffn = nn.Sequential(nn.Linear(model_dim, 2 * model_dim), nn.GELU(), nn.Linear(2 * model_dim, model_dim))

    def forward(self, x_BTNM):
        B, T, N, M = x_BTNM.shape
        # --- Spatial attention ---
        z_FNM = self.spatial_norm(x_BTNM.reshape(B * T, N, M))
        z_FNM = self.spatial_attention(z_FNM)
        x_BTNM = x_BTNM + z_FNM.reshape(B, T, N, M)
        # --- Temporal attention ---
        z_PTM = self.temporal_norm(x_BTNM.permute(0, 2, 1, 3).reshape(B * N, T, M))
        z_PTM = self.temporal_attention(z_PTM)
        x_BTNM = x_BTNM + z_PTM.reshape(B, N, T, M).permute(0, 2, 1, 3)
        return x_BTNM + self.ffn(self.ffn_norm(x_BTNM))


class STTransformer(nn.Module):
    def __init__(self, model_dim=32, num_heads=4, num_blocks=2, vocab=16, use_flash_attention=False):
        super().__init__()
        self.patch_embed = nn.Embedding(vocab, model_dim)
        self.blocks = nn.ModuleList(TransformerBlock(model_dim, num_heads, use_flash_attention)
                                    for _ in range(num_blocks))
        self.head = nn.Linear(model_dim, vocab)

    def forward(self, video_tokens_BTN):
        x = self.patch_embed(video_tokens_BTN)
        for blk in self.blocks:
            x = blk(x)
        return self.head(x)


# dynamics-model forward on a tokenised video: 5 frames x 6 patches (neither a multiple of 4)
model = STTransformer().eval()
video_tokens = torch.randint(0, 16, (2, 5, 6))
with torch.no_grad():
    logits = model(video_tokens)
    # reference: identical weights, attention without the cuDNN pad-to-4 path
    for blk in model.blocks:
        for attn, causal in ((blk.spatial_attention, False), (blk.temporal_attention, True)):
            attn.attention_fn = (lambda c: lambda q, k, v, **kw: F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=c).transpose(1, 2))(causal)
    ref = model(video_tokens)
print(f"max |logits(padded attention_fn) - logits(unpadded)|: {(logits - ref).abs().max().item():.6f}")
