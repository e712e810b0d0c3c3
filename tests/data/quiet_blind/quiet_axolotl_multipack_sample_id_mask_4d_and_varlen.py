"""Multipack (sample packing) fine-tuning as axolotl does it, shrunk to tiny sizes.

Ported from axolotl-ai-cloud/axolotl:
  src/axolotl/monkeypatch/utils.py @ 0ebab6330991ef3dcd4bdb7241cf5ee7a24db167
      get_max_seqlen_in_batch, get_unpad_data (patched over transformers' _get_unpad_data
      for the flash-attn varlen path), mask_2d_to_4d and
      patched_prepare_4d_causal_attention_mask (eager / sdpa path)
  src/axolotl/utils/collators/batching.py (V2BatchSamplerDataCollatorForSeq2Seq): the packed
      attention_mask holds the sample index 1, 2, 3, ... of each token and 0 on padding;
      position_ids restart at 0 for every packed sample.
The 4-D branch of transformers' _prepare_4d_causal_attention_mask (modeling_attn_mask_utils,
AttentionMaskConverter for a 4-D input) is written inline: inverted = 1 - mask, then
masked_fill(inverted.bool(), finfo(dtype).min).

Two attention paths over the same packed batch:
  * eager: block-diagonal causal additive mask from mask_2d_to_4d; the trailing pad rows
    (sample id 0) are fully masked on purpose, softmax of a row of finfo.min is a finite
    uniform average, and those rows carry label -100.
  * varlen: a plain-torch stand-in for flash_attn_varlen_func(causal=True) fed by
    get_unpad_data's (indices, cu_seqlens, max_seqlen): pads are dropped, each packed
    sample is a separate causal segment.

Check: the hidden states and logits at every real token, and the loss, equal those of
each sample run alone, unpadded, with plain causal attention.
"""

import math
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


# ------------------------------------------------------ axolotl/monkeypatch/utils.py
def get_max_seqlen_in_batch(attention_mask: torch.Tensor) -> torch.Tensor:
    max_num = int(torch.max(attention_mask).item())
    batch_size, _ = attention_mask.shape
    counts = torch.zeros((batch_size, max_num), dtype=torch.int32)
    for i in range(1, max_num + 1):
        mask = attention_mask == i
        counts[:, i - 1] = torch.sum(mask, dim=-1).to(dtype=torch.int32)
    result = counts.flatten()
    nonzero_indices = torch.nonzero(result).squeeze(-1)
    return result[nonzero_indices]


def get_unpad_data(attention_mask: torch.Tensor):
    device = attention_mask.device
    seqlens_in_batch = get_max_seqlen_in_batch(attention_mask)
    indices = torch.nonzero(attention_mask.flatten()).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0)).to(device=device).detach()
    return indices, cu_seqlens, max_seqlen_in_batch


def mask_2d_to_4d(mask: torch.Tensor, dtype: torch.dtype, tgt_len: Optional[int] = None):
    """[bsz, seq_len] sample ids -> [bsz, 1, tgt_len, src_len] block-diagonal lower-triangular 0/1."""
    if len(mask.size()) == 4:
        return mask
    bsz, src_len = int(mask.size()[0]), int(mask.size()[1])
    tgt_len = tgt_len if tgt_len is not None else src_len
    mask = mask.unsqueeze(1).unsqueeze(2)
    mask = mask.expand(bsz, 1, tgt_len, src_len)
    binary_mask = torch.where(
        mask != 0,
        torch.tensor(1, device=mask.device).to(dtype),
        torch.tensor(0, device=mask.device).to(dtype),
    )
    zero_one_mask = torch.eq(mask, mask.transpose(-1, -2)).int() * binary_mask
    lower_triangular_ones = torch.tril(torch.ones((tgt_len, src_len), dtype=dtype)).to(mask.device)
    return zero_one_mask * lower_triangular_ones


def _prepare_4d_causal_attention_mask(attention_mask, input_shape, inputs_embeds, past_key_values_length):
    # transformers: a 4-D mask is taken as given and inverted into an additive one
    key_value_length = input_shape[-1] + past_key_values_length
    expected_shape = (input_shape[0], 1, input_shape[1], key_value_length)
    if tuple(attention_mask.shape) != expected_shape:
        raise ValueError(f"Incorrect 4D attention_mask shape: {tuple(attention_mask.shape)}; expected: {expected_shape}.")
    inverted_mask = 1.0 - attention_mask
    return inverted_mask.masked_fill(inverted_mask.to(torch.bool), torch.finfo(inputs_embeds.dtype).min)


def patched_prepare_4d_causal_attention_mask(attention_mask, *args):
    dtype = torch.float32  # bf16 only on a bf16-capable GPU
    return _prepare_4d_causal_attention_mask(mask_2d_to_4d(attention_mask, dtype=dtype), *args)


# ---------------------------------------------- flash_attn_varlen_func stand-in (torch)
def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=True, softmax_scale=None):
    """q, k, v: (total_tokens, n_heads, head_dim); segments given by cu_seqlens."""
    out = torch.empty_like(q)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    for i in range(len(cu_seqlens_q) - 1):
        s, e = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        qs, ks, vs = (t[s:e].transpose(0, 1) for t in (q, k, v))
        scores = (qs @ ks.transpose(-1, -2)) * scale
        if causal:
            L = e - s
            scores = scores.masked_fill(~torch.ones(L, L, dtype=torch.bool).tril(), float("-inf"))
        out[s:e] = (scores.softmax(-1) @ vs).transpose(0, 1)
    return out


# ------------------------------------------------------------ tiny Llama (GQA, RoPE)
def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


def rope_cos_sin(position_ids, dim, base=10000.0):
    inv = 1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))
    freqs = position_ids[..., None].float() * inv
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


class LlamaAttention(nn.Module):
    def __init__(self, dim=32, n_heads=4, n_kv=2):
        super().__init__()
        self.n_heads, self.n_kv, self.hd = n_heads, n_kv, dim // n_heads
        self.q_proj = nn.Linear(dim, n_heads * self.hd, bias=False)
        self.k_proj = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.v_proj = nn.Linear(dim, n_kv * self.hd, bias=False)
        self.o_proj = nn.Linear(n_heads * self.hd, dim, bias=False)

    def forward(self, x, position_ids, attention_mask=None, impl="eager", unpad=None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.n_kv, self.hd).transpose(1, 2)
        cos, sin = rope_cos_sin(position_ids, self.hd)
        cos, sin = cos[:, None], sin[:, None]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        rep = self.n_heads // self.n_kv
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        if impl == "eager":
            w = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
            if attention_mask is not None:  # additive (B, 1, T, T)
                w = w + attention_mask
            else:
                w = w.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), float("-inf"))
            o = torch.softmax(w, dim=-1, dtype=torch.float32) @ v
            o = o.transpose(1, 2).reshape(B, T, -1)
        else:  # flash-attn varlen, as transformers' _flash_attention_forward unpads
            indices, cu_seqlens, max_seqlen = unpad
            qf, kf, vf = (t.transpose(1, 2).reshape(B * T, self.n_heads, self.hd)[indices] for t in (q, k, v))
            of = flash_attn_varlen_func(qf, kf, vf, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
            o = torch.zeros(B * T, self.n_heads, self.hd)
            o[indices] = of  # pad_input: zeros at padding
            o = o.view(B, T, -1)
        return self.o_proj(o)


class Block(nn.Module):
    def __init__(self, dim=32):
        super().__init__()
        self.ln1, self.ln2 = nn.RMSNorm(dim, eps=1e-6), nn.RMSNorm(dim, eps=1e-6)
        self.attn = LlamaAttention(dim)
        self.gate, self.up, self.down = nn.Linear(dim, 64, bias=False), nn.Linear(dim, 64, bias=False), nn.Linear(64, dim, bias=False)

    def forward(self, x, position_ids, attention_mask, impl, unpad):
        x = x + self.attn(self.ln1(x), position_ids, attention_mask, impl, unpad)
        h = self.ln2(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class TinyLlama(nn.Module):
    def __init__(self, vocab=50, dim=32, n_layers=2):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=1e-6)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, input_ids, position_ids, attention_mask=None, impl="eager"):
        x = self.embed(input_ids)
        B, T = input_ids.shape
        mask4d, unpad = None, None
        if attention_mask is not None and impl == "eager":
            mask4d = patched_prepare_4d_causal_attention_mask(attention_mask, (B, T), x, 0)
        if attention_mask is not None and impl == "flash_attention_2":
            unpad = get_unpad_data(attention_mask)
        for layer in self.layers:
            x = layer(x, position_ids, mask4d, impl, unpad)
        return self.lm_head(self.norm(x))


def pack(samples, seq_len, pad_id=0):
    """V2BatchSamplerDataCollatorForSeq2Seq-style: concatenate samples, sample ids as mask."""
    ids, mask, pos, labels = [], [], [], []
    for i, (toks, labs) in enumerate(samples):
        ids += toks
        mask += [i + 1] * len(toks)
        pos += list(range(len(toks)))
        labels += labs
    n_pad = seq_len - len(ids)
    ids += [pad_id] * n_pad
    mask += [0] * n_pad
    pos += [0] * n_pad
    labels += [-100] * n_pad
    return ids, mask, pos, labels


def causal_lm_loss(logits, labels):
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1),
                           ignore_index=-100, reduction="sum")


@torch.no_grad()
def main() -> None:
    torch.manual_seed(0)
    model = TinyLlama().eval()
    for p in model.parameters():
        if p.dim() > 1:
            nn.init.normal_(p, std=0.4)

    g = torch.Generator().manual_seed(3)

    def sample(n, n_prompt):
        toks = torch.randint(1, 50, (n,), generator=g).tolist()
        return toks, [-100] * n_prompt + toks[n_prompt:]  # prompt tokens are not trained on

    rows = [[sample(5, 2), sample(4, 1)],               # 9 tokens + 3 pads
            [sample(3, 1), sample(6, 2), sample(3, 1)]]  # exactly 12 tokens, no pad
    seq_len = 12
    packed = [pack(r, seq_len) for r in rows]
    input_ids = torch.tensor([p[0] for p in packed])
    attention_mask = torch.tensor([p[1] for p in packed])
    position_ids = torch.tensor([p[2] for p in packed])
    labels = torch.tensor([p[3] for p in packed])

    # reference: every sample alone, unpadded, plain causal attention
    ref_logits = torch.zeros(2, seq_len, 50)
    ref_loss = 0.0
    for b, r in enumerate(rows):
        start = 0
        for toks, labs in r:
            L = len(toks)
            out = model(torch.tensor([toks]), torch.arange(L)[None], None, "eager")
            ref_logits[b, start:start + L] = out[0]
            ref_loss += causal_lm_loss(out, torch.tensor([labs])).item()
            start += L
    real = attention_mask != 0

    ok = True
    for impl in ("eager", "flash_attention_2"):
        logits = model(input_ids, position_ids, attention_mask, impl)
        assert torch.isfinite(logits).all()
        err = (logits - ref_logits)[real].abs().max().item()
        loss = causal_lm_loss(logits, labels).item()
        match = err < 1e-4 and abs(loss - ref_loss) < 1e-3
        ok &= match
        print(f"{impl:18s} max |packed - alone| = {err:.2e}  loss {loss:.4f} vs {ref_loss:.4f}  match={match}")

    idx, cu, mx = get_unpad_data(attention_mask)
    print("cu_seqlens", cu.tolist(), "max_seqlen", mx)
    ok &= cu.tolist() == [0, 5, 9, 12, 18, 21]
    print("MATCH" if ok else "MISMATCH")
    if not ok:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
