# lucidrains/infini-transformer-pytorch commit c42031f ("fix an issue with rotary embeddings and cached kv").
# In generate() the wrapper fed the whole prompt again at every step while the kv cache kept growing, so the
# queries attended to duplicated copies of the prompt in the cache (and never to the sampled tokens), and the
# queries were rotated from position 0 while the cached keys ran on, so the query-key offsets were wrong.
# The fix feeds the current segment, keeps only its last token when a cache exists, and rotates q after the cached keys.
from __future__ import annotations
import sys
from math import ceil
from typing import Tuple, List, NamedTuple, Callable

import torch
from torch import nn, Tensor
import torch.nn.functional as F
from torch.nn import Module, ModuleList

FIXED = "--fixed" in sys.argv

# rotary_embedding_torch (the parts used here)

def rotate_half(x):
    x = x.reshape(*x.shape[:-1], -1, 2)
    x1, x2 = x.unbind(dim = -1)
    x = torch.stack((-x2, x1), dim = -1)
    return x.reshape(*x.shape[:-2], -1)

def apply_rotary_emb(freqs, t, start_index = 0, scale = 1., seq_dim = -2):
    if freqs.ndim == 2 or t.ndim == 3:
        seq_len = t.shape[seq_dim]
        freqs = freqs[-seq_len:].to(t)

    rot_dim = freqs.shape[-1]
    end_index = start_index + rot_dim

    t_left, t, t_right = t[..., :start_index], t[..., start_index:end_index], t[..., end_index:]
    t = (t * freqs.cos() * scale) + (rotate_half(t) * freqs.sin() * scale)
    return torch.cat((t_left, t, t_right), dim = -1)

class RotaryEmbedding(Module):
    def __init__(self, dim, theta = 10000):
        super().__init__()
        freqs = 1. / (theta ** (torch.arange(0, dim, 2)[:(dim // 2)].float() / dim))
        self.freqs = nn.Parameter(freqs, requires_grad = False)
        self.default_seq_dim = -2

    def get_seq_pos(self, seq_len, device, dtype, offset = 0):
        return (torch.arange(seq_len, device = device, dtype = dtype) + offset)

    def rotate_queries_or_keys(self, t, seq_dim = None, offset = 0, freq_seq_len = None):
        seq_dim = default(seq_dim, self.default_seq_dim)
        device, dtype, seq_len = t.device, t.dtype, t.shape[seq_dim]

        if exists(freq_seq_len):
            assert freq_seq_len >= seq_len
            seq_len = freq_seq_len

        freqs = self.forward(self.get_seq_pos(seq_len, device = device, dtype = dtype, offset = offset))
        return apply_rotary_emb(freqs, t, seq_dim = seq_dim)

    def rotate_queries_with_cached_keys(self, q, k, seq_dim = None, offset = 0):
        seq_dim = default(seq_dim, self.default_seq_dim)

        q_len, k_len = q.shape[seq_dim], k.shape[seq_dim]
        assert q_len <= k_len
        rotated_q = self.rotate_queries_or_keys(q, seq_dim = seq_dim, freq_seq_len = k_len)
        rotated_k = self.rotate_queries_or_keys(k, seq_dim = seq_dim)
        return rotated_q.type(q.dtype), rotated_k.type(k.dtype)

    def forward(self, t):
        freqs = torch.einsum('..., f -> ... f', t.type(self.freqs.dtype), self.freqs)
        return freqs.repeat_interleave(2, dim = -1)

# constants

class Memories(NamedTuple):
    kv_mem: Tensor
    k_norm: Tensor

class TransformerReturn(NamedTuple):
    logits: Tensor
    cached_kvs: List[Tensor] | None
    past_memories: List[Memories] | None

# helpers

def exists(v):
    return v is not None

def default(v, d):
    return v if exists(v) else d

def divisible_by(num, den):
    return (num % den) == 0

def round_down_multiple(n, mult):
    return n // mult * mult

# classes

class RMSNorm(Module):
    def __init__(self, dim):
        super().__init__()
        self.scale = dim ** 0.5
        self.gamma = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return F.normalize(x, dim = -1) * self.scale * self.gamma

class FeedForward(Module):
    def __init__(self, dim, mult = 4, dropout = 0.):
        super().__init__()
        dim_inner = int(mult * dim * 2 / 3)
        self.norm = RMSNorm(dim)
        self.proj_in = nn.Linear(dim, dim_inner * 2)
        self.proj_out = nn.Linear(dim_inner, dim)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = self.norm(x)
        x, gates = self.proj_in(x).chunk(2, dim = -1)
        x = F.gelu(gates) * x
        x = self.dropout(x)
        return self.proj_out(x)

class CausalAttention(Module):
    def __init__(
        self,
        dim,
        *,
        dim_head = 128,
        heads = 8,
        dropout = 0.,
        head_gate_init_value = 10.,
        use_mem_delta_rule = False,
        rotary_emb_linear_attn = False
    ):
        super().__init__()
        dim_inner = dim_head * heads
        self.heads = heads
        self.scale = dim_head ** -0.5
        self.norm = RMSNorm(dim)

        self.rotary_emb = RotaryEmbedding(dim_head)

        self.to_qkv = nn.Linear(dim, dim_inner * 3, bias = False)
        self.to_out = nn.Linear(dim_inner, dim, bias = False)

        self.dropout = nn.Dropout(dropout)

        self.head_gates = nn.Parameter(torch.ones(heads) * head_gate_init_value)

        self.use_mem_delta_rule = use_mem_delta_rule
        self.rotary_emb_linear_attn = rotary_emb_linear_attn

    def split_heads(self, x):
        b, n, _ = x.shape
        return x.reshape(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)

    def merge_heads(self, x):
        b, h, n, d = x.shape
        return x.transpose(1, 2).reshape(b, n, h * d)

    def forward(
        self,
        x,
        cached_kv: Tensor | None = None,
        past_memories: Memories | None = None,
        return_new_memories = False,
        eps = 1e-10
    ) -> Tuple[Tensor, Tensor, Memories]:
        x = self.norm(x)

        x = self.to_qkv(x)
        q, k, v = self.split_heads(x)

        # handle cached key / values

        if exists(cached_kv):
            cached_k, cached_v = cached_kv
            k = torch.cat((cached_k, k), dim = -2)
            v = torch.cat((cached_v, v), dim = -2)

        orig_k, orig_v = k, v

        # similarity

        q_scaled = q * self.scale
        if FIXED:
            q_rotated, k_rotated = self.rotary_emb.rotate_queries_with_cached_keys(q_scaled, k)
        else:
            q_rotated = self.rotary_emb.rotate_queries_or_keys(q_scaled)
            k_rotated = self.rotary_emb.rotate_queries_or_keys(k)

        sim = torch.einsum('... i d, ... j d -> ... i j', q_rotated, k_rotated)

        # causal mask

        i, j = sim.shape[-2:]
        causal_mask = torch.ones((i, j), device = sim.device, dtype = torch.bool).triu(j - i + 1)
        sim = sim.masked_fill(causal_mask, -torch.finfo(sim.dtype).max)

        attn = sim.softmax(dim = -1)
        attn = self.dropout(attn)

        out = torch.einsum('... i j, ... j d -> ... i d', attn, v)

        q = F.elu(q) + 1
        k = F.elu(k) + 1

        if self.rotary_emb_linear_attn:
            if FIXED:
                q, k = self.rotary_emb.rotate_queries_with_cached_keys(q, k)
            else:
                q, k = map(self.rotary_emb.rotate_queries_or_keys, (q, k))

        def retrieve_from_kv_memories(t, past_memories: Memories):
            past_memories_kv, past_memories_norm = past_memories

            numer = torch.einsum('b h n k, b h k v -> b h n v', t, past_memories_kv)
            denom = torch.einsum('b h n d, b h d -> b h n', t, past_memories_norm)

            denom = denom[..., None]
            return numer / denom.clamp(min = eps)

        if exists(past_memories):
            mem_out = retrieve_from_kv_memories(q, past_memories)

            gates = self.head_gates[:, None, None]
            gates = gates.sigmoid()

            out = out * gates + mem_out * (1. - gates)

        out = self.merge_heads(out)
        out = self.to_out(out)

        if not return_new_memories:
            cached_kv = torch.stack((orig_k, orig_v))
            return out, cached_kv, past_memories

        if exists(past_memories) and self.use_mem_delta_rule:
            delta_v = retrieve_from_kv_memories(k, past_memories)
            v = v - delta_v

        new_memories_kv = torch.einsum('... n k, ... n v -> ... k v', k, v)
        new_memories_norm = k.sum(dim = -2)

        if exists(past_memories):
            past_memories_kv, past_memories_norm = past_memories

            new_memories_kv = new_memories_kv + past_memories_kv
            new_memories_norm = new_memories_norm + past_memories_norm

        new_memories = Memories(new_memories_kv, new_memories_norm)

        return out, None, new_memories

class InfiniTransformer(Module):
    def __init__(
        self,
        *,
        num_tokens,
        dim,
        depth,
        dim_head = 128,
        heads = 8,
        attn_dropout = 0.,
        ff_mult = 4,
        ff_dropout = 0.,
        use_mem_delta_rule = False,
        rotary_emb_linear_attn = False
    ):
        super().__init__()

        self.token_emb = nn.Embedding(num_tokens, dim)

        self.layers = ModuleList([])

        for _ in range(depth):
            attn = CausalAttention(
                dim = dim,
                dim_head = dim_head,
                heads = heads,
                use_mem_delta_rule = use_mem_delta_rule,
                rotary_emb_linear_attn = rotary_emb_linear_attn,
                dropout = attn_dropout
            )

            ff = FeedForward(dim = dim, mult = ff_mult, dropout = ff_dropout)

            self.layers.append(ModuleList([attn, ff]))

        self.norm = RMSNorm(dim)
        self.to_logits = nn.Linear(dim, num_tokens)

    def forward(
        self,
        x,
        past_memories: List[Memories] | None = None,
        cached_kv: List[Tensor] | None = None,
        return_new_memories = False,
        detach_memories = False
    ) -> TransformerReturn:

        x = self.token_emb(x)

        if FIXED and exists(cached_kv):
            x = x[:, -1:]

        new_cached_kv = []
        cached_kv_iter = iter(default(cached_kv, []))

        new_memories = []
        past_memories_iter = iter(default(past_memories, []))

        for attn, ff in self.layers:

            attn_out, layer_cached_kv, layer_new_memories = attn(
                x,
                cached_kv = next(cached_kv_iter, None),
                past_memories = next(past_memories_iter, None),
                return_new_memories = return_new_memories
            )

            x = attn_out + x
            x = ff(x) + x

            new_cached_kv.append(layer_cached_kv)
            new_memories.append(layer_new_memories)

        embed = self.norm(x)
        logits = self.to_logits(embed)

        if not return_new_memories:
            return TransformerReturn(logits, new_cached_kv, past_memories)

        return TransformerReturn(logits, None, new_memories)

# sampling helpers

def log(t, eps = 1e-20):
    return torch.log(t.clamp(min = eps))

def gumbel_noise(t):
    noise = torch.zeros_like(t).uniform_(0, 1)
    return -log(-log(noise))

def gumbel_sample(t, temperature = 1., dim = -1, keepdim = True, eps = 1e-10):
    return ((t / max(temperature, eps)) + gumbel_noise(t)).argmax(dim = dim, keepdim = keepdim)

def top_p(logits, thres = 0.9):
    sorted_logits, sorted_indices = torch.sort(logits, descending = True)
    cum_probs = torch.cumsum(F.softmax(sorted_logits, dim = -1), dim = -1)

    sorted_indices_to_remove = cum_probs > thres
    sorted_indices_to_remove = F.pad(sorted_indices_to_remove, (1, -1), value = False)

    sorted_logits[sorted_indices_to_remove] = float('-inf')
    return sorted_logits.scatter(1, sorted_indices, sorted_logits)

class InfiniTransformerWrapper(Module):
    def __init__(self, model: InfiniTransformer, segment_length = 512, ignore_index = -1):
        super().__init__()
        self.model = model
        self.segment_length = segment_length
        self.ignore_index = ignore_index

    @property
    def device(self):
        return next(self.model.parameters()).device

    @torch.no_grad()
    def generate(
        self,
        *,
        seq_len,
        prompt = None,
        batch_size = 1,
        temperature = 1.,
        filter_fn: Callable = top_p,
        filter_kwargs: dict = dict(thres = 0.9),
        exclude_prompt = True,
        segment_length = None
    ):
        segment_length = default(segment_length, self.segment_length)
        device, train_state = self.device, self.training
        self.eval()

        out = default(prompt, torch.empty((batch_size, 0), device = device, dtype = torch.long))
        init_len = out.shape[-1]

        cached_kv = None
        past_memories = None

        for curr_len in range(init_len, seq_len):

            if FIXED:
                start_ind = round_down_multiple(curr_len - 1, segment_length)
                model_input = out[:, start_ind:]
            else:
                model_input = prompt

            logits, cached_kv, past_memories = self.model(
                model_input,
                cached_kv = cached_kv,
                past_memories = past_memories,
                return_new_memories = divisible_by(curr_len, segment_length)
            )

            logits = logits[:, -1]

            filtered_logits = filter_fn(logits, **filter_kwargs)
            sampled = gumbel_sample(filtered_logits, temperature = temperature)

            out = torch.cat((out, sampled), dim = -1)

        if exclude_prompt:
            out = out[:, init_len:]

        self.train(train_state)
        return out

if __name__ == "__main__":
    torch.manual_seed(0)

    model = InfiniTransformer(num_tokens = 64, dim = 64, depth = 2, dim_head = 32, heads = 2)
    wrapper = InfiniTransformerWrapper(model, segment_length = 16)

    prompt = torch.randint(0, 64, (2, 6))
    sampled = wrapper.generate(seq_len = 14, prompt = prompt, temperature = 1.)
    print("fixed" if FIXED else "buggy", "sampled:", sampled.tolist())
