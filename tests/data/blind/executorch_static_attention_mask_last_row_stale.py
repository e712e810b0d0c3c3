"""ExecuTorch static attention IO manager: set_causal_mask leaves the last input row untouched.

Citation: pytorch/executorch#13332 (commit ee13aa053b), "Static attention IO manager: fix causal
mask bug for last input position" ("The last input should have the entire mask cleared"). In
examples/models/llama/runner/static_attention_io_manager.h, `StaticAttentionMask::set_causal_mask`
wrote the new-token block of rows `i < input_len_ - 1` only. The mask buffer lives as long as the
IO manager (`get_mask(input_len)` hands back the same object every call) and `reset()` clears only
the cache columns, so the last row keeps whatever was there before: uninitialised memory, or the
lookahead-decoding pattern `set_lookahead_decoding_mask` wrote during an earlier request. The fix
loops `i < input_len_`.

This program ports the runner's mask object and its calls to torch (the exported model takes the
mask as an input tensor and adds it to q @ k^T before softmax, as static_attention.py does):
request 1 prefills and runs lookahead decoding (ngram_size=3, window_size=2, no verification
branches: input_len 4), the manager is reset, request 2 prefills a 4-token chunk. With the bug the
chunk's last query keeps the lookahead row [0, 0, mask, 0] over the new tokens and misses key 2.
The lookahead loop is trimmed to greedy acceptance of the first position (the n-gram verification
logic does not touch the mask).
"""
import sys

import torch
import torch.nn as nn

FIXED = "--fixed" in sys.argv


class StaticAttentionMask:
    """Port of the C++ StaticAttentionMask (SMART_MASK style): rows are inputs, cache then input columns."""

    def __init__(self, cache_len, input_len, zero_val=0.0, mask_val=float("-inf")):
        self.cache_len, self.input_len = cache_len, input_len
        self.zero_val, self.mask_val = zero_val, mask_val
        # The C++ allocator hands back uninitialised memory; a fresh zeroed page reads as zero_val.
        self.data = torch.zeros(input_len, cache_len + input_len)
        self.reset()

    def reset(self):
        self.cache_valid_len = 0
        self.data[:, : self.cache_len] = self.mask_val

    def unmask(self, update_n):
        update_n = min(update_n, self.cache_len - self.cache_valid_len)
        if update_n > 0:
            self.data[:, self.cache_valid_len : self.cache_valid_len + update_n] = self.zero_val
            self.cache_valid_len += update_n

    def set_causal_mask(self):
        rows = self.input_len if FIXED else self.input_len - 1
        for i in range(rows):
            c = self.cache_len
            self.data[i, c : c + 1 + i] = self.zero_val
            self.data[i, c + 1 + i : c + self.input_len] = self.mask_val

    def get(self):
        return self.data


def set_lookahead_decoding_mask(mask, input_len, cache_len, ngram_size, window_size, n_verifications):
    sub = mask.get()[:, cache_len:]
    sub[0, 0] = mask.zero_val
    sub[:input_len, :input_len] = mask.mask_val
    for i in range(ngram_size - 1):
        r = window_size * i
        for a in range(window_size):
            sub[r + a, : a + 1] = mask.zero_val
        for j in range(1, i + 1):
            for a in range(window_size):
                sub[r + a, window_size * j + a] = mask.zero_val
    verification_offset = max(window_size * (ngram_size - 1), 1)
    for i in range(n_verifications):
        b = verification_offset + i * (ngram_size - 1)
        for a in range(ngram_size - 1):
            sub[b + a, b : b + a + 1] = mask.zero_val
    for i in range(verification_offset, input_len):
        sub[i, 0] = mask.zero_val


class StaticAttention(nn.Module):
    def __init__(self, dim, n_heads):
        super().__init__()
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.wq = nn.Linear(dim, dim, bias=False)
        self.wk = nn.Linear(dim, dim, bias=False)
        self.wv = nn.Linear(dim, dim, bias=False)
        self.wo = nn.Linear(dim, dim, bias=False)

    def forward(self, x, k_cache, v_cache, mask):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        all_k = torch.cat([k_cache, k], dim=2)
        all_v = torch.cat([v_cache, v], dim=2)
        attn = q @ all_k.transpose(-2, -1) * self.head_dim ** -0.5
        attn = attn + mask
        attn = torch.softmax(attn.float(), dim=-1)
        return self.wo((attn @ all_v).transpose(1, 2).reshape(b, t, -1)), k, v


class StaticTransformer(nn.Module):
    def __init__(self, vocab=50, dim=16, n_heads=2, n_layers=2):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(StaticAttention(dim, n_heads) for _ in range(n_layers))
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, mask, k_caches, v_caches):
        h = self.tok_embeddings(tokens)
        k_out, v_out = [], []
        for layer, kc, vc in zip(self.layers, k_caches, v_caches):
            a, k, v = layer(h, kc, vc, mask)
            h = h + a
            k_out.append(k)
            v_out.append(v)
        return self.output(h), k_out, v_out


class StaticAttentionIOManager:
    def __init__(self, model, cache_len, input_len, n_layers=2, n_heads=2, head_dim=8):
        self.model, self.cache_len, self.input_len = model, cache_len, input_len
        self.k_caches = [torch.zeros(1, n_heads, cache_len, head_dim) for _ in range(n_layers)]
        self.v_caches = [torch.zeros(1, n_heads, cache_len, head_dim) for _ in range(n_layers)]
        self.masks = {input_len: StaticAttentionMask(cache_len, input_len)}

    def get_mask(self, input_len):
        return self.masks[input_len]

    def reset(self):
        for c in self.k_caches + self.v_caches:
            c.zero_()
        for m in self.masks.values():
            m.reset()

    def _execute(self, input_buffer, mask):
        return self.model(input_buffer, mask.get(), self.k_caches, self.v_caches)

    def update(self, k_out, v_out, update_n, mask):
        pos = mask.cache_valid_len
        n = min(update_n, self.cache_len - pos)
        for kc, vc, k, v in zip(self.k_caches, self.v_caches, k_out, v_out):
            kc[:, :, pos : pos + n] = k[:, :, :n]
            vc[:, :, pos : pos + n] = v[:, :, :n]
        mask.unmask(update_n)

    def prefill(self, tokens):
        mask = self.get_mask(self.input_len)
        mask.set_causal_mask()
        batch_len, logits = 0, None
        for i in range(0, len(tokens), self.input_len):
            chunk = tokens[i : i + self.input_len]
            batch_len = len(chunk)
            input_buffer = torch.tensor([chunk + [0] * (self.input_len - batch_len)])
            logits, k_out, v_out = self._execute(input_buffer, mask)
            self.update(k_out, v_out, batch_len, mask)
        return logits[0, batch_len - 1].argmax().item()

    def lookahead_decode(self, prev_tok, n_steps, ngram_size=3, window_size=2, n_verifications=0):
        mask = self.get_mask(self.input_len)
        set_lookahead_decoding_mask(mask, self.input_len, self.cache_len, ngram_size, window_size, n_verifications)
        generated = []
        input_buffer = torch.full((1, self.input_len), prev_tok)
        for _ in range(n_steps):
            input_buffer[0, 0] = prev_tok
            logits, k_out, v_out = self._execute(input_buffer, mask)
            self.update(k_out, v_out, 1, mask)
            prev_tok = logits[0, 0].argmax().item()
            generated.append(prev_tok)
        return generated


def main():
    torch.manual_seed(0)
    model = StaticTransformer().eval()
    io = StaticAttentionIOManager(model, cache_len=12, input_len=4)
    with torch.no_grad():
        tok = io.prefill([3, 14, 15, 9])
        first = io.lookahead_decode(tok, n_steps=2)
        io.reset()
        second = io.prefill([21, 1, 38, 12])
    print("fixed" if FIXED else "buggy", "request 1", first, "request 2 next token", second)
    print("request 2 mask, last row over the new tokens:", io.get_mask(4).get()[-1, -4:].tolist())


if __name__ == "__main__":
    main()
