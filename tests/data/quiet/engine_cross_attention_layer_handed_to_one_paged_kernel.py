"""A module-less engine backend (the layout of vLLM's and SGLang's encoder-decoder support) whose decoder
self-attention and cross-attention go through one paged kernel, told apart only by the layer object handed to it.

Written for maskcli's tests (trace/crossing.py, checks/reqlens.py). Each layer is a plain object stating its
`attn_type` ("decoder", or vLLM's "encoder_decoder" for a cross-attention); one metadata object per step states every
request's new tokens (`query_start_loc`), its own keys (`seq_lens`) and its encoder's (`encoder_seq_lens`). The
backend's `forward(q, layer, metadata)` hands the kernel the request's own slots and `seq_lens` for a decoder layer,
its encoder's slots and `encoder_seq_lens` for a cross-attention. Correct: every request attends its own keys, and
its cross-attention its own encoder output, whose count is no decoder key count.
"""
from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    encoder_seq_lens: torch.Tensor
    slots: list
    encoder_slots: list


class Layer:
    def __init__(self, layer_id, attn_type):
        self.layer_id, self.attn_type = layer_id, attn_type


def paged_attention(q, k_pool, v_pool, slots, lens, cu_q, causal):
    """Per request: its queries against the first `lens[i]` of its slots (bottom-right causal where asked)."""
    out = torch.empty_like(q)
    for i in range(len(slots)):
        start, end = int(cu_q[i]), int(cu_q[i + 1])
        taken = slots[i][: int(lens[i])]
        k, v = k_pool[taken], v_pool[taken]  # (keys, heads, dim)
        scores = torch.einsum("qhd,khd->hqk", q[start:end], k) * q.shape[-1] ** -0.5
        n_q, n_k = end - start, k.shape[0]
        keep = torch.ones(n_q, n_k, dtype=torch.bool)
        if causal:
            keep = keep.tril(n_k - n_q)
        weights = torch.softmax(scores.masked_fill(~keep, float("-inf")), dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", weights, v)
    return out


class Backend:
    def __init__(self, pools):
        self.pools = pools

    def forward(self, q, layer, metadata):
        k_pool, v_pool = self.pools[layer.layer_id]
        if layer.attn_type == "encoder_decoder":
            return paged_attention(q, k_pool, v_pool, metadata.encoder_slots, metadata.encoder_seq_lens,
                                   metadata.query_start_loc, causal=False)
        return paged_attention(q, k_pool, v_pool, metadata.slots, metadata.seq_lens, metadata.query_start_loc,
                               causal=True)


torch.manual_seed(0)
heads, dim = 2, 8
encoder_lens, decoder_lens = [6, 3, 9], [4, 5, 2]
pools = {0: (torch.randn(64, heads, dim), torch.randn(64, heads, dim)),
         1: (torch.randn(64, heads, dim), torch.randn(64, heads, dim))}
slots, encoder_slots, free = [], [], 1
for n, e in zip(decoder_lens, encoder_lens):  # each request's encoder output, then room for its decoder tokens
    encoder_slots.append(list(range(free, free + e)))
    slots.append(list(range(free + e, free + e + n + 1)))
    free += e + n + 1
backend = Backend(pools)
self_layer, cross_layer = Layer(0, "decoder"), Layer(1, "encoder_decoder")
# step 1 prefills every request's prompt (its decoder tokens); step 2 decodes one token each
steps = [(decoder_lens, decoder_lens), ([1, 1, 1], [n + 1 for n in decoder_lens])]
with torch.no_grad():
    for new, total in steps:
        metadata = AttentionMetadata(query_start_loc=torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()]),
                                     seq_lens=torch.tensor(total), encoder_seq_lens=torch.tensor(encoder_lens),
                                     slots=slots, encoder_slots=encoder_slots)
        q = torch.randn(sum(new), heads, dim)
        h = q + backend.forward(q, self_layer, metadata)
        h = h + backend.forward(h, cross_layer, metadata)
        print("step:", [round(x, 4) for x in h[:, 0, 0].tolist()])
