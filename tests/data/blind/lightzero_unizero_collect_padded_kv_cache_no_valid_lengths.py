# Citation: opendilab/LightZero commit 8c6c0b8e ("fix(unizero): align cache, targets, and replay semantics").
#
# UniZero's world model (lzero/model/unizero_world_models/world_model.py, transformer.py, kv_caching.py),
# collect phase, root (initial) inference for several environments at once. Each environment keeps its own
# KV cache of its episode so far; the caches have different sizes, so trim_and_pad_kv_cache() left-pads the
# shorter ones with zero keys / values up to the longest and stacks them into one batched cache. The step's
# action token and new observation are then run over that batched cache.
#
# Before the fix, WorldModel.forward() reset `valid_context_lengths = None` whenever is_init_infer was set, and
# the collect path passed none, so SelfAttention built only the causal slice: the shorter environments' new
# tokens attended to the zero-padded slots at the front of their cache. The fix stops the reset, passes the
# per-env cache sizes (when they differ) to both forwards, and bumps them by one after each appended token.
# (The same commit also reworked position lookup and RoPE; both runs here keep the learned absolute positions.)
import math
import sys
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class TransformerConfig:
    tokens_per_block: int = 2
    max_blocks: int = 8
    embed_dim: int = 32
    num_heads: int = 4
    num_layers: int = 2
    attn_pdrop: float = 0.0
    resid_pdrop: float = 0.0
    embed_pdrop: float = 0.0

    @property
    def max_tokens(self) -> int:
        return self.tokens_per_block * self.max_blocks


# ---------------------------------------------------------------- kv_caching.py
class Cache:
    def __init__(self, num_samples, num_heads, max_tokens, embed_dim, device):
        assert embed_dim % num_heads == 0
        self._num_samples, self._num_heads, self._max_tokens = num_samples, num_heads, max_tokens
        self._head_dim = embed_dim // num_heads
        self._device = device
        self._cache = torch.zeros(num_samples, num_heads, max_tokens, self._head_dim, device=device)
        self._size = 0

    @property
    def shape(self):
        return self._num_samples, self._num_heads, self._size, self._head_dim

    def get(self):
        return self._cache[:, :, :self._size, :]

    def update(self, x, tokens):
        assert self._size + tokens <= self._cache.shape[2]
        self._cache = self._cache.clone()
        self._cache[:, :, self._size:self._size + tokens, :] = x
        self._size += tokens


class KVCache:
    def __init__(self, num_samples, num_heads, max_tokens, embed_dim, device):
        self._k_cache = Cache(num_samples, num_heads, max_tokens, embed_dim, device)
        self._v_cache = Cache(num_samples, num_heads, max_tokens, embed_dim, device)

    @property
    def shape(self):
        return self._k_cache.shape

    def get(self):
        return self._k_cache.get(), self._v_cache.get()

    def update(self, k, v):
        self._k_cache.update(k, k.size(2))
        self._v_cache.update(v, v.size(2))


class KeysValues:
    def __init__(self, num_samples, num_heads, max_tokens, embed_dim, num_layers, device):
        self._keys_values = tuple(
            KVCache(num_samples, num_heads, max_tokens, embed_dim, device) for _ in range(num_layers)
        )

    def __getitem__(self, layer_index):
        return self._keys_values[layer_index]

    @property
    def size(self):
        return self._keys_values[0].shape[2]


# ---------------------------------------------------------------- transformer.py
class SelfAttention(nn.Module):
    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        self.num_heads = config.num_heads
        self.key = nn.Linear(config.embed_dim, config.embed_dim)
        self.query = nn.Linear(config.embed_dim, config.embed_dim)
        self.value = nn.Linear(config.embed_dim, config.embed_dim)
        self.proj = nn.Linear(config.embed_dim, config.embed_dim)
        self.attn_drop = nn.Dropout(config.attn_pdrop)
        self.resid_drop = nn.Dropout(config.resid_pdrop)
        causal_mask = torch.tril(torch.ones(config.max_tokens, config.max_tokens))
        self.register_buffer("mask", causal_mask)

    def forward(self, x, kv_cache=None, valid_context_lengths=None):
        B, T, C = x.size()
        head_size = C // self.num_heads
        past_len = 0
        if kv_cache is not None:
            past_len = kv_cache.shape[2]

        q = self.query(x).view(B, T, self.num_heads, head_size).transpose(1, 2)
        k = self.key(x).view(B, T, self.num_heads, head_size).transpose(1, 2)
        v = self.value(x).view(B, T, self.num_heads, head_size).transpose(1, 2)

        if kv_cache is not None:
            kv_cache.update(k, v)
            k, v = kv_cache.get()

        current_len = k.size(2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))

        mask = self.mask[past_len:past_len + T, :current_len]
        if valid_context_lengths is not None:
            batch_mask = torch.zeros(B, T, current_len, device=att.device)
            for i in range(B):
                batch_mask[i] = mask.clone()
                batch_mask[i, :, :(past_len - valid_context_lengths[i])] = 0
            mask = batch_mask.unsqueeze(1).expand(-1, self.num_heads, -1, -1)

        att = att.masked_fill(mask == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        att = self.attn_drop(att)
        y = att @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.resid_drop(self.proj(y))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln1 = nn.LayerNorm(config.embed_dim)
        self.ln2 = nn.LayerNorm(config.embed_dim)
        self.attn = SelfAttention(config)
        self.mlp = nn.Sequential(
            nn.Linear(config.embed_dim, 4 * config.embed_dim),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * config.embed_dim, config.embed_dim),
            nn.Dropout(config.resid_pdrop),
        )

    def forward(self, x, past_keys_values=None, valid_context_lengths=None):
        x = x + self.attn(self.ln1(x), past_keys_values, valid_context_lengths)
        x = x + self.mlp(self.ln2(x))
        return x


class Transformer(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.drop = nn.Dropout(config.embed_pdrop)
        self.blocks = nn.ModuleList([Block(config) for _ in range(config.num_layers)])
        self.ln_f = nn.LayerNorm(config.embed_dim)

    def generate_empty_keys_values(self, n, max_tokens):
        return KeysValues(n, self.config.num_heads, max_tokens, self.config.embed_dim,
                          self.config.num_layers, self.ln_f.weight.device)

    def forward(self, sequences, past_keys_values=None, valid_context_lengths=None):
        x = self.drop(sequences)
        for i, block in enumerate(self.blocks):
            kv_cache_layer = None if past_keys_values is None else past_keys_values[i]
            x = block(x, kv_cache_layer, valid_context_lengths)
        return self.ln_f(x)


# ---------------------------------------------------------------- world_model.py (trimmed)
class WorldModel(nn.Module):
    def __init__(self, config: TransformerConfig, action_space_size: int = 4, support_size: int = 11):
        super().__init__()
        self.config = config
        self.embed_dim = config.embed_dim
        self.num_layers = config.num_layers
        self.context_length = config.max_tokens
        self.device = torch.device("cpu")
        self.transformer = Transformer(config)
        self.pos_emb = nn.Embedding(config.max_tokens, config.embed_dim)
        self.act_embedding_table = nn.Embedding(action_space_size, config.embed_dim)
        self.head_policy = nn.Linear(config.embed_dim, action_space_size)
        self.head_value = nn.Linear(config.embed_dim, support_size)
        self.keys_values_wm = None
        self.keys_values_wm_list: List[KeysValues] = []
        self.keys_values_wm_size_list: List[int] = []
        self.keys_values_wm_size_list_current: List[int] = []

    @staticmethod
    def _variable_context_lengths(context_lengths: List[int]) -> Optional[List[int]]:
        if not context_lengths or min(context_lengths) == max(context_lengths):
            return None
        return context_lengths

    def forward(self, obs_embeddings_or_act_tokens, past_keys_values=None, is_init_infer=True,
                valid_context_lengths=None):
        prev_steps = 0 if past_keys_values is None else past_keys_values.size
        if is_init_infer and not FIXED:
            # Reset valid context lengths during initial inference phase.
            valid_context_lengths = None

        if "obs_embeddings" in obs_embeddings_or_act_tokens:
            emb = obs_embeddings_or_act_tokens["obs_embeddings"]
            if emb.dim() == 2:
                emb = emb.unsqueeze(1)
        else:
            emb = self.act_embedding_table(obs_embeddings_or_act_tokens["act_tokens"])
        num_steps = emb.size(1)
        sequences = emb + self.pos_emb(prev_steps + torch.arange(num_steps, device=self.device))

        x = self.transformer(sequences, past_keys_values, valid_context_lengths=valid_context_lengths)
        return x, self.head_policy(x), self.head_value(x)

    def trim_and_pad_kv_cache(self, is_init_infer=True) -> list:
        max_size = max(self.keys_values_wm_size_list)
        for layer in range(self.num_layers):
            kv_cache_k_list, kv_cache_v_list = [], []
            for idx, keys_values in enumerate(self.keys_values_wm_list):
                k_cache = keys_values[layer]._k_cache._cache
                v_cache = keys_values[layer]._v_cache._cache
                effective_size = self.keys_values_wm_size_list[idx]
                pad_size = max_size - effective_size
                if pad_size > 0:
                    k_cache_trimmed = k_cache[:, :, :-pad_size, :]
                    v_cache_trimmed = v_cache[:, :, :-pad_size, :]
                    k_cache_padded = F.pad(k_cache_trimmed, (0, 0, pad_size, 0), "constant", 0)
                    v_cache_padded = F.pad(v_cache_trimmed, (0, 0, pad_size, 0), "constant", 0)
                else:
                    k_cache_padded, v_cache_padded = k_cache, v_cache
                kv_cache_k_list.append(k_cache_padded)
                kv_cache_v_list.append(v_cache_padded)
            self.keys_values_wm._keys_values[layer]._k_cache._cache = torch.stack(kv_cache_k_list, dim=0).squeeze(1)
            self.keys_values_wm._keys_values[layer]._v_cache._cache = torch.stack(kv_cache_v_list, dim=0).squeeze(1)
            self.keys_values_wm._keys_values[layer]._k_cache._size = max_size
            self.keys_values_wm._keys_values[layer]._v_cache._size = max_size
        return list(self.keys_values_wm_size_list)

    @torch.no_grad()
    def wm_forward_for_initial_infererence(self, env_caches, batch_action, current_obs_embeddings):
        """Collect phase, continuing envs: each env's cached episode, then [action, new observation]."""
        ready_env_num = current_obs_embeddings.shape[0]
        self.keys_values_wm = self.transformer.generate_empty_keys_values(n=ready_env_num,
                                                                         max_tokens=self.context_length)
        self.keys_values_wm_list = list(env_caches)
        self.keys_values_wm_size_list = [kv.size for kv in env_caches]
        self.keys_values_wm_size_list_current = self.trim_and_pad_kv_cache(is_init_infer=True)

        act_tokens = torch.as_tensor(batch_action, dtype=torch.long).unsqueeze(1)
        if FIXED:
            self.forward({"act_tokens": act_tokens}, past_keys_values=self.keys_values_wm, is_init_infer=True,
                         valid_context_lengths=self._variable_context_lengths(self.keys_values_wm_size_list_current))
            self.keys_values_wm_size_list_current = [s + 1 for s in self.keys_values_wm_size_list_current]
            out = self.forward({"obs_embeddings": current_obs_embeddings}, past_keys_values=self.keys_values_wm,
                               is_init_infer=True,
                               valid_context_lengths=self._variable_context_lengths(self.keys_values_wm_size_list_current))
            self.keys_values_wm_size_list_current = [s + 1 for s in self.keys_values_wm_size_list_current]
        else:
            self.forward({"act_tokens": act_tokens}, past_keys_values=self.keys_values_wm, is_init_infer=True)
            out = self.forward({"obs_embeddings": current_obs_embeddings}, past_keys_values=self.keys_values_wm,
                               is_init_infer=True)
        return out


def build_env_cache(wm: WorldModel, obs_seq, act_seq):
    """An env's own (unbatched) KV cache of its episode: obs_0, a_0, obs_1, a_1, ..., obs_t."""
    kv = wm.transformer.generate_empty_keys_values(n=1, max_tokens=wm.context_length)
    with torch.no_grad():
        for t in range(len(obs_seq)):
            wm.forward({"obs_embeddings": obs_seq[t].view(1, 1, -1)}, past_keys_values=kv, is_init_infer=True)
            if t < len(act_seq):
                wm.forward({"act_tokens": torch.tensor([[act_seq[t]]])}, past_keys_values=kv, is_init_infer=True)
    return kv


def main():
    torch.manual_seed(0)
    config = TransformerConfig()
    wm = WorldModel(config).eval()

    # Two envs mid-episode: env 0 has seen 4 observations, env 1 only 2 (it was reset later).
    lengths = [4, 2]
    env_caches, last_actions, new_obs = [], [], []
    for n_obs in lengths:
        obs = torch.randn(n_obs, config.embed_dim)
        acts = torch.randint(0, 4, (n_obs - 1,)).tolist()
        env_caches.append(build_env_cache(wm, obs, acts))
        last_actions.append(int(torch.randint(0, 4, (1,))))
        new_obs.append(torch.randn(config.embed_dim))
    print("per-env cache sizes:", [kv.size for kv in env_caches])

    x, logits_policy, logits_value = wm.wm_forward_for_initial_infererence(
        env_caches, last_actions, torch.stack(new_obs, 0)
    )
    policy = logits_policy[:, -1].softmax(-1)
    value = logits_value[:, -1].softmax(-1) @ torch.arange(-5.0, 6.0)
    for i in range(len(lengths)):
        print(f"env {i}: root policy prior {[round(p, 4) for p in policy[i].tolist()]}  value {value[i].item():+.4f}")


if __name__ == "__main__":
    main()
