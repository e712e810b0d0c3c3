# SWivid/F5-TTS commit a051a68 ("fix batch inference skipping last words in shorter sentences", issues #1039 #1179).
# DiT.get_input_embed calls InputEmbedding without audio_mask, so ConvPositionEmbedding's two stacked Conv1d layers run
# over the padded frames of shorter samples; the fix passes the mask and re-zeroes padding after each Conv1d.
import sys, math
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

def exists(v): return v is not None

def lens_to_mask(t, length=None):
    if not exists(length):
        length = t.amax()
    seq = torch.arange(length, device=t.device)
    return seq[None, :] < t[:, None]

# ---- x_transformers rotary (interleaved) ----
class RotaryEmbedding(nn.Module):
    def __init__(self, dim, theta=10000):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim)))
    def forward_from_seq_len(self, seq_len):
        t = torch.arange(seq_len).float()
        freqs = torch.einsum("i , j -> i j", t, self.inv_freq)
        freqs = torch.stack((freqs, freqs), dim=-1).flatten(-2)
        return freqs, 1.0

def rotate_half(x):
    x = x.unflatten(-1, (-1, 2))
    x1, x2 = x.unbind(dim=-1)
    return torch.stack((-x2, x1), dim=-1).flatten(-2)

def apply_rotary_pos_emb(t, freqs, scale=1):
    return (t * freqs.cos() * scale) + (rotate_half(t) * freqs.sin() * scale)

# ---- f5_tts/model/modules.py ----
class SinusPositionEmbedding(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.dim = dim
    def forward(self, x, scale=1000):
        half_dim = self.dim // 2
        emb = math.log(10000) / (half_dim - 1)
        emb = torch.exp(torch.arange(half_dim).float() * -emb)
        emb = scale * x.unsqueeze(1) * emb.unsqueeze(0)
        return torch.cat((emb.sin(), emb.cos()), dim=-1)

class ConvPositionEmbedding(nn.Module):
    def __init__(self, dim, kernel_size=31, groups=16):
        super().__init__()
        assert kernel_size % 2 != 0
        self.conv1d = nn.Sequential(
            nn.Conv1d(dim, dim, kernel_size, groups=groups, padding=kernel_size // 2),
            nn.Mish(),
            nn.Conv1d(dim, dim, kernel_size, groups=groups, padding=kernel_size // 2),
            nn.Mish(),
        )
        self.layer_need_mask_idx = [i for i, layer in enumerate(self.conv1d) if isinstance(layer, nn.Conv1d)]

    def forward(self, x, mask=None):
        if not FIXED:
            if mask is not None:
                mask = mask[..., None]
                x = x.masked_fill(~mask, 0.0)
            x = x.permute(0, 2, 1)
            x = self.conv1d(x)
            out = x.permute(0, 2, 1)
        else:
            if mask is not None:
                mask = mask.unsqueeze(-1)
                mask_t = mask.permute(0, 2, 1)
                x = x.masked_fill(~mask, 0.0)
            x = x.permute(0, 2, 1)
            for i, block in enumerate(self.conv1d):
                x = block(x)
                if mask is not None and i in self.layer_need_mask_idx:
                    x = x.masked_fill(~mask_t, 0.0)
            out = x.permute(0, 2, 1)
        if mask is not None:
            out = out.masked_fill(~mask, 0.0)
        return out

def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    freqs = torch.outer(torch.arange(end), freqs).float()
    return torch.cat([torch.cos(freqs), torch.sin(freqs)], dim=-1)

class GRN(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gamma = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
        self.beta = nn.Parameter(torch.randn(1, 1, dim) * 0.1)
    def forward(self, x):
        Gx = torch.norm(x, p=2, dim=1, keepdim=True)
        Nx = Gx / (Gx.mean(dim=-1, keepdim=True) + 1e-6)
        return self.gamma * (x * Nx) + self.beta + x

class ConvNeXtV2Block(nn.Module):
    def __init__(self, dim, intermediate_dim):
        super().__init__()
        self.dwconv = nn.Conv1d(dim, dim, kernel_size=7, padding=3, groups=dim)
        self.norm = nn.LayerNorm(dim, eps=1e-6)
        self.pwconv1 = nn.Linear(dim, intermediate_dim)
        self.act = nn.GELU()
        self.grn = GRN(intermediate_dim)
        self.pwconv2 = nn.Linear(intermediate_dim, dim)
    def forward(self, x):
        residual = x
        x = self.dwconv(x.transpose(1, 2)).transpose(1, 2)
        x = self.pwconv2(self.grn(self.act(self.pwconv1(self.norm(x)))))
        return residual + x

class AdaLayerNorm(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, dim * 6)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
    def forward(self, x, emb=None):
        emb = self.linear(self.silu(emb))
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = torch.chunk(emb, 6, dim=1)
        x = self.norm(x) * (1 + scale_msa[:, None]) + shift_msa[:, None]
        return x, gate_msa, shift_mlp, scale_mlp, gate_mlp

class AdaLayerNorm_Final(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(dim, dim * 2)
        self.norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
    def forward(self, x, emb):
        scale, shift = torch.chunk(self.linear(self.silu(emb)), 2, dim=1)
        return self.norm(x) * (1 + scale)[:, None, :] + shift[:, None, :]

class FeedForward(nn.Module):
    def __init__(self, dim, mult=4, approximate="tanh"):
        super().__init__()
        inner_dim = int(dim * mult)
        self.ff = nn.Sequential(nn.Sequential(nn.Linear(dim, inner_dim), nn.GELU(approximate=approximate)),
                                nn.Dropout(0.0), nn.Linear(inner_dim, dim))
    def forward(self, x):
        return self.ff(x)

class Attention(nn.Module):
    def __init__(self, processor, dim, heads=8, dim_head=64):
        super().__init__()
        self.processor = processor
        self.heads = heads
        self.inner_dim = dim_head * heads
        self.to_q = nn.Linear(dim, self.inner_dim)
        self.to_k = nn.Linear(dim, self.inner_dim)
        self.to_v = nn.Linear(dim, self.inner_dim)
        self.q_norm = self.k_norm = None
        self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, dim), nn.Dropout(0.0)])
    def forward(self, x, mask=None, rope=None):
        return self.processor(self, x, mask=mask, rope=rope)

class AttnProcessor:
    def __init__(self, pe_attn_head=None, attn_backend="torch", attn_mask_enabled=True):
        self.pe_attn_head = pe_attn_head
        self.attn_backend = attn_backend
        self.attn_mask_enabled = attn_mask_enabled

    def __call__(self, attn, x, mask=None, rope=None):
        batch_size = x.shape[0]
        query, key, value = attn.to_q(x), attn.to_k(x), attn.to_v(x)
        inner_dim = key.shape[-1]
        head_dim = inner_dim // attn.heads
        query = query.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        key = key.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        value = value.view(batch_size, -1, attn.heads, head_dim).transpose(1, 2)
        if rope is not None:
            freqs, xpos_scale = rope
            query = apply_rotary_pos_emb(query, freqs, 1.0)
            key = apply_rotary_pos_emb(key, freqs, 1.0)
        # attn_backend == "torch"
        if self.attn_mask_enabled and mask is not None:
            attn_mask = mask.unsqueeze(1).unsqueeze(1)  # 'b n -> b 1 1 n'
            attn_mask = attn_mask.expand(batch_size, attn.heads, query.shape[-2], key.shape[-2])
        else:
            attn_mask = None
        x = F.scaled_dot_product_attention(query, key, value, attn_mask=attn_mask, dropout_p=0.0, is_causal=False)
        x = x.transpose(1, 2).reshape(batch_size, -1, attn.heads * head_dim)
        x = attn.to_out[1](attn.to_out[0](x))
        if mask is not None:
            x = x.masked_fill(~mask.unsqueeze(-1), 0.0)
        return x

class DiTBlock(nn.Module):
    def __init__(self, dim, heads, dim_head, ff_mult=4, attn_backend="torch", attn_mask_enabled=True):
        super().__init__()
        self.attn_norm = AdaLayerNorm(dim)
        self.attn = Attention(AttnProcessor(attn_backend=attn_backend, attn_mask_enabled=attn_mask_enabled),
                              dim=dim, heads=heads, dim_head=dim_head)
        self.ff_norm = nn.LayerNorm(dim, elementwise_affine=False, eps=1e-6)
        self.ff = FeedForward(dim=dim, mult=ff_mult, approximate="tanh")
    def forward(self, x, t, mask=None, rope=None):
        norm, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.attn_norm(x, emb=t)
        attn_output = self.attn(x=norm, mask=mask, rope=rope)
        x = x + gate_msa.unsqueeze(1) * attn_output
        norm = self.ff_norm(x) * (1 + scale_mlp[:, None]) + shift_mlp[:, None]
        return x + gate_mlp.unsqueeze(1) * self.ff(norm)

class TimestepEmbedding(nn.Module):
    def __init__(self, dim, freq_embed_dim=64):
        super().__init__()
        self.time_embed = SinusPositionEmbedding(freq_embed_dim)
        self.time_mlp = nn.Sequential(nn.Linear(freq_embed_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
    def forward(self, timestep):
        return self.time_mlp(self.time_embed(timestep))

# ---- f5_tts/model/backbones/dit.py ----
class TextEmbedding(nn.Module):
    def __init__(self, text_num_embeds, text_dim, mask_padding=True, conv_layers=0, conv_mult=2):
        super().__init__()
        self.text_embed = nn.Embedding(text_num_embeds + 1, text_dim)
        self.mask_padding = mask_padding
        self.extra_modeling = conv_layers > 0
        self.register_buffer("freqs_cis", precompute_freqs_cis(text_dim, 256), persistent=False)
        self.text_blocks = nn.Sequential(*[ConvNeXtV2Block(text_dim, text_dim * conv_mult) for _ in range(conv_layers)])

    def forward(self, text, seq_len, drop_text=False, audio_mask=None):
        text = text + 1
        text = text[:, :seq_len]
        text = F.pad(text, (0, seq_len - text.shape[1]), value=0)
        if self.mask_padding:
            text_mask = text == 0
        if drop_text:
            text = torch.zeros_like(text)
        text = self.text_embed(text)
        if self.extra_modeling:
            text = text + self.freqs_cis[:seq_len, :]
            text = text.masked_fill(text_mask.unsqueeze(-1).expand(-1, -1, text.size(-1)), 0.0)
            for block in self.text_blocks:
                text = block(text)
                text = text.masked_fill(text_mask.unsqueeze(-1).expand(-1, -1, text.size(-1)), 0.0)
        return text

class InputEmbedding(nn.Module):
    def __init__(self, mel_dim, text_dim, out_dim):
        super().__init__()
        self.proj = nn.Linear(mel_dim * 2 + text_dim, out_dim)
        self.conv_pos_embed = ConvPositionEmbedding(dim=out_dim)

    def forward(self, x, cond, text_embed, drop_audio_cond=False, audio_mask=None):
        if drop_audio_cond:
            cond = torch.zeros_like(cond)
        x = self.proj(torch.cat((x, cond, text_embed), dim=-1))
        if not FIXED:
            x = self.conv_pos_embed(x) + x
        else:
            x = self.conv_pos_embed(x, mask=audio_mask) + x
        return x

class DiT(nn.Module):
    def __init__(self, *, dim, depth=8, heads=8, dim_head=64, ff_mult=4, mel_dim=100, text_num_embeds=256,
                 text_dim=None, conv_layers=0, attn_backend="torch", attn_mask_enabled=False):
        super().__init__()
        self.time_embed = TimestepEmbedding(dim)
        text_dim = mel_dim if text_dim is None else text_dim
        self.text_embed = TextEmbedding(text_num_embeds, text_dim, conv_layers=conv_layers)
        self.text_cond, self.text_uncond = None, None
        self.input_embed = InputEmbedding(mel_dim, text_dim, dim)
        self.rotary_embed = RotaryEmbedding(dim_head)
        self.transformer_blocks = nn.ModuleList([
            DiTBlock(dim=dim, heads=heads, dim_head=dim_head, ff_mult=ff_mult,
                     attn_backend=attn_backend, attn_mask_enabled=attn_mask_enabled) for _ in range(depth)])
        self.norm_out = AdaLayerNorm_Final(dim)
        self.proj_out = nn.Linear(dim, mel_dim)
        # (initialize_weights() zero-inits AdaLN / proj_out; left random here, as in a trained checkpoint)

    def get_input_embed(self, x, cond, text, drop_audio_cond=False, drop_text=False, cache=True, audio_mask=None):
        if self.text_uncond is None or self.text_cond is None or not cache:
            if audio_mask is None:
                text_embed = self.text_embed(text, x.shape[1], drop_text=drop_text, audio_mask=audio_mask)
            else:
                seq_lens = audio_mask.sum(dim=1)
                text_embed_list = []
                for i in range(x.shape[0]):
                    text_embed_i = self.text_embed(text[i].unsqueeze(0), seq_lens[i].item(), drop_text=drop_text, audio_mask=audio_mask)
                    text_embed_list.append(text_embed_i[0])
                text_embed = pad_sequence(text_embed_list, batch_first=True, padding_value=0)
            if cache:
                if drop_text:
                    self.text_uncond = text_embed
                else:
                    self.text_cond = text_embed
        if cache:
            text_embed = self.text_uncond if drop_text else self.text_cond

        if not FIXED:
            x = self.input_embed(x, cond, text_embed, drop_audio_cond=drop_audio_cond)
        else:
            x = self.input_embed(x, cond, text_embed, drop_audio_cond=drop_audio_cond, audio_mask=audio_mask)
        return x

    def clear_cache(self):
        self.text_cond, self.text_uncond = None, None

    def forward(self, x, cond, text, time, mask=None, drop_audio_cond=False, drop_text=False, cfg_infer=False, cache=False):
        batch, seq_len = x.shape[0], x.shape[1]
        if time.ndim == 0:
            time = time.repeat(batch)
        t = self.time_embed(time)
        if cfg_infer:
            x_cond = self.get_input_embed(x, cond, text, drop_audio_cond=False, drop_text=False, cache=cache, audio_mask=mask)
            x_uncond = self.get_input_embed(x, cond, text, drop_audio_cond=True, drop_text=True, cache=cache, audio_mask=mask)
            x = torch.cat((x_cond, x_uncond), dim=0)
            t = torch.cat((t, t), dim=0)
            mask = torch.cat((mask, mask), dim=0) if mask is not None else None
        else:
            x = self.get_input_embed(x, cond, text, drop_audio_cond=drop_audio_cond, drop_text=drop_text, cache=cache, audio_mask=mask)
        rope = self.rotary_embed.forward_from_seq_len(seq_len)
        for block in self.transformer_blocks:
            x = block(x, t, mask=mask, rope=rope)
        x = self.norm_out(x, t)
        return self.proj_out(x)

# ---- f5_tts/model/cfm.py (CFM.sample, trimmed: mel input, euler odeint, no sway / epss) ----
class CFM(nn.Module):
    def __init__(self, transformer, num_channels):
        super().__init__()
        self.transformer = transformer
        self.num_channels = num_channels

    @torch.no_grad()
    def sample(self, cond, text, duration, *, lens=None, steps=4, cfg_strength=2.0, seed=None, max_duration=4096):
        self.eval()
        batch, cond_seq_len = cond.shape[:2]
        if not exists(lens):
            lens = torch.full((batch,), cond_seq_len, dtype=torch.long)
        cond_mask = lens_to_mask(lens)
        if isinstance(duration, int):
            duration = torch.full((batch,), duration, dtype=torch.long)
        duration = torch.maximum(torch.maximum((text != -1).sum(dim=-1), lens) + 1, duration)
        duration = duration.clamp(max=max_duration)
        max_duration = duration.amax()
        cond = F.pad(cond, (0, 0, 0, max_duration - cond_seq_len), value=0.0)
        cond_mask = F.pad(cond_mask, (0, max_duration - cond_mask.shape[-1]), value=False).unsqueeze(-1)
        step_cond = torch.where(cond_mask, cond, torch.zeros_like(cond))
        if batch > 1:
            mask = lens_to_mask(duration)
        else:
            mask = None

        def fn(t, x):
            pred_cfg = self.transformer(x=x, cond=step_cond, text=text, time=t, mask=mask, cfg_infer=True, cache=True)
            pred, null_pred = torch.chunk(pred_cfg, 2, dim=0)
            return pred + (pred - null_pred) * cfg_strength

        y0 = []
        for dur in duration:
            if exists(seed):
                torch.manual_seed(seed)
            y0.append(torch.randn(dur, self.num_channels))
        y0 = pad_sequence(y0, padding_value=0, batch_first=True)
        t = torch.linspace(0, 1, steps + 1)
        x = y0
        for t0, t1 in zip(t[:-1], t[1:]):        # odeint(fn, y0, t, method="euler")
            x = x + (t1 - t0) * fn(t0, x)
        self.transformer.clear_cache()
        out = torch.where(cond_mask, cond, x)
        return out, duration

mel_dim = 16
model = CFM(DiT(dim=64, depth=2, heads=4, dim_head=16, mel_dim=mel_dim, text_num_embeds=40, text_dim=32,
                conv_layers=2, attn_backend="torch", attn_mask_enabled=True), num_channels=mel_dim)

# batched inference (infer_batch_process style): 3 reference mels of different lengths, padded text with -1
lens = torch.tensor([12, 8, 10])
cond = torch.randn(3, 12, mel_dim) * lens_to_mask(lens)[..., None]
text = torch.randint(0, 40, (3, 14))
text[1, 9:] = -1
text[2, 11:] = -1
duration = torch.tensor([32, 20, 26])

batched, dur = model.sample(cond, text, duration, lens=lens, seed=0)
worst = 0.0
for b in range(3):
    L, D = int(lens[b]), int(dur[b])
    t_len = int((text[b] != -1).sum())
    alone, _ = model.sample(cond[b:b+1, :L], text[b:b+1, :t_len], duration[b:b+1], lens=lens[b:b+1], seed=0)
    worst = max(worst, (batched[b, :D] - alone[0, :D]).abs().max().item())
print(f"fixed={FIXED} max |batched sample - same sample alone| over each sample's frames: {worst:.3e}")
