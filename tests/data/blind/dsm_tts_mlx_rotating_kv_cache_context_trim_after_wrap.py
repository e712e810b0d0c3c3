# kyutai-labs/delayed-streams-modeling#108 (commit cf97f8d, "Workaround for the mlx kv-cache bug", issue #106:
# "Audio becomes garbled after 5 mins"). scripts/tts_mlx.py builds moshi_mlx's Lm from its config, whose
# transformer has context=3000 and max_seq_len=4096; the main transformer's cache is a RotatingKVCache of
# max_size=max_seq_len, and Attention keeps the last `context` keys by slicing the tail of what the cache returns.
# Once the ring has wrapped (step >= max_seq_len) the buffer is no longer in time order, so the tail slice keeps
# stale slots and drops the newest keys (moshi_mlx <= 0.3.0).
# Fix (workaround in the script): lm_config.transformer.max_seq_len = lm_config.transformer.context, so the ring
# holds exactly the context window and nothing is sliced off.
# Ported to torch from moshi_mlx/modules/transformer.py (TransformerConfig, Attention, make_rot_cache) and
# moshi_mlx/modules/kv_cache.py (RotatingKVCache), sizes shrunk (context=6, max_seq_len=10).
import sys
from dataclasses import dataclass

import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class TransformerConfig:
    d_model: int
    num_heads: int
    num_layers: int
    causal: bool
    norm_first: bool
    bias_ff: bool
    bias_attn: bool
    layer_scale: float | None
    positional_embedding: str
    gating: bool
    norm: str
    context: int
    max_period: int
    max_seq_len: int
    kv_repeat: int
    dim_feedforward: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.num_heads


@dataclass
class LmConfig:
    transformer: TransformerConfig
    text_in_vocab_size: int
    text_out_vocab_size: int
    audio_vocab_size: int

    @classmethod
    def from_config_dict(cls, data: dict) -> "LmConfig":
        transformer = TransformerConfig(
            d_model=data["dim"],
            num_heads=data["num_heads"],
            num_layers=data["num_layers"],
            causal=data["causal"],
            norm_first=True,
            bias_ff=False,
            bias_attn=False,
            layer_scale=data["layer_scale"],
            positional_embedding=data["positional_embedding"],
            gating=data["gating"] != "none",
            norm=data["norm"],
            context=data["context"],
            max_period=data["max_period"],
            max_seq_len=4096 if data.get("max_seq_len") is None else data["max_seq_len"],
            kv_repeat=1,
            dim_feedforward=int(data["hidden_scale"] * data["dim"]),
        )
        return cls(
            transformer=transformer,
            text_in_vocab_size=data["text_card"] + 1,
            text_out_vocab_size=data["text_card"],
            audio_vocab_size=data["card"] + 2,
        )


def rope_traditional(x, offset, base):
    # mlx nn.RoPE(dims, traditional=True): rotate consecutive pairs (x[2i], x[2i+1])
    b, h, t, d = x.shape
    inv = base ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    pos = torch.arange(offset, offset + t, dtype=torch.float32)
    ang = pos[:, None] * inv[None, :]
    cos, sin = torch.cos(ang), torch.sin(ang)
    x = x.view(b, h, t, d // 2, 2)
    x0, x1 = x[..., 0], x[..., 1]
    return torch.stack([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1).view(b, h, t, d)


class RotatingKVCache:
    def __init__(self, head_dim, n_kv_heads, max_size, keep=0, step=256):
        self.n_kv_heads = n_kv_heads
        self.k_head_dim = self.v_head_dim = head_dim
        self.keep = keep
        self.keys = None
        self.values = None
        self.offset = 0
        self.max_size = max_size
        self.step = step
        self._idx = 0

    def _trim(self, trim_size, v, append=None):
        if trim_size > 0:
            to_cat = [v[..., : self.keep, :], v[..., trim_size + self.keep :, :]]
        else:
            to_cat = [v]
        if append is not None:
            to_cat.append(append)
        return torch.cat(to_cat, dim=2)

    def update_and_fetch(self, keys, values):
        prev = self.offset
        B, _, S = keys.shape[:3]

        # Prefill mode
        if S > 1:
            if self.keys is None:
                self.keys = keys
                self.values = values
            else:
                trim_size = self.keys.shape[2] - self.max_size + 1
                self.keys = self._trim(trim_size, self.keys, keys)
                self.values = self._trim(trim_size, self.values, values)
            self.offset += S
            self._idx = self.keys.shape[2]
            return self.keys, self.values

        # Generation mode
        if self.keys is None or (prev >= self.keys.shape[2] and self.keys.shape[2] < self.max_size):
            new_size = min(self.step, self.max_size - prev)
            new_k = torch.zeros((B, self.n_kv_heads, new_size, self.k_head_dim), dtype=keys.dtype)
            new_v = torch.zeros((B, self.n_kv_heads, new_size, self.v_head_dim), dtype=values.dtype)
            if self.keys is not None:
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
            self._idx = prev

        trim_size = self.keys.shape[2] - self.max_size
        if trim_size > 0:
            self.keys = self._trim(trim_size, self.keys)
            self.values = self._trim(trim_size, self.values)
            self._idx = self.max_size

        # Rotate
        if self._idx == self.max_size:
            self._idx = self.keep

        # Assign
        self.keys[..., self._idx : self._idx + 1, :] = keys
        self.values[..., self._idx : self._idx + 1, :] = values
        self.offset += 1
        self._idx += 1

        if self.offset < self.max_size:
            return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]
        return self.keys, self.values


class Attention(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        num_kv = cfg.num_heads // cfg.kv_repeat
        out_dim = cfg.d_model + 2 * num_kv * cfg.d_model // cfg.num_heads
        self.cfg = cfg
        self.in_proj = nn.Linear(cfg.d_model, out_dim, bias=cfg.bias_attn)
        self.out_proj = nn.Linear(cfg.d_model, cfg.d_model, bias=cfg.bias_attn)
        self.scale = cfg.head_dim ** (-0.5)

    def forward(self, xs, cache: RotatingKVCache, mask=None):
        b, t, hd = xs.shape
        qkv = self.in_proj(xs).reshape(b, t, 3, self.cfg.num_heads, self.cfg.head_dim)
        q = qkv[:, :, 0].transpose(1, 2)
        k = qkv[:, :, 1].transpose(1, 2)
        v = qkv[:, :, 2].transpose(1, 2)
        if self.cfg.positional_embedding == "rope":
            q = rope_traditional(q, cache.offset, self.cfg.max_period)
            k = rope_traditional(k, cache.offset, self.cfg.max_period)

        k, v = cache.update_and_fetch(k, v)
        k_len = k.shape[2]
        k_target_len = t + min(self.cfg.context, k_len - t)
        if k_target_len < k_len:
            k = k[:, :, k_len - k_target_len :]
            v = v[:, :, k_len - k_target_len :]

        xs = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)
        xs = xs.transpose(1, 2).reshape(b, t, hd)
        return self.out_proj(xs)


class MlpGating(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        hidden = 2 * cfg.dim_feedforward // 3
        self.linear_in = nn.Linear(cfg.d_model, 2 * hidden, bias=cfg.bias_ff)
        self.linear_out = nn.Linear(hidden, cfg.d_model, bias=cfg.bias_ff)

    def forward(self, xs):
        xs = self.linear_in(xs)
        b, t, _ = xs.shape
        xs = xs.reshape(b, t, 2, -1)
        return self.linear_out(F.silu(xs[:, :, 0]) * xs[:, :, 1])


class TransformerLayer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.gating = MlpGating(cfg)
        self.norm1 = nn.RMSNorm(cfg.d_model, eps=1e-8)
        self.norm2 = nn.RMSNorm(cfg.d_model, eps=1e-8)
        self.self_attn = Attention(cfg)

    def forward(self, xs, cache):
        xs = xs + self.self_attn(self.norm1(xs), cache=cache)
        xs = xs + self.gating(self.norm2(xs))
        return xs


class Transformer(nn.Module):
    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList([TransformerLayer(cfg) for _ in range(cfg.num_layers)])

    def forward(self, xs, cache):
        for layer, c in zip(self.layers, cache):
            xs = layer(xs, cache=c)
        return xs

    def make_rot_cache(self):
        num_kv_heads = self.cfg.num_heads // self.cfg.kv_repeat
        return [
            RotatingKVCache(head_dim=self.cfg.head_dim, n_kv_heads=num_kv_heads, max_size=self.cfg.max_seq_len)
            for _ in self.layers
        ]


class Lm(nn.Module):
    """The temporal transformer of moshi_mlx's Lm: text + one audio codebook summed in, text logits out."""

    def __init__(self, cfg: LmConfig):
        super().__init__()
        self.cfg = cfg
        d = cfg.transformer.d_model
        self.text_emb = nn.Embedding(cfg.text_in_vocab_size, d)
        self.audio_emb = nn.Embedding(cfg.audio_vocab_size, d)
        self.transformer = Transformer(cfg.transformer)
        self.out_norm = nn.RMSNorm(d, eps=1e-8)
        self.text_linear = nn.Linear(d, cfg.text_out_vocab_size, bias=False)
        self.audio_linear = nn.Linear(d, cfg.audio_vocab_size - 2, bias=False)
        self.transformer_cache = self.transformer.make_rot_cache()

    def step(self, text_token, audio_token):
        xs = self.text_emb(text_token) + self.audio_emb(audio_token)
        xs = self.transformer(xs, cache=self.transformer_cache)
        xs = self.out_norm(xs)
        return self.text_linear(xs)[:, -1], self.audio_linear(xs)[:, -1]


raw_config = {
    "dim": 32, "num_heads": 4, "num_layers": 2, "causal": True, "layer_scale": None,
    "positional_embedding": "rope", "gating": "silu", "norm": "rms_norm", "context": 6,
    "max_period": 10000, "max_seq_len": 10, "hidden_scale": 4.125, "text_card": 40, "card": 30,
}
lm_config = LmConfig.from_config_dict(raw_config)
if FIXED:
    # There is a bug in moshi_mlx <= 0.3.0 handling of the ring kv cache.
    # The following line gets around it for now.
    lm_config.transformer.max_seq_len = lm_config.transformer.context
model = Lm(lm_config).eval()

# Streaming TTS loop (greedy): each step feeds the last text token and audio token back in.
text_token = torch.tensor([[lm_config.text_out_vocab_size]])  # text start token
audio_token = torch.tensor([[lm_config.audio_vocab_size - 1]])  # audio start token
text_out, audio_out, logit_sums = [], [], []
with torch.no_grad():
    for step in range(24):
        text_logits, audio_logits = model.step(text_token, audio_token)
        text_token = text_logits.argmax(-1, keepdim=True)
        audio_token = audio_logits.argmax(-1, keepdim=True)
        text_out.append(int(text_token))
        audio_out.append(int(audio_token))
        logit_sums.append(round(float(audio_logits.abs().sum()), 4))

print("cache max_size:", model.transformer_cache[0].max_size, "context:", lm_config.transformer.context)
print("text tokens :", text_out)
print("audio tokens:", audio_out)
print("audio logit |sum| per step:", logit_sums)
