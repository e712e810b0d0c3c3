# Blaizzy/mlx-audio commit a9754f4d ("fix(irodori-tts): mask empty captions and guard the tail trim"), Irodori-TTS
# (mlx_audio/tts/models/irodori_tts/irodori_tts.py generate_latents, model.py JointAttention / IrodoriDiT,
# sampling.py sample_euler_cfg). A caption-conditioned checkpoint (v4: speaker + caption, "dual" mode) used for
# voice cloning without a caption still tokenizes the empty caption to a BOS token, and _prepare_caption returns a
# mask with that BOS set, so every DiT block's joint attention over [latents, text, speaker, caption] keys sees a
# one-token caption instead of no caption at all (upstream zeroes the caption mask when the caption text is empty).
# Fix: `if not cap.strip(): caption_mask = mx.zeros_like(caption_mask)` right after _prepare_caption.
# Ported to torch, tiny sizes, no duration predictor (duration given as seconds), no DACVAE (the output is the
# sampled latent); the HF tokenizer is replaced by a small character tokenizer with the same encode_text contract.
import math
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

RotaryCache = Tuple[torch.Tensor, torch.Tensor]
KVCache = Tuple[torch.Tensor, torch.Tensor]


@dataclass
class IrodoriDiTConfig:
    latent_dim: int = 4
    latent_patch_size: int = 1
    speaker_patch_size: int = 2
    model_dim: int = 32
    num_heads: int = 2
    num_layers: int = 2
    mlp_ratio: float = 2.0
    adaln_rank: int = 8
    timestep_embed_dim: int = 16
    norm_eps: float = 1e-5
    text_vocab_size: int = 64
    text_dim: int = 32
    text_heads: int = 2
    text_layers: int = 1
    text_mlp_ratio_resolved: float = 2.0
    speaker_dim: int = 32
    speaker_heads: int = 2
    speaker_layers: int = 1
    speaker_mlp_ratio_resolved: float = 2.0
    caption_vocab_size_resolved: int = 64
    caption_dim_resolved: int = 32
    caption_heads_resolved: int = 2
    caption_layers_resolved: int = 1
    caption_mlp_ratio_resolved: float = 2.0
    use_speaker_condition_resolved: bool = True
    use_caption_condition: bool = True
    text_add_bos: bool = True
    caption_add_bos_resolved: bool = True

    @property
    def patched_latent_dim(self):
        return self.latent_dim * self.latent_patch_size

    @property
    def speaker_patched_latent_dim(self):
        return self.latent_dim * self.speaker_patch_size


@dataclass
class SamplerConfig:
    num_steps: int = 6
    cfg_scale_text: float = 3.0
    cfg_scale_speaker: float = 5.0
    cfg_scale_caption: float = 3.0
    cfg_guidance_mode: str = "independent"
    cfg_min_t: float = 0.5
    cfg_max_t: float = 1.0


@dataclass
class ModelConfig:
    dit: IrodoriDiTConfig
    sampler: SamplerConfig
    sample_rate: int = 48000
    audio_downsample_factor: int = 1920
    max_text_length: int = 16
    max_caption_length: int = 8


class CharTokenizer:
    """Stand-in for the HF tokenizer: ids 0 = pad, 1 = bos, characters from 2."""

    def __init__(self):
        self.padding_side = "left"
        self.pad_token_id = 0
        self.bos_token_id = 1

    def encode(self, text, add_special_tokens=False):
        return [2 + (ord(c) % 60) for c in text]


def normalize_text(text: str) -> str:
    return " ".join(text.split())


def encode_text(text, tokenizer, max_length, add_bos=True):
    tokenizer.padding_side = "right"
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    if add_bos:
        token_ids.insert(0, int(tokenizer.bos_token_id))
    token_ids = token_ids[:max_length]
    n = len(token_ids)
    ids = token_ids + [tokenizer.pad_token_id] * (max_length - n)
    mask = [True] * n + [False] * (max_length - n)
    return torch.tensor([ids], dtype=torch.long), torch.tensor([mask], dtype=torch.bool)


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> RotaryCache:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32)[: (dim // 2)] / float(dim)))
    t = torch.arange(end, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    return torch.cos(freqs), torch.sin(freqs)


def apply_rotary_emb(x, freqs_cis: RotaryCache):
    cos, sin = freqs_cis
    x_even = x[..., 0::2]
    x_odd = x[..., 1::2]
    cos = cos[None, :, None, :]
    sin = sin[None, :, None, :]
    x_rot_even = x_even * cos - x_odd * sin
    x_rot_odd = x_odd * cos + x_even * sin
    return torch.stack([x_rot_even, x_rot_odd], dim=-1).reshape(x.shape)


def get_timestep_embedding(timestep, embed_size: int):
    half = embed_size // 2
    base = math.log(10000.0)
    freqs = 1000.0 * torch.exp(-base * torch.arange(0, half, dtype=torch.float32) / float(half))
    args = timestep[..., None] * freqs[None, :]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


def _bool_to_additive_mask(mask):
    """Convert boolean mask (B, Sq, Sk) to additive float mask (B, 1, Sq, Sk)."""
    zero = torch.zeros(mask.shape, dtype=torch.float32)
    neg_inf = torch.full(mask.shape, -1e9, dtype=torch.float32)
    return torch.where(mask, zero, neg_inf)[:, None, :, :]


def patch_sequence_with_mask(seq, mask, patch_size: int):
    if patch_size <= 1:
        return seq, mask
    bsz, seq_len, dim = seq.shape
    usable = (seq_len // patch_size) * patch_size
    seq = seq[:, :usable].reshape(bsz, usable // patch_size, dim * patch_size)
    mask = mask[:, :usable].reshape(bsz, usable // patch_size, patch_size)
    mask = torch.all(mask, dim=-1)
    return seq, mask


class RMSNorm(nn.Module):
    def __init__(self, model_size, eps: float):
        super().__init__()
        self.eps = eps
        if isinstance(model_size, int):
            model_size = (model_size,)
        self.weight = nn.Parameter(torch.ones(model_size))

    def forward(self, x):
        x = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        return x * self.weight


class LowRankAdaLN(nn.Module):
    def __init__(self, model_dim: int, rank: int, eps: float):
        super().__init__()
        self.eps = eps
        rank = max(1, min(int(rank), int(model_dim)))
        self.shift_down = nn.Linear(model_dim, rank, bias=False)
        self.scale_down = nn.Linear(model_dim, rank, bias=False)
        self.gate_down = nn.Linear(model_dim, rank, bias=False)
        self.shift_up = nn.Linear(rank, model_dim, bias=True)
        self.scale_up = nn.Linear(rank, model_dim, bias=True)
        self.gate_up = nn.Linear(rank, model_dim, bias=True)

    def forward(self, x, cond_embed):
        shift, scale, gate = torch.chunk(cond_embed, 3, dim=-1)
        shift = self.shift_up(self.shift_down(F.silu(shift))) + shift
        scale = self.scale_up(self.scale_down(F.silu(scale))) + scale
        gate = self.gate_up(self.gate_down(F.silu(gate))) + gate
        x = x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)
        x = x * (1.0 + scale) + shift
        return x, torch.tanh(gate)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class SelfAttention(nn.Module):
    """Non-causal self-attention with RoPE and output gate (used in encoders)."""

    def __init__(self, dim: int, heads: int, norm_eps: float):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.gate = nn.Linear(dim, dim, bias=False)
        self.q_norm = RMSNorm((heads, self.head_dim), eps=norm_eps)
        self.k_norm = RMSNorm((heads, self.head_dim), eps=norm_eps)

    def forward(self, x, key_mask, freqs_cis):
        bsz, seq_len = x.shape[:2]
        q = self.wq(x).reshape(bsz, seq_len, self.heads, self.head_dim)
        k = self.wk(x).reshape(bsz, seq_len, self.heads, self.head_dim)
        v = self.wv(x).reshape(bsz, seq_len, self.heads, self.head_dim)
        gate = self.gate(x)
        q = self.q_norm(q)
        k = self.k_norm(k)
        q = apply_rotary_emb(q, (freqs_cis[0][:seq_len], freqs_cis[1][:seq_len]))
        k = apply_rotary_emb(k, (freqs_cis[0][:seq_len], freqs_cis[1][:seq_len]))
        attn_mask = None
        if key_mask is not None:
            m = key_mask[:, None, :].expand(bsz, seq_len, seq_len)
            attn_mask = _bool_to_additive_mask(m)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=attn_mask, scale=1.0 / math.sqrt(self.head_dim),
        )
        out = out.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.wo(out * torch.sigmoid(gate))


class JointAttention(nn.Module):
    """Joint attention over latent self-tokens, text context, and speaker/caption context (half-RoPE)."""

    def __init__(self, dim, heads, text_ctx_dim, speaker_ctx_dim, norm_eps, caption_ctx_dim=None):
        super().__init__()
        self.heads = heads
        self.head_dim = dim // heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wk_text = nn.Linear(text_ctx_dim, dim, bias=False)
        self.wv_text = nn.Linear(text_ctx_dim, dim, bias=False)
        self.gate = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)
        self.q_norm = RMSNorm((heads, self.head_dim), eps=norm_eps)
        self.k_norm = RMSNorm((heads, self.head_dim), eps=norm_eps)
        self.has_speaker_condition = speaker_ctx_dim is not None
        self.has_caption_condition = caption_ctx_dim is not None
        if speaker_ctx_dim is not None:
            self.wk_speaker = nn.Linear(speaker_ctx_dim, dim, bias=False)
            self.wv_speaker = nn.Linear(speaker_ctx_dim, dim, bias=False)
        if caption_ctx_dim is not None:
            self.wk_caption = nn.Linear(caption_ctx_dim, dim, bias=False)
            self.wv_caption = nn.Linear(caption_ctx_dim, dim, bias=False)

    def _apply_rotary_half(self, y, freqs_cis):
        half = y.shape[-2] // 2
        y1 = apply_rotary_emb(y[..., :half, :], freqs_cis)
        return torch.cat([y1, y[..., half:, :]], dim=-2)

    def get_kv_cache_text(self, text_state) -> KVCache:
        bsz = text_state.shape[0]
        k = self.wk_text(text_state).reshape(bsz, text_state.shape[1], self.heads, self.head_dim)
        v = self.wv_text(text_state).reshape(bsz, text_state.shape[1], self.heads, self.head_dim)
        return self.k_norm(k), v

    def get_kv_cache_speaker(self, speaker_state) -> KVCache:
        bsz = speaker_state.shape[0]
        k = self.wk_speaker(speaker_state).reshape(bsz, speaker_state.shape[1], self.heads, self.head_dim)
        v = self.wv_speaker(speaker_state).reshape(bsz, speaker_state.shape[1], self.heads, self.head_dim)
        return self.k_norm(k), v

    def get_kv_cache_caption(self, caption_state) -> KVCache:
        bsz = caption_state.shape[0]
        k = self.wk_caption(caption_state).reshape(bsz, caption_state.shape[1], self.heads, self.head_dim)
        v = self.wv_caption(caption_state).reshape(bsz, caption_state.shape[1], self.heads, self.head_dim)
        return self.k_norm(k), v

    def forward(self, x, text_mask, freqs_cis, kv_cache_text, kv_cache_speaker=None, speaker_mask=None,
                kv_cache_caption=None, caption_mask=None, start_pos=0):
        bsz, seq_len = x.shape[:2]
        q = self.wq(x).reshape(bsz, seq_len, self.heads, self.head_dim)
        k_self = self.wk(x).reshape(bsz, seq_len, self.heads, self.head_dim)
        v_self = self.wv(x).reshape(bsz, seq_len, self.heads, self.head_dim)
        gate = self.gate(x)
        q = self.q_norm(q)
        k_self = self.k_norm(k_self)
        q_cos = freqs_cis[0][start_pos : start_pos + seq_len]
        q_sin = freqs_cis[1][start_pos : start_pos + seq_len]
        q = self._apply_rotary_half(q, (q_cos, q_sin))
        k_self = self._apply_rotary_half(k_self, (q_cos, q_sin))

        k_text, v_text = kv_cache_text
        self_mask = torch.ones((bsz, seq_len), dtype=torch.bool)
        k_parts = [k_self, k_text]
        v_parts = [v_self, v_text]
        mask_parts = [self_mask, text_mask]
        if kv_cache_speaker is not None:
            k_spk, v_spk = kv_cache_speaker
            k_parts.append(k_spk)
            v_parts.append(v_spk)
            mask_parts.append(speaker_mask)
        if kv_cache_caption is not None:
            k_cap, v_cap = kv_cache_caption
            k_parts.append(k_cap)
            v_parts.append(v_cap)
            mask_parts.append(caption_mask)

        k = torch.cat(k_parts, dim=1)
        v = torch.cat(v_parts, dim=1)
        full_mask = torch.cat(mask_parts, dim=1)
        full_mask = full_mask[:, None, :].expand(bsz, seq_len, full_mask.shape[1])
        attn_mask = _bool_to_additive_mask(full_mask)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
            attn_mask=attn_mask, scale=1.0 / math.sqrt(self.head_dim),
        )
        out = out.transpose(1, 2).reshape(bsz, seq_len, -1)
        return self.wo(out * torch.sigmoid(gate))


class TextBlock(nn.Module):
    def __init__(self, dim, heads, mlp_hidden_dim, norm_eps):
        super().__init__()
        self.attention_norm = RMSNorm(dim, eps=norm_eps)
        self.attention = SelfAttention(dim, heads, norm_eps=norm_eps)
        self.mlp_norm = RMSNorm(dim, eps=norm_eps)
        self.mlp = SwiGLU(dim, mlp_hidden_dim)

    def forward(self, x, mask, freqs_cis):
        x = x + self.attention(self.attention_norm(x), key_mask=mask, freqs_cis=freqs_cis)
        x = x + self.mlp(self.mlp_norm(x))
        return x


class TextEncoder(nn.Module):
    """Embedding + non-causal blocks; masked positions are zeroed after each block (text and caption)."""

    def __init__(self, vocab_size, dim, heads, num_layers, mlp_ratio, norm_eps):
        super().__init__()
        self.head_dim = dim // heads
        self.text_embedding = nn.Embedding(vocab_size, dim)
        mlp_hidden = int(dim * mlp_ratio)
        self.blocks = nn.ModuleList([TextBlock(dim, heads, mlp_hidden, norm_eps) for _ in range(num_layers)])

    def forward(self, input_ids, mask=None):
        x = self.text_embedding(input_ids)
        freqs_cis = precompute_freqs_cis(self.head_dim, input_ids.shape[1])
        if mask is not None:
            mask_f = mask[..., None].to(x.dtype)
            x = x * mask_f
            for block in self.blocks:
                x = block(x, mask=mask, freqs_cis=freqs_cis)
                x = x * mask_f
            return x * mask_f
        for block in self.blocks:
            x = block(x, mask=None, freqs_cis=freqs_cis)
        return x


class ReferenceLatentEncoder(nn.Module):
    def __init__(self, in_dim, dim, heads, num_layers, mlp_ratio, norm_eps):
        super().__init__()
        self.head_dim = dim // heads
        self.in_proj = nn.Linear(in_dim, dim, bias=True)
        mlp_hidden = int(dim * mlp_ratio)
        self.blocks = nn.ModuleList([TextBlock(dim, heads, mlp_hidden, norm_eps) for _ in range(num_layers)])

    def forward(self, latent, mask=None):
        x = self.in_proj(latent) / 6.0
        freqs_cis = precompute_freqs_cis(self.head_dim, x.shape[1])
        mask_f = mask[..., None].to(x.dtype)
        x = x * mask_f
        for block in self.blocks:
            x = block(x, mask=mask, freqs_cis=freqs_cis)
            x = x * mask_f
        return x * mask_f


class DiffusionBlock(nn.Module):
    def __init__(self, dim, heads, mlp_hidden_dim, text_ctx_dim, speaker_ctx_dim, adaln_rank, norm_eps,
                 caption_ctx_dim=None):
        super().__init__()
        self.attention = JointAttention(dim, heads, text_ctx_dim, speaker_ctx_dim, norm_eps,
                                        caption_ctx_dim=caption_ctx_dim)
        self.mlp = SwiGLU(dim, mlp_hidden_dim)
        self.attention_adaln = LowRankAdaLN(dim, adaln_rank, norm_eps)
        self.mlp_adaln = LowRankAdaLN(dim, adaln_rank, norm_eps)

    def forward(self, x, cond_embed, text_mask, freqs_cis, kv_cache_text, kv_cache_speaker=None,
                speaker_mask=None, kv_cache_caption=None, caption_mask=None, start_pos=0):
        x_norm, attn_gate = self.attention_adaln(x, cond_embed)
        x = x + attn_gate * self.attention(x_norm, text_mask, freqs_cis, kv_cache_text, kv_cache_speaker,
                                           speaker_mask, kv_cache_caption, caption_mask, start_pos)
        x_norm, mlp_gate = self.mlp_adaln(x, cond_embed)
        x = x + mlp_gate * self.mlp(x_norm)
        return x


class IrodoriDiT(nn.Module):
    def __init__(self, cfg: IrodoriDiTConfig):
        super().__init__()
        self.cfg = cfg
        self.head_dim = cfg.model_dim // cfg.num_heads
        self.text_encoder = TextEncoder(cfg.text_vocab_size, cfg.text_dim, cfg.text_heads, cfg.text_layers,
                                        cfg.text_mlp_ratio_resolved, cfg.norm_eps)
        self.text_norm = RMSNorm(cfg.text_dim, eps=cfg.norm_eps)
        self.speaker_encoder = ReferenceLatentEncoder(cfg.speaker_patched_latent_dim, cfg.speaker_dim,
                                                      cfg.speaker_heads, cfg.speaker_layers,
                                                      cfg.speaker_mlp_ratio_resolved, cfg.norm_eps)
        self.speaker_norm = RMSNorm(cfg.speaker_dim, eps=cfg.norm_eps)
        self.caption_encoder = TextEncoder(cfg.caption_vocab_size_resolved, cfg.caption_dim_resolved,
                                           cfg.caption_heads_resolved, cfg.caption_layers_resolved,
                                           cfg.caption_mlp_ratio_resolved, cfg.norm_eps)
        self.caption_norm = RMSNorm(cfg.caption_dim_resolved, eps=cfg.norm_eps)
        self.cond_module = nn.Sequential(
            nn.Linear(cfg.timestep_embed_dim, cfg.model_dim, bias=False), nn.SiLU(),
            nn.Linear(cfg.model_dim, cfg.model_dim, bias=False), nn.SiLU(),
            nn.Linear(cfg.model_dim, cfg.model_dim * 3, bias=False),
        )
        self.in_proj = nn.Linear(cfg.patched_latent_dim, cfg.model_dim, bias=True)
        mlp_hidden = int(cfg.model_dim * cfg.mlp_ratio)
        self.blocks = nn.ModuleList([
            DiffusionBlock(cfg.model_dim, cfg.num_heads, mlp_hidden, cfg.text_dim, cfg.speaker_dim,
                           cfg.adaln_rank, cfg.norm_eps, caption_ctx_dim=cfg.caption_dim_resolved)
            for _ in range(cfg.num_layers)
        ])
        self.out_norm = RMSNorm(cfg.model_dim, eps=cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.model_dim, cfg.patched_latent_dim, bias=True)

    def encode_conditions_full(self, text_input_ids, text_mask, ref_latent=None, ref_mask=None,
                               caption_input_ids=None, caption_mask=None):
        text_state = self.text_norm(self.text_encoder(text_input_ids, text_mask))
        speaker_state = speaker_mask = None
        if self.cfg.use_speaker_condition_resolved:
            ref_latent_p, ref_mask_p = patch_sequence_with_mask(ref_latent, ref_mask, self.cfg.speaker_patch_size)
            speaker_state = self.speaker_norm(self.speaker_encoder(ref_latent_p, ref_mask_p))
            speaker_mask = ref_mask_p
        out_caption_state = out_caption_mask = None
        if self.cfg.use_caption_condition and caption_input_ids is not None and caption_mask is not None:
            out_caption_state = self.caption_norm(self.caption_encoder(caption_input_ids, caption_mask))
            out_caption_mask = caption_mask
        return text_state, text_mask, speaker_state, speaker_mask, out_caption_state, out_caption_mask

    def build_kv_cache(self, text_state, speaker_state=None, caption_state=None):
        kv_text = [block.attention.get_kv_cache_text(text_state) for block in self.blocks]
        kv_speaker = None
        if speaker_state is not None:
            kv_speaker = [block.attention.get_kv_cache_speaker(speaker_state) for block in self.blocks]
        kv_caption = None
        if caption_state is not None:
            kv_caption = [block.attention.get_kv_cache_caption(caption_state) for block in self.blocks]
        return kv_text, kv_speaker, kv_caption

    def forward_with_conditions(self, x_t, t, text_state, text_mask, speaker_state, speaker_mask, kv_text=None,
                                kv_speaker=None, start_pos=0, caption_state=None, caption_mask=None,
                                kv_caption=None):
        t_embed = get_timestep_embedding(t, self.cfg.timestep_embed_dim)
        cond_embed = self.cond_module(t_embed)[:, None, :]
        x = self.in_proj(x_t)
        freqs_cis = precompute_freqs_cis(self.head_dim, start_pos + x.shape[1])
        for i, block in enumerate(self.blocks):
            kv_t = kv_text[i] if kv_text is not None else block.attention.get_kv_cache_text(text_state)
            kv_s = None
            if speaker_state is not None:
                kv_s = kv_speaker[i] if kv_speaker is not None else block.attention.get_kv_cache_speaker(speaker_state)
            kv_c = None
            if caption_state is not None:
                kv_c = kv_caption[i] if kv_caption is not None else block.attention.get_kv_cache_caption(caption_state)
            x = block(x, cond_embed, text_mask, freqs_cis, kv_t, kv_s, speaker_mask, kv_c, caption_mask, start_pos)
        x = self.out_norm(x)
        return self.out_proj(x).float()


def _concat_kv_caches(*caches):
    result = []
    for i in range(len(caches[0])):
        k = torch.cat([c[i][0] for c in caches], dim=0)
        v = torch.cat([c[i][1] for c in caches], dim=0)
        result.append((k, v))
    return result


@torch.no_grad()
def sample_euler_cfg(model: IrodoriDiT, text_input_ids, text_mask, ref_latent, ref_mask, latent_dim, rng_seed=0,
                     sequence_length=750, num_steps=40, cfg_scale_text=3.0, cfg_scale_speaker=5.0,
                     cfg_scale_caption=3.0, cfg_guidance_mode="independent", cfg_min_t=0.5, cfg_max_t=1.0,
                     caption_input_ids=None, caption_mask=None, **_ignored):
    """Euler sampler for the rectified-flow ODE with classifier-free guidance (dual mode, independent)."""
    batch_size = text_input_ids.shape[0]
    has_text_cfg = cfg_scale_text > 0
    has_speaker_cfg = cfg_scale_speaker > 0
    has_caption_cfg = cfg_scale_caption > 0

    (text_state_cond, text_mask_cond, speaker_state_cond, speaker_mask_cond, caption_state_cond,
     caption_mask_cond) = model.encode_conditions_full(
        text_input_ids=text_input_ids, text_mask=text_mask, ref_latent=ref_latent, ref_mask=ref_mask,
        caption_input_ids=caption_input_ids, caption_mask=caption_mask,
    )
    text_state_uncond = torch.zeros_like(text_state_cond)
    text_mask_uncond = torch.zeros_like(text_mask_cond)
    speaker_state_uncond = torch.zeros_like(speaker_state_cond)
    speaker_mask_uncond = torch.zeros_like(speaker_mask_cond)
    caption_state_uncond = torch.zeros_like(caption_state_cond)
    caption_mask_uncond = torch.zeros_like(caption_mask_cond)

    kv_text_cond, kv_speaker_cond, kv_caption_cond = model.build_kv_cache(
        text_state_cond, speaker_state_cond, caption_state_cond
    )
    n_bundles = 1 + sum([has_text_cfg, has_speaker_cfg, has_caption_cfg])
    kv_text_cfg = _concat_kv_caches(*([kv_text_cond] * n_bundles))
    kv_speaker_cfg = _concat_kv_caches(*([kv_speaker_cond] * n_bundles))
    kv_caption_cfg = _concat_kv_caches(*([kv_caption_cond] * n_bundles))

    gen = torch.Generator().manual_seed(rng_seed)
    init_scale = 0.999
    x_t = torch.randn((batch_size, sequence_length, latent_dim), generator=gen)
    t_schedule = torch.linspace(1.0 * init_scale, 0.0, num_steps + 1).tolist()

    for i in range(num_steps):
        t = float(t_schedule[i])
        t_next = float(t_schedule[i + 1])
        t_arr = torch.full((batch_size,), t, dtype=torch.float32)
        use_cfg = (has_text_cfg or has_speaker_cfg) and (cfg_min_t <= t <= cfg_max_t)
        if use_cfg:
            bundles_x = [x_t]
            bundles_t = [text_state_cond]
            bundles_tm = [text_mask_cond]
            bundles_s = [speaker_state_cond]
            bundles_sm = [speaker_mask_cond]
            bundles_c = [caption_state_cond]
            bundles_cm = [caption_mask_cond]
            if has_text_cfg:
                bundles_x.append(x_t); bundles_t.append(text_state_uncond); bundles_tm.append(text_mask_uncond)
                bundles_s.append(speaker_state_cond); bundles_sm.append(speaker_mask_cond)
                bundles_c.append(caption_state_cond); bundles_cm.append(caption_mask_cond)
            if has_speaker_cfg:
                bundles_x.append(x_t); bundles_t.append(text_state_cond); bundles_tm.append(text_mask_cond)
                bundles_s.append(speaker_state_uncond); bundles_sm.append(speaker_mask_uncond)
                bundles_c.append(caption_state_cond); bundles_cm.append(caption_mask_cond)
            if has_caption_cfg:
                bundles_x.append(x_t); bundles_t.append(text_state_cond); bundles_tm.append(text_mask_cond)
                bundles_s.append(speaker_state_cond); bundles_sm.append(speaker_mask_cond)
                bundles_c.append(caption_state_uncond); bundles_cm.append(caption_mask_uncond)
            n_b = len(bundles_x)
            v_out = model.forward_with_conditions(
                x_t=torch.cat(bundles_x, dim=0),
                t=torch.full((batch_size * n_b,), t, dtype=torch.float32),
                text_state=torch.cat(bundles_t, dim=0),
                text_mask=torch.cat(bundles_tm, dim=0),
                speaker_state=torch.cat(bundles_s, dim=0),
                speaker_mask=torch.cat(bundles_sm, dim=0),
                kv_text=kv_text_cfg,
                kv_speaker=kv_speaker_cfg,
                caption_state=torch.cat(bundles_c, dim=0),
                caption_mask=torch.cat(bundles_cm, dim=0),
                kv_caption=kv_caption_cfg,
            )
            splits = torch.chunk(v_out, n_b, dim=0)
            v_cond = splits[0]
            v_pred = v_cond
            idx = 1
            if has_text_cfg:
                v_pred = v_pred + cfg_scale_text * (v_cond - splits[idx])
                idx += 1
            if has_speaker_cfg:
                v_pred = v_pred + cfg_scale_speaker * (v_cond - splits[idx])
                idx += 1
            if has_caption_cfg:
                v_pred = v_pred + cfg_scale_caption * (v_cond - splits[idx])
        else:
            v_pred = model.forward_with_conditions(
                x_t=x_t, t=t_arr, text_state=text_state_cond, text_mask=text_mask_cond,
                speaker_state=speaker_state_cond, speaker_mask=speaker_mask_cond, kv_text=kv_text_cond,
                kv_speaker=kv_speaker_cond, caption_state=caption_state_cond, caption_mask=caption_mask_cond,
                kv_caption=kv_caption_cond,
            )
        x_t = x_t + v_pred * (t_next - t)
    return x_t


class Model(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.model = IrodoriDiT(config.dit)
        self._tokenizer = CharTokenizer()

    def _prepare_text(self, text):
        return encode_text(normalize_text(text), tokenizer=self._tokenizer, max_length=self.config.max_text_length,
                           add_bos=self.config.dit.text_add_bos)

    def _prepare_caption(self, caption):
        return encode_text(caption, tokenizer=self._tokenizer, max_length=self.config.max_caption_length,
                           add_bos=self.config.dit.caption_add_bos_resolved)

    def generate_latents(self, text, ref_latent=None, ref_mask=None, caption=None, rng_seed=0, seconds=None,
                         min_seconds=0.5, max_seconds=30.0, **sampling_kwargs):
        text_input_ids, text_mask = self._prepare_text(text)
        caption_input_ids = None
        caption_mask = None
        if self.config.dit.use_caption_condition:
            cap = caption or ""
            caption_input_ids, caption_mask = self._prepare_caption(cap)
            if FIXED and not cap.strip():
                # An empty caption still tokenizes to a BOS token; mask it out entirely.
                caption_mask = torch.zeros_like(caption_mask)

        if self.config.dit.use_speaker_condition_resolved:
            if ref_latent is None:
                ref_latent = torch.zeros((1, self.config.dit.speaker_patch_size, self.config.dit.latent_dim))
            if ref_mask is None:
                ref_mask = torch.zeros((1, ref_latent.shape[1]), dtype=torch.bool)

        clamped_seconds = min(max_seconds, max(min_seconds, float(seconds)))
        target_samples = int(clamped_seconds * self.config.sample_rate)
        latent_steps = math.ceil(target_samples / self.config.audio_downsample_factor)
        patched_steps = math.ceil(latent_steps / self.config.dit.latent_patch_size)

        sampler_cfg = dict(self.config.sampler.__dict__)
        for k, v in sampling_kwargs.items():
            if k in sampler_cfg:
                sampler_cfg[k] = v
        latent_out = sample_euler_cfg(
            model=self.model, text_input_ids=text_input_ids, text_mask=text_mask, ref_latent=ref_latent,
            ref_mask=ref_mask, caption_input_ids=caption_input_ids, caption_mask=caption_mask, rng_seed=rng_seed,
            latent_dim=self.config.dit.patched_latent_dim, sequence_length=patched_steps, **sampler_cfg,
        )
        return latent_out, latent_steps


def main():
    config = ModelConfig(dit=IrodoriDiTConfig(), sampler=SamplerConfig())
    model = Model(config).eval()
    # Voice cloning without a caption: a reference clip's latent (already DACVAE-encoded) and no caption text.
    ref_latent = torch.randn(1, 8, config.dit.latent_dim)
    ref_mask = torch.ones(1, 8, dtype=torch.bool)
    latent, steps = model.generate_latents(
        "konnichiwa sekai", ref_latent=ref_latent, ref_mask=ref_mask, caption=None, rng_seed=0, seconds=0.5,
    )
    print("latent steps:", steps, "shape:", tuple(latent.shape))
    print("latent mean/std:", round(latent.mean().item(), 5), round(latent.std().item(), 5))
    print("first frame:", [round(v, 4) for v in latent[0, 0].tolist()])


if __name__ == "__main__":
    main()
