"""An embedding model served the vLLM way: each layer's `Attention` module holds `attn_type` from a class of str
constants (`AttentionType.ENCODER_ONLY = "encoder_only"`), and the backend picks SDPA's is_causal. Its bug: the backend
reads causality from a flag every decoder sets and never from the layer's type, so the encoder runs causal over an
unpadded batch; --fixed: is_causal only where attn_type is DECODER."""

import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class AttentionType:
    DECODER = "decoder"
    ENCODER_ONLY = "encoder_only"


class SDPABackend:
    causal = True  # (the decoders' default, read for every layer: the bug)

    def forward(self, layer, q, k, v):
        causal = layer.attn_type == AttentionType.DECODER if FIXED else self.causal
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


class Attention(torch.nn.Module):
    def __init__(self, backend, attn_type):
        super().__init__()
        self.backend, self.attn_type = backend, attn_type

    def forward(self, q, k, v):
        return self.backend.forward(self, q, k, v)


class EmbeddingLayer(torch.nn.Module):
    def __init__(self, dim, heads, backend):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.attn = Attention(backend, AttentionType.ENCODER_ONLY)

    def forward(self, x):
        b, n, d = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        return x + self.attn(q, k, v).transpose(1, 2).reshape(b, n, d)


class Embedder(torch.nn.Module):
    def __init__(self, dim=16, heads=2, layers=2):
        super().__init__()
        backend = SDPABackend()
        self.layers = torch.nn.ModuleList(EmbeddingLayer(dim, heads, backend) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x.mean(1)


if __name__ == "__main__":
    torch.manual_seed(0)
    with torch.no_grad():
        print(Embedder().eval()(torch.randn(2, 6, 16)).shape)
