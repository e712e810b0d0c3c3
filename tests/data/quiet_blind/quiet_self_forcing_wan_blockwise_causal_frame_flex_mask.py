# Citation: guandeh17/Self-Forcing wan/modules/causal_model.py (CausalWanModel._prepare_blockwise_causal_attn_mask,
#   CausalWanSelfAttention.forward training path with kv_cache=None: pad q/k/v to a multiple of 128, flex_attention
#   with the block mask, slice the padding off).
# Masking: latent video tokens are grouped into chunks of num_frame_per_block frames; ends[q] is the end of q's
#   chunk, so every token sees all frames up to the end of its own chunk (bidirectional inside the chunk, causal
#   across chunks). Right-padding rows beyond total_length only see themselves (q_idx == kv_idx) and are sliced off;
#   real queries never reach padding because ends[q] <= total_length. Text cross-attention is unmasked.
import math
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention, create_block_mask, BlockMask

torch.manual_seed(0)


def _prepare_blockwise_causal_attn_mask(device, num_frames=21, frame_seqlen=1560, num_frame_per_block=1,
                                        local_attn_size=-1) -> BlockMask:
    total_length = num_frames * frame_seqlen

    # we do right padding to get to a multiple of 128
    padded_length = math.ceil(total_length / 128) * 128 - total_length

    ends = torch.zeros(total_length + padded_length, device=device, dtype=torch.long)

    # Block-wise causal mask will attend to all elements that are before the end of the current chunk
    frame_indices = torch.arange(start=0, end=total_length, step=frame_seqlen * num_frame_per_block, device=device)

    for tmp in frame_indices:
        ends[tmp:tmp + frame_seqlen * num_frame_per_block] = tmp + frame_seqlen * num_frame_per_block

    def attention_mask(b, h, q_idx, kv_idx):
        if local_attn_size == -1:
            return (kv_idx < ends[q_idx]) | (q_idx == kv_idx)
        else:
            return ((kv_idx < ends[q_idx]) & (kv_idx >= (ends[q_idx] - local_attn_size * frame_seqlen))) | (q_idx == kv_idx)

    block_mask = create_block_mask(attention_mask, B=None, H=None, Q_LEN=total_length + padded_length,
                                   KV_LEN=total_length + padded_length, _compile=False, device=device)
    return block_mask


class CausalWanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)

    def forward(self, x, block_mask):
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, s, n, d)
        k = self.norm_k(self.k(x)).view(b, s, n, d)
        v = self.v(x).view(b, s, n, d)
        padded_length = math.ceil(q.shape[1] / 128) * 128 - q.shape[1]
        padded_roped_query = torch.cat([q, torch.zeros([q.shape[0], padded_length, q.shape[2], q.shape[3]], dtype=v.dtype)], dim=1)
        padded_roped_key = torch.cat([k, torch.zeros([k.shape[0], padded_length, k.shape[2], k.shape[3]], dtype=v.dtype)], dim=1)
        padded_v = torch.cat([v, torch.zeros([v.shape[0], padded_length, v.shape[2], v.shape[3]], dtype=v.dtype)], dim=1)
        x = flex_attention(query=padded_roped_query.transpose(2, 1), key=padded_roped_key.transpose(2, 1),
                           value=padded_v.transpose(2, 1), block_mask=block_mask)[:, :, :-padded_length].transpose(2, 1)
        return self.o(x.flatten(2))


class CausalWanAttentionBlock(nn.Module):
    def __init__(self, dim, num_heads):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, elementwise_affine=False)
        self.self_attn = CausalWanSelfAttention(dim, num_heads)
        self.norm3 = nn.LayerNorm(dim)
        self.cross_attn = nn.MultiheadAttention(dim, num_heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(approximate='tanh'), nn.Linear(2 * dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)

    def forward(self, x, e, context, block_mask):
        e = (self.modulation + e).chunk(6, dim=1)
        y = self.self_attn(self.norm1(x) * (1 + e[1]) + e[0], block_mask)
        x = x + y * e[2]
        h = self.norm3(x)
        x = x + self.cross_attn(h, context, context, need_weights=False)[0]
        y = self.ffn(self.norm2(x) * (1 + e[4]) + e[3])
        return x + y * e[5]


class CausalWanModel(nn.Module):
    def __init__(self, in_dim=4, dim=32, num_heads=4, num_layers=2, text_dim=16, max_tokens=256):
        super().__init__()
        self.patch_embedding = nn.Linear(in_dim, dim)
        self.pos = nn.Parameter(torch.randn(1, max_tokens, dim) * 0.02)
        self.text_embedding = nn.Linear(text_dim, dim)
        self.time_embedding = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, 6 * dim))
        self.blocks = nn.ModuleList([CausalWanAttentionBlock(dim, num_heads) for _ in range(num_layers)])
        self.head = nn.Linear(dim, in_dim)
        self.block_mask = None
        self.num_frame_per_block = 2

    def forward(self, x, t, context):
        # x: [B, F, H*W, C] latent frames flattened per frame
        B, F_, S, C = x.shape
        if self.block_mask is None:
            self.block_mask = _prepare_blockwise_causal_attn_mask(device=x.device, num_frames=F_, frame_seqlen=S,
                                                                  num_frame_per_block=self.num_frame_per_block)
        h = self.patch_embedding(x.reshape(B, F_ * S, C)) + self.pos[:, :F_ * S]
        e = self.time_embedding(t[:, None]).view(B, 6, -1)
        ctx = self.text_embedding(context)
        for blk in self.blocks:
            h = blk(h, e, ctx, self.block_mask)
        return self.head(h).reshape(B, F_, S, C)


model = CausalWanModel().eval()
latents = torch.randn(2, 6, 15, 4)          # 6 latent frames x (3x5) patches = 90 tokens -> padded to 128
context = torch.randn(2, 7, 16)
t = torch.rand(2)
noise = torch.randn_like(latents)
noisy = (1 - t[:, None, None, None]) * latents + t[:, None, None, None] * noise
with torch.no_grad():  # FlexAttention has no CPU backward: evaluate the flow-matching loss only
    pred = model(noisy, t, context)
    loss = F.mse_loss(pred, noise - latents)
print(f"loss {loss.item():.4f}")
