"""Speculative decoding as pytorch-labs/gpt-fast writes it (draft chain + one verify pass), shrunk to tiny sizes.

Correct program (quiet batch quiet-r109a).

Ported from pytorch-labs/gpt-fast:
  generate.py @ 0055c42dfeb98f5c3e1a1ab8c2e4b3025f7d3f3a
      (logits_to_probs, multinomial_sample_one_no_sync, sample, prefill, decode_one_token,
       decode_n_tokens, model_forward, speculative_decode, generate)
  model.py @ 03e10bc23f31487a0353f22da7f506f0841ed720
      (ModelArgs, KVCache.update: k_cache[:, :, input_pos] = k_val;
       Transformer.setup_caches: causal_mask = tril(ones(max_seq_length, max_seq_length, bool));
       Transformer.forward: mask = self.causal_mask[None, None, input_pos];
       Attention.forward: F.scaled_dot_product_attention(q, k, v, attn_mask=mask) over the whole cache)

Both models hold a static KV cache of max_seq_length slots.  The draft model decodes
speculate_k tokens one at a time; the target verifies [cur_token] + drafts in one forward
at input_pos = arange(input_pos, input_pos + k + 1).  "Rollback" after a rejection is only
the host-side input_pos moving back to the end of the accepted prefix: the rejected draft
keys stay in both caches, hidden from every later query by the row of the bool causal mask
picked at that query's position, and overwritten when those positions are decoded again.
When every draft is accepted the draft model is fed its last draft token so its cache has
no hole.  Grouped-query attention (n_local_heads < n_head) as in the Mistral-7B config.

Checks: (1) with temperature ~0 the algorithm reduces to the target's greedy decoding,
recomputed here without any cache (a full causal forward each step); (2) every cached
forward of either model, greedy or sampled, matches a cache-free forward over the tokens
the positions 0..max(input_pos) hold at that moment.
"""

from dataclasses import dataclass
from typing import Optional, Tuple

import torch
import torch.nn as nn
from torch import Tensor
from torch.nn import functional as F


# ----------------------------------------------------------------------------- model.py

def find_multiple(n: int, k: int) -> int:
    if n % k == 0:
        return n
    return n + k - (n % k)


@dataclass
class ModelArgs:
    block_size: int = 2048
    vocab_size: int = 32000
    n_layer: int = 32
    n_head: int = 32
    dim: int = 4096
    intermediate_size: int = None
    n_local_heads: int = -1
    head_dim: int = 64
    rope_base: float = 10000
    norm_eps: float = 1e-5

    def __post_init__(self):
        if self.n_local_heads == -1:
            self.n_local_heads = self.n_head
        if self.intermediate_size is None:
            hidden_dim = 4 * self.dim
            n_hidden = int(2 * hidden_dim / 3)
            self.intermediate_size = find_multiple(n_hidden, 256)
        self.head_dim = self.dim // self.n_head


class KVCache(nn.Module):
    def __init__(self, max_batch_size, max_seq_length, n_heads, head_dim, dtype=torch.bfloat16):
        super().__init__()
        cache_shape = (max_batch_size, n_heads, max_seq_length, head_dim)
        self.register_buffer('k_cache', torch.zeros(cache_shape, dtype=dtype))
        self.register_buffer('v_cache', torch.zeros(cache_shape, dtype=dtype))

    def update(self, input_pos, k_val, v_val):
        # input_pos: [S], k_val: [B, H, S, D]
        assert input_pos.shape[0] == k_val.shape[2]

        k_out = self.k_cache
        v_out = self.v_cache
        k_out[:, :, input_pos] = k_val
        v_out[:, :, input_pos] = v_val

        return k_out, v_out


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.config = config

        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config) for _ in range(config.n_layer))
        self.norm = RMSNorm(config.dim, eps=config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

        self.freqs_cis: Optional[Tensor] = None
        self.mask_cache: Optional[Tensor] = None
        self.max_batch_size = -1
        self.max_seq_length = -1

    def setup_caches(self, max_batch_size, max_seq_length):
        if self.max_seq_length >= max_seq_length and self.max_batch_size >= max_batch_size:
            return
        head_dim = self.config.dim // self.config.n_head
        max_seq_length = find_multiple(max_seq_length, 8)
        self.max_seq_length = max_seq_length
        self.max_batch_size = max_batch_size
        dtype = self.output.weight.dtype
        for b in self.layers:
            b.attention.kv_cache = KVCache(max_batch_size, max_seq_length, self.config.n_local_heads, head_dim, dtype)

        self.freqs_cis = precompute_freqs_cis(self.config.block_size, self.config.dim // self.config.n_head, self.config.rope_base, dtype)
        self.causal_mask = torch.tril(torch.ones(self.max_seq_length, self.max_seq_length, dtype=torch.bool))

    def forward(self, idx: Tensor, input_pos: Optional[Tensor] = None) -> Tensor:
        assert self.freqs_cis is not None, "Caches must be initialized first"
        mask = self.causal_mask[None, None, input_pos]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)

        for i, layer in enumerate(self.layers):
            x = layer(x, input_pos, freqs_cis, mask)
        x = self.norm(x)
        logits = self.output(x)
        return logits


class TransformerBlock(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.attention = Attention(config)
        self.feed_forward = FeedForward(config)
        self.ffn_norm = RMSNorm(config.dim, config.norm_eps)
        self.attention_norm = RMSNorm(config.dim, config.norm_eps)

    def forward(self, x: Tensor, input_pos: Tensor, freqs_cis: Tensor, mask: Tensor) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, input_pos)
        out = h + self.feed_forward(self.ffn_norm(h))
        return out


class Attention(nn.Module):
    def __init__(self, config: ModelArgs):
        super().__init__()
        assert config.dim % config.n_head == 0

        total_head_dim = (config.n_head + 2 * config.n_local_heads) * config.head_dim
        # key, query, value projections for all heads, but in a batch
        self.wqkv = nn.Linear(config.dim, total_head_dim, bias=False)
        self.wo = nn.Linear(config.dim, config.dim, bias=False)
        self.kv_cache = None

        self.n_head = config.n_head
        self.head_dim = config.head_dim
        self.n_local_heads = config.n_local_heads
        self.dim = config.dim

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Tensor, input_pos: Optional[Tensor] = None) -> Tensor:
        bsz, seqlen, _ = x.shape

        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.wqkv(x).split([self.dim, kv_size, kv_size], dim=-1)

        q = q.view(bsz, seqlen, self.n_head, self.head_dim)
        k = k.view(bsz, seqlen, self.n_local_heads, self.head_dim)
        v = v.view(bsz, seqlen, self.n_local_heads, self.head_dim)

        q = apply_rotary_emb(q, freqs_cis)
        k = apply_rotary_emb(k, freqs_cis)

        q, k, v = map(lambda x: x.transpose(1, 2), (q, k, v))

        if self.kv_cache is not None:
            k, v = self.kv_cache.update(input_pos, k, v)

        k = k.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        v = v.repeat_interleave(self.n_head // self.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0)

        y = y.transpose(1, 2).contiguous().view(bsz, seqlen, self.dim)

        y = self.wo(y)
        return y


class FeedForward(nn.Module):
    def __init__(self, config: ModelArgs) -> None:
        super().__init__()
        self.w1 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w3 = nn.Linear(config.dim, config.intermediate_size, bias=False)
        self.w2 = nn.Linear(config.intermediate_size, config.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def _norm(self, x):
        return x * torch.rsqrt(torch.mean(x * x, dim=-1, keepdim=True) + self.eps)

    def forward(self, x: Tensor) -> Tensor:
        output = self._norm(x.float()).type_as(x)
        return output * self.weight


def precompute_freqs_cis(
    seq_len: int, n_elem: int, base: int = 10000,
    dtype: torch.dtype = torch.bfloat16
) -> Tensor:
    freqs = 1.0 / (base ** (torch.arange(0, n_elem, 2)[: (n_elem // 2)].float() / n_elem))
    t = torch.arange(seq_len, device=freqs.device)
    freqs = torch.outer(t, freqs)
    freqs_cis = torch.polar(torch.ones_like(freqs), freqs)
    cache = torch.stack([freqs_cis.real, freqs_cis.imag], dim=-1)
    return cache.to(dtype=dtype)


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    xshaped = x.float().reshape(*x.shape[:-1], -1, 2)
    freqs_cis = freqs_cis.view(1, xshaped.size(1), 1, xshaped.size(3), 2)
    x_out2 = torch.stack(
        [
            xshaped[..., 0] * freqs_cis[..., 0] - xshaped[..., 1] * freqs_cis[..., 1],
            xshaped[..., 1] * freqs_cis[..., 0] + xshaped[..., 0] * freqs_cis[..., 1],
        ],
        -1,
    )

    x_out2 = x_out2.flatten(3)
    return x_out2.type_as(x)


# ----------------------------------------------------------------------------- generate.py

def multinomial_sample_one_no_sync(probs_sort):  # Does multinomial sampling without a cuda synchronization
    q = torch.empty_like(probs_sort).exponential_(1)
    return torch.argmax(probs_sort / q, dim=-1, keepdim=True).to(dtype=torch.int)


def logits_to_probs(logits, temperature: float = 1.0, top_k: Optional[int] = None):
    logits = logits / max(temperature, 1e-5)

    if top_k is not None:
        v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
        pivot = v.select(-1, -1).unsqueeze(-1)
        logits = torch.where(logits < pivot, -float("Inf"), logits)
    probs = torch.nn.functional.softmax(logits, dim=-1)
    return probs


def sample(logits, temperature: float = 1.0, top_k: Optional[int] = None):
    probs = logits_to_probs(logits[0, -1], temperature, top_k)
    idx_next = multinomial_sample_one_no_sync(probs)
    return idx_next, probs


def prefill(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor, **sampling_kwargs) -> torch.Tensor:
    # input_pos: [B, S]
    logits = model(x, input_pos)
    return sample(logits, **sampling_kwargs)[0]


def decode_one_token(model: Transformer, x: torch.Tensor, input_pos: torch.Tensor, **sampling_kwargs) -> Tuple[torch.Tensor, torch.Tensor]:
    # input_pos: [B, 1]
    assert input_pos.shape[-1] == 1
    logits = model(x, input_pos)
    return sample(logits, **sampling_kwargs)


def decode_n_tokens(model: Transformer, cur_token: torch.Tensor, input_pos: torch.Tensor, num_new_tokens: int, callback=lambda _: _, **sampling_kwargs):
    new_tokens, new_probs = [], []
    for i in range(num_new_tokens):
        # gpt-fast wraps this call in torch.backends.cuda.sdp_kernel(enable_math=True only); CPU runs the math path anyway
        next_token, next_prob = decode_one_token(
            model, cur_token, input_pos, **sampling_kwargs
        )
        input_pos += 1
        new_tokens.append(next_token.clone())
        callback(new_tokens[-1])
        new_probs.append(next_prob.clone())
        cur_token = next_token.view(1, -1)

    return new_tokens, new_probs


def model_forward(model, x, input_pos):
    return model(x, input_pos)


def speculative_decode(
    model: Transformer,
    draft_model: Transformer,
    cur_token: torch.Tensor,
    input_pos: int,
    speculate_k: int,
    **sampling_kwargs
) -> torch.Tensor:
    # draft model inference sequentially
    device = cur_token.device
    orig_input_pos = torch.tensor([input_pos], dtype=torch.int64, device=cur_token.device)
    draft_tokens, draft_probs = decode_n_tokens(draft_model, cur_token.view(1, -1), orig_input_pos.clone(), speculate_k, **sampling_kwargs)

    draft_tokens = torch.cat(draft_tokens)
    # parallel inference on target model using draft tokens
    target_logits = model_forward(
        model,
        torch.cat([cur_token.view(1), draft_tokens]).view(1, -1),
        torch.arange(input_pos, input_pos + speculate_k + 1, device=cur_token.device)
    )
    target_probs = logits_to_probs(target_logits[0], **sampling_kwargs)
    draft_probs = torch.stack(draft_probs)
    # q: target prob, p: draft prob
    # q >= p: always accept draft token
    # q < p: q/p prob to accept draft token
    p = draft_probs[torch.arange(0, speculate_k, device=device), draft_tokens]
    q = target_probs[torch.arange(0, speculate_k, device=device), draft_tokens]
    accept_draft_prob = torch.minimum(torch.ones(()), q[:speculate_k] / p)
    rejected_locations = (torch.rand_like(accept_draft_prob) > accept_draft_prob).nonzero()

    if rejected_locations.shape[0] == 0:  # All draft tokens have been accepted
        accept_length = speculate_k + 1
        last_token = multinomial_sample_one_no_sync(target_probs[-1])
        # fill last token into draft model
        model_forward(
            draft_model,
            draft_tokens[-1].view(1, -1),
            orig_input_pos + speculate_k,
        )
        return torch.cat([draft_tokens, last_token])
    else:
        accept_length = rejected_locations[0].item()
        p = draft_probs[accept_length]
        q = target_probs[accept_length]
        new = q - p
        new = torch.where(new > 0, new, 0.0)
        new = new / new.sum()
        next_token = multinomial_sample_one_no_sync(new)
        return torch.cat([draft_tokens[:accept_length], next_token])


@torch.no_grad()
def generate(
    model: Transformer,
    prompt: torch.Tensor,
    max_new_tokens: int,
    *,
    interactive: bool,
    draft_model: Transformer,
    speculate_k: Optional[int] = 8,
    callback=lambda x: x,
    **sampling_kwargs
) -> torch.Tensor:
    """
    Takes a conditioning sequence (prompt) as input and continues to generate as many tokens as requested.
    """

    is_speculative = draft_model is not None
    # create an empty tensor of the expected final shape and fill in the current tokens
    T = prompt.size(0)
    T_new = T + max_new_tokens
    if interactive:
        max_seq_length = 350
    else:
        max_seq_length = min(T_new, model.config.block_size)

    device, dtype = prompt.device, prompt.dtype
    max_seq_length = max_seq_length + speculate_k + 1 if is_speculative else max_seq_length
    with torch.device(device):
        model.setup_caches(max_batch_size=1, max_seq_length=max_seq_length)
        if is_speculative and draft_model is not model:
            draft_model.setup_caches(max_batch_size=1, max_seq_length=max_seq_length)

    # create an empty tensor of the expected final shape and fill in the current tokens
    empty = torch.empty(T_new, dtype=dtype, device=device)
    empty[:T] = prompt
    seq = empty
    input_pos = torch.arange(0, T, device=device)

    next_token = prefill(model, prompt.view(1, -1), input_pos, **sampling_kwargs)
    if is_speculative:
        prefill(draft_model, prompt.view(1, -1), input_pos, **sampling_kwargs)
    seq[T] = next_token

    input_pos = torch.tensor([T], device=device, dtype=torch.int)
    accept_counts = [0] * (speculate_k + 1)

    if is_speculative:
        input_pos = input_pos.item()  # for speculative decoding easier to keep on host
        while input_pos < T_new - 1:
            cur_token = next_token.view(())

            next_tokens = speculative_decode(
                model, draft_model, cur_token, input_pos, speculate_k, **sampling_kwargs
            )

            accept_counts[len(next_tokens) - 1] += 1
            num_added = min(T_new - input_pos - 1, len(next_tokens))
            seq[input_pos + 1: input_pos + num_added + 1] = next_tokens[: num_added]
            for i in next_tokens[: num_added, ]:
                callback(i)
            input_pos = input_pos + num_added
            next_token = next_tokens[-1]
    else:
        generated_tokens, _ = decode_n_tokens(model, next_token.view(1, -1), input_pos, max_new_tokens - 1, callback=callback, **sampling_kwargs)
        seq[T + 1:] = torch.cat(generated_tokens)

    generate_stats = {
        'accept_counts': accept_counts
    }
    return seq, generate_stats


# ----------------------------------------------------------------------------- checks

def full_forward_no_cache(model: Transformer, idx: Tensor) -> Tensor:
    """The same weights run over idx [1, S] from position 0, with no cache and is_causal=True."""
    S = idx.shape[1]
    freqs_cis = model.freqs_cis[:S]
    x = model.tok_embeddings(idx)
    for layer in model.layers:
        attn = layer.attention
        h = layer.attention_norm(x)
        kv_size = attn.n_local_heads * attn.head_dim
        q, k, v = attn.wqkv(h).split([attn.dim, kv_size, kv_size], dim=-1)
        q = apply_rotary_emb(q.view(1, S, attn.n_head, attn.head_dim), freqs_cis).transpose(1, 2)
        k = apply_rotary_emb(k.view(1, S, attn.n_local_heads, attn.head_dim), freqs_cis).transpose(1, 2)
        v = v.view(1, S, attn.n_local_heads, attn.head_dim).transpose(1, 2)
        k = k.repeat_interleave(attn.n_head // attn.n_local_heads, dim=1)
        v = v.repeat_interleave(attn.n_head // attn.n_local_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = attn.wo(y.transpose(1, 2).reshape(1, S, attn.dim))
        x = x + y
        x = x + layer.feed_forward(layer.ffn_norm(x))
    return model.output(model.norm(x))


class CacheShadow:
    """Tracks which token every cache slot of a model holds, and compares each cached forward
    with a cache-free forward over slots 0..max(input_pos)."""

    def __init__(self, model: Transformer, name: str):
        self.name = name
        self.tokens = {}
        self.calls = 0
        model.register_forward_hook(self.hook)

    def hook(self, model, args, logits):
        idx, input_pos = args
        pos = input_pos.view(-1).tolist()
        for p, t in zip(pos, idx.view(-1).tolist()):
            self.tokens[p] = t
        last = max(pos)
        held = torch.tensor([[self.tokens[p] for p in range(last + 1)]], dtype=torch.long)
        ref = full_forward_no_cache(model, held)[0, pos]
        torch.testing.assert_close(logits[0], ref, atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"{self.name} cached forward at {pos}: {m}")
        self.calls += 1


@torch.no_grad()
def greedy_no_cache(model: Transformer, prompt: Tensor, max_new_tokens: int) -> Tensor:
    seq = prompt.long().view(1, -1)
    for _ in range(max_new_tokens):
        nxt = full_forward_no_cache(model, seq)[0, -1].argmax()
        seq = torch.cat([seq, nxt.view(1, 1)], dim=1)
    return seq[0]


def main():
    torch.manual_seed(0)
    config = ModelArgs(block_size=128, vocab_size=96, n_layer=2, n_head=4, n_local_heads=2, dim=64,
                       intermediate_size=128)
    model = Transformer(config).eval()
    # draft: the target's weights, perturbed, so that it agrees on some tokens and not on others
    draft_model = Transformer(config).eval()
    with torch.no_grad():
        for (name, p_t), p_d in zip(model.named_parameters(), draft_model.parameters()):
            p_d.copy_(p_t + 0.2 * p_t.std() * torch.randn_like(p_t) if p_t.dim() > 1 else p_t)

    target_shadow = CacheShadow(model, "target")
    draft_shadow = CacheShadow(draft_model, "draft")

    max_new_tokens, speculate_k = 40, 4
    prompts = [torch.randint(0, config.vocab_size, (n,), dtype=torch.int) for n in (7, 11, 5)]

    totals = [0] * (speculate_k + 1)
    for prompt in prompts:
        # temperature -> 1e-5: every distribution is one-hot, speculative decoding == target greedy
        torch.manual_seed(1234)
        seq, stats = generate(model, prompt, max_new_tokens, interactive=False, draft_model=draft_model,
                              speculate_k=speculate_k, temperature=0.0, top_k=None)
        ref = greedy_no_cache(model, prompt, max_new_tokens)
        assert torch.equal(seq.long(), ref), (seq.tolist(), ref.tolist())
        totals = [a + b for a, b in zip(totals, stats['accept_counts'])]
        print(f"greedy prompt len {prompt.numel()}: matches no-cache greedy; accept_counts {stats['accept_counts']}")

        # sampled run, as gpt-fast's main() calls it: caches (reused, stale slots and all) checked on every forward
        torch.manual_seed(5678)
        seq, stats = generate(model, prompt, max_new_tokens, interactive=False, draft_model=draft_model,
                              speculate_k=speculate_k, temperature=0.8, top_k=20)
        assert seq.shape[0] == prompt.numel() + max_new_tokens
        totals = [a + b for a, b in zip(totals, stats['accept_counts'])]
        print(f"sampled prompt len {prompt.numel()}: accept_counts {stats['accept_counts']}")

    # both the all-accepted branch (draft cache filled with its last token) and rejections happened
    assert totals[-1] > 0 and sum(totals[:-1]) > 0, totals
    print(f"cached forwards checked: target {target_shadow.calls}, draft {draft_shadow.calls}")
    print("OK")


if __name__ == "__main__":
    main()
