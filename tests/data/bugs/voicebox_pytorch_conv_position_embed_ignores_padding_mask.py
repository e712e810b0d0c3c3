# lucidrains/voicebox-pytorch, commit d079b26 ("address a potential issue with convs and masking").
# VoiceBox.forward passes self_attn_mask only to the transformer: the ConvPositionEmbed depthwise conv
# runs over padded frames (ODE noise), leaking padding into valid frames despite the attention key mask.
import sys, math
import torch
from torch import nn, einsum
import torch.nn.functional as F
from torch.nn import Module

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

def exists(v): return v is not None
def default(v, d): return v if exists(v) else d

class LearnedSinusoidalPosEmb(Module):
    def __init__(self, dim):
        super().__init__()
        self.weights = nn.Parameter(torch.randn(dim // 2))
    def forward(self, x):
        x = x[:, None]
        freqs = x * self.weights[None, :] * 2 * math.pi
        return torch.cat((freqs.sin(), freqs.cos()), dim = -1)

class RotaryEmbedding(Module):
    def __init__(self, dim, theta = 50000):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim)))
    def forward(self, t):
        if not torch.is_tensor(t):
            t = torch.arange(t)
        t = t.type_as(self.inv_freq)
        freqs = torch.einsum('i , j -> i j', t, self.inv_freq)
        return torch.cat((freqs, freqs), dim = -1)

def rotate_half(x):
    x1, x2 = x.chunk(2, dim = -1)
    return torch.cat((-x2, x1), dim = -1)

def apply_rotary_pos_emb(pos, t):
    return t * pos.cos() + rotate_half(t) * pos.sin()

class ConvPositionEmbed(Module):
    def __init__(self, dim, *, kernel_size, groups = None):
        super().__init__()
        groups = default(groups, dim)
        self.dw_conv1d = nn.Sequential(
            nn.Conv1d(dim, dim, kernel_size, groups = groups, padding = kernel_size // 2),
            nn.GELU()
        )

    if not FIXED:
        def forward(self, x):
            x = x.transpose(1, 2)                       # b n c -> b c n
            x = self.dw_conv1d(x)
            return x.transpose(1, 2)                    # b c n -> b n c
    else:
        def forward(self, x, mask = None):
            if exists(mask):
                mask = mask[..., None]
                x = x.masked_fill(~mask, 0.)
            x = x.transpose(1, 2)
            x = self.dw_conv1d(x)
            out = x.transpose(1, 2)
            if exists(mask):
                out = out.masked_fill(~mask, 0.)
            return out

class RMSNorm(Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))
    def forward(self, x):
        return F.normalize(x, dim = -1) * self.scale * self.gamma

class AdaptiveRMSNorm(Module):
    def __init__(self, dim, cond_dim = None):
        super().__init__()
        cond_dim = default(cond_dim, dim)
        self.scale = dim ** 0.5
        self.to_gamma = nn.Linear(cond_dim, dim)
        self.to_beta = nn.Linear(cond_dim, dim)
    def forward(self, x, *, cond):
        normed = F.normalize(x, dim = -1) * self.scale
        gamma, beta = self.to_gamma(cond)[:, None], self.to_beta(cond)[:, None]
        return normed * gamma + beta

class Attend(Module):
    def __init__(self, dropout = 0., scale = None):
        super().__init__()
        self.scale = scale
        self.attn_dropout = nn.Dropout(dropout)
    def forward(self, q, k, v, mask = None):
        scale = default(self.scale, q.shape[-1] ** -0.5)
        if exists(mask) and mask.ndim != 4:
            mask = mask[:, None, None, :]               # b j -> b 1 1 j
        sim = einsum("b h i d, b h j d -> b h i j", q, k) * scale
        if exists(mask):
            sim = sim.masked_fill(~mask, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim = -1)
        attn = self.attn_dropout(attn)
        return einsum("b h i j, b h j d -> b h i d", attn, v)

class Attention(Module):
    def __init__(self, dim, dim_head = 16, heads = 2):
        super().__init__()
        self.heads = heads
        dim_inner = dim_head * heads
        self.attend = Attend()
        self.to_qkv = nn.Linear(dim, dim_inner * 3, bias = False)
        self.to_out = nn.Linear(dim_inner, dim, bias = False)
    def forward(self, x, mask = None, rotary_emb = None):
        b, n, _ = x.shape
        q, k, v = self.to_qkv(x).chunk(3, dim = -1)
        q, k, v = map(lambda t: t.view(b, n, self.heads, -1).transpose(1, 2), (q, k, v))
        if exists(rotary_emb):
            q, k = map(lambda t: apply_rotary_pos_emb(rotary_emb, t), (q, k))
        out = self.attend(q, k, v, mask = mask)
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))

class GEGLU(Module):
    def forward(self, x):
        x, gate = x.chunk(2, dim = -1)
        return F.gelu(gate) * x

def FeedForward(dim, mult = 4):
    dim_inner = int(dim * mult * 2 / 3)
    return nn.Sequential(nn.Linear(dim, dim_inner * 2), GEGLU(), nn.Linear(dim_inner, dim))

class Transformer(Module):
    def __init__(self, dim, *, depth, dim_head, heads, num_register_tokens, adaptive_rmsnorm_cond_dim_in):
        super().__init__()
        self.layers = nn.ModuleList([])
        self.rotary_emb = RotaryEmbedding(dim = dim_head)
        self.num_register_tokens = num_register_tokens
        self.register_tokens = nn.Parameter(torch.randn(num_register_tokens, dim))
        for _ in range(depth):
            self.layers.append(nn.ModuleList([
                AdaptiveRMSNorm(dim, cond_dim = adaptive_rmsnorm_cond_dim_in),
                Attention(dim = dim, dim_head = dim_head, heads = heads),
                AdaptiveRMSNorm(dim, cond_dim = adaptive_rmsnorm_cond_dim_in),
                FeedForward(dim = dim)
            ]))
        self.final_norm = RMSNorm(dim)

    def forward(self, x, mask = None, adaptive_rmsnorm_cond = None):
        batch, seq_len, _ = x.shape
        register_tokens = self.register_tokens[None].expand(batch, -1, -1)
        x = torch.cat([register_tokens, x], dim = 1)
        if exists(mask):
            mask = F.pad(mask, (self.num_register_tokens, 0), value = True)
        main_positions = torch.arange(seq_len, dtype = torch.long)
        register_positions = torch.full((self.num_register_tokens,), -10000, dtype = torch.long)
        rotary_emb = self.rotary_emb(torch.cat((register_positions, main_positions)))
        for attn_prenorm, attn, ff_prenorm, ff in self.layers:
            x = attn(attn_prenorm(x, cond = adaptive_rmsnorm_cond), mask = mask, rotary_emb = rotary_emb) + x
            x = ff(ff_prenorm(x, cond = adaptive_rmsnorm_cond)) + x
        x = x[:, self.num_register_tokens:]
        return self.final_norm(x)

class VoiceBox(Module):
    def __init__(self, *, num_cond_tokens, dim_in, dim_cond_emb, dim, depth, dim_head, heads,
                 conv_pos_embed_kernel_size = 31, num_register_tokens = 4):
        super().__init__()
        time_hidden_dim = dim * 4
        self.sinu_pos_emb = nn.Sequential(LearnedSinusoidalPosEmb(dim), nn.Linear(dim, time_hidden_dim), nn.SiLU())
        self.null_cond_id = num_cond_tokens
        self.to_cond_emb = nn.Embedding(num_cond_tokens + 1, dim_cond_emb)
        self.to_embed = nn.Linear(dim_in * 2 + dim_cond_emb, dim)
        self.conv_embed = ConvPositionEmbed(dim = dim, kernel_size = conv_pos_embed_kernel_size)
        self.transformer = Transformer(dim, depth = depth, dim_head = dim_head, heads = heads,
                                       num_register_tokens = num_register_tokens,
                                       adaptive_rmsnorm_cond_dim_in = time_hidden_dim)
        self.to_pred = nn.Linear(dim, dim_in, bias = False)

    def forward(self, x, *, times, cond_token_ids, self_attn_mask = None, cond = None, cond_mask = None):
        batch, seq_len, _ = cond.shape
        if not exists(cond_mask):
            cond_mask = torch.ones((batch, seq_len), dtype = torch.bool)
        cond = cond * ~cond_mask[..., None]
        cond_emb = self.to_cond_emb(cond_token_ids)
        embed = torch.cat([x, cond_emb, cond], dim = -1)
        x = self.to_embed(embed)

        if not FIXED:
            x = self.conv_embed(x) + x
        else:
            x = self.conv_embed(x, mask = self_attn_mask) + x

        time_emb = self.sinu_pos_emb(times)
        x = self.transformer(x, mask = self_attn_mask, adaptive_rmsnorm_cond = time_emb)
        return self.to_pred(x)

dim_in, n_tokens = 8, 20
model = VoiceBox(num_cond_tokens = n_tokens, dim_in = dim_in, dim_cond_emb = 16, dim = 32, depth = 2,
                 dim_head = 16, heads = 2, conv_pos_embed_kernel_size = 7).eval()

# batched inference as in ConditionalFlowMatcherWrapper.sample: x0 is noise over the whole padded length
lens = torch.tensor([24, 13, 18])
N = int(lens.max())
mask = torch.arange(N)[None] < lens[:, None]
x = torch.randn(3, N, dim_in)                     # ODE state (noise), padded frames are noise too
cond = torch.randn(3, N, dim_in) * mask[..., None]
ids = torch.randint(0, n_tokens, (3, N))
times = torch.full((3,), 0.3)

with torch.no_grad():
    batched = model(x, times = times, cond_token_ids = ids, self_attn_mask = mask, cond = cond)
    worst = 0.
    for b in range(3):
        L = int(lens[b])
        alone = model(x[b:b+1, :L], times = times[b:b+1], cond_token_ids = ids[b:b+1, :L],
                      self_attn_mask = mask[b:b+1, :L], cond = cond[b:b+1, :L])
        worst = max(worst, (batched[b, :L] - alone[0]).abs().max().item())

print(f"fixed={FIXED} max |padded batch - each sequence alone| on valid frames: {worst:.3e}")
