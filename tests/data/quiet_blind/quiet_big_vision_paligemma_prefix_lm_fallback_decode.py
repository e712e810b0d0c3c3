# Correct program (quiet batch quiet-r80a).
# Ported from google-research/big_vision @11eea5740d595c2104da948849e087a27e92926f:
# big_vision/models/proj/paligemma/paligemma.py (make_attn_mask, Model.embed_image_and_text,
# Model.__call__, Model.prefill_cache / _fallback_prefill_cache / _fallback_extend_cache), JAX written
# as torch. The image tower and the LLM are small stand-ins (a patch projection; a 2-layer Gemma-style
# decoder whose attention masks its logits with where(mask, logits, K_MASK) as gemma_bv does).
# PaliGemma's prefix-LM: image tokens and the prompt (mask_ar 0) see each other both ways, the suffix
# (mask_ar 1) is causal; the fallback decoder keeps x / input_mask / mask_ar in a zero-padded cache and
# reruns the whole sequence each step, the new token placed at sum(input_mask).
# Self-check: every row's training logits on its real text tokens and its greedy decode logits equal a
# per-example run, unpadded, under a double-loop prefix-LM mask.
import math
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

torch.manual_seed(0)
K_MASK = -2.3819763e38


def make_attn_mask(input_mask, mask_ar):
    """bool[B, N, N]: tokens attend to valid tokens whose cumulative mask_ar is <= theirs."""
    cumsum = torch.cumsum(mask_ar, dim=1)
    attn_mask = cumsum[:, None, :] <= cumsum[:, :, None]
    valid_mask = input_mask[:, None, :] & input_mask[:, :, None]
    return attn_mask & valid_mask


def apply_rope(x, positions, max_wavelength=10_000):
    d = x.shape[-1]
    freq_exponents = 2.0 * torch.arange(d // 2, dtype=torch.float32) / d
    timescale = max_wavelength ** freq_exponents
    radians = positions[..., None].float() / timescale
    radians = radians[..., None, :]  # B T 1 D/2
    sin, cos = torch.sin(radians), torch.cos(radians)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, d):
        super().__init__()
        self.scale = nn.Parameter(torch.zeros(d))

    def forward(self, x):
        var = x.pow(2).mean(-1, keepdim=True)
        return x * torch.rsqrt(var + 1e-6) * (1 + self.scale)


class Attention(nn.Module):
    def __init__(self, embdim, num_heads, head_dim):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, head_dim
        self.qkv = nn.Linear(embdim, 3 * num_heads * head_dim, bias=False)
        self.out = nn.Linear(num_heads * head_dim, embdim, bias=False)

    def forward(self, x, positions, attn_mask):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.num_heads, self.head_dim).unbind(2)
        q = apply_rope(q, positions) * self.head_dim ** -0.5
        k = apply_rope(k, positions)
        logits = torch.einsum("btnh,bsnh->bnts", q, k)
        logits = torch.where(attn_mask[:, None, :, :], logits, torch.tensor(K_MASK))
        probs = torch.softmax(logits, dim=-1)
        enc = torch.einsum("bnts,bsnh->btnh", probs, v).reshape(B, T, -1)
        return self.out(enc)


class Block(nn.Module):
    def __init__(self, embdim, num_heads, head_dim, mlp_dim):
        super().__init__()
        self.pre_attention_norm = RMSNorm(embdim)
        self.attn = Attention(embdim, num_heads, head_dim)
        self.pre_ffw_norm = RMSNorm(embdim)
        self.gate = nn.Linear(embdim, 2 * mlp_dim, bias=False)
        self.down = nn.Linear(mlp_dim, embdim, bias=False)

    def forward(self, x, positions, attn_mask):
        x = x + self.attn(self.pre_attention_norm(x), positions, attn_mask)
        g, u = self.gate(self.pre_ffw_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.gelu(g, approximate="tanh") * u)


class GemmaLLM(nn.Module):
    """Stand-in for proj.paligemma.gemma_bv.Model: __call__(x, mask=...) over embedded tokens."""

    def __init__(self, vocab_size=40, embdim=32, depth=2, num_heads=2, head_dim=16, mlp_dim=64):
        super().__init__()
        self.embdim = embdim
        self.embedder = nn.Embedding(vocab_size, embdim)
        self.layers = nn.ModuleList(Block(embdim, num_heads, head_dim, mlp_dim) for _ in range(depth))
        self.final_norm = RMSNorm(embdim)

    def embed_tokens(self, tokens):
        return self.embedder(tokens) * math.sqrt(self.embdim)

    def compute_logits(self, pre_logits):
        return pre_logits @ self.embedder.weight.T

    def forward(self, x, mask):
        positions = torch.arange(x.shape[1])[None].expand(x.shape[0], -1)
        for layer in self.layers:
            x = layer(x, positions, mask)
        pre_logits = self.final_norm(x)
        return self.compute_logits(pre_logits), {"pre_logits": pre_logits}


class ImgModel(nn.Module):
    """Stand-in for the SigLIP tower: 4 patches of a 8x8 image, projected to the LLM width."""

    def __init__(self, num_classes, patch=4):
        super().__init__()
        self.patch = patch
        self.proj = nn.Linear(patch * patch * 3, num_classes)

    def forward(self, image):
        B, H, W, C = image.shape
        p = self.patch
        patches = image.reshape(B, H // p, p, W // p, p, C).permute(0, 1, 3, 2, 4, 5).reshape(B, -1, p * p * C)
        return self.proj(patches), {}


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self._llm = GemmaLLM()
        self._img_model = ImgModel(num_classes=self._llm.embdim)
        self.cache = {}

    def embed_image(self, image):
        zimg, out_img = self._img_model(image)
        out = {"img/zimg": zimg}
        return zimg, out

    def embed_text(self, tokens):
        ztxt = self._llm.embed_tokens(tokens)
        return ztxt, {"llm/ztxt": ztxt}

    def embed_image_and_text(self, image, text, *, input_mask=None, mask_ar=None):
        zimg, out_img = self.embed_image(image)
        ztxt, out_txt = self.embed_text(text)
        if input_mask is None:
            input_mask = torch.full(text.shape, True)
        if mask_ar is None:
            mask_ar = torch.full(text.shape, 1)
        x = torch.cat([zimg, ztxt], dim=1)
        _, img_len, _ = zimg.shape
        mask_ar = F.pad(mask_ar, (img_len, 0), value=0)
        input_mask = F.pad(input_mask, (img_len, 0), value=True)
        return (x, input_mask, mask_ar), {**out_img, **out_txt}

    def forward(self, image, text, mask_ar):
        (x, input_mask, mask_ar), out = self.embed_image_and_text(image, text, mask_ar=mask_ar)
        attn_mask = out["attn_mask"] = make_attn_mask(input_mask, mask_ar)
        _, out_llm = self._llm(x, mask=attn_mask)
        zimg = out["img/zimg"]
        text_pre_logits = out_llm["pre_logits"][:, zimg.shape[1]:, :]
        text_logits = self._llm.compute_logits(text_pre_logits)
        return text_logits, out

    def prefill_cache(self, x, input_mask, mask_ar, *, cache_size):
        return self._fallback_prefill_cache(x, input_mask, mask_ar, cache_size)

    def extend_cache(self, x):
        return self._fallback_extend_cache(x)

    def _fallback_prefill_cache(self, x, input_mask, mask_ar, cache_size):
        attn_mask = make_attn_mask(input_mask, mask_ar)
        logits, _ = self._llm(x, mask=attn_mask)
        pad_size = cache_size - x.shape[1]
        x = F.pad(torch.where(input_mask[..., None], x, torch.zeros(())), (0, 0, 0, pad_size))
        mask_ar = F.pad(torch.where(input_mask, mask_ar, torch.zeros((), dtype=mask_ar.dtype)), (0, pad_size))
        input_mask = F.pad(input_mask, (0, pad_size), value=False)
        self.cache = {"x_cache": x, "input_mask_cache": input_mask, "mask_ar_cache": mask_ar}
        last_pos = input_mask.sum(dim=1)[:, None] - 1
        last_onehot = F.one_hot(last_pos, logits.shape[1]).to(logits.dtype)
        return torch.einsum("bnh,ben->beh", logits, last_onehot)

    def _fallback_extend_cache(self, x):
        assert x.shape[1] == 1
        mask_ar = torch.full(x.shape[:-1], 1)
        input_mask = torch.full(x.shape[:-1], True)
        c_x = self.cache["x_cache"]
        c_input_mask = self.cache["input_mask_cache"]
        c_mask_ar = self.cache["mask_ar_cache"]
        next_pos = c_input_mask.sum(dim=1)[:, None]
        move_onehot = F.one_hot(next_pos, c_x.shape[1])
        x = c_x + torch.einsum("beh,ben->bnh", x, move_onehot.to(x.dtype))
        mask_ar = c_mask_ar + torch.einsum("be,ben->bn", mask_ar, move_onehot)
        input_mask = c_input_mask | torch.einsum("be,ben->bn", input_mask.long(), move_onehot).bool()
        self.cache = {"x_cache": x, "input_mask_cache": input_mask, "mask_ar_cache": mask_ar}
        attn_mask = make_attn_mask(input_mask, mask_ar)
        logits, _ = self._llm(x, mask=attn_mask)
        last_pos = input_mask.sum(dim=1)[:, None] - 1
        last_onehot = F.one_hot(last_pos, logits.shape[1]).to(logits.dtype)
        return torch.einsum("bnh,ben->beh", logits, last_onehot)


def reference_logits(model, image, tokens, prefix_len):
    """One example alone, no padding: key j visible to query i iff j is in the image+prompt or j <= i."""
    zimg, _ = model.embed_image(image[None])
    ztxt, _ = model.embed_text(tokens[None])
    x = torch.cat([zimg, ztxt], dim=1)
    n = x.shape[1]
    full = zimg.shape[1] + prefix_len
    mask = torch.zeros(1, n, n, dtype=torch.bool)
    for i in range(n):
        for j in range(n):
            mask[0, i, j] = j < full or j <= i
    logits, _ = model._llm(x, mask=mask)
    return logits[0]


def main():
    model = Model().eval()
    B, T, img_len = 3, 9, 4
    images = torch.randn(B, 8, 8, 3)
    prefixes = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15]]
    suffixes = [[20, 21, 22], [23, 24, 25, 26, 27, 28], [29, 30]]

    # Training batch: prefix (mask_ar 0) then suffix (mask_ar 1), right-padded with pad id 0 and mask_ar 1.
    text = torch.zeros(B, T, dtype=torch.long)
    mask_ar = torch.ones(B, T, dtype=torch.long)
    for b in range(B):
        seq = prefixes[b] + suffixes[b]
        text[b, : len(seq)] = torch.tensor(seq)
        mask_ar[b, : len(prefixes[b])] = 0
    with torch.no_grad():
        text_logits, _ = model(images, text, mask_ar)
        for b in range(B):
            seq = torch.tensor(prefixes[b] + suffixes[b])
            ref = reference_logits(model, images[b], seq, len(prefixes[b]))[img_len:]
            got = text_logits[b, : len(seq)]
            assert torch.allclose(got, ref, atol=1e-4), (b, (got - ref).abs().max())

        # Decoding: the prompt alone, right-padded, then greedy steps through the fallback cache.
        P = max(len(p) for p in prefixes)
        prompt = torch.zeros(B, P, dtype=torch.long)
        input_mask = torch.zeros(B, P, dtype=torch.bool)
        for b in range(B):
            prompt[b, : len(prefixes[b])] = torch.tensor(prefixes[b])
            input_mask[b, : len(prefixes[b])] = True
        steps = 4
        (x, input_mask_full, mask_ar_full), _ = model.embed_image_and_text(
            images, prompt, input_mask=input_mask, mask_ar=torch.zeros(B, P, dtype=torch.long))
        last_logits = model.prefill_cache(x, input_mask_full, mask_ar_full, cache_size=img_len + P + steps)
        generated = [[] for _ in range(B)]
        for step in range(steps):
            for b in range(B):
                seq = torch.tensor(prefixes[b] + generated[b])
                ref = reference_logits(model, images[b], seq, len(prefixes[b]))[-1]
                assert torch.allclose(last_logits[b, 0], ref, atol=1e-4), (step, b, (last_logits[b, 0] - ref).abs().max())
            next_tok = last_logits[:, 0].argmax(-1)
            for b in range(B):
                generated[b].append(int(next_tok[b]))
            last_logits = model.extend_cache(model.embed_text(next_tok[:, None])[0])
    print("big_vision PaliGemma prefix-LM: training logits and fallback decode match per-example references")
    return 0


if __name__ == "__main__":
    sys.exit(main())
