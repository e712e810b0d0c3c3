"""OpenRLHF reward-model packing: a packed mask with no 0 in it is dropped by HF's flash path (commit 15517919).

Citation: OpenRLHF/OpenRLHF commit 15517919 "fix packing_samples attention for hf" (2024-07-21; no PR thread
found). Read in the upstream git history: openrlhf/datasets/reward_dataset.py `RewardDataset.packing_collate_fn`,
openrlhf/trainer/rm_trainer.py `packed_samples_forward`, openrlhf/models/packing_utils.py `get_unpad_data` and
openrlhf/models/model.py `RewardModel.forward` before and after the commit. The fix's own comment points at
transformers v4.42.4 modeling_llama.py L1028 (`LlamaModel._update_causal_mask`), reproduced here from memory of
that release: for flash_attention_2 it keeps `attention_mask` only `if attention_mask is not None and 0.0 in
attention_mask`, otherwise returns None.

Bug: with `--packing_samples`, OpenRLHF writes sample indices (1, 1, 1, 2, 2, ...) into `attention_mask` and patches
transformers' `_get_unpad_data` so flash-attn varlen gets one segment per sample. The pre-fix reward collate packed
all chosen sequences into row 0 and all rejected into row 1 and zero-padded the shorter row. When no row needs
padding (equal packed lengths) the mask contains no 0, HF discards it, and flash attention runs plainly causal over
each whole row: every packed sample attends to the samples packed before it.

Fix: pack chosen and rejected into one row and append one pad token with mask 0 so the mask is always kept;
`packed_samples_forward` reads every reward from row 0. 15517919 offset the rejected indices by
`len(item_list) // 2`, which let a chosen and a rejected sample share an index; the next commit, e98d0cbd "fix dpo
packing samples" (2024-07-22), made the offset `len(item_list)`. `--fixed` is the code after both commits.

This program: the pre-fix and fixed collates, OpenRLHF's `get_unpad_data`, a Llama-style reward model whose
`_update_causal_mask` follows transformers 4.42's flash rule and whose flash attention is emulated on CPU
(`flash_attn_varlen_func` as causal SDPA per cu_seqlens segment, `flash_attn_func` as causal SDPA over the row),
and `packed_samples_forward`. Chosen lengths (5, 7) and rejected (6, 6) pack to equal rows, so the buggy run drops
the mask. Prints chosen/rejected rewards.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


def zero_pad_sequences(sequences, side="left", value=0):
    max_len = max(seq.size(-1) for seq in sequences)
    padded = []
    for seq in sequences:
        pad_len = max_len - seq.size(-1)
        padding = (pad_len, 0) if side == "left" else (0, pad_len)
        padded.append(F.pad(seq, padding, value=value))
    return torch.stack(padded, dim=0)


def get_seqlens_in_batch(attention_mask):
    bsz = attention_mask.size(0)
    max_num = torch.max(attention_mask).item()
    counts = torch.zeros((bsz, max_num), dtype=attention_mask.dtype)
    for i in range(max_num):
        counts[:, i] = torch.sum(attention_mask == (i + 1), dim=-1)
    counts = counts.flatten()
    return counts[counts.nonzero().squeeze(dim=-1)]


def get_unpad_data(attention_mask):
    """OpenRLHF's patch of transformers' `_get_unpad_data`: one varlen segment per packed sample index."""
    seqlens_in_batch = get_seqlens_in_batch(attention_mask)
    indices = torch.nonzero(attention_mask.flatten(), as_tuple=False).flatten()
    max_seqlen_in_batch = seqlens_in_batch.max().item()
    cu_seqlens = F.pad(torch.cumsum(seqlens_in_batch, dim=0, dtype=torch.int32), (1, 0))
    return indices, cu_seqlens, max_seqlen_in_batch


def flash_attn_varlen_func(q, k, v, cu_seqlens, causal=True):
    """CPU stand-in for flash-attn's varlen kernel: causal attention inside each [cu[i], cu[i+1]) segment."""
    out = torch.empty_like(q)
    for s, e in zip(cu_seqlens[:-1].tolist(), cu_seqlens[1:].tolist()):
        seg = [t[s:e].transpose(0, 1)[None] for t in (q, k, v)]  # (1, H, n, D)
        out[s:e] = F.scaled_dot_product_attention(*seg, is_causal=causal)[0].transpose(0, 1)
    return out


def flash_attn_func(q, k, v, causal=True):
    """CPU stand-in for flash-attn's dense kernel over (B, L, H, D)."""
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), is_causal=causal).transpose(1, 2)


class LlamaFlashAttention2(nn.Module):
    def __init__(self, hidden_size, num_heads):
        super().__init__()
        self.num_heads = num_heads
        self.qkv_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=False)
        self.o_proj = nn.Linear(hidden_size, hidden_size, bias=False)

    def _flash_attention_forward(self, q, k, v, attention_mask):
        if attention_mask is not None:
            bsz, seqlen = attention_mask.shape
            indices, cu_seqlens, _ = get_unpad_data(attention_mask)
            q_u, k_u, v_u = (t.reshape(bsz * seqlen, self.num_heads, -1)[indices] for t in (q, k, v))
            out_u = flash_attn_varlen_func(q_u, k_u, v_u, cu_seqlens, causal=True)
            out = torch.zeros(bsz * seqlen, *out_u.shape[1:])
            out[indices] = out_u
            return out.view(bsz, seqlen, self.num_heads, -1)
        return flash_attn_func(q, k, v, causal=True)

    def forward(self, hidden_states, attention_mask):
        b, n, _ = hidden_states.shape
        q, k, v = self.qkv_proj(hidden_states).view(b, n, 3, self.num_heads, -1).unbind(2)
        out = self._flash_attention_forward(q, k, v, attention_mask)
        return self.o_proj(out.reshape(b, n, -1))


class LlamaModel(nn.Module):
    def __init__(self, vocab_size=50, hidden_size=32, num_heads=4, num_layers=2, max_position=64):
        super().__init__()
        self.config = type("LlamaConfig", (), {"_attn_implementation": "flash_attention_2"})()
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_positions = nn.Embedding(max_position, hidden_size)
        self.layers = nn.ModuleList(LlamaFlashAttention2(hidden_size, num_heads) for _ in range(num_layers))
        self.norm = nn.LayerNorm(hidden_size)

    def _update_causal_mask(self, attention_mask):
        if self.config._attn_implementation == "flash_attention_2":
            if attention_mask is not None and 0.0 in attention_mask:
                return attention_mask
            return None
        raise NotImplementedError

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1])[None]
        hidden_states = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        causal_mask = self._update_causal_mask(attention_mask)
        for layer in self.layers:
            hidden_states = hidden_states + layer(hidden_states, causal_mask)
        return {"last_hidden_state": self.norm(hidden_states)}


class RewardModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = LlamaModel()
        self.value_head = nn.Linear(32, 1, bias=False)

    def forward(self, input_ids, attention_mask=None, return_output=False, packing_samples=False):
        position_ids = None  # packing_samples
        outputs = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids)
        values = self.value_head(outputs["last_hidden_state"]).squeeze(-1)
        return (values, outputs) if return_output else values


def packing_collate_fn(item_list, pad_token_id=0):
    chosen_ids, chosen_att_masks, chosen_seq_lens = [], [], []
    rejected_ids, rejected_att_masks, rejected_seq_lens = [], [], []
    index = 1
    for chosen_id, reject_id in item_list:
        chosen_ids.append(chosen_id.flatten())
        chosen_att_masks.append(torch.ones_like(chosen_id.flatten()) * index)
        chosen_seq_lens.append(len(chosen_id.flatten()))
        rejected_ids.append(reject_id.flatten())
        if FIXED:
            rejected_att_masks.append(torch.ones_like(reject_id.flatten()) * (index + len(item_list)))
        else:
            rejected_att_masks.append(torch.ones_like(reject_id.flatten()) * index)
        rejected_seq_lens.append(len(reject_id.flatten()))
        index += 1

    packed_seq_lens = chosen_seq_lens + rejected_seq_lens
    if FIXED:
        # transformers v4.42.4 modeling_llama.py L1028: keep a 0 in the mask so flash attention keeps it
        rejected_ids.append(torch.tensor([pad_token_id]))
        rejected_att_masks.append(torch.tensor([0]))
        packed_input_ids = torch.cat(chosen_ids + rejected_ids, dim=0).unsqueeze(0)
        packed_attention_masks = torch.cat(chosen_att_masks + rejected_att_masks, dim=0).unsqueeze(0)
        return packed_input_ids, packed_attention_masks, packed_seq_lens

    # Concatenate all tensors into a single row
    chosen_ids = torch.cat(chosen_ids, dim=0)
    chosen_att_masks = torch.cat(chosen_att_masks, dim=0)
    rejected_ids = torch.cat(rejected_ids, dim=0)
    rejected_att_masks = torch.cat(rejected_att_masks, dim=0)
    # padding
    packed_input_ids = zero_pad_sequences([chosen_ids, rejected_ids], side="right", value=pad_token_id)
    packed_attention_masks = zero_pad_sequences([chosen_att_masks, rejected_att_masks], side="right")
    return packed_input_ids, packed_attention_masks, packed_seq_lens


def packed_samples_forward(model, packed_input_ids, packed_attention_masks, packed_seq_lens):
    all_values, output = model(
        packed_input_ids, attention_mask=packed_attention_masks, return_output=True, packing_samples=True
    )
    half_len = len(packed_seq_lens) // 2
    rewards = []
    index = 0
    for i, seq_len in enumerate(packed_seq_lens):
        if FIXED:
            index = index + seq_len
            rewards.append(all_values[0, index - 1])
        else:
            batch = 0 if i < half_len else 1
            index = index + seq_len if i != half_len else seq_len
            rewards.append(all_values[batch, index - 1])
    rewards = torch.stack(rewards)
    return rewards[:half_len], rewards[half_len:]


def main():
    torch.manual_seed(0)
    model = RewardModel()
    item_list = [
        (torch.randint(1, 50, (5,)), torch.randint(1, 50, (6,))),
        (torch.randint(1, 50, (7,)), torch.randint(1, 50, (6,))),
    ]
    packed_input_ids, packed_attention_masks, packed_seq_lens = packing_collate_fn(item_list)
    with torch.no_grad():
        chosen_reward, reject_reward = packed_samples_forward(
            model, packed_input_ids, packed_attention_masks, packed_seq_lens
        )
    print("chosen", [round(v, 4) for v in chosen_reward.tolist()], "rejected", [round(v, 4) for v in reject_reward.tolist()])


if __name__ == "__main__":
    main()
