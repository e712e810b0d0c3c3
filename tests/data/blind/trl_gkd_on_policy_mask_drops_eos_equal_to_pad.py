"""TRL GKDTrainer on-policy step: attention_mask zeroed wherever a token equals pad_token_id (== eos).

Citation: huggingface/trl#6357 ("Fix EOS being masked when pad_token_id equals eos_token_id in GKD and
GOLD", commit 707a7172e). I read the diff of trl/experimental/gkd/gkd_trainer.py.

Bug: generate_on_policy_outputs rebuilt the mask of the generated sequences as all ones, then
new_attention_mask[generated_tokens == pad_token_id] = 0. With pad_token = eos_token (common when a
tokenizer has no pad), every real EOS is masked too — including the end-of-turn EOS inside a multi-turn
prompt — so the student and teacher forwards in compute_loss never attend those tokens.

Fix: take the prompt part from inputs["prompt_attention_mask"] and the completion part from a mask that
keeps everything up to and including the first EOS ("Pad ids can appear inside real prompt text, so use
the prompt mask instead of matching ids").

This program: left-padded multi-turn prompts with end-of-turn EOS inside, an HF-like greedy generate (pads
finished rows with pad_token_id), the trainer's on-policy step, and Llama-style student/teacher models
(positions from the mask, HF-style additive mask into F.scaled_dot_product_attention).
"""
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv

EOS = 2


class LlamaForCausalLM(nn.Module):
    def __init__(self, vocab_size=48, hidden_size=32, num_heads=4, num_layers=2, max_positions=64):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, hidden_size // num_heads
        self.embed_tokens = nn.Embedding(vocab_size, hidden_size)
        self.embed_positions = nn.Embedding(max_positions, hidden_size)
        self.qkv = nn.ModuleList(nn.Linear(hidden_size, 3 * hidden_size, bias=False) for _ in range(num_layers))
        self.o_proj = nn.ModuleList(nn.Linear(hidden_size, hidden_size, bias=False) for _ in range(num_layers))
        self.lm_head = nn.Linear(hidden_size, vocab_size, bias=False)

    def forward(self, input_ids, attention_mask):
        bsz, seq_len = input_ids.shape
        position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        h = self.embed_tokens(input_ids) + self.embed_positions(position_ids)
        keep = torch.ones(seq_len, seq_len, dtype=torch.bool).tril()[None, None] & attention_mask[:, None, None, :].bool()
        mask = torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)
        for qkv, o_proj in zip(self.qkv, self.o_proj):
            q, k, v = qkv(h).view(bsz, seq_len, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            h = h + o_proj(out.transpose(1, 2).reshape(bsz, seq_len, -1))
        return SimpleNamespace(logits=self.lm_head(h))

    @torch.no_grad()
    def generate(self, input_ids, attention_mask, generation_config, return_dict_in_generate=True):
        sequences, finished = input_ids, torch.zeros(input_ids.shape[0], dtype=torch.bool)
        for _ in range(generation_config.max_new_tokens):
            logits = self.forward(sequences, attention_mask).logits[:, -1]
            next_tokens = logits.argmax(-1)
            next_tokens = torch.where(finished, generation_config.pad_token_id, next_tokens)
            finished |= next_tokens == generation_config.eos_token_id
            sequences = torch.cat([sequences, next_tokens[:, None]], dim=1)
            attention_mask = torch.cat([attention_mask, torch.ones_like(next_tokens[:, None])], dim=1)
        return SimpleNamespace(sequences=sequences)


class GKDTrainer:
    def __init__(self, model, teacher_model, processing_class, generation_config, beta=0.5):
        self.model, self.teacher_model = model, teacher_model
        self.processing_class = processing_class
        self.generation_config = generation_config
        self.beta = beta

    @staticmethod
    def generate_on_policy_outputs(model, inputs, generation_config, pad_token_id=None):
        generated_outputs = model.generate(input_ids=inputs["prompts"], attention_mask=inputs["prompt_attention_mask"],
                                           generation_config=generation_config, return_dict_in_generate=True)
        generated_tokens = generated_outputs.sequences
        prompt_length = inputs["prompts"].shape[1]
        if FIXED:
            completion_ids = generated_tokens[:, prompt_length:]
            is_eos = torch.isin(completion_ids, torch.tensor(generation_config.eos_token_id))
            eos_idx = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
            eos_idx[is_eos.any(dim=1)] = is_eos.int().argmax(dim=1)[is_eos.any(dim=1)]
            sequence_indices = torch.arange(is_eos.size(1)).expand(is_eos.size(0), -1)
            completion_mask = (sequence_indices <= eos_idx.unsqueeze(1)).int()
            new_attention_mask = torch.ones_like(generated_tokens)
            new_attention_mask[:, prompt_length:] = completion_mask
            new_attention_mask[:, :prompt_length] = inputs["prompt_attention_mask"]
            new_labels = generated_tokens.clone()
            new_labels[new_attention_mask == 0] = -100
        else:
            new_attention_mask = torch.ones_like(generated_tokens)
            new_labels = generated_tokens.clone()
            if pad_token_id is not None:
                new_labels[new_labels == pad_token_id] = -100
                new_attention_mask[generated_tokens == pad_token_id] = 0
        new_labels[:, :prompt_length] = -100
        return generated_tokens, new_attention_mask, new_labels

    @staticmethod
    def generalized_jsd_loss(student_logits, teacher_logits, labels, beta):
        student_log_probs = F.log_softmax(student_logits, dim=-1)
        teacher_log_probs = F.log_softmax(teacher_logits, dim=-1)
        mixture = torch.logsumexp(torch.stack([student_log_probs + torch.log(torch.tensor(1 - beta)),
                                               teacher_log_probs + torch.log(torch.tensor(beta))]), dim=0)
        jsd = beta * F.kl_div(mixture, teacher_log_probs, reduction="none", log_target=True) + (1 - beta) * \
            F.kl_div(mixture, student_log_probs, reduction="none", log_target=True)
        mask = labels != -100
        return jsd.sum(-1)[mask].sum() / mask.sum()

    def training_step(self, inputs):
        new_input_ids, new_attention_mask, new_labels = self.generate_on_policy_outputs(
            self.model, inputs, self.generation_config, self.processing_class.pad_token_id)
        inputs["input_ids"], inputs["attention_mask"], inputs["labels"] = new_input_ids, new_attention_mask, new_labels
        student_outputs = self.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        with torch.no_grad():
            teacher_outputs = self.teacher_model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"])
        return self.generalized_jsd_loss(student_outputs.logits[:, :-1], teacher_outputs.logits[:, :-1],
                                         inputs["labels"][:, 1:], self.beta)


def main():
    torch.manual_seed(0)
    processing_class = SimpleNamespace(pad_token_id=EOS, eos_token_id=EOS)  # pad_token = eos_token
    generation_config = SimpleNamespace(max_new_tokens=4, eos_token_id=EOS, pad_token_id=EOS)
    # multi-turn prompts: user, assistant <eos>, user; left-padded with pad (== eos)
    prompts = torch.tensor([[EOS, EOS, 10, 11, 12, EOS, 13, 14],
                            [20, 21, 22, 23, EOS, 24, 25, 26]])
    prompt_attention_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1, 1]])
    trainer = GKDTrainer(LlamaForCausalLM(), LlamaForCausalLM(), processing_class, generation_config)
    loss = trainer.training_step({"prompts": prompts, "prompt_attention_mask": prompt_attention_mask})
    print("loss %.5f" % loss.item())


if __name__ == "__main__":
    main()
