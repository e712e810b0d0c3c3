# DeepSpeed-Chat (deepspeedai/DeepSpeedExamples#457, commit 9a586b1b): DataCollatorRLHF pads the *flipped* prompts
# with pad=(pad_length, 0), so after the flip back the extra pads (mask 0) land AFTER the prompt and the actor's
# generate() predicts the first answer token from a pad position instead of the last real prompt token.
import sys

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence
from transformers import OPTConfig, OPTForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

PAD_ID = 1  # OPT pad token


class PromptDataset(torch.utils.data.Dataset):
    """train_phase == 3: each item is (flipped input_ids, flipped attention_mask, pad_token_id)."""

    def __init__(self, prompt_dataset, pad_token_id):
        self.prompt_dataset = prompt_dataset
        self.pad_token_id = pad_token_id

    def __len__(self):
        return len(self.prompt_dataset)

    def __getitem__(self, idx):
        return (self.prompt_dataset[idx]["input_ids"], self.prompt_dataset[idx]["attention_mask"], self.pad_token_id)


def create_phase3_prompts(token_lists, max_seq_len):
    # data_utils.create_dataset_split, train_phase == 3: tokens are stored flipped
    prompt_dataset = []
    for ids in token_lists:
        prompt_token = {"input_ids": torch.tensor([ids]), "attention_mask": torch.ones(1, len(ids), dtype=torch.long)}
        for key_word in ["input_ids", "attention_mask"]:
            length = prompt_token[key_word].size()[-1]
            if length > max_seq_len:
                y = prompt_token[key_word].squeeze(0)[length - (max_seq_len - 1):].flip(0)
            else:
                y = prompt_token[key_word].squeeze(0).flip(0)
            prompt_token[key_word] = y
        prompt_dataset.append(prompt_token)
    return PromptDataset(prompt_dataset, PAD_ID)


class DataCollatorRLHF:

    def __init__(self, max_token_len, inference_tp_size):
        self.max_token_len = max_token_len
        self.inference_tp_size = inference_tp_size

    def __call__(self, data):
        batch = {}
        pad_token_id = data[-1][-1]

        prompt = pad_sequence([f[0] for f in data], padding_value=pad_token_id, batch_first=True)
        prompt_mask = pad_sequence([f[1] for f in data], padding_value=0, batch_first=True)

        ### make sure the final ouput is a seqence of 2**?
        length = prompt.size()[-1]
        pad_length = self.max_token_len - length
        if pad_length > 0:
            side = (0, pad_length) if FIXED else (pad_length, 0)
            batch["prompt"] = F.pad(prompt, pad=side, mode='constant', value=pad_token_id)
            batch["prompt_att_mask"] = F.pad(prompt_mask, pad=side, mode='constant', value=0)
        else:
            batch["prompt"] = prompt
            batch["prompt_att_mask"] = prompt_mask
        batch["prompt"] = batch["prompt"].flip(1)
        batch["prompt_att_mask"] = batch["prompt_att_mask"].flip(1)
        return batch


config = OPTConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, ffn_dim=64, num_attention_heads=4,
                   max_position_embeddings=64, word_embed_proj_dim=32, pad_token_id=PAD_ID, bos_token_id=2,
                   eos_token_id=2, dropout=0.0, attention_dropout=0.0, init_std=0.5)
config._attn_implementation = "eager"
actor = OPTForCausalLM(config).eval()

prompts_tokens = [[2, 11, 23, 9, 40, 17, 5], [2, 31, 8, 14], [2, 50, 6, 19, 27, 33]]
max_prompt_seq_len = 10
max_answer_seq_len = 4

dataset = create_phase3_prompts(prompts_tokens, max_prompt_seq_len)
collator = DataCollatorRLHF(max_prompt_seq_len, inference_tp_size=1)
loader = torch.utils.data.DataLoader(dataset, batch_size=3, collate_fn=collator)
batch = next(iter(loader))
prompts = batch["prompt"]
print("prompt_att_mask:\n", batch["prompt_att_mask"])


def _generate_sequence(prompts):
    # ppo_trainer.DeepSpeedPPOTrainer._generate_sequence at this commit (mask inferred by generate from pad ids)
    max_min_length = max_answer_seq_len + prompts.shape[1]
    with torch.no_grad():
        out = actor.generate(prompts, max_length=max_min_length, min_length=max_min_length, do_sample=False,
                             output_logits=True, return_dict_in_generate=True)
    return out


out = _generate_sequence(prompts)
first_logits = out.logits[0]  # raw logits of the first generated token

# reference: each prompt alone, no padding at all
max_diff = 0.0
for i, ids in enumerate(prompts_tokens):
    with torch.no_grad():
        solo = actor.generate(torch.tensor([ids]), max_length=len(ids) + 1, min_length=len(ids) + 1, do_sample=False,
                              output_logits=True, return_dict_in_generate=True)
    max_diff = max(max_diff, (first_logits[i] - solo.logits[0][0]).abs().max().item())
print(f"max |first-step logits (collated batch) - (prompt alone)| = {max_diff:.6f}")
