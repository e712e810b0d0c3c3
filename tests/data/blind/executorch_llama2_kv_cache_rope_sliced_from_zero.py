# pytorch/executorch#2010 (landed as commit 027ad541b5, "Fix a rotary position encoding bug in kv cache",
# D53954747): examples/models/llama2/model.py, Transformer.forward.
#
# The Llama 2 example takes its KV cache as inputs (tokens, start_pos, cache_k, cache_v), and the runner feeds the
# prompt and the generated tokens one at a time, start_pos = pos. Before the fix Transformer.forward sliced the
# precomputed rotary tables as `self.freqs_cos[:seqlen]` on both branches, so with the cache every token was rotated
# at position 0 whatever start_pos was. The fix slices `self.freqs_cos[sp : sp + seqlen]` when use_kv_cache is set.
#
# Ported from examples/models/llama2/model.py at 027ad541b5^ (ModelArgs, precompute_freqs_cis, apply_rotary_emb,
# Attention with the mask buffer and narrow()-ed caches, TransformerBlock, Transformer) and the token-by-token loop of
# examples/models/llama2/runner/runner.cpp, shrunk to tiny sizes with random weights. The export-only
# torch._constrain_as_* hints are left out; MoE and the checkpoint loader are not used.
import sys
from dataclasses import dataclass
from typing import List, Optional, Tuple, Union

import torch
import torch.nn.functional as F
from torch import nn

FIXED = "--fixed" in sys.argv


class RMSNorm(torch.nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)

    def forward(self, x):
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


@dataclass
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: Optional[int] = None
    vocab_size: int = -1  # defined later by tokenizer
    multiple_of: int = 256  # make SwiGLU hidden layer size multiple of large power of 2
    ffn_dim_multiplier: Optional[float] = None
    norm_eps: float = 1e-5
    max_batch_size: int = 32
    max_seq_len: int = 2048
    use_kv_cache: bool = False  # Use key/value cache
    bos_idx: int = 1
    eos_idx: int = 3

    def __post_init__(self):
        if self.n_kv_heads is None:
            self.n_kv_heads = self.n_heads


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """torch.repeat_interleave(x, dim=2, repeats=n_rep)"""
    bs, slen, n_kv_heads, head_dim = x.shape
    if n_rep == 1:
        return x
    return (
        x[:, :, :, None, :]
        .expand(bs, slen, n_kv_heads, n_rep, head_dim)
        .reshape(bs, slen, n_kv_heads * n_rep, head_dim)
    )


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end, device=freqs.device)
    freqs = torch.outer(t, freqs).float()
    freqs_cos = torch.cos(freqs)
    freqs_sin = torch.sin(freqs)
    return freqs_cos, freqs_sin


def reshape_for_broadcast(freqs_cis: torch.Tensor, x: torch.Tensor):
    ndim = x.ndim
    assert 0 <= 1 < ndim
    assert freqs_cis.shape == (x.shape[1], x.shape[-1])
    shape = [d if i == 1 or i == ndim - 1 else 1 for i, d in enumerate(x.shape)]
    return freqs_cis.view(shape)


def apply_rotary_emb(
    xq: torch.Tensor, xk: torch.Tensor, freqs_cos: torch.Tensor, freqs_sin: torch.Tensor
) -> Tuple[torch.Tensor, torch.Tensor]:
    xq_r, xq_i = xq.float().reshape(xq.shape[:-1] + (-1, 2)).unbind(-1)
    xk_r, xk_i = xk.float().reshape(xk.shape[:-1] + (-1, 2)).unbind(-1)

    freqs_cos = reshape_for_broadcast(freqs_cos, xq_r)
    freqs_sin = reshape_for_broadcast(freqs_sin, xq_r)

    xq_out_r = xq_r * freqs_cos - xq_i * freqs_sin
    xq_out_i = xq_r * freqs_sin + xq_i * freqs_cos
    xk_out_r = xk_r * freqs_cos - xk_i * freqs_sin
    xk_out_i = xk_r * freqs_sin + xk_i * freqs_cos

    xq_out = torch.stack([xq_out_r, xq_out_i], dim=-1).flatten(3)
    xk_out = torch.stack([xk_out_r, xk_out_i], dim=-1).flatten(3)

    return xq_out.type_as(xq), xk_out.type_as(xk)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.use_kv_cache = args.use_kv_cache
        self.n_kv_heads = args.n_heads if args.n_kv_heads is None else args.n_kv_heads
        assert args.n_heads % self.n_kv_heads == 0
        model_parallel_size = 1
        self.n_local_heads = args.n_heads // model_parallel_size
        self.n_local_kv_heads = self.n_kv_heads // model_parallel_size
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = args.dim // args.n_heads
        self.max_batch_size = args.max_batch_size
        self.max_seq_len = args.max_seq_len
        self.wq = nn.Linear(args.dim, args.n_heads * self.head_dim, bias=False)
        self.wk = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(args.dim, self.n_kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(args.n_heads * self.head_dim, args.dim, bias=False)

        mask = torch.full(
            (1, 1, args.max_seq_len, args.max_seq_len),
            float("-inf"),
        )

        mask = torch.triu(mask, diagonal=1)
        self.register_buffer("mask", mask)

        # The module takes in the cache as io (ExecuTorch could not hold mutable buffers at the time).
        self.kv_cache_sizes = [
            args.max_batch_size,
            args.max_seq_len,
            self.n_kv_heads,
            self.head_dim,
        ]

    def forward(
        self,
        x: torch.Tensor,
        freqs_cos: torch.Tensor,
        freqs_sin: torch.Tensor,
        start_pos: Optional[int] = None,
        cache_k: Optional[torch.Tensor] = None,  # (max_batch_size, max_seq_len, n_kv_heads, head_dim)
        cache_v: Optional[torch.Tensor] = None,  # (max_batch_size, max_seq_len, n_kv_heads, head_dim)
    ):
        bsz, seqlen, _ = x.shape

        # QKV
        xq, xk, xv = self.wq(x), self.wk(x), self.wv(x)
        xq = xq.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        xk = xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)

        # RoPE relative positional embeddings
        xq, xk = apply_rotary_emb(xq, xk, freqs_cos, freqs_sin)

        if self.use_kv_cache:
            assert start_pos is not None
            assert cache_k is not None and cache_v is not None

            # Replace the entry in the cache for this token
            # cache_k[:bsz, start_pos : start_pos + seqlen] = xk
            # cache_v[:bsz, start_pos : start_pos + seqlen] = xv
            narrowed_k = cache_k[:bsz].narrow(1, start_pos, seqlen)
            narrowed_v = cache_v[:bsz].narrow(1, start_pos, seqlen)

            narrowed_k.copy_(xk)
            narrowed_v.copy_(xv)

            keys = cache_k[:bsz].narrow(1, 0, start_pos + seqlen)
            values = cache_v[:bsz].narrow(1, 0, start_pos + seqlen)

        else:
            keys = xk
            values = xv

        # grouped multiquery attention: expand out keys and values
        keys = repeat_kv(keys, self.n_rep)  # (bs, seqlen, n_local_heads, head_dim)
        values = repeat_kv(values, self.n_rep)  # (bs, seqlen, n_local_heads, head_dim)

        # make heads into a batch dimension
        xq = xq.transpose(1, 2)  # (bs, n_local_heads, seqlen, head_dim)
        keys = keys.transpose(1, 2)
        values = values.transpose(1, 2)

        assert hasattr(self, "mask")
        mask = self.mask[:, :, :seqlen, :seqlen]

        # XNNPACK requires a 2D mask: [1, 1, L, S] -> [L, S]
        mask = torch.squeeze(mask, [0, 1])

        output = F.scaled_dot_product_attention(
            xq, keys, values, attn_mask=mask, dropout_p=0.0
        )

        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)

        output = self.wo(output)

        if self.use_kv_cache:
            return output, cache_k, cache_v
        else:
            return output, None, None


class FeedForward(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, multiple_of: int):
        super().__init__()
        hidden_dim = int(2 * hidden_dim / 3)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, layer_id: int, args: ModelArgs):
        super().__init__()
        self.use_kv_cache = args.use_kv_cache
        self.n_heads = args.n_heads
        self.dim = args.dim
        self.head_dim = args.dim // args.n_heads
        self.attention = Attention(args)
        self.feed_forward = FeedForward(
            dim=args.dim,
            hidden_dim=4 * args.dim,
            multiple_of=args.multiple_of,
        )
        self.layer_id = layer_id
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)

    def forward(self, x, freqs_cos, freqs_sin, start_pos=None, cache_k=None, cache_v=None):  # x: 1xN
        h, cache_k, cache_v = self.attention.forward(
            self.attention_norm(x),
            freqs_cos,
            freqs_sin,
            start_pos,
            cache_k,
            cache_v,
        )

        h = x + h
        out = h + self.feed_forward(self.ffn_norm(h))
        return out, cache_k, cache_v


class Transformer(nn.Module):
    def __init__(self, params: ModelArgs):
        super().__init__()
        self.params = params
        self.vocab_size = params.vocab_size
        self.n_layers = params.n_layers

        self.tok_embeddings = nn.Embedding(params.vocab_size, params.dim)
        self.layers = torch.nn.ModuleList()
        for layer_id in range(params.n_layers):
            self.layers.append(TransformerBlock(layer_id, params))
        self.norm = RMSNorm(params.dim, eps=params.norm_eps)
        self.output = nn.Linear(params.dim, params.vocab_size, bias=False)
        self.use_kv_cache = params.use_kv_cache

        freqs_cos, freqs_sin = precompute_freqs_cis(
            self.params.dim // self.params.n_heads, self.params.max_seq_len
        )
        self.register_buffer("freqs_cos", freqs_cos, persistent=False)
        self.register_buffer("freqs_sin", freqs_sin, persistent=False)

    def forward(
        self,
        tokens: torch.Tensor,
        start_pos: Optional[torch.Tensor] = None,  # Scalar tensor indicating size of window of the caches
        cache_k: Optional[torch.Tensor] = None,  # n_layers long
        cache_v: Optional[torch.Tensor] = None,  # n_layers long
    ) -> Union[torch.Tensor, Tuple[torch.Tensor, List[torch.Tensor], List[torch.Tensor]]]:
        if FIXED:
            _bsz, seqlen = tokens.shape
            h = self.tok_embeddings(tokens)

            if self.use_kv_cache:
                assert (
                    cache_k is not None and cache_v is not None and start_pos is not None
                ), "Caches and start_pos must be provided when use_kv_cache is True"
                assert cache_k.size(0) == self.n_layers, f"{cache_k.size(0)} != {self.n_layers}"
                assert cache_v.size(0) == self.n_layers, f"{cache_v.size(0)} != {self.n_layers}"

                sp = start_pos.item()
                # when KV cache is used, seqlen is most likely 1. We want to slice from the start_pos.
                freqs_cos = self.freqs_cos[sp : sp + seqlen]
                freqs_sin = self.freqs_sin[sp : sp + seqlen]
            else:
                assert (
                    start_pos is None and cache_k is None and cache_v is None,
                ), "Caches and start_pos are unused when use_kv_cache is False"
                freqs_cos = self.freqs_cos[:seqlen]
                freqs_sin = self.freqs_sin[:seqlen]
        else:
            if self.use_kv_cache:
                assert (
                    cache_k is not None and cache_v is not None and start_pos is not None
                ), "Caches and start_pos must be provided when use_kv_cache is True"
                assert cache_k.size(0) == self.n_layers, f"{cache_k.size(0)} != {self.n_layers}"
                assert cache_v.size(0) == self.n_layers, f"{cache_v.size(0)} != {self.n_layers}"
            else:
                assert (
                    start_pos is None and cache_k is None and cache_v is None,
                    "Caches and start_pos are unused when use_kv_cache is False",
                )

            _bsz, seqlen = tokens.shape
            h = self.tok_embeddings(tokens)
            freqs_cos = self.freqs_cos[:seqlen]
            freqs_sin = self.freqs_sin[:seqlen]

            if self.use_kv_cache:
                sp = start_pos.item()

        for index, layer in enumerate(self.layers):
            if self.use_kv_cache:
                h, updated_cache_k, updated_cache_v = layer(
                    h,
                    freqs_cos,
                    freqs_sin,
                    sp,
                    cache_k[index],
                    cache_v[index],
                )
                cache_k[index] = updated_cache_k
                cache_v[index] = updated_cache_v

            else:
                h, _, _ = layer(h, freqs_cos, freqs_sin)

        h = self.norm(h)

        logits = self.output(h)
        if self.use_kv_cache:
            return (logits, cache_k, cache_v)
        else:
            return logits

    # For each layer return the sizes of the needed caches
    def get_cache_sizes(self):
        return [self.n_layers, *self.layers[0].attention.kv_cache_sizes]


def run(model, prompt_tokens, max_seq_len):
    # runner.cpp with use_kv_cache: "set pos to 0, refill token by token"; inputs [tokens, start_pos, k_cache, v_cache]
    cache_k = torch.zeros(model.get_cache_sizes())
    cache_v = torch.zeros(model.get_cache_sizes())
    num_prompt_tokens = len(prompt_tokens)
    pos = 0
    token = prompt_tokens[0]
    out = [token]
    with torch.no_grad():
        while pos < max_seq_len:
            tokens = torch.tensor([[token]], dtype=torch.long)
            start_pos = torch.tensor(pos, dtype=torch.long)
            logits, cache_k, cache_v = model(tokens, start_pos, cache_k, cache_v)
            next_tok = int(logits[0, -1].argmax())
            if pos < num_prompt_tokens - 1:
                # force the next prompt token
                next_tok = prompt_tokens[pos + 1]
            token = next_tok
            out.append(token)
            pos += 1
            if pos >= num_prompt_tokens and token == model.params.eos_idx:
                break
    return out, logits


def main():
    torch.manual_seed(1)
    params = ModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        vocab_size=96,
        multiple_of=32,
        max_batch_size=1,
        max_seq_len=24,
        use_kv_cache=True,
        eos_idx=-1,  # never stop early: generate to max_seq_len
    )
    model = Transformer(params).eval()
    prompt = [params.bos_idx, 17, 42, 5, 63, 28, 9, 71]
    out, logits = run(model, prompt, max_seq_len=params.max_seq_len - 1)
    print("tokens:", out)
    print("last logits[:6]:", [round(v, 4) for v in logits[0, -1, :6].tolist()])


if __name__ == "__main__":
    main()
