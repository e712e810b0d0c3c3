# FunAudioLLM/CosyVoice#628, fixed in commit 3e38100: ConditionalDecoder built attn_mask as the float
# product mask^T @ mask (1.0 keep / 0.0 pad) and the diffusers SDPA processor added it to the scores.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def mask_to_bias(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    assert mask.dtype == torch.bool
    mask = mask.to(dtype)
    return (1.0 - mask) * torch.finfo(dtype).min


class SinusoidalPosEmb(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim

    def forward(self, x, scale=1000):
        half = self.dim // 2
        emb = torch.exp(torch.arange(half).float() * -(math.log(10000) / (half - 1)))
        emb = scale * x.unsqueeze(1) * emb.unsqueeze(0)
        return torch.cat((emb.sin(), emb.cos()), dim=-1)


class ChannelNorm(nn.LayerNorm):
    # per-frame norm over channels (matcha uses GroupNorm over channels x time; kept per frame here so
    # that padded frames cannot move the statistics of real ones)
    def forward(self, x):
        return super().forward(x.transpose(1, 2)).transpose(1, 2)


class Block1D(nn.Module):
    def __init__(self, dim, dim_out):
        super().__init__()
        self.block = nn.Sequential(nn.Conv1d(dim, dim_out, 3, padding=1), ChannelNorm(dim_out), nn.Mish())

    def forward(self, x, mask):
        return self.block(x * mask) * mask


class ResnetBlock1D(nn.Module):
    def __init__(self, dim, dim_out, time_emb_dim):
        super().__init__()
        self.mlp = nn.Sequential(nn.Mish(), nn.Linear(time_emb_dim, dim_out))
        self.block1 = Block1D(dim, dim_out)
        self.block2 = Block1D(dim_out, dim_out)
        self.res_conv = nn.Conv1d(dim, dim_out, 1)

    def forward(self, x, mask, time_emb):
        h = self.block1(x, mask) + self.mlp(time_emb).unsqueeze(-1)
        h = self.block2(h, mask)
        return h + self.res_conv(x * mask)


class Attention(nn.Module):
    """diffusers Attention with AttnProcessor2_0 (the processor used by matcha's BasicTransformerBlock)."""

    def __init__(self, query_dim, heads, dim_head):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.to_q = nn.Linear(query_dim, inner, bias=False)
        self.to_k = nn.Linear(query_dim, inner, bias=False)
        self.to_v = nn.Linear(query_dim, inner, bias=False)
        self.to_out = nn.Linear(inner, query_dim)

    def prepare_attention_mask(self, attention_mask, target_length, batch_size):
        if attention_mask.shape[0] < batch_size * self.heads:
            attention_mask = attention_mask.repeat_interleave(self.heads, dim=0)
        return attention_mask

    def forward(self, hidden_states, attention_mask=None):
        batch_size, sequence_length, _ = hidden_states.shape
        if attention_mask is not None:
            attention_mask = self.prepare_attention_mask(attention_mask, sequence_length, batch_size)
            attention_mask = attention_mask.view(batch_size, self.heads, -1, attention_mask.shape[-1])
        q, k, v = self.to_q(hidden_states), self.to_k(hidden_states), self.to_v(hidden_states)
        head_dim = q.shape[-1] // self.heads
        q, k, v = (t.view(batch_size, -1, self.heads, head_dim).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attention_mask, dropout_p=0.0, is_causal=False)
        out = out.transpose(1, 2).reshape(batch_size, -1, self.heads * head_dim)
        return self.to_out(out)


class BasicTransformerBlock(nn.Module):
    def __init__(self, dim, num_attention_heads, attention_head_dim):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn1 = Attention(dim, num_attention_heads, attention_head_dim)
        self.norm3 = nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, hidden_states, attention_mask=None, timestep=None):
        hidden_states = self.attn1(self.norm1(hidden_states), attention_mask=attention_mask) + hidden_states
        return self.ff(self.norm3(hidden_states)) + hidden_states


class ConditionalDecoder(nn.Module):
    def __init__(self, in_channels, out_channels, channels=32, attention_head_dim=8, num_heads=4):
        super().__init__()
        self.time_embeddings = SinusoidalPosEmb(in_channels)
        time_embed_dim = channels * 4
        self.time_mlp = nn.Sequential(nn.Linear(in_channels, time_embed_dim), nn.SiLU(),
                                      nn.Linear(time_embed_dim, time_embed_dim))
        block = lambda: nn.ModuleList([BasicTransformerBlock(channels, num_heads, attention_head_dim)])
        self.down_blocks = nn.ModuleList([nn.ModuleList([ResnetBlock1D(in_channels, channels, time_embed_dim),
                                                         block(), nn.Conv1d(channels, channels, 3, padding=1)])])
        self.mid_blocks = nn.ModuleList([nn.ModuleList([ResnetBlock1D(channels, channels, time_embed_dim), block()])])
        self.up_blocks = nn.ModuleList([nn.ModuleList([ResnetBlock1D(2 * channels, channels, time_embed_dim),
                                                       block(), nn.Conv1d(channels, channels, 3, padding=1)])])
        self.final_block = Block1D(channels, channels)
        self.final_proj = nn.Conv1d(channels, out_channels, 1)

    def _attn_mask(self, m, x):
        if FIXED:
            # add_optional_chunk_mask(x, m.bool(), False, False, 0, static_chunk_size=0, -1) is m itself
            return mask_to_bias(m.bool() == 1, x.dtype)
        return torch.matmul(m.transpose(1, 2).contiguous(), m)

    def _run(self, blocks, x, m, t):
        x = x.transpose(1, 2).contiguous()
        attn_mask = self._attn_mask(m, x)
        for transformer_block in blocks:
            x = transformer_block(hidden_states=x, attention_mask=attn_mask, timestep=t)
        return x.transpose(1, 2).contiguous()

    def forward(self, x, mask, mu, t, spks=None, cond=None):
        t = self.time_mlp(self.time_embeddings(t).to(t.dtype))
        x = torch.cat([x, mu], dim=1)
        hiddens, masks = [], [mask]
        for resnet, transformer_blocks, downsample in self.down_blocks:
            mask_down = masks[-1]
            x = self._run(transformer_blocks, resnet(x, mask_down, t), mask_down, t)
            hiddens.append(x)
            x = downsample(x * mask_down)
            masks.append(mask_down[:, :, ::2])
        masks = masks[:-1]
        mask_mid = masks[-1]
        for resnet, transformer_blocks in self.mid_blocks:
            x = self._run(transformer_blocks, resnet(x, mask_mid, t), mask_mid, t)
        for resnet, transformer_blocks, upsample in self.up_blocks:
            mask_up = masks.pop()
            skip = hiddens.pop()
            x = torch.cat([x[:, :, :skip.shape[-1]], skip], dim=1)
            x = self._run(transformer_blocks, resnet(x, mask_up, t), mask_up, t)
            x = upsample(x * mask_up)
        x = self.final_block(x, mask_up)
        return self.final_proj(x * mask_up) * mask


n_mels = 8
estimator = ConditionalDecoder(in_channels=2 * n_mels, out_channels=n_mels).eval()

# flow-matching estimator call on a batch of two mel targets, 24 and 15 frames, padded to 24
feat_len = torch.tensor([24, 15])
T = int(feat_len.max())
mask = (torch.arange(T)[None, :] < feat_len[:, None]).float().unsqueeze(1)  # (B, 1, T), 1.0 = real frame
x = torch.randn(2, n_mels, T) * mask
mu = torch.randn(2, n_mels, T) * mask
t = torch.rand(2)
with torch.no_grad():
    batched = estimator(x, mask, mu, t)
    alone = estimator(x[1:, :, :15], mask[1:, :, :15], mu[1:, :, :15], t[1:])
diff = (batched[1, :, :15] - alone[0]).abs().max().item()
print(f"fixed={FIXED} short utterance: max |batched - alone| velocity over real frames = {diff:.4e}")
