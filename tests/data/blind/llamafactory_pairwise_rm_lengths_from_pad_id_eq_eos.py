# hiyouga/LlamaFactory commit e6ba7ef3e ("improve rlhf", 2024-07-02), src/llamafactory/train/rm/trainer.py
# PairwiseTrainer.compute_loss.
#
# Bug: the reward model's pairwise loss (trlx-style) found each sequence's end with
# `(input_ids != tokenizer.pad_token_id).nonzero()[-1] + 1`. LLaMA-Factory's template sets
# `tokenizer.pad_token = tokenizer.eos_token` when the tokenizer has no pad token, and every response
# ends with the template's EOS, so the trailing EOS is taken for padding: the score is read on the token
# before EOS and the truncated reward span stops one token short.
# Fix: the end of each row is read from the collator's attention mask
# (`chosen_rewards.gather(-1, chosen_masks.sum(-1, keepdim=True) - 1)`), last-token Bradley-Terry loss.
#
# The value-head model is trl's AutoModelForCausalLMWithValueHead shape (v_head on the last hidden
# state), written here around a tiny LlamaForCausalLM; batches are right-padded by
# DataCollatorForSeq2Seq (pad id in input_ids, 0 in attention_mask), chosen rows first.
import sys

import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv


class ValueHead(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.dropout = nn.Identity()
        self.summary = nn.Linear(config.hidden_size, 1)

    def forward(self, hidden_states):
        return self.summary(self.dropout(hidden_states))


class AutoModelForCausalLMWithValueHead(nn.Module):
    def __init__(self, pretrained_model):
        super().__init__()
        self.pretrained_model = pretrained_model
        self.config = pretrained_model.config
        self.v_head = ValueHead(self.config)

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        kwargs["output_hidden_states"] = True
        base_model_output = self.pretrained_model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        last_hidden_state = base_model_output.hidden_states[-1]
        lm_logits = base_model_output.logits
        value = self.v_head(last_hidden_state).squeeze(-1)
        return (lm_logits, None, value)


class Tokenizer:
    bos_token_id = 1
    eos_token_id = 2
    pad_token_id = None


def fix_tokenizer(tokenizer):
    # get_template_and_fix_tokenizer
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return tokenizer


def pairwise_collate(features, tokenizer):
    # PairwiseDataCollatorWithPadding -> DataCollatorForSeq2Seq (padding_side="right")
    concatenated = []
    for key in ("chosen", "rejected"):
        for feature in features:
            concatenated.append(
                {
                    "input_ids": feature["{}_input_ids".format(key)],
                    "attention_mask": feature["{}_attention_mask".format(key)],
                }
            )
    max_len = max(len(f["input_ids"]) for f in concatenated)
    input_ids, attention_mask = [], []
    for f in concatenated:
        pad = max_len - len(f["input_ids"])
        input_ids.append(f["input_ids"] + [tokenizer.pad_token_id] * pad)
        attention_mask.append(f["attention_mask"] + [0] * pad)
    return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention_mask)}


class PairwiseTrainer:
    def __init__(self, model, tokenizer):
        self.model = model
        self.tokenizer = tokenizer

    def compute_loss(self, model, inputs, return_outputs=False):
        # Compute rewards
        _, _, values = model(**inputs, output_hidden_states=True, return_dict=True)

        batch_size = inputs["input_ids"].size(0) // 2
        if FIXED:
            chosen_masks, rejected_masks = torch.split(inputs["attention_mask"], batch_size, dim=0)
            chosen_rewards, rejected_rewards = torch.split(values, batch_size, dim=0)
            chosen_scores = chosen_rewards.gather(dim=-1, index=(chosen_masks.sum(dim=-1, keepdim=True) - 1))
            rejected_scores = rejected_rewards.gather(dim=-1, index=(rejected_masks.sum(dim=-1, keepdim=True) - 1))
            chosen_scores, rejected_scores = chosen_scores.squeeze(), rejected_scores.squeeze()
            loss = -torch.nn.functional.logsigmoid(chosen_scores - rejected_scores).mean()
            if return_outputs:
                return loss, (loss, chosen_scores, rejected_scores)
            return loss

        # Split the inputs and rewards into two parts, chosen and rejected
        chosen_input_ids, rejected_input_ids = inputs["input_ids"][:batch_size], inputs["input_ids"][batch_size:]
        chosen_rewards, rejected_rewards = values[:batch_size], values[batch_size:]
        chosen_scores, rejected_scores = [], []

        # Compute pairwise loss. Only backprop on the different tokens before padding
        loss = 0
        for i in range(batch_size):
            chosen_length = (chosen_input_ids[i] != self.tokenizer.pad_token_id).nonzero()[-1] + 1
            rejected_length = (rejected_input_ids[i] != self.tokenizer.pad_token_id).nonzero()[-1] + 1
            check_divergence = (chosen_input_ids[i] != rejected_input_ids[i]).nonzero()

            if len(check_divergence) == 0:
                end_index = chosen_length
                div_index = end_index - 1
            else:
                end_index = max(chosen_length, rejected_length)
                div_index = check_divergence[0]

            assert div_index > 0
            chosen_trunc_rewards = chosen_rewards[i, div_index:end_index]
            rejected_trunc_rewards = rejected_rewards[i, div_index:end_index]
            if return_outputs:  # use the score on the last token except pad token for inference
                chosen_scores.append(chosen_rewards[i, chosen_length - 1])
                rejected_scores.append(rejected_rewards[i, rejected_length - 1])
            loss += -torch.nn.functional.logsigmoid(chosen_trunc_rewards - rejected_trunc_rewards).mean()

        loss = loss / batch_size
        if return_outputs:
            chosen_scores, rejected_scores = torch.stack(chosen_scores).squeeze(-1), torch.stack(rejected_scores).squeeze(-1)
            return loss, [loss, chosen_scores, rejected_scores]
        return loss


def main():
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=2,
        attn_implementation="sdpa",
    )
    model = AutoModelForCausalLMWithValueHead(LlamaForCausalLM(config)).eval()
    tokenizer = fix_tokenizer(Tokenizer())

    def example(prompt, chosen, rejected):
        # preprocess_pairwise_dataset: prompt + response + eos (template eos slot)
        c = [tokenizer.bos_token_id] + prompt + chosen + [tokenizer.eos_token_id]
        r = [tokenizer.bos_token_id] + prompt + rejected + [tokenizer.eos_token_id]
        return {
            "chosen_input_ids": c, "chosen_attention_mask": [1] * len(c),
            "rejected_input_ids": r, "rejected_attention_mask": [1] * len(r),
        }

    features = [
        example([10, 11, 12], [20, 21, 22, 23], [30, 31]),
        example([13, 14], [24, 25], [32, 33, 34, 35, 36]),
    ]
    inputs = pairwise_collate(features, tokenizer)
    trainer = PairwiseTrainer(model, tokenizer)
    with torch.no_grad():
        loss, (_, chosen_scores, rejected_scores) = trainer.compute_loss(model, inputs, return_outputs=True)
    print("loss", round(loss.item(), 6))
    print("chosen scores", [round(v, 6) for v in chosen_scores.tolist()])
    print("rejected scores", [round(v, 6) for v in rejected_scores.tolist()])


if __name__ == "__main__":
    main()
