# samvanstroud/hepattn cb6dc0a (PR #148): with local_strided_attn the MaskFormerDecoder built a local window
# cross-attention mask (each object query sees only the hits near it in phi), but the decoder layers were built with
# mask_attention=False and therefore replaced any attn_mask by None, so the queries attended to every hit.
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def get_local_ca_mask(n_objects, n_inputs, window_size, stride=1, device=None, wrap=False):
    assert window_size >= 0, "Window size must be non-negative"
    assert window_size % 2 == 0, "Window size must be even"
    mask = torch.zeros((n_objects, n_inputs), dtype=torch.bool, device=device)
    for i in range(n_objects):
        start_raw = round(i * stride) - window_size // 2
        start = max(0, start_raw)
        end_raw = round(i * stride) + window_size // 2 + 1
        end = min(n_inputs, end_raw)
        mask[i, start:end] = 1
        # if wrap, left and right ends are connected
        if wrap:
            if start_raw < 0:
                mask[i, n_inputs + start_raw:n_inputs] = 1
            if end_raw > n_inputs:
                mask[i, 0:end_raw - n_inputs] = 1
    return mask


def auto_local_ca_mask(q, kv, window_size, wrap=True):
    n_objects = q.shape[1]
    n_inputs = kv.shape[1]
    stride = n_inputs / n_objects
    mask = get_local_ca_mask(n_objects, n_inputs, window_size, stride, q.device, wrap)
    assert not (~mask.any(dim=0)).any(), "Some columns are all False, increase window size"
    return mask.unsqueeze(0)


class Attention(nn.Module):
    def __init__(self, dim, num_heads=4):
        super().__init__()
        self.num_heads = num_heads
        self.q_proj, self.k_proj, self.v_proj = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)
        self.out_proj = nn.Linear(dim, dim)

    def forward(self, q, kv=None, attn_mask=None):
        kv = kv if kv is not None else q
        b, s, d = q.shape
        h = self.num_heads
        q = self.q_proj(q).view(b, s, h, d // h).transpose(1, 2)
        k = self.k_proj(kv).view(b, kv.shape[1], h, d // h).transpose(1, 2)
        v = self.v_proj(kv).view(b, kv.shape[1], h, d // h).transpose(1, 2)
        if attn_mask is not None:
            attn_mask = attn_mask.unsqueeze(-3)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask)
        return self.out_proj(out.transpose(1, 2).reshape(b, s, d))


class Residual(nn.Module):
    def __init__(self, fn, dim):
        super().__init__()
        self.fn, self.norm = fn, nn.LayerNorm(dim)

    def forward(self, x, **kwargs):
        return x + self.fn(self.norm(x), **kwargs)


class Dense(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        return self.net(x)


class MaskFormerDecoderLayer(nn.Module):
    def __init__(self, dim, mask_attention=True, bidirectional_ca=True):
        super().__init__()
        self.mask_attention = mask_attention
        self.bidirectional_ca = bidirectional_ca
        residual = partial(Residual, dim=dim)
        self.q_ca = residual(Attention(dim))
        self.q_sa = residual(Attention(dim))
        self.q_dense = residual(Dense(dim))
        if bidirectional_ca:
            self.kv_ca = residual(Attention(dim))
            self.kv_dense = residual(Dense(dim))

    def forward(self, q: Tensor, kv: Tensor, attn_mask: Tensor | None = None):
        if not FIXED:
            if self.mask_attention:
                attn_mask = attn_mask.detach()
                attn_mask = torch.where(torch.all(~attn_mask, dim=-1, keepdim=True), True, attn_mask)
            else:
                attn_mask = None
        q = self.q_ca(q, kv=kv, attn_mask=attn_mask)
        q = self.q_sa(q)
        q = self.q_dense(q)
        if self.bidirectional_ca:
            if attn_mask is not None:
                attn_mask = attn_mask.transpose(-2, -1)
            kv = self.kv_ca(kv, kv=q, attn_mask=attn_mask)
            kv = self.kv_dense(kv)
        return q, kv


class MaskFormerDecoder(nn.Module):
    def __init__(self, num_queries, decoder_layer_config, num_decoder_layers, mask_attention=True,
                 local_strided_attn=False, window_size=512, window_wrap=True):
        super().__init__()
        decoder_layer_config = decoder_layer_config.copy()
        if not FIXED:
            # Ensure mask_attention is passed to decoder layers
            decoder_layer_config["mask_attention"] = mask_attention
        self.decoder_layers = nn.ModuleList([MaskFormerDecoderLayer(**decoder_layer_config)
                                             for _ in range(num_decoder_layers)])
        self.num_queries = num_queries
        self.mask_attention = mask_attention
        self.local_strided_attn = local_strided_attn
        self.window_size = window_size
        self.window_wrap = window_wrap
        self.initial_queries = nn.Parameter(torch.randn(num_queries, decoder_layer_config["dim"]))
        assert not (self.local_strided_attn and self.mask_attention), \
            "local_strided_attn and mask_attention cannot both be True"

    def forward(self, x):
        batch_size = x["key_embed"].shape[0]
        x["query_embed"] = self.initial_queries.expand(batch_size, -1, -1)
        attn_mask = None
        if self.local_strided_attn:
            assert x["query_embed"].shape[0] == 1, "Local strided attention only supports batch size 1"
            attn_mask = auto_local_ca_mask(x["query_embed"], x["key_embed"], self.window_size, wrap=self.window_wrap)
        for decoder_layer in self.decoder_layers:
            x["query_embed"], x["key_embed"] = decoder_layer(x["query_embed"], x["key_embed"], attn_mask=attn_mask)
        return x, attn_mask


dim = 32
hit_embed = nn.Linear(3, dim)
decoder = MaskFormerDecoder(num_queries=8, decoder_layer_config={"dim": dim}, num_decoder_layers=2,
                            mask_attention=False, local_strided_attn=True, window_size=4).eval()

# one event, 32 hits sorted by phi (the window is a window in phi)
phi = torch.sort(torch.rand(1, 32) * 2 * torch.pi - torch.pi).values
hits = torch.stack([phi.cos(), phi.sin(), torch.randn(1, 32)], dim=-1)

captured = []
decoder.decoder_layers[0].q_ca.register_forward_hook(lambda m, i, o: captured.append(o.detach()))
with torch.no_grad():
    _, window = decoder({"key_embed": hit_embed(hits)})
    # move every hit outside query 0's phi window; with the window applied query 0's first cross-attention
    # output must not change
    far = ~window[0, 0]
    hits2 = hits.clone()
    hits2[0, far] += 5.0
    decoder({"key_embed": hit_embed(hits2)})
diff = (captured[0][0, 0] - captured[1][0, 0]).abs().max().item()
print(f"fixed={FIXED} query 0 cross-attention change when only hits outside its window move: {diff:.3e}")
