"""ExecuTorch static attention: single-chunk prefill gives sliding-window layers a full-causal mask.

Citation: pytorch/executorch PR #21384 ("Apply local sliding-window mask in StaticAttentionIOManager
single-chunk prefill"; description read, it quotes the before/after input masks). Code below follows
`examples/models/llama/static_attention.py` (`StaticAttentionMask`, `StaticAttentionIOManager.prefill`,
`_run_once`, `StaticKVCache.apply_update`) at a version before the fix, cut down to what the mask needs.

Bug: the IO manager keeps one `StaticAttentionMask` per distinct `cache_len`; local (sliding-window)
layers get a short cache (their window), global layers a long one. `prefill` wrote the same
`triu(full(-inf), diagonal=1)` input block into every mask. The window is normally realised by cache
eviction between chunks, so when the whole prompt fits one chunk (`input_len > cache_len`) a local
layer's query i attends every earlier token of the chunk instead of its `cache_len`-token window.

Fix: for masks with `0 < cache_len < input_len`, also mask `tril(full(-inf), diagonal=-cache_len)`.

Reproduction: `ModelArgs`-like config with two layers, `cache_lens = [2, 8]` (layer 0 local window 2,
layer 1 global), `input_len = 6`, one 6-token prompt prefilled in one chunk; attention is the static
attention's explicit `softmax(q @ k^T * scale + mask)` over `cat(cache, new)`.
"""
import sys
from collections import defaultdict
from dataclasses import dataclass
from typing import List, Union

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


@dataclass
class ModelArgs:
    dim: int = 32
    n_layers: int = 2
    n_heads: int = 2
    n_kv_heads: int = 2
    head_dim: int = 16
    vocab_size: int = 64
    generate_full_logits: bool = True


class StaticAttentionMask:
    def __init__(self, input_len, cache_len, style, mask_val=float("-inf"), dtype=torch.float32):
        self.input_len = input_len
        self.cache_len = cache_len
        assert style in ("shift_pointer", "smart_mask")
        self.style = style
        self.mask_val = mask_val
        self.unmasked_len = 0
        self.tensor = torch.zeros(1, input_len, input_len + cache_len, dtype=dtype)
        self.reset()

    def reset(self):
        self.unmasked_len = 0
        self.tensor[:, :, : self.cache_len] = self.mask_val

    def set_input_mask(self, input_mask):
        self.tensor[:, :, self.cache_len :] = input_mask

    def unmask(self, new_unmasked_len):
        if new_unmasked_len <= 0:
            return
        if self.style == "shift_pointer":
            self.tensor[:, :, max(0, self.cache_len - self.unmasked_len - new_unmasked_len) :
                        self.cache_len - self.unmasked_len] = 0
        self.unmasked_len += new_unmasked_len


def apply_update(cache, update, style="shift_pointer"):
    cache_len = cache.size(-2)
    if cache_len == 0:
        return cache
    if cache_len < update.size(-2):
        update = torch.narrow(update, -2, update.size(-2) - cache_len, cache_len)
    update_len = update.size(-2)
    updated = torch.roll(cache, -update_len, -2)
    updated[..., -update_len:, :] = update
    return updated


class StaticAttention(nn.Module):
    def __init__(self, config: ModelArgs, layer_id: int):
        super().__init__()
        self.layer_id = layer_id
        self.n_heads, self.head_dim = config.n_heads, config.head_dim
        self.wq = nn.Linear(config.dim, config.n_heads * config.head_dim, bias=False)
        self.wk = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wv = nn.Linear(config.dim, config.n_kv_heads * config.head_dim, bias=False)
        self.wo = nn.Linear(config.n_heads * config.head_dim, config.dim, bias=False)

    def forward(self, x, mask, k_cache, v_cache):
        bsz, seqlen, _ = x.shape
        q = self.wq(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(bsz, seqlen, self.n_heads, self.head_dim).transpose(1, 2)
        all_k = torch.cat([k_cache, k], dim=-2)
        all_v = torch.cat([v_cache, v], dim=-2)
        attn = q @ all_k.transpose(-2, -1) * self.head_dim ** -0.5
        attn = attn + mask
        attn = torch.softmax(attn.float(), dim=-1).type_as(attn)
        y = (attn @ all_v).transpose(1, 2).reshape(bsz, seqlen, -1)
        return self.wo(y), k, v


class Transformer(nn.Module):
    def __init__(self, config: ModelArgs, cache_lens: List[int]):
        super().__init__()
        self.cache_lens = cache_lens
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(StaticAttention(config, i) for i in range(config.n_layers))
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)

    def forward(self, tokens, attn_masks, k_caches, v_caches):
        h = self.tok_embeddings(tokens)
        new_k, new_v = {}, {}
        for layer in self.layers:
            cl = self.cache_lens[layer.layer_id]
            out, k, v = layer(h, attn_masks[cl], k_caches[layer.layer_id], v_caches[layer.layer_id])
            h = h + out
            new_k[layer.layer_id], new_v[layer.layer_id] = k, v
        return self.output(h), new_k, new_v


class StaticAttentionIOManager:
    def __init__(self, config: ModelArgs, input_len: int, cache_lens: Union[int, List[int]],
                 style: str = "shift_pointer", mask_val: float = float("-inf")):
        if isinstance(cache_lens, int):
            cache_lens_dict = defaultdict(lambda x=cache_lens: x)
            cache_lens = [cache_lens]
        else:
            cache_lens_dict = dict(enumerate(cache_lens))
        self._masks = {cl: StaticAttentionMask(input_len, cl, style=style, mask_val=mask_val)
                       for cl in set(cache_lens)}
        self.k_caches = {i: torch.zeros(1, config.n_kv_heads, cache_lens_dict[i], config.head_dim)
                         for i in range(config.n_layers)}
        self.v_caches = {i: torch.zeros(1, config.n_kv_heads, cache_lens_dict[i], config.head_dim)
                         for i in range(config.n_layers)}
        self.generate_full_logits = config.generate_full_logits
        self.input_len = input_len
        self.style = style
        self.mask_val = mask_val
        self.pos = 0

    @property
    def masks(self):
        return {cache_len: mask.tensor for cache_len, mask in self._masks.items()}

    def prefill(self, model, tokens):
        for mask in self._masks.values():
            input_mask = torch.triu(torch.full((1, self.input_len, self.input_len), self.mask_val), diagonal=1)
            if FIXED and 0 < mask.cache_len < self.input_len:
                # local layer: the window is not realised by eviction inside one chunk
                input_mask = input_mask + torch.tril(
                    torch.full((1, self.input_len, self.input_len), self.mask_val), diagonal=-mask.cache_len)
            mask.set_input_mask(input_mask)
        if isinstance(tokens, list):
            tokens = torch.tensor([tokens], dtype=torch.int32)
        all_logits = None
        for i in range(0, tokens.size(1), self.input_len):
            logits = self._run_once(model, tokens[:, i : i + self.input_len])
            all_logits = logits if all_logits is None else torch.cat([all_logits, logits], dim=1)
        return all_logits[:, : tokens.size(1), :]

    def _run_once(self, model, tokens):
        n_tokens = tokens.size(1)
        logits, k_out, v_out = model(tokens, self.masks, self.k_caches, self.v_caches)
        for layer_id in self.k_caches:
            self.k_caches[layer_id] = apply_update(self.k_caches[layer_id], k_out[layer_id][..., :n_tokens, :])
            self.v_caches[layer_id] = apply_update(self.v_caches[layer_id], v_out[layer_id][..., :n_tokens, :])
        for mask in self._masks.values():
            mask.unmask(n_tokens)
        self.pos += n_tokens
        return logits


def main():
    config = ModelArgs()
    model = Transformer(config, cache_lens=[2, 8]).eval()
    mgr = StaticAttentionIOManager(config, input_len=6, cache_lens=[2, 8])
    tokens = torch.randint(0, config.vocab_size, (6,)).tolist()
    with torch.no_grad():
        logits = mgr.prefill(model, tokens)
    print("next token", int(logits[0, -1].argmax()), "logit checksum", round(float(logits.abs().sum()), 3))


if __name__ == "__main__":
    main()
