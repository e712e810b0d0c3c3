# Correct program (quiet batch quiet-r142b).
#
# Citation: inclusionAI/AReaL @ee6b66feb4fff0c7d8c359b13fd0c11d2d6c1331:
#   areal/experimental/models/archon/attention.py (create_block_causal_mask_2d, SDPAWrapper)
#   areal/experimental/models/archon/qwen2/model/model.py (Attention, TransformerBlock,
#   Qwen2Model.forward; stored version 0bf3c440dddd2cc7a2b0894f53a2f2f28ea34ec9, KV-cache branch left out)
#
# AReaL's Archon engine trains on packed rows: every document of the micro-batch is
# concatenated into a single row of shape [1, total_len], the collator hands the model
# `cu_seqlens` (cumulative document lengths) and `positions` restarting at 0 in each document.
# On the SDPA backend the attention builds a document mask from those lengths: each token's
# document id comes from `searchsorted(cu_seqlens, arange(seq_len), side="right") - 1`, the
# boolean `same_seq & causal` (same document, key not after the query) is turned into a float
# 0 / -inf bias, and SDPA runs with is_causal=False and GQA.
#
# This program runs one pretraining step (forward, next-token loss inside each document,
# backward, AdamW step) over two packed rows of several documents each and checks the logits
# and the loss against each document run alone through the same weights with is_causal=True.

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

IGNORE_INDEX = -100


@dataclass
class Qwen2ModelArgs:
    dim: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    hidden_dim: int = 128
    vocab_size: int = 97
    max_seq_len: int = 64
    rope_theta: float = 1_000_000.0
    norm_eps: float = 1e-6
    attention_bias: bool = True
    eos_id: int = 96


def create_block_causal_mask_2d(
    cu_seqlens: torch.Tensor,
    seq_len: int,
    device: torch.device,
    dtype: torch.dtype,
) -> torch.Tensor:
    """2D block-diagonal causal mask for SDPA over one packed row.

    cu_seqlens [0, 3, 5, 7] -> three documents of lengths 3, 2, 2; inside a document the
    mask is lower triangular, across documents nothing is attended. 0.0 = attend, -inf = not.
    """
    positions = torch.arange(seq_len, device=device)
    seq_ids = torch.searchsorted(cu_seqlens, positions, side="right") - 1

    # same_seq: query and key must be in the same sequence
    # causal: key position <= query position
    same_seq = seq_ids.unsqueeze(1) == seq_ids.unsqueeze(0)
    causal = positions.unsqueeze(0) <= positions.unsqueeze(1)

    mask = torch.full((seq_len, seq_len), float("-inf"), device=device, dtype=dtype)
    mask = mask.masked_fill(same_seq & causal, 0.0)
    return mask


class SDPAWrapper(nn.Module):
    DEFAULT_BACKENDS = [
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.MATH,
    ]

    def __init__(self, sdpa_backends=None):
        super().__init__()
        self.sdpa_backends = sdpa_backends if sdpa_backends is not None else self.DEFAULT_BACKENDS

    def forward(self, q, k, v, *, scale=None, cu_seqlens, max_seqlen, **kwargs):
        seq_len = q.shape[2]
        attn_mask = create_block_causal_mask_2d(cu_seqlens, seq_len, q.device, q.dtype)
        with sdpa_kernel(self.sdpa_backends, set_priority=True):
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=attn_mask,
                scale=scale,
                is_causal=False,
                enable_gqa=q.size(1) != k.size(1),
            )


def precompute_rope_cache(dim: int, max_seq_len: int, base: float) -> torch.Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    t = torch.arange(max_seq_len, dtype=torch.float32)
    idx_theta = torch.outer(t, freqs)
    idx_theta = torch.cat([idx_theta, idx_theta], dim=-1)
    return torch.cat([idx_theta.cos(), idx_theta.sin()], dim=-1)  # [max_seq_len, 2 * dim]


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_emb(xq, xk, rope_cache, positions):
    # xq, xk: [bs, seqlen, heads, head_dim]; positions: [bs, seqlen]
    head_dim = xq.shape[-1]
    rope = rope_cache[positions]  # [bs, seqlen, 2 * head_dim]
    cos = rope[..., :head_dim].unsqueeze(2)
    sin = rope[..., head_dim:].unsqueeze(2)
    xq_out = xq * cos + rotate_half(xq) * sin
    xk_out = xk * cos + rotate_half(xk) * sin
    return xq_out.type_as(xq), xk_out.type_as(xk)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x):
        input_dtype = x.dtype
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + self.eps)
        return self.weight * x.to(input_dtype)


class Attention(nn.Module):
    def __init__(self, model_args: Qwen2ModelArgs):
        super().__init__()
        self.n_heads = model_args.n_heads
        self.n_kv_heads = model_args.n_kv_heads
        self.head_dim = model_args.head_dim
        self.scaling = self.head_dim**-0.5
        bias = model_args.attention_bias
        self.wq = nn.Linear(model_args.dim, self.n_heads * self.head_dim, bias=bias)
        self.wk = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wv = nn.Linear(model_args.dim, self.n_kv_heads * self.head_dim, bias=bias)
        self.wo = nn.Linear(self.n_heads * self.head_dim, model_args.dim, bias=False)
        self.packed_attn = SDPAWrapper()

    def forward(self, x, rope_cache, positions, cu_seqlens, max_seqlen):
        bs, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bs, seqlen, -1, self.head_dim)
        xk = xk.view(bs, seqlen, -1, self.head_dim)
        xv = xv.view(bs, seqlen, -1, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, rope_cache, positions)

        xq = xq.transpose(1, 2)
        xk = xk.transpose(1, 2)
        xv = xv.transpose(1, 2)

        output = self.packed_attn(
            xq, xk, xv, scale=self.scaling, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen
        )
        output = output.transpose(1, 2).contiguous().view(bs, seqlen, -1)
        return self.wo(output)


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, model_args: Qwen2ModelArgs):
        super().__init__()
        self.attention = Attention(model_args)
        self.feed_forward = FeedForward(model_args.dim, model_args.hidden_dim)
        self.attention_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.ffn_norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)

    def forward(self, x, rope_cache, positions, cu_seqlens, max_seqlen):
        x = x + self.attention(self.attention_norm(x), rope_cache, positions, cu_seqlens, max_seqlen)
        x = x + self.feed_forward(self.ffn_norm(x))
        return x


class Qwen2Model(nn.Module):
    def __init__(self, model_args: Qwen2ModelArgs):
        super().__init__()
        self.model_args = model_args
        self.tok_embeddings = nn.Embedding(model_args.vocab_size, model_args.dim)
        self.register_buffer(
            "rope_cache",
            precompute_rope_cache(model_args.head_dim, model_args.max_seq_len, model_args.rope_theta),
            persistent=False,
        )
        self.layers = nn.ModuleDict(
            {str(i): TransformerBlock(i, model_args) for i in range(model_args.n_layers)}
        )
        self.norm = RMSNorm(model_args.dim, eps=model_args.norm_eps)
        self.output = nn.Linear(model_args.dim, model_args.vocab_size, bias=False)

    def forward(self, tokens, positions, cu_seqlens, max_seqlen):
        # When pipeline parallelism is enabled, cu_seqlens arrives as [1, B + 1]
        if cu_seqlens.ndim == 2:
            cu_seqlens = cu_seqlens.squeeze(0)
        if isinstance(max_seqlen, torch.Tensor):
            max_seqlen = int(max_seqlen.item())
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h, self.rope_cache, positions, cu_seqlens, max_seqlen)
        return self.output(self.norm(h))


def pack_documents(docs: list[torch.Tensor]) -> dict:
    """One packed micro-batch: every document concatenated into a single row."""
    lens = torch.tensor([d.numel() for d in docs], dtype=torch.int32)
    cu_seqlens = F.pad(torch.cumsum(lens, 0, dtype=torch.int32), (1, 0))
    tokens = torch.cat(docs).unsqueeze(0)
    positions = torch.cat([torch.arange(d.numel()) for d in docs]).unsqueeze(0)
    # next-token labels inside each document; a document's last token predicts nothing
    labels = torch.cat(
        [torch.cat([d[1:], torch.tensor([IGNORE_INDEX])]) for d in docs]
    ).unsqueeze(0)
    return dict(
        input_ids=tokens,
        positions=positions,
        cu_seqlens=cu_seqlens,
        max_seqlen=int(lens.max()),
        labels=labels,
    )


def reference_logits(model: Qwen2Model, doc: torch.Tensor) -> torch.Tensor:
    """The document alone, through the same weights, plain causal SDPA."""
    args = model.model_args
    h = model.tok_embeddings(doc.unsqueeze(0))
    positions = torch.arange(doc.numel()).unsqueeze(0)
    for layer in model.layers.values():
        attn = layer.attention
        x = layer.attention_norm(h)
        q = attn.wq(x).view(1, -1, args.n_heads, args.head_dim)
        k = attn.wk(x).view(1, -1, args.n_kv_heads, args.head_dim)
        v = attn.wv(x).view(1, -1, args.n_kv_heads, args.head_dim)
        q, k = apply_rotary_emb(q, k, model.rope_cache, positions)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        rep = args.n_heads // args.n_kv_heads
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h + attn.wo(o.transpose(1, 2).reshape(1, doc.numel(), -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h))[0]


def main():
    torch.manual_seed(0)
    args = Qwen2ModelArgs()
    model = Qwen2Model(args)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def doc(n):
        body = torch.randint(0, args.eos_id, (n - 1,))
        return torch.cat([body, torch.tensor([args.eos_id])])

    # two micro-batches, each one packed row of several documents
    micro_batches = [[doc(5), doc(9), doc(3), doc(7)], [doc(11), doc(4), doc(8)]]

    for step, docs in enumerate(micro_batches):
        batch = pack_documents(docs)
        logits = model(
            batch["input_ids"], batch["positions"], batch["cu_seqlens"], batch["max_seqlen"]
        )
        loss = F.cross_entropy(
            logits.view(-1, args.vocab_size).float(),
            batch["labels"].view(-1),
            ignore_index=IGNORE_INDEX,
        )

        with torch.no_grad():
            ref_logits = torch.cat([reference_logits(model, d) for d in docs])
            ref_loss = F.cross_entropy(
                ref_logits, batch["labels"].view(-1), ignore_index=IGNORE_INDEX
            )
        max_err = (logits[0] - ref_logits).abs().max().item()
        assert max_err < 1e-4, f"step {step}: packed logits differ from per-document run ({max_err})"
        assert abs(loss.item() - ref_loss.item()) < 1e-5, (loss.item(), ref_loss.item())

        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(
            f"step {step}: docs={[d.numel() for d in docs]} cu_seqlens={batch['cu_seqlens'].tolist()} "
            f"loss={loss.item():.4f} ref_loss={ref_loss.item():.4f} max|dlogits|={max_err:.2e}"
        )

    print("ok")


if __name__ == "__main__":
    main()
