"""OpenAI Whisper (openai/whisper whisper/model.py, decoding.py, timing.py): hook KV cache and alignment pass.

Follows openai/whisper: ModelDimensions dataclass; TextDecoder registers `mask = empty(n_ctx, n_ctx).fill_(-inf)
.triu_(1)`; MultiHeadAttention.qkv_attention uses SDPA with `is_causal=mask is not None and n_ctx > 1` when
`use_sdpa`, else adds `mask[:n_ctx, :n_ctx]` to q @ k; `install_kv_cache_hooks` caches key/value Linear outputs
with forward hooks (append for self-attention, store once for cross-attention); decoding feeds the whole SOT
sequence first and then one token per step with the offset taken from the cache length; timing.find_alignment
re-runs the full sequence under `disable_sdpa()` and hooks the cross-attention weights.

Masks meant:
- audio encoder: full bidirectional over the fixed-length (padded-to-30s) mel frames, no mask by design;
- decoder self-attention: causal; on cached steps the single new token sees all cached tokens, no mask;
- cross-attention: every text token sees every audio frame, no mask. 14 text tokens vs 12 audio frames here.
"""
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn


@dataclass
class ModelDimensions:
    n_mels: int = 8
    n_audio_ctx: int = 12
    n_audio_state: int = 32
    n_audio_head: int = 4
    n_audio_layer: int = 2
    n_vocab: int = 60
    n_text_ctx: int = 16
    n_text_state: int = 32
    n_text_head: int = 4
    n_text_layer: int = 2


def sinusoids(length, channels, max_timescale=10000):
    log_timescale_increment = np.log(max_timescale) / (channels // 2 - 1)
    inv_timescales = torch.exp(-log_timescale_increment * torch.arange(channels // 2))
    scaled_time = torch.arange(length)[:, np.newaxis] * inv_timescales[np.newaxis, :]
    return torch.cat([torch.sin(scaled_time), torch.cos(scaled_time)], dim=1)


@contextmanager
def disable_sdpa():
    prev_state = MultiHeadAttention.use_sdpa
    try:
        MultiHeadAttention.use_sdpa = False
        yield
    finally:
        MultiHeadAttention.use_sdpa = prev_state


class MultiHeadAttention(nn.Module):
    use_sdpa = True

    def __init__(self, n_state, n_head):
        super().__init__()
        self.n_head = n_head
        self.query = nn.Linear(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)

    def forward(self, x, xa=None, mask=None, kv_cache=None):
        q = self.query(x)
        if kv_cache is None or xa is None or self.key not in kv_cache:
            # hooks, if installed, replace k and v by the cached tensors
            k = self.key(x if xa is None else xa)
            v = self.value(x if xa is None else xa)
        else:
            k = kv_cache[self.key]
            v = kv_cache[self.value]
        wv, qk = self.qkv_attention(q, k, v, mask)
        return self.out(wv), qk

    def qkv_attention(self, q, k, v, mask=None):
        n_batch, n_ctx, n_state = q.shape
        scale = (n_state // self.n_head) ** -0.25
        q = q.view(*q.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        k = k.view(*k.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        v = v.view(*v.shape[:2], self.n_head, -1).permute(0, 2, 1, 3)
        if MultiHeadAttention.use_sdpa:
            a = F.scaled_dot_product_attention(q, k, v, is_causal=mask is not None and n_ctx > 1)
            out = a.permute(0, 2, 1, 3).flatten(start_dim=2)
            qk = None
        else:
            qk = (q * scale) @ (k * scale).transpose(-1, -2)
            if mask is not None:
                qk = qk + mask[:n_ctx, :n_ctx]
            qk = qk.float()
            w = F.softmax(qk, dim=-1).to(q.dtype)
            out = (w @ v).permute(0, 2, 1, 3).flatten(start_dim=2)
            qk = qk.detach()
        return out, qk


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state, n_head, cross_attention=False):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head)
        self.attn_ln = nn.LayerNorm(n_state)
        self.cross_attn = MultiHeadAttention(n_state, n_head) if cross_attention else None
        self.cross_attn_ln = nn.LayerNorm(n_state) if cross_attention else None
        self.mlp = nn.Sequential(nn.Linear(n_state, n_state * 4), nn.GELU(), nn.Linear(n_state * 4, n_state))
        self.mlp_ln = nn.LayerNorm(n_state)

    def forward(self, x, xa=None, mask=None, kv_cache=None):
        x = x + self.attn(self.attn_ln(x), mask=mask, kv_cache=kv_cache)[0]
        if self.cross_attn:
            x = x + self.cross_attn(self.cross_attn_ln(x), xa, kv_cache=kv_cache)[0]
        return x + self.mlp(self.mlp_ln(x))


class AudioEncoder(nn.Module):
    def __init__(self, n_mels, n_ctx, n_state, n_head, n_layer):
        super().__init__()
        self.conv1 = nn.Conv1d(n_mels, n_state, kernel_size=3, padding=1)
        self.conv2 = nn.Conv1d(n_state, n_state, kernel_size=3, stride=2, padding=1)
        self.register_buffer("positional_embedding", sinusoids(n_ctx, n_state))
        self.blocks = nn.ModuleList([ResidualAttentionBlock(n_state, n_head) for _ in range(n_layer)])
        self.ln_post = nn.LayerNorm(n_state)

    def forward(self, x):
        x = F.gelu(self.conv1(x))
        x = F.gelu(self.conv2(x))
        x = x.permute(0, 2, 1)
        assert x.shape[1:] == self.positional_embedding.shape, "incorrect audio shape"
        x = x + self.positional_embedding
        for block in self.blocks:
            x = block(x)
        return self.ln_post(x)


class TextDecoder(nn.Module):
    def __init__(self, n_vocab, n_ctx, n_state, n_head, n_layer):
        super().__init__()
        self.token_embedding = nn.Embedding(n_vocab, n_state)
        self.positional_embedding = nn.Parameter(torch.empty(n_ctx, n_state).normal_(std=0.02))
        self.blocks = nn.ModuleList([ResidualAttentionBlock(n_state, n_head, cross_attention=True)
                                     for _ in range(n_layer)])
        self.ln = nn.LayerNorm(n_state)
        mask = torch.empty(n_ctx, n_ctx).fill_(-np.inf).triu_(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x, xa, kv_cache=None):
        offset = next(iter(kv_cache.values())).shape[1] if kv_cache else 0
        x = self.token_embedding(x) + self.positional_embedding[offset: offset + x.shape[-1]]
        for block in self.blocks:
            x = block(x, xa, mask=self.mask, kv_cache=kv_cache)
        x = self.ln(x)
        return (x @ torch.transpose(self.token_embedding.weight, 0, 1)).float()


class Whisper(nn.Module):
    def __init__(self, dims: ModelDimensions):
        super().__init__()
        self.dims = dims
        self.encoder = AudioEncoder(dims.n_mels, dims.n_audio_ctx, dims.n_audio_state, dims.n_audio_head,
                                    dims.n_audio_layer)
        self.decoder = TextDecoder(dims.n_vocab, dims.n_text_ctx, dims.n_text_state, dims.n_text_head,
                                   dims.n_text_layer)

    def install_kv_cache_hooks(self, cache=None):
        cache = {**cache} if cache is not None else {}
        hooks = []

        def save_to_cache(module, _, output):
            if module not in cache or output.shape[1] > self.dims.n_text_ctx:
                # save as-is, for the first token or cross attention
                cache[module] = output
            else:
                cache[module] = torch.cat([cache[module], output], dim=1).detach()
            return cache[module]

        def install_hooks(layer: nn.Module):
            if isinstance(layer, MultiHeadAttention):
                hooks.append(layer.key.register_forward_hook(save_to_cache))
                hooks.append(layer.value.register_forward_hook(save_to_cache))

        self.decoder.apply(install_hooks)
        return cache, hooks


def main():
    torch.manual_seed(0)
    dims = ModelDimensions()
    model = Whisper(dims).eval()
    mel = torch.randn(2, dims.n_mels, 2 * dims.n_audio_ctx)
    sot_sequence = torch.tensor([[50 % dims.n_vocab, 51, 52, 53]] * 2)  # <|sot|><|en|><|transcribe|><|notimestamps|>

    with torch.no_grad():
        audio_features = model.encoder(mel)
        kv_cache, hooks = model.install_kv_cache_hooks()
        tokens = sot_sequence
        logits = model.decoder(tokens, audio_features, kv_cache=kv_cache)
        for _ in range(10):
            next_tokens = logits[:, -1].argmax(-1, keepdim=True)
            tokens = torch.cat([tokens, next_tokens], dim=-1)
            logits = model.decoder(next_tokens, audio_features, kv_cache=kv_cache)
        for hook in hooks:
            hook.remove()

        # timing.find_alignment: one full pass without SDPA, collecting the cross-attention weights
        QKs = [None] * dims.n_text_layer
        hooks = [block.cross_attn.register_forward_hook(
            lambda _, ins, outs, index=i: QKs.__setitem__(index, outs[-1][0]))
            for i, block in enumerate(model.decoder.blocks)]
        with disable_sdpa():
            full_logits = model.decoder(tokens, audio_features)
        for hook in hooks:
            hook.remove()

    assert torch.allclose(full_logits[:, -1], logits[:, -1], atol=1e-4)
    weights = torch.stack(QKs).softmax(dim=-1)
    assert weights.shape == (dims.n_text_layer, dims.n_text_head, tokens.shape[1], dims.n_audio_ctx)
    print(tokens[:, 4:].tolist())


if __name__ == "__main__":
    main()
