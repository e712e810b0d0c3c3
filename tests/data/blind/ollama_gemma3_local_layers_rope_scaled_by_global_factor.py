"""Ollama Gemma 3: every layer, local (sliding-window) ones included, rotated with the global rope scale.

Citation: ollama/ollama#13452 (commit 1b308e1d2, "model: fix global layer rope scale values for
gemma 3"; fixes issues #13449 and #13450). Ported from `model/models/gemma3/model_text.go` at
1b308e1d2^ and 1b308e1d2 (`TextConfig.applyRotaryPositionEmbeddings`, `ropeBaseForLayer` /
`ropeValuesForLayer`, `TextSelfAttention.Forward`, `TextModel.Shift`, `newTextModel`), the
wrapper cache of `model/models/gemma3/model.go` (`NewWrapperCache(NewSWACache(window, m.Shift),
NewCausalCache(m.Shift))`) and `kvcache/causal.go` (`buildMask`, `Remove` -> `shift`, which re-ropes
the kept keys through the model's `Shift`). ggml's NeoX RoPE (`nn.RoPE(..., base, freqScale)`) and
`nn.Attention` are written in torch; the runner's context shift is reduced to numKeep + discard half.

Bug: `applyRotaryPositionEmbeddings` used `1./o.ropeScale` (the GGUF's `rope.scaling.factor`, 8 for
Gemma 3 4B and up) for every layer and `ropeBaseForLayer` only chose the base, so the sliding-window
layers rotated queries, keys and cache shifts at position / 8 as the global layers do.

Fix: `ropeValuesForLayer` returns `(ropeLocalBase, 1.0)` for local layers and `(ropeBase, ropeScale)`
for global ones, and both Forward and Shift pass that scale (the default factor also became 8.0).

Reproduction: a tiny 6-block Gemma 3 (5 SWA : 1 global, window 4) from GGUF-style metadata without
`attention.sliding_window_pattern`; a 12-token prompt is decoded greedily with num_ctx 16, so the
runner shifts the context once mid-generation.
"""
import math
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

gemmaGlobalCacheCount = 6

GGUF = {
    "block_count": 6,
    "embedding_length": 64,
    "attention.head_count": 4,
    "attention.head_count_kv": 2,
    "attention.key_length": 16,
    "attention.value_length": 16,
    "attention.layer_norm_rms_epsilon": 1e-6,
    "attention.sliding_window": 4,
    "rope.local.freq_base": 10000.0,
    "rope.freq_base": 1000000.0,
    "rope.scaling.type": "linear",
    "rope.scaling.factor": 8.0,
    "feed_forward_length": 128,
    "vocab_size": 97,
}


class TextConfig:
    def __init__(self, c):
        self.hiddenSize = c["embedding_length"]
        self.numHeads = c["attention.head_count"]
        self.numKVHeads = c["attention.head_count_kv"]
        self.attnKeyLen = c.get("attention.key_length", 256)
        self.attnValLen = c.get("attention.value_length", 256)
        self.eps = c.get("attention.layer_norm_rms_epsilon", 1e-6)
        self.ropeLocalBase = c.get("rope.local.freq_base", 10000.0)
        self.ropeBase = c.get("rope.freq_base", 1000000.0)
        self.slidingWindowPattern = c.get("attention.sliding_window_pattern")
        self.ropeType = c.get("rope.scaling.type", "")
        self.ropeScale = c.get("rope.scaling.factor", 8.0 if FIXED else 1.0)
        self.largeModelScaling = False
        if self.slidingWindowPattern is not None and any(self.slidingWindowPattern):
            self.ropeScale = 1.0

    # ggml_rope_ext, NeoX mode: theta = pos * freq_scale * base^(-2i/n_dims)
    def applyRotaryPositionEmbeddings(self, states, positions, base, scale=None):
        if not FIXED:
            scale = self.ropeScale
        freq_scale = 1.0 / scale
        d = self.attnKeyLen
        inv = base ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
        theta = positions.to(torch.float64)[:, None] * freq_scale * inv[None, :]  # [T, d/2]
        cos = theta.cos().float()[:, None, :]
        sin = theta.sin().float()[:, None, :]
        x0, x1 = states[..., : d // 2], states[..., d // 2:]
        return torch.cat([x0 * cos - x1 * sin, x0 * sin + x1 * cos], dim=-1)

    def ropeBaseForLayer(self, layer):
        if self.slidingWindowPattern is not None and self.slidingWindowPattern[layer]:
            return self.ropeLocalBase
        if (layer + 1) % gemmaGlobalCacheCount > 0:
            return self.ropeLocalBase
        return self.ropeBase

    def ropeValuesForLayer(self, layer):
        if self.slidingWindowPattern is not None and self.slidingWindowPattern[layer]:
            return self.ropeLocalBase, 1.0
        if (layer + 1) % gemmaGlobalCacheCount > 0:
            return self.ropeLocalBase, 1.0
        return self.ropeBase, self.ropeScale


# ----------------------------------------------------------------------------- kvcache
class Causal:
    def __init__(self, swaWindowSize, shiftFn):
        self.swaWindowSize = swaWindowSize
        self.shiftFn = shiftFn
        self.cellPos = []  # one sequence; cell i holds position cellPos[i]
        self.keys, self.values = {}, {}
        self.curLayer = None
        self.curPositions = None
        self.start = 0

    def StartForward(self, positions):
        self.curPositions = positions
        self.start = len(self.cellPos)
        self.cellPos.extend(positions.tolist())

    def SetLayer(self, layer):
        self.curLayer = layer

    def Put(self, k, v):
        kk = self.keys.get(self.curLayer)
        vv = self.values.get(self.curLayer)
        self.keys[self.curLayer] = k if kk is None else torch.cat([kk, k])
        self.values[self.curLayer] = v if vv is None else torch.cat([vv, v])

    def Get(self):
        return self.keys[self.curLayer], self.values[self.curLayer], self.buildMask()

    def buildMask(self):
        cell = torch.tensor(self.cellPos)[None, :]
        q = self.curPositions[:, None]
        masked = (cell > q) | (cell < q - self.swaWindowSize)
        return torch.zeros(masked.shape).masked_fill(masked, float("-inf"))

    def Remove(self, beginIndex, endIndex):
        offset = beginIndex - endIndex
        keep = [i for i, p in enumerate(self.cellPos) if not (beginIndex <= p < endIndex)]
        for layer in self.keys:
            self.keys[layer] = self.keys[layer][keep]
            self.values[layer] = self.values[layer][keep]
        self.cellPos = [self.cellPos[i] for i in keep]
        self.shift(beginIndex, offset)

    def shift(self, beginIndex, offset):
        idx = [i for i, p in enumerate(self.cellPos) if p >= beginIndex]
        kShift = torch.full((len(idx),), offset)
        for layer, key in self.keys.items():
            roped = self.shiftFn(layer, key[idx], kShift)
            key[idx] = roped
        for i in idx:
            self.cellPos[i] += offset


class WrapperCache:
    def __init__(self, *caches):
        self.caches = caches
        self.curType = 0

    def StartForward(self, positions):
        for c in self.caches:
            c.StartForward(positions)

    def SetLayer(self, layer):
        for c in self.caches:
            c.SetLayer(layer)

    def SetLayerType(self, t):
        self.curType = t

    def UnderlyingCache(self):
        return self.caches[self.curType]

    def Remove(self, beginIndex, endIndex):
        for c in self.caches:
            c.Remove(beginIndex, endIndex)


cacheTypeSWA, cacheTypeCausal = 0, 1


def rms_norm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w)


def attention(q, k, v, scaleFactor, cache):
    # nn.Attention: store this batch's K/V, then attend over the cache with its mask
    c = cache.UnderlyingCache()
    c.Put(k, v)
    K, V, mask = c.Get()
    rep = q.shape[1] // K.shape[1]
    K = K.repeat_interleave(rep, dim=1)
    V = V.repeat_interleave(rep, dim=1)
    scores = torch.einsum("thd,shd->hts", q, K) * scaleFactor + mask
    return torch.einsum("hts,shd->thd", scores.softmax(-1), V)


class TextModel:
    def __init__(self, c):
        self.cfg = TextConfig(c)
        H, n = self.cfg.hiddenSize, c["block_count"]
        hd, nh, nkv, ff = self.cfg.attnKeyLen, self.cfg.numHeads, self.cfg.numKVHeads, c["feed_forward_length"]
        r = lambda *s: torch.randn(*s) * 0.15
        self.tok = torch.randn(c["vocab_size"], H) * 0.5
        self.out = torch.randn(c["vocab_size"], H) * 0.2
        self.layers = [dict(attn_q=r(nh * hd, H), attn_k=r(nkv * hd, H), attn_v=r(nkv * hd, H), attn_output=r(H, nh * hd),
                            attn_q_norm=r(hd), attn_k_norm=r(hd), attn_norm=r(H), post_attention_norm=r(H),
                            ffn_norm=r(H), post_ffw_norm=r(H), ffn_gate=r(ff, H), ffn_up=r(ff, H), ffn_down=r(H, ff))
                       for _ in range(n)]
        self.output_norm = r(H)
        self.Cache = WrapperCache(Causal(c["attention.sliding_window"], self.Shift), Causal(2 ** 31 - 1, self.Shift))

    def Shift(self, layer, key, shift):
        if FIXED:
            ropeBase, ropeScale = self.cfg.ropeValuesForLayer(layer)
            return self.cfg.applyRotaryPositionEmbeddings(key, shift, ropeBase, ropeScale)
        return self.cfg.applyRotaryPositionEmbeddings(key, shift, self.cfg.ropeBaseForLayer(layer))

    def selfAttention(self, layer, h, positionIDs, cache):
        o, w = self.cfg, self.layers[layer]
        T = h.shape[0]
        if FIXED:
            ropeBase, ropeScale = o.ropeValuesForLayer(layer)
        else:
            ropeBase, ropeScale = o.ropeBaseForLayer(layer), None
        q = (h @ w["attn_q"].T).view(T, o.numHeads, o.attnKeyLen)
        q = rms_norm(q, w["attn_q_norm"], o.eps)
        q = o.applyRotaryPositionEmbeddings(q, positionIDs, ropeBase, ropeScale)
        q = q * (1.0 / math.sqrt(o.attnKeyLen))
        k = (h @ w["attn_k"].T).view(T, o.numKVHeads, o.attnKeyLen)
        k = rms_norm(k, w["attn_k_norm"], o.eps)
        k = o.applyRotaryPositionEmbeddings(k, positionIDs, ropeBase, ropeScale)
        v = (h @ w["attn_v"].T).view(T, o.numKVHeads, o.attnValLen)
        kqv = attention(q, k, v, 1.0, cache).reshape(T, -1)
        return kqv @ w["attn_output"].T

    def Forward(self, inputs, positions):
        cache, o = self.Cache, self.cfg
        cache.StartForward(positions)
        h = self.tok[inputs] * math.sqrt(o.hiddenSize)
        for i, w in enumerate(self.layers):
            cacheType = cacheTypeCausal if (i + 1) % gemmaGlobalCacheCount == 0 else cacheTypeSWA
            cache.SetLayer(i)
            cache.SetLayerType(cacheType)
            residual = h
            x = rms_norm(h, w["attn_norm"], o.eps)
            x = self.selfAttention(i, x, positions, cache)
            x = rms_norm(x, w["post_attention_norm"], o.eps)
            h = x + residual
            residual = h
            x = rms_norm(h, w["ffn_norm"], o.eps)
            x = (F.gelu(x @ w["ffn_gate"].T, approximate="tanh") * (x @ w["ffn_up"].T)) @ w["ffn_down"].T
            h = rms_norm(x, w["post_ffw_norm"], o.eps) + residual
        return rms_norm(h, self.output_norm, o.eps) @ self.out.T


@torch.no_grad()
def main():
    m = TextModel(GGUF)
    numCtx, numKeep = 16, 2
    prompt = [2, 40, 17, 88, 5, 63, 31, 9, 72, 14, 50, 26]
    inputs = list(prompt)
    nextPos = 0
    batch = prompt
    out = []
    for step in range(10):
        if nextPos + len(batch) > numCtx:
            # runner: shiftContext -- keep numKeep, discard half of the rest
            discard = (nextPos - numKeep) // 2
            m.Cache.Remove(numKeep, numKeep + discard)
            inputs = inputs[:numKeep] + inputs[numKeep + discard:]
            nextPos -= discard
            print("context shift: discarded", discard)
        positions = torch.arange(nextPos, nextPos + len(batch))
        logits = m.Forward(torch.tensor(batch), positions)
        nextPos += len(batch)
        tok = int(logits[-1].argmax())
        if step == 0:
            print("prefill last logits[:4]", [round(x, 4) for x in logits[-1, :4].tolist()])
        out.append(tok)
        inputs.append(tok)
        batch = [tok]
    print("generated", out)
    print("final logits[:4]", [round(x, 4) for x in logits[-1, :4].tolist()])


if __name__ == "__main__":
    main()
