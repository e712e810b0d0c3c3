"""Correct program (quiet batch quiet-r89b).

Ported from meta-llama/llama-models models/llama4/model.py @408c577168a187941f9359c916004fa3b21fbc3b
(Attention.forward with its cache_k / cache_v written at start_pos, TransformerBlock.forward choosing
global_attn_mask on NoPE layers and local_attn_mask on RoPE layers, Transformer.forward building both masks,
create_chunked_attention_mask) and models/llama4/args.py @00bb6d68 (ModelArgs: attention_chunk_size,
nope_layer_interval, use_qk_norm).  fairscale's parallel linears become nn.Linear, the caches live on the
CPU, the MoE / vision parts are left out, ModelArgs is a plain dataclass instead of pydantic.

Llama 4's iRoPE: RoPE layers attend causally inside chunks of `attention_chunk_size` tokens (tokens
(0, K), (K, 2K), ... only see their own chunk), every `nope_layer_interval`-th layer is a NoPE layer with
full causal attention.  The program prefills a batch of two equal-length prompts (start_pos = 0, as
llama-models' generator prefills) and scores them: the logits are compared to a reference that runs each
prompt alone through the same weights with attention written as a double loop over queries and the keys
each one may see (same chunk and not ahead on RoPE layers, not ahead on NoPE layers), and the per-token
log-likelihood of the prompts (a scoring loop, as eval harnesses use the model) is compared as well.
"""
import math
from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import nn


@dataclass
class ModelArgs:
    dim: int = -1
    n_layers: int = -1
    n_heads: int = -1
    n_kv_heads: Optional[int] = None
    head_dim: Optional[int] = None
    vocab_size: int = -1
    multiple_of: int = 256
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    attention_chunk_size: Optional[int] = None
    rope_theta: float = 500000
    use_scaled_rope: bool = False
    rope_scaling_factor: Optional[float] = None
    rope_high_freq_factor: Optional[float] = None
    nope_layer_interval: Optional[int] = None
    use_qk_norm: bool = False
    attn_temperature_tuning: bool = False
    floor_scale: float = 8192.0
    attn_scale: float = 0.1
    max_batch_size: int = 32
    max_seq_len: int = 2048


@dataclass
class TransformerInput:
    tokens: torch.Tensor
    tokens_position: int


@dataclass
class TransformerOutput:
    logits: torch.Tensor


def rmsnorm(x, eps):
    def _norm(y):
        return y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + eps)

    return _norm(x.float()).type_as(x)


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return rmsnorm(x, self.eps) * self.weight


def precompute_freqs_cis(dim: int, end: int, theta: float):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device, dtype=torch.float32)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)  # complex64
    return freqs_cis


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    assert 0 <= 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(*shape)


def apply_rotary_emb(xq, xk, freqs_cis) -> Tuple[torch.Tensor, torch.Tensor]:
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = reshape_for_broadcast(freqs_cis, xq_)
    xq_out = torch.view_as_real(xq_ * freqs_cis).flatten(3)
    xk_out = torch.view_as_real(xk_ * freqs_cis).flatten(3)
    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, use_qk_norm: bool, use_rope: bool, add_bias: bool = False):
        super().__init__()
        self.use_rope = use_rope
        self.use_qk_norm = use_qk_norm
        self.attn_temperature_tuning = args.attn_temperature_tuning
        self.floor_scale = args.floor_scale
        self.attn_scale = args.attn_scale

        self.n_heads = args.n_heads
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        world_size = 1
        self.n_local_heads = args.n_heads // world_size
        self.n_local_kv_heads = self.n_kv_heads // world_size
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads

        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=add_bias)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=add_bias)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=add_bias)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=add_bias)

        self.cache_k = torch.zeros((args.max_batch_size, args.max_seq_len, self.n_local_kv_heads, self.head_dim))
        self.cache_v = torch.zeros((args.max_batch_size, args.max_seq_len, self.n_local_kv_heads, self.head_dim))
        self.norm_eps = args.norm_eps

    def forward(self, x: torch.Tensor, start_pos: int, freqs_cis: torch.Tensor, mask: Optional[torch.Tensor] = None):
        bsz, seqlen, _ = x.shape
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)

        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)

        if self.use_rope:
            xq, xk = apply_rotary_emb(xq, xk, freqs_cis=freqs_cis)

        if self.use_qk_norm:
            xq = rmsnorm(xq, self.norm_eps)
            xk = rmsnorm(xk, self.norm_eps)

        if self.attn_temperature_tuning and not self.use_rope:
            seq_positions = torch.arange(start_pos, start_pos + seqlen, device=xq.device, dtype=torch.float32)
            attn_scales = torch.log(torch.floor((seq_positions + 1.0) / self.floor_scale) + 1.0) * self.attn_scale + 1.0
            attn_scales = attn_scales.view(1, seqlen, 1, 1)
            xq = xq * attn_scales

        self.cache_k = self.cache_k.to(xq)
        self.cache_v = self.cache_v.to(xq)

        self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
        self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv

        xk = self.cache_k[:bsz, : start_pos + seqlen]
        xv = self.cache_v[:bsz, : start_pos + seqlen]

        xq, xk, xv = [t.transpose(1, 2) for t in (xq, xk, xv)]

        xk = xk.repeat_interleave(self.n_rep, dim=1)
        xv = xv.repeat_interleave(self.n_rep, dim=1)

        attn_output = F.scaled_dot_product_attention(xq, xk, xv, attn_mask=mask, dropout_p=0.0)
        attn_output = attn_output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        output = self.wo(attn_output)
        return output


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.head_dim = args.dim // args.n_heads if args.head_dim is None else args.head_dim

        self.is_nope_layer = args.nope_layer_interval is not None and (layer_id + 1) % args.nope_layer_interval == 0

        use_rope = not self.is_nope_layer
        use_qk_norm = args.use_qk_norm and not self.is_nope_layer

        self.attention = Attention(args, use_rope=use_rope, use_qk_norm=use_qk_norm)

        hidden_dim = int(4 * args.dim)
        hidden_dim = int(2 * hidden_dim / 3)
        if args.ffn_dim_multiplier is not None:
            hidden_dim = int(args.ffn_dim_multiplier * hidden_dim)
        hidden_dim = args.multiple_of * ((hidden_dim + args.multiple_of - 1) // args.multiple_of)
        self.feed_forward = FeedForward(dim=args.dim, hidden_dim=hidden_dim)
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, start_pos: int, freqs_cis, global_attn_mask, local_attn_mask):
        # The iRoPE architecture uses global attention mask for NoPE layers or
        # if chunked local attention is not used
        if self.is_nope_layer or local_attn_mask is None:
            mask = global_attn_mask
        else:
            mask = local_attn_mask

        h = x + self.attention(self.attention_norm(x), start_pos, freqs_cis, mask)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs, **kwargs) -> None:
        super().__init__()
        self.args = args
        self.vocab_size = args.vocab_size
        self.n_layers = args.n_layers
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = torch.nn.ModuleList()
        for layer_id in range(args.n_layers):
            self.layers.append(TransformerBlock(layer_id, args))
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        self.freqs_cis = precompute_freqs_cis(args.dim // args.n_heads, args.max_seq_len * 2, args.rope_theta)

    @torch.inference_mode()
    def forward(self, model_input: TransformerInput) -> TransformerOutput:
        tokens = model_input.tokens
        start_pos = model_input.tokens_position
        assert isinstance(start_pos, int), (
            "This implementation does not support different start positions per batch item"
        )

        _bsz, seqlen = tokens.shape
        h = self.tok_embeddings(tokens)

        self.freqs_cis = self.freqs_cis.to(h.device)
        freqs_cis = self.freqs_cis[start_pos : start_pos + seqlen]

        global_attn_mask, local_attn_mask = None, None
        if seqlen > 1:
            global_attn_mask = torch.full((seqlen, seqlen), float("-inf"), device=tokens.device)
            global_attn_mask = torch.triu(global_attn_mask, diagonal=1).type_as(h)

            if chunk_size := self.args.attention_chunk_size:
                local_attn_mask = create_chunked_attention_mask(seqlen, chunk_size, tokens.device)

        for layer in self.layers:
            h = layer(h, start_pos, freqs_cis, global_attn_mask, local_attn_mask)
        h = self.norm(h)
        output = self.output(h).float()

        return TransformerOutput(logits=output)


# tokens (0, K), (K, 2K), (2K, 3K) attend to each other when doing local chunked attention
# in the iRoPE architecture
def create_chunked_attention_mask(seq_len: int, attention_chunk_size: int, device: torch.device) -> torch.Tensor:
    block_pos = torch.abs(
        (torch.arange(seq_len).unsqueeze(0) // attention_chunk_size)
        - (torch.arange(seq_len).unsqueeze(1) // attention_chunk_size)
    )
    token_pos = torch.arange(seq_len).unsqueeze(0) - torch.arange(seq_len).unsqueeze(1)
    mask = (block_pos == 0) & (token_pos <= 0)
    return mask.to(device)


# ---------------------------------------------------------------- reference (one prompt, double loop)
@torch.no_grad()
def reference_logits(model: Transformer, tokens_1d: torch.Tensor, chunked: bool = True) -> torch.Tensor:
    """One prompt alone; every attention written as a loop over queries and the keys each may see."""
    args = model.args
    T = tokens_1d.shape[0]
    h = model.tok_embeddings(tokens_1d[None])  # (1, T, D)
    freqs = model.freqs_cis[:T]
    for layer in model.layers:
        att = layer.attention
        x = layer.attention_norm(h)
        q = att.wq(x).view(1, T, att.n_heads, att.head_dim)
        k = att.wk(x).view(1, T, att.n_kv_heads, att.head_dim)
        v = att.wv(x).view(1, T, att.n_kv_heads, att.head_dim)
        if att.use_rope:
            q, k = apply_rotary_emb(q, k, freqs)
        if att.use_qk_norm:
            q = rmsnorm(q, att.norm_eps)
            k = rmsnorm(k, att.norm_eps)
        out = torch.zeros(1, T, att.n_heads, att.head_dim)
        for head in range(att.n_heads):
            kvh = head // att.n_rep
            for i in range(T):
                if layer.is_nope_layer or not chunked:
                    keys = list(range(0, i + 1))
                else:
                    c = args.attention_chunk_size
                    keys = [j for j in range(T) if j <= i and j // c == i // c]
                scores = torch.stack([(q[0, i, head] * k[0, j, kvh]).sum() / math.sqrt(att.head_dim) for j in keys])
                p = torch.softmax(scores, dim=0)
                out[0, i, head] = sum(p[n] * v[0, j, kvh] for n, j in enumerate(keys))
        h = h + att.wo(out.reshape(1, T, -1))
        h = h + layer.feed_forward(layer.ffn_norm(h))
    return model.output(model.norm(h)).float()[0]


def main():
    torch.manual_seed(0)
    args = ModelArgs(
        dim=32, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=61, multiple_of=16,
        attention_chunk_size=4, nope_layer_interval=4, use_qk_norm=True, rope_theta=10000.0,
        max_batch_size=4, max_seq_len=32,
    )
    model = Transformer(args).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.3)

    seqlen = 11  # chunks [0..3] [4..7] [8..10]
    tokens = torch.randint(1, args.vocab_size, (2, seqlen))
    out = model.forward(TransformerInput(tokens=tokens, tokens_position=0))
    logits = out.logits  # (2, 11, V)

    # per-token log-likelihood of each prompt (score the continuation, as eval loops do)
    logprobs = torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)

    for b in range(2):
        ref = reference_logits(model, tokens[b])
        err = (logits[b] - ref).abs().max().item()
        assert err < 1e-4, (b, err)
        ref_lp = torch.log_softmax(ref[:-1], dim=-1).gather(-1, tokens[b, 1:, None]).squeeze(-1)
        assert torch.allclose(logprobs[b], ref_lp, atol=1e-4), b
        print(f"prompt {b}: max |logits - reference| = {err:.2e}, sum logprob = {logprobs[b].sum().item():.4f}")

    # the chunks matter here: a reference whose RoPE layers are plain causal differs after the first chunk
    unchunked = reference_logits(model, tokens[0], chunked=False)
    assert (unchunked[4:] - logits[0, 4:]).abs().max() > 1e-3
    assert torch.allclose(unchunked[:4], logits[0, :4], atol=1e-4)
    print("ok")


if __name__ == "__main__":
    main()
