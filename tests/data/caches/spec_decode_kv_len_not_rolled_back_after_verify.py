"""A hand-written speculative decoding loop (Medusa / EAGLE style, one sequence): the verify forward writes the 4
drafted tokens' keys into a preallocated cache with `index_copy_` and advances `kv_len` by 4; only 2 drafts are
accepted, and the next decode writes the new token's key at the slot after the accepted ones, but `kv_len`, which the
additive (0 / -inf) mask is built from, is never brought back, so the new token attends the 2 rejected drafts' keys.
The same bug as vllm-ascend#14883 (draft steps reusing the verify step's seq_lens), written another way.
Fix: kv_len -= rejected after verification.

    python spec_decode_kv_len_not_rolled_back_after_verify.py [--fixed]
"""
import sys

import torch

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

H, D, VOCAB, CAPACITY = 2, 8, 40, 20


class Decoder(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, H * D)
        self.wq = torch.nn.Linear(H * D, H * D)
        self.wk = torch.nn.Linear(H * D, H * D)
        self.wv = torch.nn.Linear(H * D, H * D)
        self.head = torch.nn.Linear(H * D, VOCAB)
        self.register_buffer("k_buf", torch.randn(1, H, CAPACITY, D))  # an arena reused across requests: old keys
        self.register_buffer("v_buf", torch.randn(1, H, CAPACITY, D))
        self.kv_len = 0

    def step(self, ids, write_at):
        t = ids.shape[1]
        x = self.emb(ids)
        q, k, v = (w(x).view(1, t, H, D).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        slots = torch.arange(write_at, write_at + t)
        self.k_buf.index_copy_(2, slots, k)
        self.v_buf.index_copy_(2, slots, v)
        self.kv_len = max(self.kv_len, write_at + t)
        key = torch.arange(CAPACITY)
        visible = (key[None, :] < self.kv_len) & (key[None, :] <= slots[:, None])
        if t == 1:
            visible = key[None, :] < self.kv_len                  # decode: every cached key
        bias = torch.zeros(t, CAPACITY).masked_fill(~visible, float("-inf"))
        scores = (q @ self.k_buf.transpose(-1, -2)) / D ** 0.5 + bias
        out = torch.nn.functional.scaled_dot_product_attention(q, self.k_buf, self.v_buf, attn_mask=bias)
        return self.head(out.transpose(1, 2).reshape(1, t, H * D)), scores


@torch.no_grad()
def main():
    model = Decoder().eval()
    prompt = torch.randint(1, VOCAB, (1, 6))
    model.step(prompt, 0)                                           # prefill: slots 0-5
    drafts = torch.randint(1, VOCAB, (1, 4))
    model.step(drafts, 6)                                           # verify: slots 6-9, kv_len 10
    accepted = 2
    if FIXED:
        model.kv_len -= 4 - accepted
    nxt = torch.randint(1, VOCAB, (1, 1))
    logits, _ = model.step(nxt, 6 + accepted)                       # the bonus token at slot 8
    logits, _ = model.step(logits[:, -1:].argmax(-1), 6 + accepted + 1)
    print(f"fixed={FIXED} next={logits[0, -1].argmax().item()}")


if __name__ == "__main__":
    main()
