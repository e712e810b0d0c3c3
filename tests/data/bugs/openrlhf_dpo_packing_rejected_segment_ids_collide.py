"""OpenRLHF DPO packing: chosen and rejected samples share packed segment ids (OpenRLHF/OpenRLHF e98d0cbd).

Citation: OpenRLHF/OpenRLHF commit e98d0cbd "fix dpo packing samples" (2024-07-22; no PR thread found), fixing
a line added the day before by 15517919 "fix packing_samples attention for hf". Read in the upstream git history:
openrlhf/datasets/reward_dataset.py `RewardDataset.packing_collate_fn`, openrlhf/trainer/dpo_trainer.py
`packed_samples_forward` / `_packed_get_batch_logps`, openrlhf/models/actor.py `Actor.forward` and
openrlhf/models/packing_utils.py `get_unpad_data` at e98d0cbd^ and e98d0cbd.

Bug: with `--packing_samples`, the collate packs all chosen sequences and then all rejected sequences of a batch
into one row and writes a sample index per token into `attention_mask`; OpenRLHF's patched `_get_unpad_data`
counts tokens per index and turns the counts into flash-attn varlen `cu_seqlens`, assuming each index is one
contiguous sample. The rejected indices were `index + half_len` with `half_len = len(item_list) // 2`, so rejected
sample i reused the index of chosen sample i + half_len. The per-index counts then no longer match the packed
order, so varlen segments span several samples. With four pairs of lengths (7, 6), (7, 4), (6, 8), (6, 8) the
counts are [7, 7, 12, 10, 8, 8]: chosen 2 and 3 form one causal segment, and so do rejected 0 and 1.

Fix: `rejected_att_masks.append(torch.ones_like(reject_id.flatten()) * (index + len(item_list)))`, so the 2B
indices are distinct and follow the packed order.

This program: the collate at e98d0cbd^ / e98d0cbd, `Actor.forward` with `packing_samples` (position ids over the
whole row, the upstream TODO), a Llama-style model whose `_update_causal_mask` follows transformers 4.42's flash
rule and whose flash attention is emulated on CPU (`flash_attn_varlen_func` as causal SDPA per cu_seqlens segment),
and the DPO trainer's packed log-prob sums. Four preference pairs, so the indices collide. Prints chosen and
rejected log-prob sums.
"""

import sys

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


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


class LlamaForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = LlamaModel()
        self.lm_head = nn.Linear(32, 50, bias=False)

    def forward(self, input_ids, attention_mask=None, position_ids=None):
        hidden = self.model(input_ids, attention_mask=attention_mask, position_ids=position_ids)["last_hidden_state"]
        return {"logits": self.lm_head(hidden)}


class Actor(nn.Module):
    def __init__(self, model, packing_samples=True):
        super().__init__()
        self.model = model
        self.packing_samples = packing_samples

    def forward(self, sequences, num_actions=None, attention_mask=None, return_output=False):
        if not self.packing_samples:
            position_ids = attention_mask.long().cumsum(-1) - 1
        else:
            # TODO: reset the positions for packed samples
            position_ids = (attention_mask != 0).long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        output = self.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        return output


def packing_collate_fn(item_list, pad_token_id=0):
    extras = []
    chosen_ids, chosen_att_masks, chosen_seq_lens = [], [], []
    rejected_ids, rejected_att_masks, rejected_seq_lens = [], [], []
    index = 1
    half_len = len(item_list) // 2
    for chosen_id, chosen_mask, reject_id, rejects_mask, extra in item_list:
        chosen_ids.append(chosen_id.flatten())
        chosen_att_masks.append(torch.ones_like(chosen_id.flatten()) * index)
        chosen_seq_lens.append(len(chosen_id.flatten()))
        extras.append(extra)

        rejected_ids.append(reject_id.flatten())
        if FIXED:
            rejected_att_masks.append(torch.ones_like(reject_id.flatten()) * (index + len(item_list)))
        else:
            rejected_att_masks.append(torch.ones_like(reject_id.flatten()) * (index + half_len))
        rejected_seq_lens.append(len(reject_id.flatten()))
        index += 1

    # Concatenate all tensors into a single row
    # https://github.com/huggingface/transformers/blob/v4.42.4/src/transformers/models/llama/modeling_llama.py#L1028
    rejected_ids.append(torch.tensor([pad_token_id]))
    rejected_att_masks.append(torch.tensor([0]))

    packed_input_ids = torch.cat(chosen_ids + rejected_ids, dim=0).unsqueeze(0)
    packed_attention_masks = torch.cat(chosen_att_masks + rejected_att_masks, dim=0).unsqueeze(0)
    packed_seq_lens = chosen_seq_lens + rejected_seq_lens
    return packed_input_ids, packed_attention_masks, packed_seq_lens, extras


def _packed_get_batch_logps(logits, labels, attention_mask, prompt_id_lens, packed_seq_lens):
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_masks = attention_mask.clone().bool()
    index = 0
    for i, seq_len in enumerate(packed_seq_lens):
        loss_masks[0, index : index + prompt_id_lens[i]] = False
        index = index + seq_len
    loss_masks = loss_masks[:, 1:]
    labels[loss_masks == False] = 0  # noqa: E712
    per_token_logps = torch.gather(logits.log_softmax(-1), dim=2, index=labels.unsqueeze(2)).squeeze(2)
    logprobs_sums = []
    index = 0
    for i, seq_len in enumerate(packed_seq_lens):
        seq = per_token_logps[0, index : index + seq_len - 1]
        mask = loss_masks[0, index : index + seq_len - 1]
        logprobs_sums.append((seq * mask).sum())
        index = index + seq_len
    return torch.stack(logprobs_sums)


def packed_samples_forward(model, packed_input_ids, packed_attention_masks, packed_seq_lens, prompt_id_lens):
    output = model(packed_input_ids, attention_mask=packed_attention_masks, return_output=True)
    all_logps = _packed_get_batch_logps(
        output["logits"], packed_input_ids, packed_attention_masks, prompt_id_lens * 2, packed_seq_lens
    )
    chosen_logps = all_logps[: len(packed_seq_lens) // 2]
    rejected_logps = all_logps[len(packed_seq_lens) // 2 :]
    return chosen_logps, rejected_logps


def main():
    torch.manual_seed(0)
    model = Actor(LlamaForCausalLM(), packing_samples=True)
    item_list = []
    for prompt_len, chosen_len, rejected_len in [(3, 4, 3), (2, 5, 2), (4, 2, 4), (3, 3, 5)]:
        prompt = torch.randint(1, 50, (prompt_len,))
        chosen = torch.cat([prompt, torch.randint(1, 50, (chosen_len,))])
        rejected = torch.cat([prompt, torch.randint(1, 50, (rejected_len,))])
        item_list.append((chosen, torch.ones_like(chosen), rejected, torch.ones_like(rejected), prompt_len))
    packed_input_ids, packed_attention_masks, packed_seq_lens, prompt_id_lens = packing_collate_fn(item_list)
    with torch.no_grad():
        chosen_logps, rejected_logps = packed_samples_forward(
            model, packed_input_ids, packed_attention_masks, packed_seq_lens, prompt_id_lens
        )
    print("chosen", [round(v, 4) for v in chosen_logps.tolist()])
    print("rejected", [round(v, 4) for v in rejected_logps.tolist()])


if __name__ == "__main__":
    main()
