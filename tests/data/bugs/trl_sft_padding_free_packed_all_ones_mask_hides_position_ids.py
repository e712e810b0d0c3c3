"""TRL SFT padding-free packing: the collator's all-ones attention_mask hides the packed position_ids.

Citation: huggingface/trl#3673 ("[SFT] drop attention_mask if we have position ids for fa2", commit
d1e116c67). I read the diff of trl/trainer/sft_trainer.py (DataCollatorForLanguageModeling.torch_call).

Bug: with packing (BFD) and padding_free=True the dataset rows carry position_ids restarting at 0 for each
packed sequence, and the collator concatenates them into one [1, T] row. It also emitted
attention_mask = ones. Under flash_attention_2, transformers unpads by the attention_mask when one is given
(cu_seqlens = [0, T]) and only derives cu_seqlens from position_ids when there is no mask: "it causes flash
attention to ignore position_ids and compute wrong cu_seq_lens from the all-1s mask", so the packed
sequences attend each other.

Fix: when padding_free and the examples carry packed position_ids, do not create attention_mask.

This program: the collator as TRL wrote it, and a Llama-style model whose flash-attention dispatch is
rendered in torch (cu_seqlens from the mask if given, else from position_ids restarts; the varlen kernel as
a block-diagonal causal mask into F.scaled_dot_product_attention).
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


class DataCollatorForLanguageModeling:
    def __init__(self, pad_token_id, padding_free=False, return_position_ids=True):
        self.pad_token_id = pad_token_id
        self.padding_free = padding_free
        self.return_position_ids = return_position_ids

    def torch_call(self, examples):
        input_ids = [torch.tensor(example["input_ids"]) for example in examples]
        has_packed_position_ids = self.return_position_ids and "position_ids" in examples[0] and self.padding_free
        if not (FIXED and has_packed_position_ids):
            attention_mask = [torch.ones_like(ids) for ids in input_ids]
        if self.return_position_ids:
            if "position_ids" in examples[0]:
                position_ids = [torch.tensor(example["position_ids"]) for example in examples]
            else:
                position_ids = [torch.arange(len(ids)) for ids in input_ids]
        labels = [torch.tensor(example["input_ids"]) for example in examples]
        output = {}
        if self.padding_free:
            output["input_ids"] = torch.cat(input_ids, dim=0).unsqueeze(0)
            if not (FIXED and has_packed_position_ids):
                output["attention_mask"] = torch.cat(attention_mask, dim=0).unsqueeze(0)
            if self.return_position_ids:
                output["position_ids"] = torch.cat(position_ids, dim=0).unsqueeze(0)
            output["labels"] = torch.cat(labels, dim=0).unsqueeze(0)
        return output


def prepare_fa_kwargs_from_position_ids(position_ids):
    starts = (position_ids.flatten() == 0).nonzero().flatten()
    cu_seq_lens = torch.cat([starts, torch.tensor([position_ids.numel()])]).to(torch.int32)
    return cu_seq_lens, int(cu_seq_lens.diff().max())


def _get_unpad_data(attention_mask):
    seqlens_in_batch = attention_mask.sum(dim=-1, dtype=torch.int32)
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return cu_seqlens, int(seqlens_in_batch.max())


def _flash_attention_forward(q, k, v, attention_mask, position_ids):
    """flash_attn_varlen_func over cu_seqlens, rendered as a block-diagonal causal SDPA mask."""
    if attention_mask is not None:
        cu_seqlens, _ = _get_unpad_data(attention_mask)
    else:
        cu_seqlens, _ = prepare_fa_kwargs_from_position_ids(position_ids)
    seq_len = q.shape[-2]
    seq_idx = torch.bucketize(torch.arange(seq_len), cu_seqlens[1:], right=True)
    varlen_causal = (seq_idx[:, None] == seq_idx[None, :]) & torch.ones(seq_len, seq_len, dtype=torch.bool).tril()
    return F.scaled_dot_product_attention(q, k, v, attn_mask=varlen_causal)


class LlamaFlashAttention2(nn.Module):
    def __init__(self, hidden_size=32, num_heads=4):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def forward(self, hidden_states, attention_mask, position_ids):
        bsz, seq_len, _ = hidden_states.shape
        q, k, v = self.qkv(hidden_states).view(bsz, seq_len, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        out = _flash_attention_forward(q, k, v, attention_mask, position_ids)
        return self.o_proj(out.transpose(1, 2).reshape(bsz, seq_len, -1))


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab_size=64, hidden_size=32, num_layers=2, max_positions=32):
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_positions = nn.Embedding(max_positions, hidden_size)
        self.layers = nn.ModuleList(LlamaFlashAttention2(hidden_size) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, labels, position_ids, attention_mask=None):
        h = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        for layer in self.layers:
            h = h + layer(h, attention_mask, position_ids)
        logits = self.lm_head(h)
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)


def main():
    torch.manual_seed(0)
    # one BFD-packed example per row: sequences [5 tokens] + [3 tokens] + [4 tokens]
    examples = [{"input_ids": [4, 9, 17, 23, 2, 8, 31, 2, 12, 40, 19, 2],
                 "position_ids": [0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]}]
    batch = DataCollatorForLanguageModeling(pad_token_id=0, padding_free=True).torch_call(examples)
    with torch.no_grad():
        loss = LlamaForCausalLM()(**batch)
    print("keys", sorted(batch))
    print("loss %.5f" % loss.item())


if __name__ == "__main__":
    main()
