# DeepSpeed-Chat, deepspeedai/DeepSpeedExamples#601 (commit 4bda9e04, "make the tokenizer by default right padding").
# Step 2 keeps the tokenizer's own padding side (left for LLaMA), but RewardModel takes the first PAD as the end of
# each sequence, so with left padding the chosen/rejected reward window [divergence_ind:end_ind] is empty (loss NaN).
import sys

import torch
from torch import nn
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import LlamaConfig, LlamaModel, PreTrainedTokenizerFast

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class RewardModel(nn.Module):
    """applications/DeepSpeed-Chat/training/utils/model/reward_model.py"""

    def __init__(self, base_model, tokenizer, num_padding_at_beginning=0):
        super().__init__()
        self.config = base_model.config
        self.num_padding_at_beginning = num_padding_at_beginning
        self.config.n_embd = self.config.hidden_size if hasattr(self.config, "hidden_size") else self.config.n_embd
        self.v_head = nn.Linear(self.config.n_embd, 1, bias=False)
        self.rwtranrsformer = base_model
        self.PAD_ID = tokenizer.pad_token_id

    def forward(self, input_ids=None, past_key_values=None, attention_mask=None, position_ids=None,
                head_mask=None, inputs_embeds=None, use_cache=False):
        transformer_outputs = self.rwtranrsformer(input_ids, past_key_values=past_key_values,
                                                  attention_mask=attention_mask, inputs_embeds=inputs_embeds,
                                                  use_cache=use_cache)
        hidden_states = transformer_outputs[0]
        rewards = self.v_head(hidden_states).squeeze(-1)
        chosen_mean_scores = []
        rejected_mean_scores = []

        assert len(input_ids.shape) == 2
        bs = input_ids.shape[0] // 2
        seq_len = input_ids.shape[1]
        chosen_ids = input_ids[:bs]
        rejected_ids = input_ids[bs:]
        chosen_rewards = rewards[:bs]
        rejected_rewards = rewards[bs:]

        loss = 0
        for i in range(bs):
            chosen_id = chosen_ids[i]
            rejected_id = rejected_ids[i]
            chosen_reward = chosen_rewards[i]
            rejected_reward = rejected_rewards[i]

            c_inds = (chosen_id == self.PAD_ID).nonzero()
            c_ind = c_inds[self.num_padding_at_beginning].item() if len(
                c_inds) > self.num_padding_at_beginning else seq_len
            check_divergence = (chosen_id != rejected_id).nonzero()

            if len(check_divergence) == 0:
                end_ind = rejected_reward.size(-1)
                divergence_ind = end_ind - 1
                r_ind = c_ind
            else:
                r_inds = (rejected_id == self.PAD_ID).nonzero()
                r_ind = r_inds[self.num_padding_at_beginning].item() if len(
                    r_inds) > self.num_padding_at_beginning else seq_len
                end_ind = max(c_ind, r_ind)
                divergence_ind = check_divergence[0]
            assert divergence_ind > 0
            c_truncated_reward = chosen_reward[divergence_ind:end_ind]
            r_truncated_reward = rejected_reward[divergence_ind:end_ind]
            chosen_mean_scores.append(chosen_reward[c_ind - 1])  # use the end score for reference
            rejected_mean_scores.append(rejected_reward[r_ind - 1])
            loss += -torch.nn.functional.logsigmoid(c_truncated_reward - r_truncated_reward).mean()

        loss = loss / bs
        return {"loss": loss, "chosen_mean_scores": torch.stack(chosen_mean_scores),
                "rejected_mean_scores": torch.stack(rejected_mean_scores)}


class DataCollatorReward:
    def __call__(self, data):
        batch = {}
        batch["input_ids"] = torch.cat([f[0] for f in data] + [f[2] for f in data], dim=0)
        batch["attention_mask"] = torch.cat([f[1] for f in data] + [f[3] for f in data], dim=0)
        return batch


def create_dataset_split(pairs, tokenizer, end_of_conversation_token, max_seq_len):
    """data_utils.create_dataset_split, train_phase == 2"""
    out = []
    for chosen_sentence, reject_sentence in pairs:
        chosen_sentence += end_of_conversation_token
        reject_sentence += end_of_conversation_token
        chosen_token = tokenizer(chosen_sentence, max_length=max_seq_len, padding="max_length", truncation=True,
                                 return_tensors="pt")
        reject_token = tokenizer(reject_sentence, max_length=max_seq_len, padding="max_length", truncation=True,
                                 return_tensors="pt")
        out.append((chosen_token["input_ids"], chosen_token["attention_mask"],
                    reject_token["input_ids"], reject_token["attention_mask"]))
    return out


# A LLaMA-style tokenizer (LlamaTokenizer defaults to padding_side="left"); word-level so it needs no download.
words = ["<unk>", "<s>", "</s>", "<|endoftext|>"] + [f"w{i}" for i in range(60)]
tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
tok.pre_tokenizer = Whitespace()
tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                                    padding_side="left")

# step2_reward_model_finetuning/main.py
tokenizer.pad_token = tokenizer.eos_token
if FIXED:
    # make sure tokenizer is right pad in our logic
    tokenizer.padding_side = 'right'

cfg = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                  pad_token_id=tokenizer.pad_token_id)
rm_model = RewardModel(LlamaModel(cfg), tokenizer, num_padding_at_beginning=0).eval()

g = torch.Generator().manual_seed(1)


def sent(prefix, n):
    return prefix + " " + " ".join(f"w{int(i)}" for i in torch.randint(0, 60, (n,), generator=g))


pairs = []
for n_prompt, n_c, n_r in [(6, 5, 8), (4, 9, 3), (7, 2, 6)]:
    prompt = " ".join(f"w{int(i)}" for i in torch.randint(0, 60, (n_prompt,), generator=g))
    pairs.append((sent("Human: " + prompt + " Assistant:", n_c), sent("Human: " + prompt + " Assistant:", n_r)))
dataset = create_dataset_split(pairs, tokenizer, " <|endoftext|>", max_seq_len=28)
batch = DataCollatorReward()(dataset)

with torch.no_grad():
    outputs = rm_model(**batch, use_cache=False)
print("RewardModel loss:", round(outputs["loss"].item(), 6))
print("chosen_mean_scores:", [round(v, 4) for v in outputs["chosen_mean_scores"].tolist()])
