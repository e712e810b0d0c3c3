# Citation: collabora/WhisperSpeech commit 20bbb6c473b29e1ad5c7fc33a46c01b4cc929df6
#   ("Fixed prompted S2A generation"; also carried in the janhq/WhisperSpeech fork).
# Upstream: whisperspeech/s2a_delar_mup_wds_mlang.py, SADelARTransformer.generate (with
#   generate_one / forward / DelSumEmbedding / DelSumHead) and whisperspeech/modules.py
#   (MultiHeadAttention with k_cache/v_cache and mask[q_positions, :k.shape[-2]], BaseDecoder's
#   causal mask buffer).
# Bug: with an acoustic-token prompt (atoks_prompt, laid out with the per-codebook delay pattern),
#   the prefill step ran only position 0 (the SOT column) through the decoder, so the prompt's
#   columns 1..P never reached the self-attention KV cache; the decode loop then attends, through
#   the causal mask over the whole cache, to those never-written (zero) cache slots, and the
#   prefill's sample overwrote the prompt's first codebook-0 token at column 1.
# Fix: prefill runs all columns 0..P (toks[:, :, :start], positions[:start]) so the prompt fills
#   the cache, writes the prefill sample to column P+1, and the loop continues from there.
# Shrunk: 1024 codes -> 16, 4 quantizers, tiny widths; random weights; CPU, float32, no compile.
import math
import sys

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from typing import Optional

FIXED = "--fixed" in sys.argv


# ---------------------------------------------------------------- inference.py
def multinomial_sample_one_no_sync(probs_sort):
    q = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / q, dim=-1, keepdim=True).to(dtype=torch.int)


def logits_to_probs(logits, T=1.0, top_k=None):
    logits = logits / max(T, 1e-5)
    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return probs


def sample(logits, T=1.0, top_k=None):
    probs = logits_to_probs(logits, T, top_k)
    idx_next = multinomial_sample_one_no_sync(probs)
    return idx_next


# ---------------------------------------------------------------- modules.py
class LayerNorm(nn.LayerNorm):
    def forward(self, x):
        return super().forward(x.float()).type(x.dtype)


class QueryHead(nn.Linear):
    pass


class Rotary(torch.nn.Module):
    def __init__(self, dim, base=10000):
        super().__init__()
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq)
        self.seq_len_cached = None
        self.cos_cached = None
        self.sin_cached = None

    def forward(self, x, seq_dim=1):
        seq_len = x.shape[seq_dim]
        if not self.seq_len_cached or seq_len > self.seq_len_cached:
            self.seq_len_cached = 2500
            t = torch.arange(self.seq_len_cached, device=x.device).type_as(self.inv_freq)
            freqs = torch.einsum("i,j->ij", t, self.inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1).to(x.device)
            self.cos_cached = emb.cos()[None, :, None, :]
            self.sin_cached = emb.sin()[None, :, None, :]
        return self.cos_cached, self.sin_cached


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=len(x.shape) - 1)


def rope_rotate(x, positions, cos, sin):
    return x * cos[:, positions] + rotate_half(x) * sin[:, positions]


class MultiHeadAttention(nn.Module):
    def __init__(self, n_state: int, n_head: int, qk_scale: float = 1, rope: bool = False, cross=False):
        super().__init__()
        self.n_state = n_state
        self.n_head = n_head
        self.sqrt_qk_scale = math.sqrt(qk_scale)
        self.query = QueryHead(n_state, n_state)
        self.key = nn.Linear(n_state, n_state, bias=False)
        self.value = nn.Linear(n_state, n_state)
        self.out = nn.Linear(n_state, n_state)
        self.cross = cross
        self.query_subsampling = 1
        self.key_subsampling = 1

        self.cached_kvx = None
        self.register_buffer('k_cache', None)
        self.register_buffer('v_cache', None)

        self.rotary = None
        if rope:
            self.rotary = Rotary(n_state // n_head)
        self.qkv = None
        self.kv = None

    def setup_kv_cache(self, max_batch_size, max_seq_len, dtype=torch.float32):
        cache_shape = (max_batch_size, self.n_head, max_seq_len, self.n_state // self.n_head)
        self.k_cache = torch.zeros(cache_shape, dtype=dtype, device=self.key.weight.device)
        self.v_cache = torch.zeros(cache_shape, dtype=dtype, device=self.value.weight.device)

    def merge_linears(self, layers, mults):
        bias = [x.bias for x in layers if x.bias is not None][0]
        din, dout = layers[0].weight.shape
        new = nn.Linear(din, len(layers) * dout).to(layers[0].weight.device)
        with torch.no_grad():
            new.weight[:] = torch.cat([x.weight * m for x, m in zip(layers, mults)])
            new.bias[:] = torch.cat([torch.zeros_like(bias) if x.bias is None else x.bias * m for x, m in zip(layers, mults)])
        return new

    def convert_for_eval(self):
        if self.qkv or self.kv: raise AttributeError("already converted")
        self.odim = self.key.weight.shape[1]
        if self.cross:
            self.q = self.merge_linears([self.query], [self.sqrt_qk_scale])
            self.kv = self.merge_linears([self.key, self.value], [self.sqrt_qk_scale, 1])
        else:
            self.qkv = self.merge_linears([self.query, self.key, self.value],
                                          [self.sqrt_qk_scale, self.sqrt_qk_scale, 1])

    def split_heads(self, x, x_positions, rope=False, subsampling=1):
        x = x.view(*x.shape[:2], self.n_head, -1)
        if rope:
            x = rope_rotate(x, x_positions * subsampling, *self.rotary(x))
        return x.permute(0, 2, 1, 3)

    def forward(self, qx, q_positions, kvx, kv_positions, causal=False, mask=None):
        if self.k_cache is not None:
            assert qx.shape[0] <= self.k_cache.shape[0], "please pass in a larger max_batch_size to setup_kv_cache"
        if self.qkv:
            q, k, v = self.qkv(qx).split(self.odim, dim=-1)
        elif self.kv:
            q = self.q(qx)
            k, v = self.kv(kvx).split(self.odim, dim=-1)
        else:
            q, k, v = None, None, None

        if q is None: q = self.query(qx) * self.sqrt_qk_scale
        q = self.split_heads(q, q_positions, rope=self.rotary, subsampling=self.query_subsampling)

        if kvx is not self.cached_kvx:
            if k is None: k = self.key(kvx) * self.sqrt_qk_scale
            k = self.split_heads(k, kv_positions, rope=self.rotary, subsampling=self.key_subsampling)
            if v is None: v = self.value(kvx)
            v = self.split_heads(v, kv_positions)
            if self.k_cache is not None:
                self.k_cache[:k.shape[0], :, kv_positions] = k
                self.v_cache[:v.shape[0], :, kv_positions] = v

        if self.k_cache is not None:
            k, v = self.k_cache[:k.shape[0]], self.v_cache[:v.shape[0]]

        if mask is not None:
            mask = mask[q_positions, :k.shape[-2]]

        wv = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0, is_causal=causal)

        return self.out(wv.permute(0, 2, 1, 3).flatten(start_dim=2))


class ResidualAttentionBlock(nn.Module):
    def __init__(self, n_state: int, n_head: int, cross_attention: bool = False, rope: bool = False,
                 qk_scale: float = 1, ffn_mult: int = 4):
        super().__init__()
        self.attn = MultiHeadAttention(n_state, n_head, qk_scale=qk_scale, rope=rope)
        self.attn_ln = LayerNorm(n_state)
        self.cross_attn = (
            MultiHeadAttention(n_state, n_head, qk_scale=qk_scale, rope=rope, cross=True) if cross_attention else None
        )
        self.cross_attn_ln = LayerNorm(n_state) if cross_attention else None
        n_mlp = n_state * ffn_mult
        self.mlp = nn.Sequential(nn.Linear(n_state, n_mlp), nn.GELU(), nn.Linear(n_mlp, n_state))
        self.mlp_ln = LayerNorm(n_state)

    def setup_kv_cache(self, max_batch_size, max_seq_len, max_cross_seq_len=None):
        self.attn.setup_kv_cache(max_batch_size, max_seq_len)
        if self.cross_attn:
            self.cross_attn.setup_kv_cache(max_batch_size, max_cross_seq_len)

    def forward(self, x: Tensor, x_positions: Tensor = None, xa: Optional[Tensor] = None,
                xa_positions: Optional[Tensor] = None, causal=False, mask=None):
        lnx = self.attn_ln(x)
        x = x + self.attn(lnx, x_positions, lnx, x_positions, causal=causal, mask=mask)
        if self.cross_attn:
            lnx = self.cross_attn_ln(x)
            x = x + self.cross_attn(lnx, x_positions, xa, xa_positions)
        x = x + self.mlp(self.mlp_ln(x))
        return x


class BaseDecoder(nn.Module):
    def __init__(self, depth=6, n_head=6, width=384, qk_scale=1, ffn_mult=4, length=2250, rope=False):
        super().__init__()
        self.length = length
        self.width = width
        self.layers = nn.ModuleList([
            ResidualAttentionBlock(self.width, n_head, qk_scale=qk_scale, ffn_mult=ffn_mult,
                                   cross_attention=True, rope=rope)
            for _ in range(math.floor(depth))
        ])
        self.ln_post = LayerNorm(width)
        mask = torch.empty(length, length).fill_(-torch.inf).triu_(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x, x_positions, xenc, xenc_positions):
        for i, l in enumerate(self.layers):
            x = l(x, x_positions, xenc, xenc_positions, causal=self.training,
                  mask=self.mask if not self.training else None)
        x = self.ln_post(x)
        return x


class FlexEmbeddings(nn.Module):
    def __init__(self, codes, width, special_codes=None, frozen_width=None, special_embedding=None, unembed=True):
        super().__init__()
        self.codes = codes
        self.special_codes = special_codes
        if frozen_width is None: frozen_width = width
        self.main = nn.Embedding(codes, frozen_width or width)
        self.emb_to_hidden = nn.Linear(frozen_width, width) if frozen_width != width else None
        self.hidden_to_emb = nn.Linear(width, frozen_width) if unembed and frozen_width != width else None
        if special_codes:
            self.special = special_embedding or nn.Embedding(special_codes, width)

    def forward(self, toks):
        if self.special_codes:
            special_mask = toks >= self.codes
            embs = self.main(torch.where(special_mask, 0, toks))
        else:
            embs = self.main(toks)
        if self.emb_to_hidden: embs = self.emb_to_hidden(embs)
        if self.special_codes:
            embs[special_mask] = self.special(toks[special_mask] - self.codes).to(embs.dtype)
        return embs

    def unembed(self, embs):
        orig_embs = embs
        if self.hidden_to_emb: embs = self.hidden_to_emb(embs)
        main_logits = (embs @ self.main.weight.to(embs.dtype).T).float()
        if not self.special_codes:
            return main_logits
        special_logits = (orig_embs @ self.special.weight.to(orig_embs.dtype).T).float()
        return torch.cat([main_logits, special_logits], dim=-1)


# ---------------------------------------------------------------- s2a_delar_mup_wds_mlang.py
class DelSumEmbedding(nn.Module):
    def __init__(self, n_head=6, head_width=64, atoks_width=None, length=2250, codes=1024, quantizers=8, pos_embs=None):
        super().__init__()
        self.length = length
        width = n_head * head_width
        if atoks_width is None: atoks_width = width
        self.width = width
        self.quantizers = quantizers
        emb = None
        embs = []
        for _ in range(quantizers):
            emb = FlexEmbeddings(codes, width, special_codes=2, frozen_width=atoks_width,
                                 special_embedding=emb and emb.special)
            embs.append(emb)
        self.embeddings = nn.ModuleList(embs)
        if pos_embs is not None:
            self.register_buffer("positional_embedding", pos_embs)

    def forward(self, toks, xenc):
        b, _, n = toks.shape
        newn = min(n, self.length)
        embs = torch.zeros((b, newn, self.width), dtype=xenc.dtype, device=xenc.device)
        for i in range(self.quantizers):
            embs[:, :] += self.embeddings[i](toks[:, i, :])
        x = embs.to(xenc.dtype)
        return x


class DelSumHead(nn.Module):
    def __init__(self, quantizers=8, n_head=6, head_width=64):
        super().__init__()
        self.width = n_head * head_width
        self.quantizers = quantizers
        self.splitter = nn.Sequential(nn.Linear(self.width, self.width * quantizers), nn.GELU())

    def forward(self, x, embeddings=None):
        b, newn, _ = x.shape
        split = self.splitter(x).view(b, newn, self.quantizers, self.width)
        logits = torch.stack([embeddings[q].unembed(split[:, :, q]) for q in range(self.quantizers)], dim=1)
        return logits


class Tunables:
    output_mult: float = 5.6
    query_mult: float = .3
    encoder_depth_ratio: float = 0.25
    rope: bool = True
    causal_encoder: bool = False


class SADelARTransformer(nn.Module):
    def __init__(self, depth=3, ctx_n=2250, stoks_len=750, stoks_codes=4097, stoks_width=None,
                 spk_width=None, atoks_width=None, n_head=3, head_width=64, ffn_mult=4,
                 quantizers=8, codes=1024, tunables=Tunables()):
        super().__init__()
        self.quantizers = quantizers
        self.codes = codes  # upstream: 1024 (EnCodec codebook size)
        width = n_head * head_width
        self.depth, self.ctx_n, self.stoks_len, self.stoks_codes = depth, ctx_n, stoks_len, stoks_codes
        self.width = width
        self.base_width = 3 * head_width
        self.tunables = tunables
        self.dtype = torch.float32

        if stoks_width is None: stoks_width = width
        if spk_width is None: spk_width = width
        self.emb_factor = width != stoks_width
        self.spk_factor = width != spk_width
        self.positional_embeddings = None  # tunables.rope

        self.semantic_embedding = nn.Embedding(stoks_codes, stoks_width)
        qk_scale = self.tunables.query_mult * 8 / math.sqrt(head_width)
        encoder_depth = int(depth * 2 * tunables.encoder_depth_ratio)
        decoder_depth = depth * 2 - encoder_depth
        self.encoder = nn.Sequential(*[
            ResidualAttentionBlock(width, n_head, qk_scale=qk_scale, ffn_mult=ffn_mult, rope=tunables.rope)
            for _ in range(encoder_depth)
        ])
        self.ln_post = LayerNorm(width)
        self.embds = DelSumEmbedding(pos_embs=self.positional_embeddings, length=ctx_n, n_head=n_head,
                                     head_width=head_width, atoks_width=atoks_width, quantizers=quantizers,
                                     codes=codes)
        self.decoder = BaseDecoder(qk_scale=qk_scale, length=ctx_n, n_head=n_head, width=n_head * head_width,
                                   ffn_mult=ffn_mult, depth=decoder_depth, rope=tunables.rope)
        self.head = DelSumHead(n_head=n_head, head_width=head_width, quantizers=quantizers)
        for l in self.decoder.layers:
            l.cross_attn.key_subsampling = 3
        self.apply(self.init_transformer)

    def init_transformer(self, m):  # stand-in for the muP init: random weights
        if isinstance(m, (nn.Linear, nn.Embedding)):
            torch.nn.init.trunc_normal_(m.weight, std=.3)
            if isinstance(m, nn.Linear) and m.bias is not None:
                torch.nn.init.constant_(m.bias, 0)

    def embed_stoks(self, Stoks):
        x = Stoks  # 25 toks/s path
        Sembs = self.semantic_embedding(x.to(torch.long))
        return Sembs

    def _encoder(self, semb, positions):
        x = semb
        for l in self.encoder: x = l(x, positions, causal=self.tunables.causal_encoder)
        return self.ln_post(x)

    def run_encoder(self, Stoks, speakers):
        semb = self.embed_stoks(Stoks)
        positions = torch.arange(0, semb.shape[1], device=semb.device)
        xenc = self._encoder(semb, positions)
        enc_logits = None
        spk_embs = F.normalize(speakers, dim=-1)
        return xenc + spk_embs.unsqueeze(1), positions, enc_logits

    def forward(self, Stoks, Atoks, speakers, langs=None, noloss=False, xenc=None, xenc_positions=None,
                atoks_positions=None):
        embs = self.embds(Atoks, xenc)
        if atoks_positions is None: atoks_positions = torch.arange(0, embs.shape[1], device=embs.device)
        x = self.decoder(embs, atoks_positions, xenc, xenc_positions)
        logits = self.head(x, embeddings=self.embds.embeddings)
        logits *= self.tunables.output_mult / (self.width / self.base_width)
        return logits

    def optimize(self, max_batch_size=1, dtype=torch.float32, torch_compile=False):
        for l in self.encoder:
            l.attn.convert_for_eval()
        for l in self.decoder.layers:
            l.attn.convert_for_eval()
            l.cross_attn.convert_for_eval()
            l.setup_kv_cache(max_batch_size, self.ctx_n, self.stoks_len)

    @property
    def device(self):
        return next(self.parameters()).device

    def generate_one(self, toks, positions, langs, xenc, xenc_positions, T, top_k):
        probs = self(None, toks, None, langs, noloss=True, xenc=xenc, xenc_positions=xenc_positions,
                     atoks_positions=positions)
        probs = probs[:, :, -1]
        return sample(probs, T, top_k)

    def generate_next(self, *args, **kwargs):
        return self.generate_one(*args, **kwargs)

    @torch.no_grad()
    def generate(self, stoks, speakers, langs=None, atoks_prompt=None, N=None, bs=1, T=0.7, top_k=None):
        dev = self.device
        N = N or len(stoks) * 3
        stoks = F.pad(stoks.to(dev), (1, self.stoks_len - len(stoks) - 1), value=self.stoks_codes - 1).unsqueeze(0)
        speakers = speakers.to(device=dev, dtype=self.dtype)
        toks = torch.full((bs, self.quantizers, self.ctx_n), self.codes + 1, dtype=torch.long, device=dev)
        T = torch.tensor(T, device=dev)
        if not FIXED:
            start = 0
            if atoks_prompt is not None:
                start = atoks_prompt.shape[-1]
                for i in range(self.quantizers):
                    toks[:, i, 1 + i:start + i + 1] = atoks_prompt[:, i]
            it = range(start + 1, min(N, self.ctx_n - 1))
            stoks, speakers = [x.repeat(bs, 1) for x in (stoks, speakers)]
            xenc, xenc_positions, _ = self.run_encoder(stoks, speakers)
            toks_positions = torch.arange(N, device=dev)
            # prefill
            toks[:, 0, 1] = self.generate_one(toks[:, :, :1], toks_positions[:1], langs, xenc, xenc_positions, T, top_k)[:, 0, 0]
            for i in it:
                toks[:, :i + 1, i + 1] = self.generate_next(toks[:, :, i:i + 1], toks_positions[i:i + 1], langs, xenc,
                                                            xenc_positions, T, top_k)[:, :i + 1, 0]
        else:
            start = 0  # number of valid tokens or the index of first empty spot
            if atoks_prompt is not None:
                start = atoks_prompt.shape[-1]
                for i in range(self.quantizers):
                    toks[:, i, 1 + i:start + i + 1] = atoks_prompt[:, i]
            start += 1  # we always start with at least an SOT
            stoks, speakers = [x.repeat(bs, 1) for x in (stoks, speakers)]
            xenc, xenc_positions, _ = self.run_encoder(stoks, speakers)
            toks_positions = torch.arange(N, device=dev)
            # prefill
            initial = self.generate_one(toks[:, :, :start], toks_positions[:start], langs, xenc, xenc_positions, T, top_k)
            toks[:, :start, start:start + 1] = initial[:, :start]
            start += 1
            it = range(start, min(N, self.ctx_n - 1))
            for i in it:
                toks[:, :i, i:i + 1] = self.generate_next(toks[:, :, i - 1:i], toks_positions[i - 1:i], langs, xenc,
                                                          xenc_positions, T, top_k)[:, :i]
        # shift tokens
        toks = toks[:, :, 1:N]
        for j in range(self.quantizers):
            toks[:, j] = torch.roll(toks[:, j], -j)
        return toks[:, :, :N - 4]


if __name__ == "__main__":
    torch.manual_seed(0)
    model = SADelARTransformer(depth=2, ctx_n=48, stoks_len=16, stoks_codes=33, n_head=2, head_width=16,
                               ffn_mult=2, quantizers=4, codes=16).eval()
    bs = 2
    model.optimize(max_batch_size=bs)

    stoks = torch.randint(0, 32, (12,))                # semantic tokens of the sentence
    speakers = torch.randn(1, model.width)              # speaker embedding
    atoks_prompt = torch.randint(0, 16, (1, 4, 7))      # acoustic-token prompt: 4 codebooks x 7 frames

    torch.manual_seed(1)
    out = model.generate(stoks, speakers, atoks_prompt=atoks_prompt, bs=bs, T=0.7)
    print("generated atoks shape:", tuple(out.shape))
    print("first 7 frames, codebook 0, row 0:", out[0, 0, :7].tolist())
    print("prompt codebook 0:               ", atoks_prompt[0, 0].tolist())
    print("frames 7.. codebook 0, row 0:", out[0, 0, 7:].tolist())
    print("frames 7.. codebook 1, row 1:", out[1, 1, 7:].tolist())
    print("token checksum:", int((out.long() * torch.arange(out.numel()).view_as(out)).sum()))
