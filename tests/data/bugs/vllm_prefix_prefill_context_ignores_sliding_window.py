"""vLLM prefix-prefill kernel attends to every cached context token, ignoring the sliding window.

Citation: vllm-project/vllm#4405 ("[kernel] fix sliding window in prefix prefill Triton kernel", merged
2024-04-30), file vllm/attention/ops/prefix_prefill.py. The review thread shows the hunk in the loop over
the cached context blocks:

             qk += tl.dot(q, k)
             qk = tl.where((start_n + offs_n[None, :]) < cur_batch_ctx_len, qk,
                           float("-inf"))
    +            if SLIDING_WINDOW > 0:
    +                # We can't use -inf here, because the
    +                # sliding window may lead to the entire row being masked.
    +                # This then makes m_ij contain -inf, which causes NaNs in
    +                # exp().
    +                qk = tl.where((cur_batch_ctx_len + offs_m[:, None]) -
    +                              (start_n + offs_n[None, :]) < SLIDING_WINDOW, qk,
    +                              -10000)

Bug: with prefix caching / chunked prefill, the new tokens of a request attend to the request's cached
context through the paged KV cache. The kernel only masked context slots past ctx_len, so a
sliding-window model (Mistral-style config.sliding_window) let new queries see cached keys far older
than the window. Fix: also mask context keys whose distance to the query is >= SLIDING_WINDOW.
I read the PR's review thread (this hunk and the added test parameter SLIDING_WINDOW = [0, 512]), not
the whole diff; whether the fix also touched the new-token loop I could not see, so this program keeps
every request's new tokens shorter than the window, where that loop needs no window mask.

Reproduction: a torch port of context_attention_fwd (one program per request instead of per block; the
kernel's two key loops, context from the paged cache through the block table b_loc, then the new
tokens causally, joined in one softmax over q @ k^T scores). Two requests with 10 and 6 cached tokens
and 3 and 2 new tokens, sliding_window=4, block_size=4.
"""
import sys

import torch

FIXED = "--fixed" in sys.argv


def context_attention_fwd(q, k, v, o, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, b_ctx_len,
                          max_input_len, alibi_slopes=None, sliding_window=None):
    """q, k, v, o: [num_new_tokens, heads, head_size]; k_cache/v_cache: [num_blocks, block, heads, d]."""
    block_size = k_cache.shape[1]
    sm_scale = 1.0 / (q.shape[-1] ** 0.5)
    SLIDING_WINDOW = sliding_window if sliding_window is not None else 0
    for cur_batch in range(b_seq_len.shape[0]):
        cur_batch_ctx_len = int(b_ctx_len[cur_batch])
        cur_batch_seq_len = int(b_seq_len[cur_batch])
        cur_batch_query_len = cur_batch_seq_len - cur_batch_ctx_len
        cur_batch_in_all_start_index = int(b_start_loc[cur_batch])
        qs = slice(cur_batch_in_all_start_index, cur_batch_in_all_start_index + cur_batch_query_len)
        q_b = q[qs].transpose(0, 1)                       # [H, M, D]
        offs_m = torch.arange(cur_batch_query_len)

        # loop 1: cached context, read block by block through the block table
        num_ctx_blocks = (cur_batch_ctx_len + block_size - 1) // block_size
        blocks = b_loc[cur_batch, :num_ctx_blocks]
        k_ctx = k_cache[blocks].reshape(-1, *k_cache.shape[2:])   # [N, H, D]
        v_ctx = v_cache[blocks].reshape(-1, *v_cache.shape[2:])
        offs_n = torch.arange(k_ctx.shape[0])
        qk_ctx = torch.einsum("hmd,nhd->hmn", q_b, k_ctx) * sm_scale
        qk_ctx = torch.where(offs_n[None, :] < cur_batch_ctx_len, qk_ctx, float("-inf"))
        if FIXED and SLIDING_WINDOW > 0:
            qk_ctx = torch.where((cur_batch_ctx_len + offs_m[:, None]) - offs_n[None, :] < SLIDING_WINDOW,
                                 qk_ctx, -10000)

        # loop 2: the new tokens themselves, causal
        k_new = k[qs]
        v_new = v[qs]
        qk_new = torch.einsum("hmd,nhd->hmn", q_b, k_new) * sm_scale
        qk_new = torch.where(offs_m[:, None] >= offs_m[None, :], qk_new, float("-inf"))

        p = torch.softmax(torch.cat([qk_ctx, qk_new], dim=-1), dim=-1)
        v_all = torch.cat([v_ctx, v_new], dim=0)           # [N + M, H, D]
        o[qs] = torch.einsum("hmn,nhd->mhd", p, v_all)
    return o


def main():
    torch.manual_seed(0)
    model_config = {"num_heads": 2, "head_size": 8, "sliding_window": 4}
    block_size, num_blocks = 4, 8
    H, D = model_config["num_heads"], model_config["head_size"]
    ctx_lens = [10, 6]
    query_lens = [3, 2]
    k_cache = torch.randn(num_blocks, block_size, H, D)
    v_cache = torch.randn(num_blocks, block_size, H, D)
    # block tables: request 0 owns blocks 5, 2, 7; request 1 owns blocks 1, 4
    b_loc = torch.tensor([[5, 2, 7], [1, 4, 0]])
    b_ctx_len = torch.tensor(ctx_lens)
    b_seq_len = torch.tensor([c + q for c, q in zip(ctx_lens, query_lens)])
    b_start_loc = torch.tensor([0, query_lens[0]])
    n = sum(query_lens)
    q = torch.randn(n, H, D)
    k = torch.randn(n, H, D)
    v = torch.randn(n, H, D)
    o = torch.empty_like(q)
    context_attention_fwd(q, k, v, o, k_cache, v_cache, b_loc, b_start_loc, b_seq_len, b_ctx_len,
                          max(query_lens), sliding_window=model_config["sliding_window"])
    print("o[0,0,:3]", [round(x, 4) for x in o[0, 0, :3].tolist()])


if __name__ == "__main__":
    main()
