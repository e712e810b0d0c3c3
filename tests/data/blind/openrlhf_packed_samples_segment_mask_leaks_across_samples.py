# OpenRLHF/OpenRLHF#587 (fixed by #588): with --packing_samples the actor passed the packed "attention_mask"
# (sample index per token, 0 for padding) to the HF model, which reads it as a plain 0/1 padding mask, so every
# packed sample attends to the samples packed before it; the fix drops attention_mask and uses reset position_ids.
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def log_probs_from_logits(logits, labels):
    log_probs = F.log_softmax(logits, dim=-1)
    return log_probs.gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


def reset_position_ids(attention_mask):
    position_ids = torch.zeros_like(attention_mask, dtype=torch.long)
    for i in range(attention_mask.size(0)):
        mask = attention_mask[i]
        seq_num = mask.max().item()
        for index in range(1, seq_num + 1):
            sample_mask = mask == index
            sample_length = sample_mask.sum().item()
            position_ids[i, sample_mask] = torch.arange(sample_length, device=mask.device)
    return position_ids


class Actor(nn.Module):
    def __init__(self, model, packing_samples=False):
        super().__init__()
        self.model = model
        # https://github.com/huggingface/transformers/issues/26877
        # Use `model.generate(use_cache=True)` instead.`
        self.model.config.use_cache = False
        self.packing_samples = packing_samples

    def forward(self, sequences, num_actions=None, attention_mask=None, return_output=False, packed_seq_lens=None):
        """Returns action log probs"""
        if not self.packing_samples:
            # https://github.com/OpenLLMAI/OpenRLHF/issues/217
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
        else:
            # convert attention_mask to position_ids
            position_ids = reset_position_ids(attention_mask)
            if FIXED:
                # explicitly ignore attention_mask for packing_samples
                attention_mask = None

        output = self.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        log_probs = log_probs_from_logits(output["logits"][:, :-1, :], sequences[:, 1:])

        if not self.packing_samples:
            action_log_probs = log_probs[:, -num_actions:]
        else:
            assert isinstance(num_actions, list) and len(num_actions) == len(packed_seq_lens)
            action_log_probs = []
            offset = 0
            for num_action, seq_len in zip(num_actions, packed_seq_lens):
                start, end = max(0, offset + seq_len - num_action - 1), offset + seq_len - 1
                action_log_probs.append(log_probs[:, start:end])
                offset += seq_len
            action_log_probs = torch.cat(action_log_probs, dim=1)
        return (action_log_probs, output) if return_output else action_log_probs


def packing_collate_fn(samples, pad_to_multiple_of=8, pad_token_id=0):
    """Pack (prompt+response) samples into one row; attention_mask holds the sample index (1, 2, ...)."""
    sequences, attention_mask, packed_seq_lens, num_actions = [], [], [], []
    for i, (prompt, response) in enumerate(samples):
        seq = prompt + response
        sequences.extend(seq)
        attention_mask.extend([i + 1] * len(seq))
        packed_seq_lens.append(len(seq))
        num_actions.append(len(response))
    padding_len = (pad_to_multiple_of - len(sequences) % pad_to_multiple_of) % pad_to_multiple_of
    sequences.extend([pad_token_id] * padding_len)
    attention_mask.extend([0] * padding_len)
    return torch.tensor(sequences).unsqueeze(0), torch.tensor(attention_mask).unsqueeze(0), packed_seq_lens, num_actions


def main():
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, attn_implementation="sdpa")
    model = LlamaForCausalLM(config).eval()
    samples = [
        ([5, 6, 7, 8], [20, 21, 22]),
        ([9, 10, 11], [23, 24, 25, 26]),
        ([12, 13, 14, 15, 16], [27, 28]),
    ]
    actor = Actor(model, packing_samples=True)
    sequences, attention_mask, packed_seq_lens, num_actions = packing_collate_fn(samples)
    with torch.no_grad():
        packed = actor(sequences, num_actions, attention_mask=attention_mask, packed_seq_lens=packed_seq_lens)

    # reference: each sample alone through the unpacked path
    ref_actor = Actor(model, packing_samples=False)
    ref = []
    with torch.no_grad():
        for prompt, response in samples:
            seq = torch.tensor([prompt + response])
            ref.append(ref_actor(seq, len(response), attention_mask=torch.ones_like(seq)))
    ref = torch.cat(ref, dim=1)
    diff = (packed - ref).abs().max().item()
    print(f"fixed={FIXED} max |packed action logp - per-sample action logp| = {diff:.3e}")


if __name__ == "__main__":
    main()
