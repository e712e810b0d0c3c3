# diffusers#10103's bug written another way: a hand-written text-to-audio latent denoiser (Imagen / AudioLDM-style
# layout, config a plain dict) whose pipeline encodes the prompts and the negative prompts in two calls of its own
# text encoder (a left-padded tokenizer, SDPA self-attention with a bool keep mask), repeats each per sample with
# repeat_interleave, and hands the denoiser [conditional; unconditional] for classifier-free guidance. The denoiser's
# blocks cross-attend the text through nn.MultiheadAttention with key_padding_mask = ~text_mask (True = padding).
# The bug: the masks are tiled (`mask.repeat(n, 1)`: m0,m1,m0,m1) while the embeddings are interleaved (p0,p0,p1,p1),
# so sample 1 of prompt 0 attends prompt 1's longer mask: prompt 0's left padding. The fix interleaves the masks too.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

CONFIG = {"vocab": 50, "text_dim": 24, "text_heads": 3, "text_layers": 2, "max_text": 12, "pad_id": 0,
          "latent_channels": 4, "latent_len": 6, "model_dim": 32, "heads": 4, "blocks": 2}


class LeftPadTokenizer:
    """Word-level, left padding (as decoder-style text encoders are padded), 1 = a real token."""

    padding_side = "left"
    pad_token_id = 0

    def __init__(self, vocab):
        self.vocab, self.size = {}, vocab

    def __call__(self, texts, max_length):
        ids, mask = [], []
        for text in texts:
            toks = [2 + (self.vocab.setdefault(w, len(self.vocab)) % (self.size - 2)) for w in text.split()][:max_length - 1]
            toks = toks + [1]  # (an end token, so an empty prompt is one real token)
            pad = max_length - len(toks)
            ids.append([self.pad_token_id] * pad + toks)
            mask.append([0] * pad + [1] * len(toks))
        return torch.tensor(ids), torch.tensor(mask)


class TextBlock(nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.out = nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, keep):  # keep: (B, 1, 1, S) bool, True = may attend
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        x = x + self.out(h.transpose(1, 2).reshape(b, s, d))
        return x + self.ff(self.norm2(x))


class TextEncoder(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.embed = nn.Embedding(cfg["vocab"], cfg["text_dim"])
        self.pos = nn.Parameter(torch.randn(cfg["max_text"], cfg["text_dim"]) * 0.02)
        self.blocks = nn.ModuleList([TextBlock(cfg["text_dim"], cfg["text_heads"]) for _ in range(cfg["text_layers"])])
        self.norm = nn.LayerNorm(cfg["text_dim"])

    def forward(self, input_ids, attention_mask):
        x = self.embed(input_ids) + self.pos[: input_ids.shape[1]]
        keep = attention_mask.bool()[:, None, None, :]
        for block in self.blocks:
            x = block(x, keep)
        return self.norm(x)


class DenoiserBlock(nn.Module):
    def __init__(self, dim, text_dim, heads):
        super().__init__()
        self.norm1, self.norm2, self.norm3 = nn.LayerNorm(dim), nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.self_attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.cross_attn = nn.MultiheadAttention(dim, heads, kdim=text_dim, vdim=text_dim, batch_first=True)
        self.ff = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x, context, context_pad):
        h = self.norm1(x)
        x = x + self.self_attn(h, h, h, need_weights=False)[0]
        x = x + self.cross_attn(self.norm2(x), context, context, key_padding_mask=context_pad, need_weights=False)[0]
        return x + self.ff(self.norm3(x))


class LatentDenoiser(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.config = cfg
        self.proj_in = nn.Linear(cfg["latent_channels"], cfg["model_dim"])
        self.time = nn.Sequential(nn.Linear(1, cfg["model_dim"]), nn.SiLU(), nn.Linear(cfg["model_dim"], cfg["model_dim"]))
        self.blocks = nn.ModuleList([DenoiserBlock(cfg["model_dim"], cfg["text_dim"], cfg["heads"])
                                     for _ in range(cfg["blocks"])])
        self.proj_out = nn.Linear(cfg["model_dim"], cfg["latent_channels"])

    def forward(self, latents, timestep, text_embeds, text_mask):
        x = self.proj_in(latents) + self.time(timestep[:, None, None].float() / 1000)
        context_pad = ~text_mask.bool()  # (True = padding, as nn.MultiheadAttention reads key_padding_mask)
        for block in self.blocks:
            x = block(x, text_embeds, context_pad)
        return self.proj_out(x)


class Pipeline:
    def __init__(self, tokenizer, text_encoder, denoiser, cfg):
        self.tokenizer, self.text_encoder, self.denoiser, self.cfg = tokenizer, text_encoder, denoiser, cfg

    def _encode(self, texts, samples):
        ids, mask = self.tokenizer(texts, self.cfg["max_text"])
        embeds = self.text_encoder(ids, attention_mask=mask)
        embeds = embeds.repeat_interleave(samples, dim=0)  # p0, p0, p1, p1
        if FIXED:
            mask = mask.repeat_interleave(samples, dim=0)
        else:
            mask = mask.repeat(samples, 1)  # m0, m1, m0, m1: another prompt's padding
        return embeds, mask

    @torch.no_grad()
    def __call__(self, prompts, negative_prompts, samples_per_prompt=2, steps=2, guidance=3.0):
        cond, cond_mask = self._encode(prompts, samples_per_prompt)
        uncond, uncond_mask = self._encode(negative_prompts, samples_per_prompt)
        text_embeds = torch.cat([cond, uncond])
        text_mask = torch.cat([cond_mask, uncond_mask])
        n = len(prompts) * samples_per_prompt
        latents = torch.randn(n, self.cfg["latent_len"], self.cfg["latent_channels"])
        for t in torch.linspace(900, 100, steps).long():
            timestep = t.expand(2 * n)
            eps = self.denoiser(torch.cat([latents, latents]), timestep, text_embeds, text_mask)
            eps_cond, eps_uncond = eps.chunk(2)
            latents = latents - 0.1 * (eps_uncond + guidance * (eps_cond - eps_uncond))
        return latents, text_mask


if __name__ == "__main__":
    pipe = Pipeline(LeftPadTokenizer(CONFIG["vocab"]), TextEncoder(CONFIG).eval(), LatentDenoiser(CONFIG).eval(), CONFIG)
    prompts = ["rain", "a slow piano melody over soft rain at night"]
    negative = ["low quality", "noise"]
    latents, mask = pipe(prompts, negative)
    print("real text tokens per denoiser row:", mask.sum(-1).tolist())
    print(f"fixed={FIXED} latents mean={latents.mean().item():.6f}")
