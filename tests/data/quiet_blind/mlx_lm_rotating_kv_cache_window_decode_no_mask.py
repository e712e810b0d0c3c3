"""mlx-lm RotatingKVCache ported to torch: a ring buffer holding exactly the window, decode with no mask.

Follows ml-explore/mlx-examples llms/mlx_lm/models/cache.py (RotatingKVCache: max_size, _update_concat
for prompts, _update_in_place writes at self._idx and wraps) and llms/mlx_lm/models/base.py
(create_attention_mask returns None for a single token; create_causal_mask(N, offset, window_size) =
`linds >= rinds` and `linds < rinds + window_size`). Mistral-style sliding window W = max_size.

Mask meant: query at absolute position p sees keys p-W+1 .. p (W keys including itself). In prefill the
window is an explicit mask. In decode the buffer holds exactly the last W keys, all of which are in the
window, so the single query attends the whole buffer unmasked, in ring order (the order of keys does
not matter to softmax; RoPE was applied before the keys were written).
"""
import torch
import torch.nn.functional as F

torch.manual_seed(0)


class ModelArgs:
    hidden_size = 16
    num_attention_heads = 2
    sliding_window = 5
    rope_theta = 10000.0


def rope(x, offset):
    d = x.shape[-1] // 2
    pos = torch.arange(offset, offset + x.shape[-2]).float()
    ang = pos[:, None] / (ModelArgs.rope_theta ** (torch.arange(d) / d))
    return torch.cat([x[..., :d] * ang.cos() - x[..., d:] * ang.sin(), x[..., :d] * ang.sin() + x[..., d:] * ang.cos()], -1)


def create_causal_mask(N, offset=0, window_size=None):
    rinds = torch.arange(offset + N)
    linds = torch.arange(offset, offset + N)[:, None]
    mask = linds >= rinds
    if window_size is not None:
        mask = mask & (linds < rinds + window_size)
    return mask


class RotatingKVCache:
    def __init__(self, max_size):
        self.max_size = max_size
        self.keys = self.values = None
        self.offset = 0
        self._idx = 0

    def update_and_fetch(self, keys, values):
        if keys.shape[2] == 1:
            return self._update_in_place(keys, values)
        return self._update_concat(keys, values)

    def _update_concat(self, keys, values):
        # a fresh prompt: keep all of it for this call, the mask limits each query to its window
        self.keys, self.values = keys, values
        self.offset += keys.shape[2]
        self._idx = self.keys.shape[2]
        return self.keys, self.values

    def _update_in_place(self, keys, values):
        if self.keys.shape[2] > self.max_size:
            # after a long prompt, keep only the last max_size keys, oldest first
            self.keys = self.keys[..., -self.max_size:, :]
            self.values = self.values[..., -self.max_size:, :]
            self._idx = self.max_size
        if self._idx == self.max_size:
            self._idx = 0
        if self.keys.shape[2] < self.max_size:
            self.keys = torch.cat([self.keys, keys], 2)
            self.values = torch.cat([self.values, values], 2)
        else:
            self.keys[..., self._idx:self._idx + 1, :] = keys
            self.values[..., self._idx:self._idx + 1, :] = values
        self.offset += 1
        self._idx += 1
        return self.keys, self.values


class Attention(torch.nn.Module):
    def __init__(self, args):
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.wqkv = torch.nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=False)

    def forward(self, x, mask, cache):
        B, L, D = x.shape
        q, k, v = self.wqkv(x).view(B, L, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = rope(q, cache.offset), rope(k, cache.offset)
        k, v = cache.update_and_fetch(k, v)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, L, D)


def create_attention_mask(h, cache):
    T = h.shape[1]
    if T > 1:
        return create_causal_mask(T, cache.offset, window_size=cache.max_size)
    return None


def main():
    args = ModelArgs()
    attn = Attention(args)
    cache = RotatingKVCache(max_size=args.sliding_window)
    prompt, steps = 8, 9
    x = torch.randn(1, prompt + steps, args.hidden_size)

    with torch.no_grad():
        outs = [attn(x[:, :prompt], create_attention_mask(x[:, :prompt], cache), cache)]
        for t in range(prompt, prompt + steps):
            h = x[:, t:t + 1]
            outs.append(attn(h, create_attention_mask(h, cache), cache))
            assert cache.keys.shape[2] == args.sliding_window
        got = torch.cat(outs, 1)

        # reference: the whole sequence at once, window by a double loop over absolute positions
        n = prompt + steps
        allowed = torch.zeros(n, n, dtype=torch.bool)
        for i in range(n):
            for j in range(n):
                allowed[i, j] = i - args.sliding_window < j <= i
        q, k, v = attn.wqkv(x).view(1, n, 3, 2, -1).permute(2, 0, 3, 1, 4)
        ref = F.scaled_dot_product_attention(rope(q, 0), rope(k, 0), v, attn_mask=allowed).transpose(1, 2).reshape(1, n, -1)
    assert torch.allclose(got, ref, atol=1e-5)
    print("window", args.sliding_window, "tokens", n, "cache slots", cache.keys.shape[2])


if __name__ == "__main__":
    main()
