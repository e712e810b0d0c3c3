# lucidrains/e2-tts-pytorch, commit 90bb536 (reverts `mask &= ~cond_mask` added in 24474eb).
# E2TTS.sample ANDs the self-attention mask with ~cond_mask, so during the ODE every frame is forbidden to attend
# to the audio-prompt frames: the generated speech no longer depends on the voice prompt at all.
import sys, math
import torch
from torch import nn
import torch.nn.functional as F
from torch.nn import Module, ModuleList

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

def exists(v): return v is not None
def default(v, d): return v if exists(v) else d

def lens_to_mask(t, length = None):
    if not exists(length):
        length = t.amax()
    seq = torch.arange(length, device = t.device)
    return seq[None, :] < t[:, None]                       # einx.less('n, b -> b n', seq, t)

# --- minimal stand-ins for the x_transformers pieces E2TTS builds on ---
class RotaryEmbedding(Module):
    def __init__(self, dim, theta = 10000):
        super().__init__()
        self.register_buffer('inv_freq', 1. / (theta ** (torch.arange(0, dim, 2).float() / dim)))
    def forward_from_seq_len(self, seq_len):
        t = torch.arange(seq_len).float()
        freqs = torch.einsum('i , j -> i j', t, self.inv_freq)
        return torch.cat((freqs, freqs), dim = -1)

def rotate_half(x):
    x1, x2 = x.chunk(2, dim = -1)
    return torch.cat((-x2, x1), dim = -1)

class Attention(Module):
    def __init__(self, dim, heads, dim_head, dropout = 0., gate_value_heads = True):
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias = False)
        self.to_k = nn.Linear(dim, inner, bias = False)
        self.to_v = nn.Linear(dim, inner, bias = False)
        self.to_v_gate = nn.Linear(dim, heads) if gate_value_heads else None
        self.to_out = nn.Linear(inner, dim, bias = False)
    def forward(self, x, rotary_pos_emb = None, mask = None):
        b, n, _ = x.shape
        h = self.heads
        q, k, v = (t.view(b, n, h, -1).transpose(1, 2) for t in (self.to_q(x), self.to_k(x), self.to_v(x)))
        if exists(rotary_pos_emb):
            q = q * rotary_pos_emb.cos() + rotate_half(q) * rotary_pos_emb.sin()
            k = k * rotary_pos_emb.cos() + rotate_half(k) * rotary_pos_emb.sin()
        sim = torch.einsum('b h i d, b h j d -> b h i j', q, k) * self.scale
        if exists(mask):
            sim = sim.masked_fill(~mask[:, None, None, :], -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim = -1)
        out = torch.einsum('b h i j, b h j d -> b h i d', attn, v)
        if exists(self.to_v_gate):
            out = out * self.to_v_gate(x).sigmoid().transpose(1, 2)[..., None]
        return self.to_out(out.transpose(1, 2).reshape(b, n, -1))

class AdaptiveRMSNorm(Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.to_gamma = nn.Linear(dim, dim, bias = False)
    def forward(self, x, condition):
        return F.normalize(x, dim = -1) * self.scale * (self.to_gamma(condition)[:, None, :] + 1.)

def FeedForward(dim, mult = 4):
    return nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

# --- e2_tts_pytorch/e2_tts.py ---
class CharacterEmbed(Module):
    def __init__(self, dim, num_embeds = 256):
        super().__init__()
        self.dim = dim
        self.embed = nn.Embedding(num_embeds + 1, dim)    # will just use 0 as the 'filler token'
        self.combine = nn.Linear(dim * 2, dim)
    def forward(self, x, text, drop_text_cond = None):
        if drop_text_cond:
            return x
        max_seq_len = x.shape[1]
        text_mask = text == -1
        text = text + 1
        text = text.masked_fill(text_mask, 0)
        text = text[:, :max_seq_len]
        text = F.pad(text, (0, max_seq_len - text.shape[1]), value = 0)
        return self.combine(torch.cat((x, self.embed(text)), dim = -1))

class Transformer(Module):
    def __init__(self, *, dim, depth = 4, heads = 2, dim_head = 16, max_seq_len = 256):
        super().__init__()
        self.dim, self.depth = dim, depth
        self.abs_pos_emb = nn.Embedding(max_seq_len, dim)
        self.rotary_emb = RotaryEmbedding(dim_head)
        self.time_cond_mlp = nn.Sequential(nn.Linear(1, dim), nn.SiLU())
        self.layers = ModuleList([])
        for _ in range(depth):
            self.layers.append(ModuleList([
                nn.Linear(dim * 2, dim, bias = False),     # skip_proj ('concat')
                AdaptiveRMSNorm(dim), Attention(dim, heads, dim_head),
                AdaptiveRMSNorm(dim), FeedForward(dim),
            ]))
        self.final_norm = AdaptiveRMSNorm(dim)

    def forward(self, x, times = None, mask = None):
        batch, seq_len = x.shape[:2]
        # (num_gateloop_layers = 0 in this trimmed config)
        x = x + self.abs_pos_emb(torch.arange(seq_len))
        if times.ndim == 0:
            times = times.expand(batch)
        times = self.time_cond_mlp(times[:, None])
        norm_kwargs = dict(condition = times)
        rotary_pos_emb = self.rotary_emb.forward_from_seq_len(seq_len)
        skips = []
        for ind, (maybe_skip_proj, attn_norm, attn, ff_norm, ff) in enumerate(self.layers):
            layer = ind + 1
            if layer <= self.depth // 2:
                skips.append(x)
            else:
                x = maybe_skip_proj(torch.cat((x, skips.pop()), dim = -1))
            x = attn(attn_norm(x, **norm_kwargs), rotary_pos_emb = rotary_pos_emb, mask = mask) + x
            x = ff(ff_norm(x, **norm_kwargs)) + x
        return self.final_norm(x, **norm_kwargs)

def odeint_midpoint(fn, y0, t):
    # torchdiffeq.odeint(fn, y0, t, method = 'midpoint') on the fixed grid t
    ys = [y0]
    y = y0
    for t0, t1 in zip(t[:-1], t[1:]):
        dt = t1 - t0
        y_mid = y + fn(t0, y) * dt / 2
        y = y + fn(t0 + dt / 2, y_mid) * dt
        ys.append(y)
    return torch.stack(ys)

class E2TTS(Module):
    def __init__(self, transformer: Transformer, text_num_embeds = 256):
        super().__init__()
        self.transformer = transformer
        dim = transformer.dim
        self.dim = dim
        self.to_pred = nn.Linear(dim, dim)
        self.embed_text = CharacterEmbed(dim, num_embeds = text_num_embeds)

    def transformer_with_pred_head(self, x, times, mask = None, text = None, drop_text_cond = None):
        if exists(text):
            x = self.embed_text(x, text, drop_text_cond = drop_text_cond)
        attended = self.transformer(x, times = times, mask = mask)
        return self.to_pred(attended)

    def cfg_transformer_with_pred_head(self, *args, cfg_strength = 1., **kwargs):
        pred = self.transformer_with_pred_head(*args, drop_text_cond = False, **kwargs)
        if cfg_strength < 1e-5:
            return pred
        null_pred = self.transformer_with_pred_head(*args, drop_text_cond = True, **kwargs)
        return pred + (pred - null_pred) * cfg_strength

    @torch.no_grad()
    def sample(self, cond, *, text, lens = None, duration = None, steps = 3, cfg_strength = 1., max_duration = 4096, y0 = None):
        self.eval()
        batch, cond_seq_len = cond.shape[:2]
        if not exists(lens):
            lens = torch.full((batch,), cond_seq_len, dtype = torch.long)
        cond_mask = lens_to_mask(lens)
        if isinstance(duration, int):
            duration = torch.full((batch,), duration, dtype = torch.long)
        duration = torch.maximum(lens + 1, duration)
        duration = duration.clamp(max = max_duration)
        max_duration = duration.amax()

        cond = F.pad(cond, (0, 0, 0, max_duration - cond_seq_len), value = 0.)
        cond_mask = F.pad(cond_mask, (0, max_duration - cond_seq_len), value = False)

        mask = lens_to_mask(duration)

        if not FIXED:
            # only include the target sequence in the mask
            mask &= ~cond_mask

        def fn(t, x):
            x = torch.where(cond_mask[..., None], cond, x)
            return self.cfg_transformer_with_pred_head(x, times = t, text = text, mask = mask, cfg_strength = cfg_strength)

        y0 = default(y0, torch.randn_like(cond))
        t = torch.linspace(0, 1, steps)
        trajectory = odeint_midpoint(fn, y0, t)
        return trajectory[-1], cond_mask, mask

dim = 32
model = E2TTS(Transformer(dim = dim, depth = 4, heads = 2, dim_head = 16))

# batch of 2: audio prompts of 10 and 7 mel frames, text as padded byte ids, total durations 24 and 20
lens = torch.tensor([10, 7])
prompt_a = torch.randn(2, 10, dim)
prompt_b = torch.randn(2, 10, dim)       # a different speaker's prompt, same lengths
text = torch.randint(0, 255, (2, 16))
text[1, 12:] = -1
duration = torch.tensor([24, 20])
y0 = torch.randn(2, 24, dim)

out_a, cond_mask, attn_mask = model.sample(prompt_a, text = text, lens = lens, duration = duration, steps = 4, y0 = y0)
out_b, _, _ = model.sample(prompt_b, text = text, lens = lens, duration = duration, steps = 4, y0 = y0)

target = lens_to_mask(duration) & ~cond_mask
delta = (out_a - out_b).abs()[target].max().item()
print(f"fixed={FIXED} prompt frames attendable: {bool(attn_mask[cond_mask].any())}; "
      f"max change of generated target frames when the audio prompt changes: {delta:.3e}")
