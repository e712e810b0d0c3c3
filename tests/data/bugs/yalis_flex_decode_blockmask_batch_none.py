# axonn-ai/yalis#53 ("Fix Flex Attention Masking"): the decode BlockMask was built with B=None, so the block
# sparsity of batch row 0 (its token_counter) was used for every row of a batch with different lengths.
import sys
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

warnings.filterwarnings("ignore")
FIXED = "--fixed" in sys.argv


# ---- yalis/attention/masking.py ----
def flex_decode_mask(token_counter):
    def _inner_mask(b, h, q_idx, kv_idx):
        return (kv_idx <= token_counter[b])
    return _inner_mask


def create_causal_block_mask_for_flex_attention(token_counter, kv_len, batch_size):
    if FIXED:
        return create_block_mask(flex_decode_mask(token_counter), B=batch_size, H=None, Q_LEN=1, KV_LEN=kv_len,
                                 device="cpu")
    return create_block_mask(flex_decode_mask(token_counter), B=None, H=None, Q_LEN=1, KV_LEN=kv_len, device="cpu")


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, max_batch_size, kv_length):
        super().__init__()
        self.n_head, self.head_dim = n_head, n_embd // n_head
        self.c_attn = nn.Linear(n_embd, 3 * n_embd, bias=False)
        self.c_proj = nn.Linear(n_embd, n_embd, bias=False)
        self.register_buffer("k_cache", torch.zeros(max_batch_size, n_head, kv_length, self.head_dim))
        self.register_buffer("v_cache", torch.zeros(max_batch_size, n_head, kv_length, self.head_dim))

    def forward(self, x, phase, token_counter, flex_attention_block_mask=None, batch_idx=None):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if phase == "prefill":  # one sequence at a time, positions 0..T-1
            self.k_cache[batch_idx, :, :T] = k[0]
            self.v_cache[batch_idx, :, :T] = v[0]
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # decode: one new token per sequence, written at token_counter[b]
            rows = torch.arange(B)
            self.k_cache[rows, :, token_counter] = k[:, :, 0]
            self.v_cache[rows, :, token_counter] = v[:, :, 0]
            y = flex_attention(q, self.k_cache[:B], self.v_cache[:B], block_mask=flex_attention_block_mask)
        return self.c_proj(y.transpose(1, 2).reshape(B, T, C))


class GPT(nn.Module):
    def __init__(self, vocab=64, n_embd=32, n_head=4, n_layer=2, max_batch_size=2, kv_length=384):
        super().__init__()
        self.kv_length = kv_length
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(kv_length, n_embd)
        self.h = nn.ModuleList([CausalSelfAttention(n_embd, n_head, max_batch_size, kv_length) for _ in range(n_layer)])
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.token_counter = None

    def forward(self, idx, phase, batch_idx=None):
        if phase == "prefill":
            pos = torch.arange(idx.size(1))
        else:
            pos = self.token_counter[:, None]
        x = self.wte(idx) + self.wpe(pos)
        B = x.size(0)
        mask = create_causal_block_mask_for_flex_attention(self.token_counter, self.kv_length, B) \
            if phase == "decode" else None
        for block in self.h:
            x = x + block(x, phase, self.token_counter, mask, batch_idx)
        return self.lm_head(x)


@torch.no_grad()
def main():
    torch.manual_seed(0)
    model = GPT().eval()
    prompts = [torch.randint(0, 64, (5,)), torch.randint(0, 64, (200,))]
    next_tok = torch.tensor([[7], [9]])

    for i, p in enumerate(prompts):  # prefill
        model(p[None], "prefill", batch_idx=i)
    model.token_counter = torch.tensor([len(p) for p in prompts])
    decode_logits = model(next_tok, "decode")[:, -1]

    for i, p in enumerate(prompts):  # reference: prefill of prompt + new token
        ref = model(torch.cat([p, next_tok[i]])[None], "prefill", batch_idx=i)[0, -1]
        print(f"seq {i} (len {len(p)}): max |decode - full prefill| = {(decode_logits[i] - ref).abs().max().item():.6f}")


if __name__ == "__main__":
    main()
