"""TGI Gemma 3 prefill: padded custom mask handed to flashinfer's packed-mask API.

Citation: huggingface/text-generation-inference#3324 (commit c6071749, "Fix mask
passed to flashinfer"), read in the upstream git history.

Bug: `FlashGemma3ForConditionalGeneration.get_attention_mask` builds the
prefill mask (causal for text, bidirectional inside an image span) padded to
`[batch_size, 1, max_len, max_len]`. `use_prefill_with_paged_kv_state` passed
it as `custom_mask` to `BatchPrefillWithPagedKVCacheWrapper.plan`, which
expects the *unpadded* masks of every request flattened and concatenated
(`sum(q_len[i] * k_len[i])` entries) and slices request i's block at offset
`sum_{j<i} q_len[j] * k_len[j]`. With requests of different lengths each
request reads a piece of the padded matrix reinterpreted with the wrong row
length, so queries see the wrong keys.

Fix: unpad the mask (`unpad_2d_mask`: take `attention_mask[i, :len, :len]`,
flatten, concatenate) before planning.

This program: the TGI code path in plain torch. The paged KV cache, block
tables, `cu_seqlen_prefill` and slots are TGI's; the flashinfer wrapper is
replaced by a torch port of its documented semantics (flat custom mask read
per request by offset, paged K/V gathered through `paged_kv_indices`), which
runs `F.scaled_dot_product_attention` per request. Two prefill requests of
lengths 5 and 9, each with an image span.
"""
import math
import sys
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

BLOCK_SIZE = 4
ATTENTION = "flashinfer"

prefill_with_paged_kv_state: ContextVar["BatchPrefillWithPagedKVCacheWrapper"] = ContextVar(
    "prefill_with_paged_kv_state"
)


@dataclass
class Gemma3TextConfig:
    hidden_size: int = 32
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 8
    sliding_window: int = 512
    vocab_size: int = 64


@dataclass
class Gemma3Config:
    text_config: Gemma3TextConfig
    image_token_index: int = 63


class BatchPrefillWithPagedKVCacheWrapper:
    """Torch port of flashinfer's paged prefill wrapper (plan/run semantics)."""

    def plan(self, qo_indptr, paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len,
             custom_mask=None, num_qo_heads=None, num_kv_heads=None, head_dim=None,
             page_size=None, **kwargs):
        self.qo_indptr = qo_indptr.tolist()
        self.kv_indptr = paged_kv_indptr.tolist()
        self.kv_indices = paged_kv_indices
        self.last_page_len = paged_kv_last_page_len.tolist()
        self.page_size = page_size
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        # flashinfer flattens the custom mask: one packed block of q_len * kv_len
        # entries per request, concatenated in request order.
        self.custom_mask = None if custom_mask is None else custom_mask.reshape(-1)

    def run(self, q, paged_kv_cache):
        k_cache, v_cache = paged_kv_cache
        out = torch.empty_like(q)
        mask_offset = 0
        for i in range(len(self.qo_indptr) - 1):
            qs, qe = self.qo_indptr[i], self.qo_indptr[i + 1]
            pages = self.kv_indices[self.kv_indptr[i]:self.kv_indptr[i + 1]]
            kv_len = (len(pages) - 1) * self.page_size + self.last_page_len[i]
            k = k_cache[pages].reshape(-1, self.num_kv_heads, k_cache.shape[-1])[:kv_len]
            v = v_cache[pages].reshape(-1, self.num_kv_heads, v_cache.shape[-1])[:kv_len]
            q_len = qe - qs
            if self.custom_mask is not None:
                mask = self.custom_mask[mask_offset:mask_offset + q_len * kv_len].view(q_len, kv_len)
                mask_offset += q_len * kv_len
            else:
                mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
            groups = self.num_qo_heads // self.num_kv_heads
            qh = q[qs:qe].transpose(0, 1)
            kh = k.transpose(0, 1).repeat_interleave(groups, 0)
            vh = v.transpose(0, 1).repeat_interleave(groups, 0)
            o = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask)
            out[qs:qe] = o.transpose(0, 1)
        return out


def unpad_2d_mask(attention_mask: torch.Tensor, seq_lengths: torch.Tensor) -> torch.Tensor:
    # Like torch unpad_sequence, but for 2D masks.
    unpadded_tensors = []
    for i, length in enumerate(seq_lengths):
        unpadded_matrix = attention_mask[i, :length, :length]
        unpadded_tensors.append(unpadded_matrix.flatten())
    return torch.cat(unpadded_tensors)


@contextmanager
def use_prefill_with_paged_kv_state(*, state, block_tables, cu_seqlens, custom_mask,
                                    input_lengths, num_heads, num_kv_heads, head_size,
                                    page_size):
    indptr = torch.zeros(input_lengths.shape[0] + 1, dtype=torch.int32)
    torch.add(input_lengths, page_size - 1, out=indptr[1:])
    indptr[1:].div_(page_size, rounding_mode="floor")
    indptr[1:].cumsum_(-1)

    last_page_len = torch.empty(input_lengths.shape[0], dtype=torch.int32)
    torch.sub(input_lengths, 1, out=last_page_len)
    last_page_len.remainder_(page_size)
    last_page_len += 1

    token = prefill_with_paged_kv_state.set(state)

    if FIXED:
        # Attention masks are padded, unpad.
        if custom_mask is not None:
            bs = input_lengths.shape[0]
            seq_len = math.isqrt(custom_mask.numel() // bs)
            custom_mask = unpad_2d_mask(custom_mask.reshape(bs, seq_len, seq_len), input_lengths)

    try:
        state.plan(
            qo_indptr=cu_seqlens,
            paged_kv_indptr=indptr,
            paged_kv_indices=block_tables,
            paged_kv_last_page_len=last_page_len,
            custom_mask=custom_mask,
            num_qo_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_size,
            page_size=page_size,
        )
        yield
    finally:
        prefill_with_paged_kv_state.reset(token)


def attention(query, kv_cache):
    state = prefill_with_paged_kv_state.get()
    return state.run(query, kv_cache)


class FlashGemma3Attention(torch.nn.Module):
    def __init__(self, config: Gemma3TextConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_key_value_heads = config.num_key_value_heads
        self.head_size = config.head_dim
        self.query_key_value = torch.nn.Linear(
            config.hidden_size, (self.num_heads + 2 * self.num_key_value_heads) * self.head_size, bias=False
        )
        self.o_proj = torch.nn.Linear(self.num_heads * self.head_size, config.hidden_size, bias=False)

    def forward(self, hidden_states, kv_cache, slots, attention_mask):
        qkv = self.query_key_value(hidden_states)
        query, kv = qkv.split(
            [self.head_size * self.num_heads, 2 * self.head_size * self.num_key_value_heads], dim=1
        )
        query = query.view(-1, self.num_heads, self.head_size)
        kv = kv.view(-1, 2, self.num_key_value_heads, self.head_size)
        k_cache, v_cache = kv_cache
        k_cache.view(-1, self.num_key_value_heads, self.head_size)[slots] = kv[:, 0]
        v_cache.view(-1, self.num_key_value_heads, self.head_size)[slots] = kv[:, 1]
        if attention_mask is None or ATTENTION == "flashinfer":
            attn_output = attention(query, kv_cache)
        else:
            raise NotImplementedError("only the flashinfer path is reproduced")
        return self.o_proj(attn_output.reshape(-1, self.num_heads * self.head_size))


class FlashGemma3ForConditionalGeneration(torch.nn.Module):
    def __init__(self, config: Gemma3Config):
        super().__init__()
        self.config = config
        tc = config.text_config
        self.embed_tokens = torch.nn.Embedding(tc.vocab_size, tc.hidden_size)
        self.self_attn = FlashGemma3Attention(tc)

    def get_attention_mask(self, input_ids, cu_seqlen_prefill, dtype, bool_mask=False):
        image_token_mask = (input_ids == self.config.image_token_index).to(input_ids.device)
        device = input_ids.device
        min_dtype = torch.finfo(dtype).min

        lengths = (cu_seqlen_prefill[1:] - cu_seqlen_prefill[:-1]).tolist()
        batch_size = len(lengths)

        sequence_length = max(lengths)
        target_length = sequence_length
        seq_range = torch.arange(sequence_length, device=device).unsqueeze(0)
        lengths_tensor = torch.tensor(lengths, device=device).unsqueeze(1)
        pad_mask = seq_range < lengths_tensor

        causal_mask = torch.tril(torch.ones((sequence_length, sequence_length), dtype=torch.bool, device=device))
        base_mask = pad_mask.unsqueeze(2) & pad_mask.unsqueeze(1)
        base_mask = base_mask & causal_mask.unsqueeze(0)

        image_token_mask = torch.nn.utils.rnn.pad_sequence(
            torch.split(image_token_mask, lengths), batch_first=True, padding_value=0
        )
        bidirectional_mask = image_token_mask.unsqueeze(2) & image_token_mask.unsqueeze(1)

        combined_mask = torch.logical_or(base_mask.unsqueeze(1), bidirectional_mask.unsqueeze(1)).to(device)

        full_attention_mask = torch.zeros(
            (batch_size, 1, sequence_length, target_length), device=device, dtype=torch.bool
        )
        full_attention_mask[:, :, :, :sequence_length] = combined_mask

        if bool_mask:
            return full_attention_mask
        return torch.where(full_attention_mask, 0, min_dtype).to(device)

    def forward(self, input_ids, kv_cache, slots, attention_mask):
        hidden_states = self.embed_tokens(input_ids)
        return self.self_attn(hidden_states, kv_cache, slots, attention_mask)


def main():
    torch.manual_seed(0)
    config = Gemma3Config(text_config=Gemma3TextConfig())
    model = FlashGemma3ForConditionalGeneration(config).eval()
    img = config.image_token_index

    # Two prefill requests (continuous batching), lengths 5 and 9, each with an image span.
    req0 = [5, img, img, 7, 8]
    req1 = [9, 10, img, img, img, 11, 12, 13, 14]
    input_ids = torch.tensor(req0 + req1)
    input_lengths = torch.tensor([len(req0), len(req1)], dtype=torch.int32)
    cache_lengths = torch.zeros(2, dtype=torch.int32)
    cu_seqlen_prefill = torch.tensor([0, len(req0), len(req0) + len(req1)], dtype=torch.int32)

    # Block allocator: request 0 gets blocks [3, 1], request 1 gets [0, 4, 2].
    block_tables_per_req = [[3, 1], [0, 4, 2]]
    block_tables = torch.tensor([b for bt in block_tables_per_req for b in bt], dtype=torch.int32)
    slots = torch.tensor(
        [bt[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
         for bt, n in zip(block_tables_per_req, input_lengths.tolist()) for p in range(n)]
    )
    tc = config.text_config
    num_blocks = 6
    kv_cache = (
        torch.zeros(num_blocks, BLOCK_SIZE, tc.num_key_value_heads, tc.head_dim),
        torch.zeros(num_blocks, BLOCK_SIZE, tc.num_key_value_heads, tc.head_dim),
    )

    attention_mask = model.get_attention_mask(input_ids, cu_seqlen_prefill, torch.float32, bool_mask=True)
    state = BatchPrefillWithPagedKVCacheWrapper()
    with torch.no_grad(), use_prefill_with_paged_kv_state(
        state=state,
        block_tables=block_tables,
        cu_seqlens=cu_seqlen_prefill,
        custom_mask=attention_mask,
        input_lengths=input_lengths + cache_lengths,
        num_heads=tc.num_attention_heads,
        num_kv_heads=tc.num_key_value_heads,
        head_size=tc.head_dim,
        page_size=BLOCK_SIZE,
    ):
        out = model(input_ids, kv_cache, slots, attention_mask)
    print("fixed" if FIXED else "buggy", "prefill output checksum:", round(out.sum().item(), 4))


if __name__ == "__main__":
    main()
