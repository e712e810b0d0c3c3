"""A decode step over a batch of requests of different lengths, one request at a time (a paged engine's token
attention written in torch, after LightLLM's token_attention_softmax_and_reducev): each request's scores (heads, n)
are softmaxed over its own n cached tokens and weigh its values with einsum('hn,nhd->hd'). Correct: the rows the
softmax pools are one request's heads, and every position it weighs is one of that request's tokens; the lengths of
all the requests (`b_seq_len`) are held beside it. Each prompt was prefilled alone, with SDPA.
"""

import torch
import torch.nn.functional as F

torch.manual_seed(0)
HEADS, DIM = 4, 8


def token_attention(q, k_cache, v_cache, b_seq_len):
    out = torch.empty(len(b_seq_len), HEADS, DIM)
    for b in range(len(b_seq_len)):
        n = int(b_seq_len[b])
        scores = ((q[b][None] * k_cache[b, :n]).sum(-1) / DIM ** 0.5).T  # (heads, n), as the kernel's loads sum them
        weights = torch.softmax(scores, dim=-1)
        out[b] = torch.einsum("hn,nhd->hd", weights, v_cache[b, :n])
    return out


def prefill(prompts, b_seq_len):
    """Each request's prompt attended alone (causal), its keys and values cached."""
    k_cache, v_cache = torch.zeros(len(b_seq_len), 6, HEADS, DIM), torch.zeros(len(b_seq_len), 6, HEADS, DIM)
    for b in range(len(b_seq_len)):
        n = int(b_seq_len[b])
        q, k, v = (x[b, :n].transpose(0, 1)[None] for x in prompts)
        F.scaled_dot_product_attention(q, k, v, is_causal=True)
        k_cache[b, :n], v_cache[b, :n] = k[0].transpose(0, 1), v[0].transpose(0, 1)
    return k_cache, v_cache


def main():
    b_seq_len = torch.tensor([6, 4])
    k_cache, v_cache = prefill([torch.randn(2, 6, HEADS, DIM) for _ in range(3)], b_seq_len)
    q = torch.randn(2, HEADS, DIM)
    out = token_attention(q, k_cache, v_cache, b_seq_len)
    alone = token_attention(q[1:], k_cache[1:, :4], v_cache[1:, :4], b_seq_len[1:])
    assert torch.allclose(out[1], alone[0], atol=1e-6)
    print("decode output", out.sum().item())


if __name__ == "__main__":
    main()
