# Citation: OpenRLHF/OpenRLHF commit f2f3016e ("Fix attention mask", 2025-05-16, on the async_rlhf
#   branch that became PR #1015 "Support Async RLHF and Agent RLHF"); buggy code from d465351e
#   ("Refactor _generate_vllm"), read at f2f3016e^.
# Upstream: openrlhf/trainer/ppo_utils/experience_maker.py RemoteExperienceMaker._generate_vllm
#   (Samples.attention_mask), consumed by openrlhf/models/model.py _get_reward_model RewardModel.forward
#   (cumsum position ids, reward read at the last 1 of the mask) and
#   openrlhf/trainer/ppo_utils/replay_buffer.py remove_padding_in_sequences.
# Bug: in _generate_vllm, `input_ids` is re-bound to the right-padded list before the mask is built, so
#   `[1] * len(input_ids) + [0] * (batch_max_input_len - len(input_ids))` is all ones: the pad tail of
#   shorter rollouts counts as real tokens, the reward model reads its score at the last pad slot and
#   total_length counts the pads.
# Fix: the mask is rebuilt from the tokens with process_sequences(sequences, eos_token_id, pad_token_id)
#   (first valid token .. eos inclusive); remove_padding_in_sequences counts only trailing zeros
#   (`attention_mask.flip(0).argmax()`).
import sys
from dataclasses import dataclass
from typing import List, Optional

import torch
import torch.nn as nn
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaModel, LlamaPreTrainedModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- openrlhf/models/utils.py (fix)
def process_sequences(sequences: torch.Tensor, eos_token_id, pad_token_id):
    attention_mask = (sequences.ne(eos_token_id) & sequences.ne(pad_token_id)).to(dtype=torch.long)
    seq_length = attention_mask.size(1)
    eos_indices = seq_length - attention_mask.long().fliplr().argmax(dim=1, keepdim=True).clamp(min=1)
    first_token_indices = attention_mask.long().argmax(dim=1, keepdim=True)
    mask = torch.arange(seq_length).unsqueeze(0).expand(sequences.size(0), -1).to(device=sequences.device)
    attention_mask = (mask >= first_token_indices) & (mask <= eos_indices).to(dtype=torch.long)
    return attention_mask


# ---------------------------------------------------------------- openrlhf/models/model.py
def _get_reward_model(base_pretrained_model, base_llm_model, value_head_prefix="score", packing_samples=False):
    class RewardModel(base_pretrained_model):
        supports_gradient_checkpointing = True

        def __init__(self, config):
            super().__init__(config)
            setattr(self, self.base_model_prefix, base_llm_model(config))
            self.value_head_prefix = value_head_prefix
            setattr(self, value_head_prefix, nn.Linear(config.hidden_size, 1, bias=False))
            self.packing_samples = packing_samples
            self.normalize_reward = config.normalize_reward
            self.register_buffer("mean", torch.zeros(1), persistent=False)
            self.register_buffer("std", torch.ones(1), persistent=False)

        def forward(self, input_ids=None, attention_mask=None, return_output=False, ring_attn_group=None,
                    pad_sequence=False, packed_seq_lens=None):
            batch, seqlen = input_ids.size()
            eos_indices = attention_mask.size(1) - 1 - attention_mask.long().fliplr().argmax(dim=1, keepdim=True)
            forward_attention_mask = attention_mask
            # not packing_samples: https://github.com/OpenRLHF/OpenRLHF/issues/217
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
            outputs = getattr(self, self.base_model_prefix)(
                input_ids, attention_mask=forward_attention_mask, position_ids=position_ids
            )
            last_hidden_states = outputs["last_hidden_state"]
            values = getattr(self, self.value_head_prefix)(last_hidden_states).squeeze(-1)
            reward = values.gather(dim=1, index=eos_indices).squeeze(1)
            if not self.training and self.normalize_reward:
                reward = (reward - self.mean) / self.std
            return (reward, outputs) if return_output else reward

    return RewardModel


# ---------------------------------------------------------------- vLLM output stand-ins
@dataclass
class CompletionOutput:
    token_ids: List[int]


@dataclass
class RequestOutput:
    prompt_token_ids: List[int]
    outputs: List[CompletionOutput]


@dataclass
class Samples:
    sequences: torch.Tensor
    attention_mask: Optional[torch.LongTensor]
    action_mask: Optional[torch.BoolTensor]
    response_length: torch.Tensor
    total_length: torch.Tensor
    prompts: list
    labels: list


# ---------------------------------------------------------------- experience_maker.py _generate_vllm (batching part)
def _generate_vllm_batches(all_outputs, all_prompts, all_labels, micro_rollout_batch_size, pad_token_id, eos_token_id):
    samples_list = []
    for i in range(0, len(all_outputs), micro_rollout_batch_size):
        batch_outputs = all_outputs[i : i + micro_rollout_batch_size]
        batch_prompts = all_prompts[i : i + micro_rollout_batch_size]
        batch_labels = all_labels[i : i + micro_rollout_batch_size]

        batch_max_input_len = max(
            len(output.prompt_token_ids) + len(output.outputs[0].token_ids) for output in batch_outputs
        )

        sequences = []
        attention_mask = []
        for output in batch_outputs:
            # Concatenate prompt and output tokens
            input_ids = list(output.prompt_token_ids) + list(output.outputs[0].token_ids)
            # Right pad to max length
            input_ids = input_ids + [pad_token_id] * (batch_max_input_len - len(input_ids))
            sequences.append(input_ids)
            attention_mask.append([1] * len(input_ids) + [0] * (batch_max_input_len - len(input_ids)))

        sequences = torch.tensor(sequences)
        if FIXED:
            attention_mask = process_sequences(sequences, eos_token_id, pad_token_id)
        else:
            attention_mask = torch.tensor(attention_mask)

        action_mask = torch.zeros_like(attention_mask)
        for j, output in enumerate(batch_outputs):
            action_mask[
                j, len(output.prompt_token_ids) : len(output.prompt_token_ids) + len(output.outputs[0].token_ids)
            ] = 1

        sequences = sequences.to("cpu")
        attention_mask = attention_mask.to("cpu")
        action_mask = action_mask[:, 1:].to("cpu")
        response_length = action_mask.float().sum(dim=-1)
        total_length = attention_mask.float().sum(dim=-1)

        samples_list.append(
            Samples(sequences=sequences, attention_mask=attention_mask, action_mask=action_mask,
                    response_length=response_length, total_length=total_length,
                    prompts=batch_prompts, labels=batch_labels)
        )
    return samples_list


# ---------------------------------------------------------------- replay_buffer.py
def remove_padding_in_sequences(attention_mask_row, tensors):
    if FIXED:
        right_pad = attention_mask_row.flip(0).argmax()
    else:
        right_pad = (attention_mask_row == 0).sum()
    right_pad = None if right_pad == 0 else -right_pad
    return [t[:right_pad] for t in tensors]


def main():
    PAD, EOS = 0, 2
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=PAD, eos_token_id=EOS, attn_implementation="sdpa")
    config.normalize_reward = False
    RewardModel = _get_reward_model(LlamaPreTrainedModel, LlamaModel, "score")
    rm = RewardModel(config).eval()

    # 4 rollouts of 2 prompts (n_samples_per_prompt=2), unpadded prompts, responses end with EOS
    g = torch.Generator().manual_seed(1)

    def toks(n):
        return torch.randint(3, 64, (n,), generator=g).tolist()

    p0, p1 = toks(5), toks(7)
    outs = [
        RequestOutput(p0, [CompletionOutput(toks(6) + [EOS])]),
        RequestOutput(p0, [CompletionOutput(toks(2) + [EOS])]),
        RequestOutput(p1, [CompletionOutput(toks(3) + [EOS])]),
        RequestOutput(p1, [CompletionOutput(toks(9) + [EOS])]),
    ]
    prompts = ["p0", "p0", "p1", "p1"]
    labels = ["a", "a", "b", "b"]

    samples_list = _generate_vllm_batches(outs, prompts, labels, micro_rollout_batch_size=4,
                                          pad_token_id=PAD, eos_token_id=EOS)
    s = samples_list[0]
    with torch.no_grad():
        r = rm(s.sequences, attention_mask=s.attention_mask)
    print("attention_mask row sums:", s.attention_mask.sum(-1).tolist())
    print("total_length:", s.total_length.tolist(), "response_length:", s.response_length.tolist())
    print("rewards:", [round(v, 5) for v in r.tolist()])
    for i in range(s.sequences.size(0)):
        seq, = remove_padding_in_sequences(s.attention_mask[i], [s.sequences[i]])
        print(f"sample {i}: kept {seq.numel()} of {s.sequences.size(1)} tokens")
    # group-normalised (GRPO-style) advantage from the scores
    rr = r.view(2, 2)
    adv = (rr - rr.mean(-1, keepdim=True)) / (rr.std(-1, keepdim=True) + 1e-9)
    print("group advantages:", [round(v, 4) for v in adv.flatten().tolist()])


if __name__ == "__main__":
    main()
