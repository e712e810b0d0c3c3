"""DeepSpeed-Chat step 3 (PPO): the actor generates from left-padded prompts without their attention mask.

Citation: deepspeedai/DeepSpeedExamples#468 ("add mask for generation, otherwise the generation is
broken", merged), the fix of the problem reported in deepspeedai/DeepSpeedExamples#464 ("Provide attention
mask of prompts to hf-generation script"). I read both PR descriptions, not the diff; the fix below is the
one #464 describes and #468 is said to have made.

Bug: DataCollatorRLHF pads every prompt to max_prompt_seq_len and flips it, so prompts are LEFT-padded with
pad_token_id == eos_token_id (DS-Chat sets pad_token = eos_token and model.config.pad_token_id =
eos_token_id). PPOTrainer._generate_sequence called actor.generate(prompts, max_length=...) without
attention_mask; HF generate cannot infer a mask when pad == eos, so it uses all ones and every response token
attends the eos padding in front of the prompt.

Fix: pass attention_mask=mask (the collator's prompt_att_mask) to generate.

This program: an OPT-style actor written in plain torch (learned positions from the attention mask's
cumsum, eager softmax attention with an additive mask, KV cache), an HF-like greedy generate that falls back
to an all-ones mask when none is given, and the collator and trainer method as DS-Chat wrote them.
"""
import sys

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

FIXED = "--fixed" in sys.argv

EOS = 2  # OPT's </s>; DS-Chat: tokenizer.pad_token = tokenizer.eos_token


class OPTConfig:
    vocab_size = 50
    hidden_size = 32
    num_attention_heads = 4
    num_hidden_layers = 2
    max_position_embeddings = 64
    pad_token_id = EOS
    eos_token_id = EOS


class OPTAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.k_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.v_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.out_proj = nn.Linear(config.hidden_size, config.hidden_size)

    def _shape(self, t, bsz):
        return t.view(bsz, -1, self.num_heads, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, attention_mask, past_key_value=None):
        bsz, tgt_len, _ = hidden_states.shape
        q = self._shape(self.q_proj(hidden_states) * self.scaling, bsz)
        k = self._shape(self.k_proj(hidden_states), bsz)
        v = self._shape(self.v_proj(hidden_states), bsz)
        if past_key_value is not None:
            k = torch.cat([past_key_value[0], k], dim=2)
            v = torch.cat([past_key_value[1], v], dim=2)
        attn_weights = q @ k.transpose(-1, -2) + attention_mask
        attn_probs = F.softmax(attn_weights, dim=-1)
        out = (attn_probs @ v).transpose(1, 2).reshape(bsz, tgt_len, -1)
        return self.out_proj(out), (k, v)


class OPTForCausalLM(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.embed_positions = nn.Embedding(config.max_position_embeddings + 2, config.hidden_size)
        self.layers = nn.ModuleList(OPTAttention(config) for _ in range(config.num_hidden_layers))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def _prepare_decoder_attention_mask(self, attention_mask, tgt_len, past_len):
        src_len = attention_mask.shape[1]
        causal = torch.ones(tgt_len, src_len, dtype=torch.bool).tril(diagonal=past_len)
        keep = causal[None, None] & attention_mask[:, None, None, :].bool()
        return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)

    def forward(self, input_ids, attention_mask, past_key_values=None):
        past_len = 0 if past_key_values is None else past_key_values[0][0].shape[2]
        # OPTLearnedPositionalEmbedding: positions from the mask, offset by 2
        positions = (torch.cumsum(attention_mask, dim=1) * attention_mask).long() - 1
        positions = positions[:, past_len:] + 2
        h = self.embed_tokens(input_ids) + self.embed_positions(positions)
        mask = self._prepare_decoder_attention_mask(attention_mask, input_ids.shape[1], past_len)
        presents = []
        for i, layer in enumerate(self.layers):
            out, present = layer(h, mask, None if past_key_values is None else past_key_values[i])
            h = h + out
            presents.append(present)
        return self.lm_head(h), presents

    @torch.no_grad()
    def generate(self, input_ids, attention_mask=None, max_length=None, min_length=None):
        if attention_mask is None:
            # pad_token_id == eos_token_id: generate cannot tell padding from eos, so it attends everything
            attention_mask = torch.ones_like(input_ids)
        seq, past = input_ids, None
        step_ids = input_ids
        while seq.shape[1] < max_length:
            logits, past = self.forward(step_ids, attention_mask, past)
            next_logits = logits[:, -1]
            if seq.shape[1] < min_length:
                next_logits[:, self.config.eos_token_id] = float("-inf")
            step_ids = next_logits.argmax(-1, keepdim=True)
            seq = torch.cat([seq, step_ids], dim=1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(step_ids)], dim=1)
        return seq


class DataCollatorRLHF:
    def __init__(self, max_token_len, inference_tp_size):
        self.max_token_len = max_token_len
        self.inference_tp_size = inference_tp_size

    def __call__(self, data):
        batch = {}
        pad_token_id = data[-1][-1]
        prompt = pad_sequence([f[0] for f in data], padding_value=pad_token_id, batch_first=True)
        prompt_mask = pad_sequence([f[1] for f in data], padding_value=0, batch_first=True)
        length = prompt.size()[-1]
        pad_length = self.max_token_len - length
        if pad_length > 0:
            batch["prompt"] = F.pad(prompt, pad=(0, pad_length), mode="constant", value=pad_token_id)
            batch["prompt_att_mask"] = F.pad(prompt_mask, pad=(0, pad_length), mode="constant", value=0)
        else:
            batch["prompt"] = prompt
            batch["prompt_att_mask"] = prompt_mask
        batch["prompt"] = batch["prompt"].flip(1)
        batch["prompt_att_mask"] = batch["prompt_att_mask"].flip(1)
        return batch


class DeepSpeedPPOTrainer:
    def __init__(self, actor_model, max_answer_seq_len):
        self.actor_model = actor_model
        self.max_answer_seq_len = max_answer_seq_len

    def _generate_sequence(self, prompts, mask, step):
        max_min_length = self.max_answer_seq_len + prompts.shape[1]
        with torch.no_grad():
            if FIXED:
                seq = self.actor_model.generate(prompts, attention_mask=mask, max_length=max_min_length,
                                                min_length=max_min_length)
            else:
                seq = self.actor_model.generate(prompts, max_length=max_min_length, min_length=max_min_length)
        return seq


def main():
    torch.manual_seed(0)
    actor = OPTForCausalLM(OPTConfig()).eval()
    # PromptDataset stores each prompt flipped (reversed), with its mask and the pad id
    raw = [torch.tensor([7, 11, 13, 17, 19, 23]), torch.tensor([29, 31])]
    data = [(p.flip(0), torch.ones_like(p).flip(0), EOS) for p in raw]
    batch = DataCollatorRLHF(max_token_len=8, inference_tp_size=1)(data)
    trainer = DeepSpeedPPOTrainer(actor, max_answer_seq_len=4)
    seq = trainer._generate_sequence(batch["prompt"], batch["prompt_att_mask"], step=0)
    print("prompt_att_mask", batch["prompt_att_mask"].tolist())
    print("answers", seq[:, batch["prompt"].shape[1]:].tolist())


if __name__ == "__main__":
    main()
