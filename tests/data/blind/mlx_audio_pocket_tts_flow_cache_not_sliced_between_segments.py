# Blaizzy/mlx-audio#486 (commit 401bddf4, "Properly slice cache for each segment"), Pocket TTS
# (mlx_audio/tts/models/pocket_tts/pocket_tts.py). generate_audio_stream splits long text into sentence chunks and
# runs each through the flow LM with the same model_state, whose flow_cache holds the voice prompt's frames. The
# cache was never cut back between chunks, so chunk 2's text and latents were appended after chunk 1's text and
# generated frames: its queries attend to the previous segment and its RoPE offsets start past it.
# Fix: remember the prompt's frame count (_get_flow_cache_num_frames) and _slice_flow_cache(model_state,
# prompt_num_frames) before every chunk.
# Ported to torch (mlx_lm KVCache, StreamingMultiheadAttention with create_additive_causal_mask, apply_rope,
# FlowLMModel.backbone, lsd_decode), tiny sizes; the sentencepiece tokenizer and Mimi decoder are left out
# (chunks are given as token ids, the output is the latent frames).
import math
import sys
from functools import partial

import torch
from torch import nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class KVCache:
    step = 256

    def __init__(self):
        self.keys = None
        self.values = None
        self.offset = 0

    def update_and_fetch(self, keys, values):
        prev = self.offset
        if self.keys is None or (prev + keys.shape[2]) > self.keys.shape[2]:
            B, n_kv_heads, _, k_head_dim = keys.shape
            v_head_dim = values.shape[3]
            n_steps = (self.step + keys.shape[2] - 1) // self.step
            new_k = torch.zeros((B, n_kv_heads, n_steps * self.step, k_head_dim), dtype=keys.dtype)
            new_v = torch.zeros((B, n_kv_heads, n_steps * self.step, v_head_dim), dtype=values.dtype)
            if self.keys is not None:
                if prev % self.step != 0:
                    self.keys = self.keys[..., :prev, :]
                    self.values = self.values[..., :prev, :]
                self.keys = torch.cat([self.keys, new_k], dim=2)
                self.values = torch.cat([self.values, new_v], dim=2)
            else:
                self.keys, self.values = new_k, new_v
        self.offset += keys.shape[2]
        self.keys[..., prev : self.offset, :] = keys
        self.values[..., prev : self.offset, :] = values
        return self.keys[..., : self.offset, :], self.values[..., : self.offset, :]


def create_additive_causal_mask(N: int, offset: int = 0):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N) if offset else rinds
    mask = linds[:, None] < rinds[None]
    return mask * -1e9


def apply_rope(q, k, offset: int = 0, max_period: float = 10000):
    b, t, h, d = q.shape
    half = d // 2
    freqs = torch.exp(torch.arange(half, dtype=torch.float32) * (-math.log(max_period) * 2 / d))
    ts = (torch.arange(t, dtype=torch.float32) + float(offset))[None, :, None, None]
    q = q.reshape(b, t, h, half, 2)
    k = k.reshape(b, t, h, half, 2)
    qr, qi, kr, ki = q[..., 0], q[..., 1], k[..., 0], k[..., 1]
    freqs = freqs[None, None, None, :]
    rotr = torch.cos(freqs * ts)
    roti = torch.sin(freqs * ts)
    q_out = torch.stack([qr * rotr - qi * roti, qr * roti + qi * rotr], dim=-1)
    k_out = torch.stack([kr * rotr - ki * roti, kr * roti + ki * rotr], dim=-1)
    return q_out.reshape(b, t, h, d), k_out.reshape(b, t, h, d)


class StreamingMultiheadAttention(nn.Module):
    def __init__(self, embed_dim, num_heads, max_period=10000.0):
        super().__init__()
        self.embed_dim = embed_dim
        self.num_heads = num_heads
        self.head_dim = embed_dim // num_heads
        self.scale = self.head_dim**-0.5
        self.max_period = max_period
        self.in_proj = nn.Linear(embed_dim, 3 * embed_dim, bias=False)
        self.out_proj = nn.Linear(embed_dim, embed_dim, bias=False)

    def forward(self, query, cache):
        b, t, _ = query.shape
        projected = self.in_proj(query).reshape(b, t, 3, self.num_heads, self.head_dim)
        q, k, v = projected[:, :, 0], projected[:, :, 1], projected[:, :, 2]
        offset = 0 if cache is None else cache.offset
        q, k = apply_rope(q, k, offset, self.max_period)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if cache is None:
            k_full, v_full = k, v
        else:
            k_full, v_full = cache.update_and_fetch(k, v)
        mask = create_additive_causal_mask(t, offset=offset).to(query.dtype)
        out = F.scaled_dot_product_attention(q, k_full, v_full, attn_mask=mask, scale=self.scale)
        out = out.transpose(1, 2).reshape(b, t, self.embed_dim)
        return self.out_proj(out)


class StreamingTransformerLayer(nn.Module):
    def __init__(self, d_model, num_heads, dim_feedforward):
        super().__init__()
        self.self_attn = StreamingMultiheadAttention(d_model, num_heads)
        self.norm1 = nn.LayerNorm(d_model, eps=1e-5)
        self.norm2 = nn.LayerNorm(d_model, eps=1e-5)
        self.linear1 = nn.Linear(d_model, dim_feedforward, bias=False)
        self.linear2 = nn.Linear(dim_feedforward, d_model, bias=False)

    def forward(self, x, cache):
        x = x + self.self_attn(self.norm1(x), cache)
        x = x + self.linear2(F.gelu(self.linear1(self.norm2(x))))
        return x


class StreamingTransformer(nn.Module):
    def __init__(self, d_model, num_heads, num_layers, dim_feedforward):
        super().__init__()
        self.layers = nn.ModuleList(
            [StreamingTransformerLayer(d_model, num_heads, dim_feedforward) for _ in range(num_layers)]
        )

    def forward(self, x, cache):
        for layer, layer_cache in zip(self.layers, cache):
            x = layer(x, layer_cache)
        return x

    def make_cache(self):
        return [KVCache() for _ in self.layers]


def lsd_decode(v_t, x_0, num_steps=1):
    current = x_0
    for i in range(num_steps):
        s, t = i / num_steps, (i + 1) / num_steps
        shape = x_0[..., :1].shape
        flow_dir = v_t(torch.full(shape, s), torch.full(shape, t), current)
        current = current + flow_dir / num_steps
    return current


class SimpleFlowNet(nn.Module):
    def __init__(self, d_model, ldim):
        super().__init__()
        self.cond = nn.Linear(d_model, ldim)
        self.net = nn.Sequential(nn.Linear(ldim + 2, 64), nn.SiLU(), nn.Linear(64, ldim))

    def forward(self, c, s, t, x):
        return self.net(torch.cat([x, s, t], dim=-1)) + self.cond(c)


class FlowLMModel(nn.Module):
    def __init__(self, n_bins=50, dim=32, ldim=8, num_heads=4, num_layers=2):
        super().__init__()
        self.dim, self.ldim = dim, ldim
        self.embed = nn.Embedding(n_bins + 1, dim)  # LUTConditioner
        self.bos_emb = nn.Parameter(torch.randn(ldim))
        self.input_linear = nn.Linear(ldim, dim, bias=False)
        self.transformer = StreamingTransformer(dim, num_heads, num_layers, 4 * dim)
        self.out_norm = nn.LayerNorm(dim, eps=1e-5)
        self.out_eos = nn.Linear(dim, 1)
        self.flow_net = SimpleFlowNet(dim, ldim)

    def make_cache(self):
        return self.transformer.make_cache()

    def backbone(self, input_, text_embeddings, sequence, cache):
        input_ = torch.cat([text_embeddings, input_], dim=1)
        transformer_out = self.out_norm(self.transformer(input_, cache))
        return transformer_out[:, -sequence.shape[1] :]

    def forward(self, sequence, text_embeddings, cache, temp, generator):
        sequence = torch.where(torch.isnan(sequence), self.bos_emb[None, None, :], sequence)
        input_ = self.input_linear(sequence)
        transformer_out = self.backbone(input_, text_embeddings, sequence, cache)
        transformer_out = transformer_out[:, -1]
        out_eos = self.out_eos(transformer_out) > -4.0
        noise = torch.randn(transformer_out.shape[:-1] + (self.ldim,), generator=generator) * temp**0.5
        return lsd_decode(partial(self.flow_net, transformer_out), noise, 1), out_eos


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.flow_lm = FlowLMModel()
        self.temp = 0.7

    def init_state(self):
        return {"flow_cache": self.flow_lm.make_cache()}

    def _run_flow_lm_and_increment_step(self, model_state, text_tokens=None, backbone_input_latents=None,
                                        audio_conditioning=None, generator=None):
        if text_tokens is None:
            text_tokens = torch.zeros((1, 0), dtype=torch.long)
        if backbone_input_latents is None:
            backbone_input_latents = torch.zeros((1, 0, self.flow_lm.ldim))
        if audio_conditioning is None:
            audio_conditioning = torch.zeros((1, 0, self.flow_lm.dim))
        text_embeddings = self.flow_lm.embed(text_tokens)
        text_embeddings = torch.cat([text_embeddings, audio_conditioning], dim=1)
        out, is_eos = self.flow_lm(backbone_input_latents, text_embeddings, model_state["flow_cache"],
                                   self.temp, generator)
        return out[:, None, :], is_eos

    def get_state_for_audio_prompt(self, prompt):
        model_state = self.init_state()
        self._run_flow_lm_and_increment_step(model_state=model_state, audio_conditioning=prompt)
        self._slice_flow_cache(model_state, prompt.shape[1])
        return model_state

    def generate_audio_stream(self, model_state, chunks, generator, frames_per_chunk=5):
        if FIXED:
            prompt_num_frames = self._get_flow_cache_num_frames(model_state)
        for chunk in chunks:
            if FIXED:
                self._slice_flow_cache(model_state, prompt_num_frames)
            yield from self._generate_audio_stream_short_text(model_state, chunk, frames_per_chunk, generator)

    def _generate_audio_stream_short_text(self, model_state, text_tokens, max_gen_len, generator):
        self._run_flow_lm_and_increment_step(model_state=model_state, text_tokens=text_tokens)
        backbone_input = torch.full((1, 1, self.flow_lm.ldim), float("nan"))
        for step in range(max_gen_len):
            next_latent, is_eos = self._run_flow_lm_and_increment_step(
                model_state=model_state, backbone_input_latents=backbone_input, generator=generator
            )
            yield next_latent[0, 0]
            backbone_input = next_latent

    def _slice_flow_cache(self, model_state, num_frames):
        for cache in model_state.get("flow_cache", []):
            if cache.keys is None:
                continue
            cache.keys = cache.keys[..., :num_frames, :]
            cache.values = cache.values[..., :num_frames, :]
            cache.offset = min(cache.offset, num_frames)

    def _get_flow_cache_num_frames(self, model_state):
        for cache in model_state.get("flow_cache", []):
            if cache.keys is None:
                continue
            return min(cache.offset, cache.keys.shape[2])
        return 0


model = Model().eval()
voice_prompt = torch.randn(1, 6, model.flow_lm.dim)  # speaker-projected Mimi latents of the voice prompt
# text split into sentence chunks (split_into_best_sentences), as token ids
chunks = [torch.tensor([[3, 17, 9, 22, 41]]), torch.tensor([[8, 30, 12, 5]]), torch.tensor([[44, 2, 19]])]

with torch.no_grad():
    model_state = model.get_state_for_audio_prompt(voice_prompt)
    gen = torch.Generator().manual_seed(1234)
    frames = list(model.generate_audio_stream(model_state, chunks, gen))
latents = torch.stack(frames)
print("frames:", latents.shape[0], "flow_cache offset at end:", model_state["flow_cache"][0].offset)
for i, n in enumerate(range(0, latents.shape[0], 5)):
    print(f"chunk {i} latent mean/abs: {latents[n:n+5].mean():+.5f} / {latents[n:n+5].abs().mean():.5f}")
