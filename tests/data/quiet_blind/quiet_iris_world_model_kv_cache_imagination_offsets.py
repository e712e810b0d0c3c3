"""IRIS world model (eloialonso/iris), shrunk: a minGPT transformer over
timestep-interleaved tokens [K observation tokens | 1 action token] per block,
with a preallocated per-layer KV cache and the mask sliced at the cache offset.

Ported from eloialonso/iris @24326aaaa283c527f42b89b44cfdecf2665a7a16:
  src/models/transformer.py  (TransformerConfig, SelfAttention: causal_mask /
                              block_causal_mask buffer, mask[L:L + T, :L + T])
  src/models/kv_caching.py   (Cache / KVCache / KeysValues, size offset)
  src/models/slicer.py       (Slicer / Head / Embedder with prev_steps)
  src/models/world_model.py  (WorldModel.forward, prev_steps = past_keys_values.size)
  src/envs/world_model_env.py (refresh_keys_values_with_initial_obs_tokens, step:
                              one token per pass, refresh when the cache is full)

Checks (all must match):
  1. training forward (no cache, 'causal') == a per-query loop over keys j <= i;
  2. a 'block_causal' transformer (tokens of one block see each other) == a loop
     over keys in the same or an earlier block;
  3. imagination rollout with the KV cache, one token per forward, including a
     refresh of the cache when it would overflow max_tokens == the same tokens
     run in one cache-free forward since the last refresh (every output vector,
     every logit).
"""
import math
from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch
import torch.nn as nn
from torch.nn import functional as F

torch.manual_seed(0)
torch.set_default_dtype(torch.float64)


# ----------------------------------------------------------------- kv_caching.py
class Cache:
    def __init__(self, num_samples, num_heads, max_tokens, embed_dim, device):
        assert embed_dim % num_heads == 0
        self._n, self._cache, self._size = num_samples, None, None
        self._reset = lambda n: torch.empty(n, num_heads, max_tokens, embed_dim // num_heads, device=device)
        self.reset()

    @property
    def shape(self):
        n, num_heads, _, head_dim = self._cache.shape
        return n, num_heads, self._size, head_dim

    def reset(self):
        self._cache = self._reset(self._n)
        self._size = 0

    def get(self):
        return self._cache[:, :, :self._size, :]

    def update(self, x):
        assert (x.ndim == self._cache.ndim) and all([x.size(i) == self._cache.size(i) for i in (0, 1, 3)])
        assert self._size + x.size(2) <= self._cache.shape[2]
        self._cache[:, :, self._size:self._size + x.size(2)] = x
        self._size += x.size(2)


class KVCache:
    def __init__(self, n, num_heads, max_tokens, embed_dim, device):
        self._k_cache = Cache(n, num_heads, max_tokens, embed_dim, device)
        self._v_cache = Cache(n, num_heads, max_tokens, embed_dim, device)

    @property
    def shape(self):
        return self._k_cache.shape

    def get(self):
        return self._k_cache.get(), self._v_cache.get()

    def update(self, k, v):
        self._k_cache.update(k)
        self._v_cache.update(v)


class KeysValues:
    def __init__(self, n, num_heads, max_tokens, embed_dim, num_layers, device):
        self._keys_values = tuple([KVCache(n, num_heads, max_tokens, embed_dim, device) for _ in range(num_layers)])

    def __getitem__(self, key):
        return self._keys_values[key]

    def __len__(self):
        return len(self._keys_values)

    @property
    def size(self):
        return self._keys_values[0].shape[2]


# ---------------------------------------------------------------- transformer.py
@dataclass
class TransformerConfig:
    tokens_per_block: int
    max_blocks: int
    attention: str
    num_layers: int
    num_heads: int
    embed_dim: int

    @property
    def max_tokens(self):
        return self.tokens_per_block * self.max_blocks


class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        assert config.embed_dim % config.num_heads == 0
        assert config.attention in ('causal', 'block_causal')
        self.num_heads = config.num_heads
        self.key = nn.Linear(config.embed_dim, config.embed_dim)
        self.query = nn.Linear(config.embed_dim, config.embed_dim)
        self.value = nn.Linear(config.embed_dim, config.embed_dim)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)

        causal_mask = torch.tril(torch.ones(config.max_tokens, config.max_tokens))
        block_causal_mask = torch.max(causal_mask, torch.block_diag(*[torch.ones(config.tokens_per_block, config.tokens_per_block) for _ in range(config.max_blocks)]))
        self.register_buffer('mask', causal_mask if config.attention == 'causal' else block_causal_mask)

    def forward(self, x, kv_cache: Optional[KVCache] = None):
        B, T, C = x.size()
        if kv_cache is not None:
            b, nh, L, c = kv_cache.shape
            assert nh == self.num_heads and b == B and c * nh == C
        else:
            L = 0

        q = self.query(x).view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2)
        k = self.key(x).view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2)
        v = self.value(x).view(B, T, self.num_heads, C // self.num_heads).transpose(1, 2)

        if kv_cache is not None:
            kv_cache.update(k, v)
            k, v = kv_cache.get()

        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        att = att.masked_fill(self.mask[L:L + T, :L + T] == 0, float('-inf'))
        att = F.softmax(att, dim=-1)
        y = att @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.embed_dim)
        self.ln2 = nn.LayerNorm(config.embed_dim)
        self.attn = SelfAttention(config)
        self.mlp = nn.Sequential(nn.Linear(config.embed_dim, 4 * config.embed_dim), nn.GELU(),
                                 nn.Linear(4 * config.embed_dim, config.embed_dim))

    def forward(self, x, past_keys_values=None):
        x = x + self.attn(self.ln1(x), past_keys_values)
        x = x + self.mlp(self.ln2(x))
        return x


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        self.ln_f = nn.LayerNorm(config.embed_dim)

    def generate_empty_keys_values(self, n, max_tokens):
        device = self.ln_f.weight.device
        return KeysValues(n, self.config.num_heads, max_tokens, self.config.embed_dim, self.config.num_layers, device)

    def forward(self, sequences, past_keys_values=None):
        assert past_keys_values is None or len(past_keys_values) == len(self.blocks)
        x = sequences
        for i, block in enumerate(self.blocks):
            x = block(x, None if past_keys_values is None else past_keys_values[i])
        return self.ln_f(x)


# --------------------------------------------------------------------- slicer.py
class Slicer(nn.Module):
    def __init__(self, max_blocks, block_mask):
        super().__init__()
        self.block_size = block_mask.size(0)
        self.num_kept_tokens = block_mask.sum().long().item()
        kept_indices = torch.where(block_mask)[0].repeat(max_blocks)
        offsets = torch.arange(max_blocks).repeat_interleave(self.num_kept_tokens)
        self.register_buffer('indices', kept_indices + block_mask.size(0) * offsets)

    def compute_slice(self, num_steps, prev_steps=0):
        total_steps = num_steps + prev_steps
        num_blocks = math.ceil(total_steps / self.block_size)
        indices = self.indices[:num_blocks * self.num_kept_tokens]
        return indices[torch.logical_and(prev_steps <= indices, indices < total_steps)] - prev_steps


class Head(Slicer):
    def __init__(self, max_blocks, block_mask, head_module):
        super().__init__(max_blocks, block_mask)
        self.head_module = head_module

    def forward(self, x, num_steps, prev_steps):
        return self.head_module(x[:, self.compute_slice(num_steps, prev_steps)])


class Embedder(nn.Module):
    def __init__(self, max_blocks, block_masks, embedding_tables):
        super().__init__()
        assert (sum(block_masks) == 1).all()
        self.embedding_dim = embedding_tables[0].embedding_dim
        self.embedding_tables = embedding_tables
        self.slicers = [Slicer(max_blocks, bm) for bm in block_masks]

    def forward(self, tokens, num_steps, prev_steps):
        output = torch.zeros(*tokens.size(), self.embedding_dim)
        for slicer, emb in zip(self.slicers, self.embedding_tables):
            s = slicer.compute_slice(num_steps, prev_steps)
            output[:, s] = emb(tokens[:, s])
        return output


# ---------------------------------------------------------------- world_model.py
class WorldModel(nn.Module):
    def __init__(self, obs_vocab_size, act_vocab_size, config):
        super().__init__()
        self.config = config
        self.transformer = Transformer(config)
        all_but_last_obs_tokens_pattern = torch.ones(config.tokens_per_block)
        all_but_last_obs_tokens_pattern[-2] = 0
        act_tokens_pattern = torch.zeros(config.tokens_per_block)
        act_tokens_pattern[-1] = 1
        obs_tokens_pattern = 1 - act_tokens_pattern
        self.pos_emb = nn.Embedding(config.max_tokens, config.embed_dim)
        self.embedder = Embedder(config.max_blocks, [act_tokens_pattern, obs_tokens_pattern],
                                 nn.ModuleList([nn.Embedding(act_vocab_size, config.embed_dim),
                                                nn.Embedding(obs_vocab_size, config.embed_dim)]))
        self.head_observations = Head(config.max_blocks, all_but_last_obs_tokens_pattern,
                                      nn.Sequential(nn.Linear(config.embed_dim, config.embed_dim), nn.ReLU(),
                                                    nn.Linear(config.embed_dim, obs_vocab_size)))
        self.head_rewards = Head(config.max_blocks, act_tokens_pattern,
                                 nn.Sequential(nn.Linear(config.embed_dim, config.embed_dim), nn.ReLU(),
                                               nn.Linear(config.embed_dim, 3)))
        self.head_ends = Head(config.max_blocks, act_tokens_pattern,
                              nn.Sequential(nn.Linear(config.embed_dim, config.embed_dim), nn.ReLU(),
                                            nn.Linear(config.embed_dim, 2)))

    def forward(self, tokens, past_keys_values=None):
        num_steps = tokens.size(1)
        assert num_steps <= self.config.max_tokens
        prev_steps = 0 if past_keys_values is None else past_keys_values.size
        sequences = self.embedder(tokens, num_steps, prev_steps) + self.pos_emb(prev_steps + torch.arange(num_steps))
        x = self.transformer(sequences, past_keys_values)
        return (x,
                self.head_observations(x, num_steps=num_steps, prev_steps=prev_steps),
                self.head_rewards(x, num_steps=num_steps, prev_steps=prev_steps),
                self.head_ends(x, num_steps=num_steps, prev_steps=prev_steps))


# ----------------------------------------------------- world_model_env.py (rollout)
class WorldModelEnv:
    def __init__(self, world_model, num_observations_tokens):
        self.world_model = world_model.eval()
        self.num_observations_tokens = num_observations_tokens
        self.keys_values_wm, self.obs_tokens = None, None
        self.refreshes = 0

    @torch.no_grad()
    def refresh_keys_values_with_initial_obs_tokens(self, obs_tokens):
        n, K = obs_tokens.shape
        assert K == self.num_observations_tokens
        self.keys_values_wm = self.world_model.transformer.generate_empty_keys_values(
            n=n, max_tokens=self.world_model.config.max_tokens)
        self.refreshes += 1
        return self.world_model(obs_tokens, past_keys_values=self.keys_values_wm)[0]

    @torch.no_grad()
    def reset_from_initial_observations(self, obs_tokens):
        out = self.refresh_keys_values_with_initial_obs_tokens(obs_tokens)
        self.obs_tokens = obs_tokens
        return out

    @torch.no_grad()
    def step(self, action):
        num_passes = 1 + self.num_observations_tokens
        refreshed = None
        if self.keys_values_wm.size + num_passes > self.world_model.config.max_tokens:
            refreshed = self.refresh_keys_values_with_initial_obs_tokens(self.obs_tokens)
        token = action.clone().reshape(-1, 1)
        outs, obs_tokens, obs_logits, rew_logits = [], [], [], []
        for k in range(num_passes):
            x, lo, lr, le = self.world_model(token, past_keys_values=self.keys_values_wm)
            outs.append(x)
            if k == 0:
                rew_logits.append(lr)
            if k < self.num_observations_tokens:
                obs_logits.append(lo)
                token = torch.distributions.Categorical(logits=lo).sample()
                obs_tokens.append(token)
        self.obs_tokens = torch.cat(obs_tokens, dim=1)
        return refreshed, torch.cat(outs, dim=1), torch.cat(obs_logits, 1), torch.cat(rew_logits, 1)


# ------------------------------------------------------------------ references
def reference_transformer(tr: Transformer, sequences, allowed):
    """Loop over queries; each query attends only to keys allowed[i] (list)."""
    x = sequences
    for blk in tr.blocks:
        a = blk.attn
        h = blk.ln1(x)
        B, T, C = h.shape
        nh, hd = a.num_heads, C // a.num_heads
        q = a.query(h).view(B, T, nh, hd)
        k = a.key(h).view(B, T, nh, hd)
        v = a.value(h).view(B, T, nh, hd)
        y = torch.zeros(B, T, nh, hd)
        for i in range(T):
            js = allowed[i]
            s = torch.einsum('bhd,bjhd->bhj', q[:, i], k[:, js]) / math.sqrt(hd)
            p = torch.softmax(s, dim=-1)
            y[:, i] = torch.einsum('bhj,bjhd->bhd', p, v[:, js])
        x = x + a.proj(y.reshape(B, T, C))
        x = x + blk.mlp(blk.ln2(x))
    return tr.ln_f(x)


def main():
    K = 3                      # observation tokens per frame
    tpb = K + 1                # tokens_per_block: [o_1 .. o_K | a]
    cfg = TransformerConfig(tokens_per_block=tpb, max_blocks=4, attention='causal',
                            num_layers=2, num_heads=2, embed_dim=16)
    obs_vocab, act_vocab = 11, 4
    wm = WorldModel(obs_vocab, act_vocab, cfg).eval()
    ok_all = True

    # 1. training forward, causal, against a per-query loop
    B, L = 3, cfg.max_blocks
    obs = torch.randint(0, obs_vocab, (B, L, K))
    act = torch.randint(0, act_vocab, (B, L, 1))
    tokens = torch.cat([obs, act], dim=2).reshape(B, L * tpb)
    with torch.no_grad():
        x, lo, lr, le = wm(tokens)
        T = tokens.size(1)
        seq = wm.embedder(tokens, T, 0) + wm.pos_emb(torch.arange(T))
        ref = reference_transformer(wm.transformer, seq, [list(range(i + 1)) for i in range(T)])
    ok1 = torch.allclose(x, ref, atol=1e-10)
    print('training forward (causal) matches per-query loop:', ok1)
    ok_all &= ok1

    # 2. block-causal variant of the same transformer code
    cfg_bc = TransformerConfig(tokens_per_block=tpb, max_blocks=4, attention='block_causal',
                               num_layers=2, num_heads=2, embed_dim=16)
    tr_bc = Transformer(cfg_bc).eval()
    T2 = 3 * tpb - 1            # a partial last block
    seq2 = torch.randn(2, T2, 16)
    with torch.no_grad():
        y = tr_bc(seq2)
        allowed = [[j for j in range(T2) if j // tpb <= i // tpb] for i in range(T2)]
        yref = reference_transformer(tr_bc, seq2, allowed)
    ok2 = torch.allclose(y, yref, atol=1e-10)
    print('block-causal forward matches per-query loop (same or earlier block):', ok2)
    ok_all &= ok2

    # 3. imagination rollout with the KV cache (one token per pass, refresh on overflow)
    torch.manual_seed(1)
    n = 3
    env = WorldModelEnv(wm, K)
    init_obs = torch.randint(0, obs_vocab, (n, K))
    first = env.reset_from_initial_observations(init_obs)
    segment_tokens = [init_obs]          # tokens since the last refresh
    segment_outs = [first]
    segment_obs_logits, segment_rew_logits = [], []
    checks = []

    def check_segment():
        toks = torch.cat(segment_tokens, dim=1)
        with torch.no_grad():
            xf, lof, lrf, _ = wm(toks)        # one cache-free forward from position 0
        xs = torch.cat(segment_outs, dim=1)
        good = torch.allclose(xs, xf, atol=1e-10)
        if segment_obs_logits:
            # head_observations keeps every position but each block's last obs token:
            # K - 1 for the first frame, then K per step (action + o_1 .. o_{K-1})
            lo_c = torch.cat(segment_obs_logits, dim=1)
            good &= lof.size(1) == K - 1 + lo_c.size(1)
            good &= torch.allclose(lo_c, lof[:, K - 1:], atol=1e-10)
            # head_rewards keeps the action positions: one per step
            lr_c = torch.cat(segment_rew_logits, dim=1)
            good &= lrf.shape == lr_c.shape and torch.allclose(lr_c, lrf, atol=1e-10)
        checks.append(bool(good))

    for t in range(7):
        action = torch.randint(0, act_vocab, (n,))
        obs_before = env.obs_tokens
        refreshed, outs, obs_logits, rew_logits = env.step(action)
        if refreshed is not None:
            check_segment()
            segment_tokens, segment_outs = [obs_before], [refreshed]
            segment_obs_logits, segment_rew_logits = [], []
        segment_tokens += [action.reshape(-1, 1), env.obs_tokens]
        segment_outs.append(outs)
        segment_obs_logits.append(obs_logits)
        segment_rew_logits.append(rew_logits)
    check_segment()
    ok3 = all(checks) and env.refreshes >= 2
    print(f'cached imagination ({env.refreshes} cache refreshes, {len(checks)} segments) matches cache-free forward:', ok3)
    ok_all &= ok3

    print('ALL MATCH' if ok_all else 'MISMATCH')
    assert ok_all


if __name__ == '__main__':
    main()
