# Citation: SkyworkAI/SkyReels-V2 skyreels_v2_infer/modules/transformer.py (WanModel.forward with flag_causal_attention,
#   WanModel.set_ar_attention, WanSelfAttention.forward AR branch: SDPA attn_mask=block_mask), commit
#   f1c625e76261ec7ca77f7c5bb7f20370ec981a7b.
# Diffusion-forcing video DiT: frames are grouped into causal blocks of num_frame_per_block frames; the bool KEEP mask
# is block_idx(key frame) <= block_idx(query frame), expanded to every (h, w) token of each frame, so tokens attend
# bidirectionally within their block and to all earlier blocks, with per-frame timesteps t of shape (B, F).
# Adapted for CPU: float32 and the default SDPA backend instead of bf16 + flash-only sdp_kernel; torch.compile removed.
import math

import torch
import torch.nn as nn

torch.manual_seed(0)


def sinusoidal_embedding_1d(dim, position):
    assert dim % 2 == 0
    half = dim // 2
    position = position.type(torch.float64)
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


def rope_params(max_seq_len, dim, theta=10000):
    assert dim % 2 == 0
    freqs = torch.outer(torch.arange(max_seq_len), 1.0 / torch.pow(theta, torch.arange(0, dim, 2).to(torch.float32).div(dim)))
    return torch.polar(torch.ones_like(freqs), freqs)


def rope_apply(x, grid_sizes, freqs):
    n, c = x.size(2), x.size(3) // 2
    bs = x.size(0)
    freqs = freqs.split([c - 2 * (c // 3), c // 3, c // 3], dim=1)
    f, h, w = grid_sizes.tolist()
    seq_len = f * h * w
    x = torch.view_as_complex(x.to(torch.float32).reshape(bs, seq_len, n, -1, 2))
    freqs_i = torch.cat([
        freqs[0][:f].view(f, 1, 1, -1).expand(f, h, w, -1),
        freqs[1][:h].view(1, h, 1, -1).expand(f, h, w, -1),
        freqs[2][:w].view(1, 1, w, -1).expand(f, h, w, -1),
    ], dim=-1).reshape(seq_len, 1, -1)
    return torch.view_as_real(x * freqs_i).flatten(3)


class WanRMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        x = x.float()
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


class WanSelfAttention(nn.Module):
    def __init__(self, dim, num_heads, qk_norm=True, eps=1e-6):
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.q = nn.Linear(dim, dim)
        self.k = nn.Linear(dim, dim)
        self.v = nn.Linear(dim, dim)
        self.o = nn.Linear(dim, dim)
        self.norm_q = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self.norm_k = WanRMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self._flag_ar_attention = False

    def set_ar_attention(self):
        self._flag_ar_attention = True

    def forward(self, x, grid_sizes, freqs, block_mask):
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, s, n, d)
        k = self.norm_k(self.k(x)).view(b, s, n, d)
        v = self.v(x).view(b, s, n, d)
        q = rope_apply(q, grid_sizes, freqs)
        k = rope_apply(k, grid_sizes, freqs)
        assert self._flag_ar_attention
        x = torch.nn.functional.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=block_mask
        ).transpose(1, 2).contiguous()
        return self.o(x.flatten(2))


class WanT2VCrossAttention(WanSelfAttention):
    def forward(self, x, context):
        b, n, d = x.size(0), self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, -1, n, d)
        k = self.norm_k(self.k(context)).view(b, -1, n, d)
        v = self.v(context).view(b, -1, n, d)
        x = torch.nn.functional.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.o(x.transpose(1, 2).flatten(2))


class WanAttentionBlock(nn.Module):
    def __init__(self, dim, ffn_dim, num_heads, eps=1e-6):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.self_attn = WanSelfAttention(dim, num_heads)
        self.norm3 = nn.LayerNorm(dim, eps, elementwise_affine=True)
        self.cross_attn = WanT2VCrossAttention(dim, num_heads)
        self.norm2 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)

    def set_ar_attention(self):
        self.self_attn.set_ar_attention()

    def forward(self, x, e, grid_sizes, freqs, context, block_mask):
        modulation = self.modulation.unsqueeze(2)  # 1, 6, 1, dim  (per-token e from per-frame timesteps)
        e = (modulation + e).chunk(6, dim=1)
        e = [ei.squeeze(1) for ei in e]
        y = self.self_attn(self.norm1(x) * (1 + e[1]) + e[0], grid_sizes, freqs, block_mask)
        x = x + y * e[2]
        x = x + self.cross_attn(self.norm3(x), context)
        y = self.ffn(self.norm2(x) * (1 + e[4]) + e[3])
        return x + y * e[5]


class WanModel(nn.Module):
    def __init__(self, patch_size=(1, 2, 2), in_dim=4, dim=48, ffn_dim=96, freq_dim=32, text_dim=24, out_dim=4,
                 num_heads=4, num_layers=2):
        super().__init__()
        self.patch_size = patch_size
        self.dim = dim
        self.freq_dim = freq_dim
        self.out_dim = out_dim
        self.num_frame_per_block = 1
        self.flag_causal_attention = False
        self.block_mask = None
        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=patch_size, stride=patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList([WanAttentionBlock(dim, ffn_dim, num_heads) for _ in range(num_layers)])
        self.head_norm = nn.LayerNorm(dim, 1e-6, elementwise_affine=False)
        self.head = nn.Linear(dim, math.prod(patch_size) * out_dim)
        self.head_modulation = nn.Parameter(torch.randn(1, 2, dim) / dim ** 0.5)
        d = dim // num_heads
        self.freqs = torch.cat([rope_params(1024, d - 4 * (d // 6)), rope_params(1024, 2 * (d // 6)),
                                rope_params(1024, 2 * (d // 6))], dim=1)

    def set_ar_attention(self, causal_block_size):
        self.num_frame_per_block = causal_block_size
        self.flag_causal_attention = True
        for block in self.blocks:
            block.set_ar_attention()

    def forward(self, x, t, context):
        x = self.patch_embedding(x)
        grid_sizes = torch.tensor(x.shape[2:], dtype=torch.long)
        x = x.flatten(2).transpose(1, 2)

        if self.flag_causal_attention:
            frame_num = grid_sizes[0]
            height = grid_sizes[1]
            width = grid_sizes[2]
            block_num = frame_num // self.num_frame_per_block
            range_tensor = torch.arange(block_num).view(-1, 1)
            range_tensor = range_tensor.repeat(1, self.num_frame_per_block).flatten()
            casual_mask = range_tensor.unsqueeze(0) <= range_tensor.unsqueeze(1)  # f, f
            casual_mask = casual_mask.view(frame_num, 1, 1, frame_num, 1, 1).to(x.device)
            casual_mask = casual_mask.repeat(1, height, width, 1, height, width)
            casual_mask = casual_mask.reshape(frame_num * height * width, frame_num * height * width)
            self.block_mask = casual_mask.unsqueeze(0).unsqueeze(0)

        b, f = t.shape  # diffusion forcing: one timestep per frame
        e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, t.flatten()).float())
        e0 = self.time_projection(e).unflatten(1, (6, self.dim))
        e = e.view(b, f, 1, 1, self.dim)
        e0 = e0.view(b, f, 1, 1, 6, self.dim)
        e = e.repeat(1, 1, grid_sizes[1], grid_sizes[2], 1).flatten(1, 3)
        e0 = e0.repeat(1, 1, grid_sizes[1], grid_sizes[2], 1, 1).flatten(1, 3)
        e0 = e0.transpose(1, 2).contiguous()

        context = self.text_embedding(context)
        for block in self.blocks:
            x = block(x, e=e0, grid_sizes=grid_sizes, freqs=self.freqs, context=context, block_mask=self.block_mask)

        mod = (self.head_modulation.unsqueeze(2) + e.unsqueeze(1)).chunk(2, dim=1)
        mod = [m.squeeze(1) for m in mod]
        x = self.head(self.head_norm(x) * (1 + mod[1]) + mod[0])
        c = self.out_dim
        bs = x.shape[0]
        x = x.view(bs, *grid_sizes, *self.patch_size, c)
        x = torch.einsum("bfhwpqrc->bcfphqwr", x)
        return x.reshape(bs, c, *[i * j for i, j in zip(grid_sizes, self.patch_size)]).float()


model = WanModel()
model.set_ar_attention(causal_block_size=2)
latents = torch.randn(2, 4, 6, 8, 8)  # B, C, F, H, W -> 6 frames of 4x4 tokens, 3 causal blocks
noise = torch.randn_like(latents)
# diffusion forcing: earlier frames are cleaner (smaller t) than later ones
t = torch.tensor([[0, 0, 250, 250, 750, 750], [100, 100, 400, 400, 900, 900]])
alpha = (1 - t.float() / 1000).view(2, 1, 6, 1, 1)
noisy = alpha * latents + (1 - alpha) * noise
context = torch.randn(2, 7, 24)  # short text memory
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
pred = model(noisy, t, context)
loss = torch.nn.functional.mse_loss(pred, noise - latents)  # flow-matching velocity target
loss.backward()
opt.step()
print(f"loss={loss.item():.4f}")
