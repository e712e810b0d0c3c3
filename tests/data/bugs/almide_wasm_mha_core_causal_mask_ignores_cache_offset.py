"""Almide (WASM emit) `mha_core`: the causal mask is `j > i` even when the queries sit after a
KV cache, so a cached generation step masks out the whole cached prefix but key 0.

Citation: almide/almide PR #227 ("emit_wasm: KV-cache-aware causal mask in mha_core"); the
native runtime got the same fix in PR #222 (runtime/rs/src/matrix.rs). Rust code generator; this
is a torch port of the Bonsai (Qwen3) KV-cache generation step described in #222 / #224
(rms_norm -> q/k/v linear -> per-head rms_norm -> rope_rotate_at -> append_rows -> repeat_kv ->
masked multi-head attention), written from the PR descriptions (the diffs were not read).

Bug: `almide_rt_matrix_mha_core` masked key j for query i when `j > i`. That is right only when
sq == sk. In a KV-cache step (sq = 1 new row, sk = cached rows + 1) the row i = 0 keeps only key 0:
the cached context is hidden (PR #227: the bonsai-almide browser demo looped on `:::` after
"Tokyo").

Fix: mask when `j > (sk - sq) + i` (reduces to `j > i` when sq == sk).

Reproduction: a 2-layer Qwen3-like model; a 5-token prompt is prefilled (sq == sk, same mask
either way), then 3 tokens are generated one at a time against the K/V caches.
"""
import math
import sys

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

N_LAYERS, D, N_Q_HEADS, N_KV_HEADS, HEAD_DIM, FFN_HIDDEN, VOCAB = 2, 32, 4, 2, 8, 64, 50
ROPE_THETA, EPS = 10000.0, 1e-6


def rms_norm(x, gamma, eps=EPS):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * gamma


def rope_rotate_at(x, n_heads, head_dim, start_pos, theta=ROPE_THETA):
    """Rotate each head of a (rows, n_heads * head_dim) matrix at positions start_pos.."""
    rows = x.shape[0]
    x = x.view(rows, n_heads, head_dim)
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2).float() / head_dim))
    ang = torch.outer(torch.arange(start_pos, start_pos + rows).float(), inv)
    cos, sin = torch.cat((ang, ang), -1)[:, None, :].cos(), torch.cat((ang, ang), -1)[:, None, :].sin()
    x1, x2 = x.chunk(2, dim=-1)
    return (x * cos + torch.cat((-x2, x1), -1) * sin).reshape(rows, n_heads * head_dim)


def append_rows(a, b):
    return b if a.shape[0] == 0 else torch.cat((a, b), dim=0)


def repeat_kv(x, n_rep, head_dim):
    rows = x.shape[0]
    return x.view(rows, -1, 1, head_dim).expand(rows, -1, n_rep, head_dim).reshape(rows, -1)


def mha_core(q, k, v, n_heads, head_dim):
    """almide_rt_matrix_mha_core: causal multi-head attention over (rows, heads*dim) matrices."""
    sq, sk = q.shape[0], k.shape[0]
    qh = q.view(sq, n_heads, head_dim).transpose(0, 1)
    kh = k.view(sk, n_heads, head_dim).transpose(0, 1)
    vh = v.view(sk, n_heads, head_dim).transpose(0, 1)
    scores = qh @ kh.transpose(-1, -2) / math.sqrt(head_dim)
    i = torch.arange(sq)[:, None]
    j = torch.arange(sk)[None, :]
    masked = j > (sk - sq) + i if FIXED else j > i
    scores = scores.masked_fill(masked, float("-inf"))
    out = F.softmax(scores, dim=-1) @ vh
    return out.transpose(0, 1).reshape(sq, n_heads * head_dim)


def make_weights(gen):
    def w(*shape):
        return torch.randn(*shape, generator=gen) / math.sqrt(shape[0])
    layers = []
    for _ in range(N_LAYERS):
        layers.append(dict(
            attn_norm=torch.ones(D), q=w(D, N_Q_HEADS * HEAD_DIM), k=w(D, N_KV_HEADS * HEAD_DIM),
            v=w(D, N_KV_HEADS * HEAD_DIM), q_norm=torch.ones(HEAD_DIM), k_norm=torch.ones(HEAD_DIM),
            o=w(N_Q_HEADS * HEAD_DIM, D), ffn_norm=torch.ones(D), gate=w(D, FFN_HIDDEN),
            up=w(D, FFN_HIDDEN), down=w(FFN_HIDDEN, D)))
    return dict(embed=torch.randn(VOCAB, D, generator=gen), layers=layers, norm=torch.ones(D),
                lm_head=w(D, VOCAB))


def qwen3_block_kv(h, k_cache, v_cache, lw, start_pos):
    x = rms_norm(h, lw["attn_norm"])
    q, k, v = x @ lw["q"], x @ lw["k"], x @ lw["v"]
    q = rms_norm(q.view(-1, N_Q_HEADS, HEAD_DIM), lw["q_norm"]).reshape(q.shape)
    k = rms_norm(k.view(-1, N_KV_HEADS, HEAD_DIM), lw["k_norm"]).reshape(k.shape)
    q = rope_rotate_at(q, N_Q_HEADS, HEAD_DIM, start_pos)
    k = rope_rotate_at(k, N_KV_HEADS, HEAD_DIM, start_pos)
    k_cache, v_cache = append_rows(k_cache, k), append_rows(v_cache, v)
    rep = N_Q_HEADS // N_KV_HEADS
    attn = mha_core(q, repeat_kv(k_cache, rep, HEAD_DIM), repeat_kv(v_cache, rep, HEAD_DIM), N_Q_HEADS, HEAD_DIM)
    h = h + attn @ lw["o"]
    x = rms_norm(h, lw["ffn_norm"])
    h = h + (F.silu(x @ lw["gate"]) * (x @ lw["up"])) @ lw["down"]
    return h, k_cache, v_cache


def forward(weights, tokens, caches, start_pos):
    h = weights["embed"][tokens]
    for li, lw in enumerate(weights["layers"]):
        h, caches[li][0], caches[li][1] = qwen3_block_kv(h, caches[li][0], caches[li][1], lw, start_pos)
    return rms_norm(h, weights["norm"]) @ weights["lm_head"]


def generate(weights, prompt, n_new):
    caches = [[torch.zeros(0, N_KV_HEADS * HEAD_DIM), torch.zeros(0, N_KV_HEADS * HEAD_DIM)]
              for _ in range(N_LAYERS)]
    logits = forward(weights, prompt, caches, 0)
    out = [int(logits[-1].argmax())]
    pos = len(prompt)
    for _ in range(n_new - 1):
        logits = forward(weights, torch.tensor([out[-1]]), caches, pos)
        pos += 1
        out.append(int(logits[-1].argmax()))
    return out


if __name__ == "__main__":
    torch.manual_seed(0)
    weights = make_weights(torch.Generator().manual_seed(0))
    prompt = torch.tensor([7, 21, 3, 44, 12])
    with torch.no_grad():
        print("fixed" if FIXED else "buggy", generate(weights, prompt, 4))
