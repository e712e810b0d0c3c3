# huggingface/transformers#47496 ("`DataCollatorWithFlattening` uses 0-based `position_ids`, silently degrading
# RoBERTa-family models"), fixed by huggingface/transformers#47525 ("Allow position_ids_start=2 on
# DataCollatorWithFlattening for RoBERTa etc.").
# Bug: the padding-free collator flattens the batch into one row and numbers every packed sequence's positions
# from 0. XLM-R / RoBERTa number positions from padding_idx + 1 (2), so the packed row reads position embeddings
# shifted by two (rows 0 and 1 being the reserved / padding rows) and the sentence embeddings are silently worse.
# Fix: `position_ids_start` (2 for RoBERTa-like models) on the collator, and the varlen boundaries found from
# `position_ids == position_ids.min()` instead of `position_ids == 0`.
# The flash_attn_varlen_func call is stood in for by a plain-torch loop over cu_seqlens (SDPA per segment).
import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import AttentionInterface, XLMRobertaConfig, XLMRobertaModel
from transformers.data.data_collator import DefaultDataCollator

FIXED = "--fixed" in sys.argv


@dataclass
class DataCollatorWithFlattening(DefaultDataCollator):
    def __init__(self, *args, return_position_ids=True, separator_id=-100, position_ids_start=0, **kwargs):
        super().__init__(*args, **kwargs)
        self.return_position_ids = return_position_ids
        self.separator_id = separator_id
        self.position_ids_start = position_ids_start

    def __call__(self, features, return_tensors=None, separator_id=None):
        if separator_id is None:
            separator_id = self.separator_id
        batch = {"input_ids": [], "labels": []}
        if self.return_position_ids:
            batch.update({"position_ids": []})
        for sample in features:
            input_ids = sample["input_ids"]
            batch["input_ids"] += input_ids
            batch["labels"] += [separator_id] + input_ids[1:]
            if self.return_position_ids:
                if FIXED:
                    batch["position_ids"] += [self.position_ids_start + i for i in range(len(input_ids))]
                else:
                    batch["position_ids"] += list(range(len(input_ids)))
        return {k: torch.tensor([v], dtype=torch.int64) for k, v in batch.items()}


def prepare_fa_kwargs_from_position_ids(position_ids):
    tensor_kwargs = {"dtype": torch.int32, "device": position_ids.device}
    position_ids = position_ids.reshape(-1)
    if FIXED:
        indices_q = (position_ids == position_ids.min()).nonzero().view(-1)
    else:
        indices_q = (position_ids == 0).nonzero().view(-1)
    cu_seq_lens_q = torch.cat((indices_q.to(**tensor_kwargs), torch.tensor(position_ids.size(), **tensor_kwargs)))
    max_length_q = cu_seq_lens_q.diff().max()
    return (cu_seq_lens_q, cu_seq_lens_q), (max_length_q, max_length_q)


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, softmax_scale, causal):
    # q, k, v: (total_tokens, heads, head_dim)
    out = torch.empty_like(q)
    for i in range(len(cu_seqlens_q) - 1):
        s, e = int(cu_seqlens_q[i]), int(cu_seqlens_q[i + 1])
        o = F.scaled_dot_product_attention(
            q[s:e].transpose(0, 1), k[s:e].transpose(0, 1), v[s:e].transpose(0, 1),
            scale=softmax_scale, is_causal=causal,
        )
        out[s:e] = o.transpose(0, 1)
    return out


def varlen_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    # query: (1, heads, total, head_dim) for a flattened batch
    cu_seqlens, max_seqlen = kwargs["cu_seq_lens_q"], kwargs["max_length_q"]
    q, k, v = (t.squeeze(0).transpose(0, 1) for t in (query, key, value))
    out = flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, scaling, False)
    return out.unsqueeze(0), None


AttentionInterface.register("varlen_ref", varlen_attention_forward)


def mean_pool_packed(token_embeddings, cu_seqlens):
    return torch.stack(
        [token_embeddings[0, int(s):int(e)].mean(0) for s, e in zip(cu_seqlens[:-1], cu_seqlens[1:])]
    )


def main():
    torch.manual_seed(0)
    config = XLMRobertaConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=40, pad_token_id=1, bos_token_id=0, eos_token_id=2,
        attn_implementation="varlen_ref",
    )
    model = XLMRobertaModel(config, add_pooling_layer=False).eval()

    sentences = [[0, 15, 27, 33, 2], [0, 44, 9, 61, 72, 18, 2], [0, 5, 2]]
    padding_idx = model.embeddings.padding_idx
    collator = DataCollatorWithFlattening(return_position_ids=True, position_ids_start=padding_idx + 1)
    batch = collator([{"input_ids": s} for s in sentences])

    (cu_seq_lens_q, cu_seq_lens_k), (max_length_q, max_length_k) = prepare_fa_kwargs_from_position_ids(
        batch["position_ids"]
    )
    with torch.no_grad():
        out = model(
            input_ids=batch["input_ids"], position_ids=batch["position_ids"],
            cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k,
            max_length_q=max_length_q, max_length_k=max_length_k,
        )
    embeddings = F.normalize(mean_pool_packed(out.last_hidden_state, cu_seq_lens_q), dim=-1)
    print("position_ids:", batch["position_ids"].tolist())
    print("cu_seqlens:", cu_seq_lens_q.tolist())
    print("similarity:\n", (embeddings @ embeddings.T).numpy().round(4))


if __name__ == "__main__":
    main()
