# Citation: lucidrains/transfusion-pytorch transfusion_pytorch/transfusion.py (causal, modality, transfusion_attn_mask
#   flex-attention mask_mod; Attention.forward with flex_attention(q, k, v, block_mask=...)).
# Masking: a mixed text/image sequence; mask_mod = causal OR (q_idx >= offset & kv_idx < offset + length) for each image
#   span [type, offset, length] of the sample, so image patches attend bidirectionally within their span and later text
#   sees the whole image, while text stays causal. Zero-padded modality slots (length 0) add nothing; trailing text
#   padding only follows real tokens, so causality already hides it (loss ignores it).
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention, create_block_mask

torch.manual_seed(0)


def causal(b, h, q_idx, kv_idx):
    return q_idx >= kv_idx


def modality(offset, length):
    def mask_fn(b, h, q_idx, kv_idx):
        return (q_idx >= offset) & (kv_idx < (offset + length))
    return mask_fn


def transfusion_attn_mask(modalities):
    modalities = modalities.long()

    def mask_mod(b, h, q_idx, kv_idx):
        mask = causal(b, h, q_idx, kv_idx)
        modality_batch = modalities[b]
        for _, offset, length in modality_batch:
            mask = mask | modality(offset, length)(b, h, q_idx, kv_idx)
        return mask
    return mask_mod


class Attention(nn.Module):
    def __init__(self, dim, heads=4, dim_head=16):
        super().__init__()
        self.heads = heads
        self.to_qkv = nn.Linear(dim, 3 * heads * dim_head, bias=False)
        self.to_out = nn.Linear(heads * dim_head, dim, bias=False)

    def forward(self, x, block_mask):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = flex_attention(q, k, v, block_mask=block_mask)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))


class Transfusion(nn.Module):
    def __init__(self, num_text_tokens=64, dim=64, dim_latent=8, depth=2):
        super().__init__()
        self.text_embed = nn.Embedding(num_text_tokens, dim)
        self.latent_to_model = nn.Linear(dim_latent, dim)
        self.layers = nn.ModuleList([nn.ModuleList([nn.LayerNorm(dim), Attention(dim), nn.LayerNorm(dim),
                                                    nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(),
                                                                  nn.Linear(2 * dim, dim))]) for _ in range(depth)])
        self.to_text_logits = nn.Linear(dim, num_text_tokens)
        self.model_to_latent = nn.Linear(dim, dim_latent)

    def forward(self, text, latents, modality_positions):
        x = self.text_embed(text.clamp(min=0))
        is_modality = torch.zeros(text.shape, dtype=torch.bool)
        for b, mods in enumerate(modality_positions):
            for (_, offset, length), lat in zip(mods.tolist(), latents[b]):
                if length == 0:
                    continue
                x[b, offset:offset + length] = self.latent_to_model(lat[:length])
                is_modality[b, offset:offset + length] = True
        seq_len = text.shape[1]
        block_mask = create_block_mask(transfusion_attn_mask(modality_positions), B=text.shape[0], H=None,
                                       Q_LEN=seq_len, KV_LEN=seq_len, device="cpu")
        for norm1, attn, norm2, ff in self.layers:
            x = x + attn(norm1(x), block_mask)
            x = x + ff(norm2(x))
        return self.to_text_logits(x), self.model_to_latent(x), is_modality


model = Transfusion()
B, N = 2, 24
text = torch.randint(0, 64, (B, N))
text[1, 20:] = -1  # trailing padding of the shorter sample
# [type, offset, length]; second row of sample 1 is zero padding
modality_positions = torch.tensor([[[0, 3, 6], [0, 13, 5]], [[0, 5, 8], [0, 0, 0]]])
latents = [[torch.randn(6, 8), torch.randn(5, 8)], [torch.randn(8, 8), torch.randn(1, 8)]]
with torch.no_grad():  # FlexAttention has no CPU backward: evaluate the training loss only
    text_logits, pred_latents, is_modality = model(text, latents, modality_positions)
labels = text[:, 1:].masked_fill(is_modality[:, 1:], -1)
text_loss = F.cross_entropy(text_logits[:, :-1].transpose(1, 2), labels, ignore_index=-1)
target = torch.zeros_like(pred_latents)
for b, mods in enumerate(modality_positions):
    for (_, offset, length), lat in zip(mods.tolist(), latents[b]):
        if length:
            target[b, offset:offset + length] = lat[:length]
flow_loss = F.mse_loss(pred_latents[is_modality], target[is_modality])
loss = text_loss + flow_loss
print(f"text {text_loss.item():.4f} flow {flow_loss.item():.4f}")
