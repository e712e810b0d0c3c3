"""TorchRL GPT2RewardModel: the end score is looked up with GPT-2's eos id whatever tokenizer the model came with.

Citation: pytorch/rl#3887, commit 8af364334 ("[BugFix] Infer reward model pad token from model tokenizer"),
torchrl/modules/models/llm.py GPT2RewardModel (__init__, forward, _compute_end_scores, compute_reward_loss).
Bug state read at 8af364334^.

Bug: GPT2RewardModel(model_path=...) loads any GPT-2-like checkpoint, but its `pad_id` (used to find the last
non-padding token whose reward is the sequence's end score, and as the default of compute_reward_loss) was always
`GPT2TokenizerFast.from_pretrained("gpt2").eos_token_id`, i.e. 50256. For a checkpoint whose tokenizer pads with
another id, no pad is ever found: every end score is read at the last column, over the right padding of each
shorter sequence, and the pairwise loss runs its reward differences over the padding up to the full length.

Fix: pad_id is an argument, else the pad (or eos) id of the tokenizer at model_path, else the model config's;
compute_reward_loss called on an instance uses that pad_id.

This program: a tiny GPT-2 checkpoint and a tiny word-level tokenizer (pad id 0, right padding) are saved to a
temporary directory and loaded back through GPT2RewardModel(model_path=...); chosen / rejected summaries are
scored and the pairwise loss is computed. The pre-fix `GPT2TokenizerFast.from_pretrained("gpt2").eos_token_id`
is written as its value, 50256, so that nothing is downloaded.
"""
import os
import sys
import tempfile
from pathlib import Path
from types import SimpleNamespace
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from torch import nn as nn
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

FIXED = "--fixed" in sys.argv

GPT2_EOS_TOKEN_ID = 50256  # GPT2TokenizerFast.from_pretrained("gpt2").eos_token_id


class GPT2RewardModel(nn.Module):
    def __init__(self, model_path=None, pad_token_id=None):
        from transformers import GPT2LMHeadModel

        super().__init__()
        if model_path is not None:
            model = GPT2LMHeadModel.from_pretrained(model_path, return_dict=False)
        else:
            model = GPT2LMHeadModel(GPT2LMHeadModel.config_class())

        self.config = model.config
        self.transformer = model.transformer

        # replace last layer with the reward layer
        self.lm_head = nn.Linear(self.config.n_embd, 1, bias=False)
        if FIXED:
            self.pad_id = self._get_pad_token_id(model, model_path, pad_token_id)
        else:
            self.pad_id = GPT2_EOS_TOKEN_ID

    @staticmethod
    def _get_pad_token_id(model: Any, model_path, pad_token_id) -> int:
        if pad_token_id is not None:
            return pad_token_id

        tokenizer_model_path = "gpt2" if model_path is None else model_path
        try:
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(tokenizer_model_path)
        except Exception:
            tokenizer = None

        if tokenizer is not None:
            tokenizer_pad_token_id = getattr(tokenizer, "pad_token_id", None)
            if tokenizer_pad_token_id is not None:
                return tokenizer_pad_token_id
            tokenizer_eos_token_id = getattr(tokenizer, "eos_token_id", None)
            if tokenizer_eos_token_id is not None:
                return tokenizer_eos_token_id

        config_pad_token_id = getattr(model.config, "pad_token_id", None)
        if config_pad_token_id is not None:
            return config_pad_token_id
        config_eos_token_id = getattr(model.config, "eos_token_id", None)
        if config_eos_token_id is not None:
            return config_eos_token_id
        raise ValueError("Could not infer a padding token id from the tokenizer or model config.")

    def forward(self, input_ids, attention_mask):
        outputs = self.transformer(input_ids=input_ids, attention_mask=attention_mask)
        hidden_states = outputs[0]
        rewards = self.lm_head(hidden_states).squeeze(-1)
        end_scores = self._compute_end_scores(rewards, input_ids)
        return rewards, end_scores

    def _compute_end_scores(self, rewards, input_ids):
        end_scores = []
        bs = input_ids.shape[0]
        for i in range(bs):
            pad_inds = (input_ids[i] == self.pad_id).nonzero()
            first_pad_ind = pad_inds[0].item() if len(pad_inds) > 0 else input_ids.shape[1]
            end_scores.append(rewards[i, first_pad_ind - 1])
        return torch.stack(end_scores)

    def compute_reward_loss(self, chosen_batch, rejected_batch, pad_token_id=None):
        if pad_token_id is None:
            # pre-fix: a staticmethod whose pad_token_id defaulted to 50256
            pad_token_id = self.pad_id if FIXED else GPT2_EOS_TOKEN_ID
        return GPT2RewardModel._compute_reward_loss(chosen_batch, rejected_batch, pad_token_id)

    @staticmethod
    def _compute_reward_loss(chosen_batch, rejected_batch, pad_token_id):
        chosen_ids = chosen_batch.input_ids
        rejected_ids = rejected_batch.input_ids
        chosen_rewards = chosen_batch.rewards
        rejected_rewards = rejected_batch.rewards

        bs = chosen_rewards.shape[0]
        loss = None
        valid_count = 0
        for i in range(bs):
            # Check if there is any padding otherwise take length of sequence
            c_inds = (chosen_ids[i] == pad_token_id).nonzero()
            c_ind = c_inds[0].item() if len(c_inds) > 0 else chosen_ids.shape[1]
            r_inds = (rejected_ids[i] == pad_token_id).nonzero()
            r_ind = r_inds[0].item() if len(r_inds) > 0 else rejected_ids.shape[1]
            end_ind = max(c_ind, r_ind)

            # Retrieve first index where trajectories diverge
            divergence = (chosen_ids[i] != rejected_ids[i]).nonzero(as_tuple=False)
            if divergence.numel() == 0:
                continue
            divergence_ind = divergence[0].item()

            c_truncated_reward = chosen_rewards[i][divergence_ind:end_ind]
            r_truncated_reward = rejected_rewards[i][divergence_ind:end_ind]

            sample_loss = -F.logsigmoid(c_truncated_reward - r_truncated_reward).mean()
            loss = sample_loss if loss is None else loss + sample_loss
            valid_count += 1
        if loss is None:
            return chosen_rewards.sum() * 0.0 + rejected_rewards.sum() * 0.0
        return loss / valid_count


def save_tiny_checkpoint(path: Path):
    words = ["<pad>", "<eos>", "<unk>", "post:", "tl;dr:", "the", "cat", "sat", "on", "mat", "a", "dog",
             "ran", "home", "fast", "slowly", "and", "then", "slept", "ate", "food", "it", "was", "good"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>",
                                        unk_token="<unk>", padding_side="right")
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(words), n_positions=64, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=1, eos_token_id=1, pad_token_id=None)
    GPT2LMHeadModel(config).save_pretrained(path)
    return tokenizer


def main():
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = save_tiny_checkpoint(Path(tmp))
        torch.manual_seed(1)
        reward_model = GPT2RewardModel(model_path=tmp).eval()

        chosen = ["post: the cat sat on the mat tl;dr: cat sat <eos>",
                  "post: a dog ran home fast and then slept tl;dr: dog ran home and slept <eos>"]
        rejected = ["post: the cat sat on the mat tl;dr: it was a dog and it ate food fast <eos>",
                    "post: a dog ran home fast and then slept tl;dr: dog <eos>"]
        batches = []
        for texts in (chosen, rejected):
            enc = tokenizer(texts, padding="max_length", max_length=24, return_tensors="pt")
            with torch.no_grad():
                rewards, end_scores = reward_model(enc["input_ids"], enc["attention_mask"])
            batches.append(SimpleNamespace(input_ids=enc["input_ids"], attention_mask=enc["attention_mask"],
                                           rewards=rewards, end_scores=end_scores))
        chosen_batch, rejected_batch = batches
        loss = reward_model.compute_reward_loss(chosen_batch, rejected_batch)

    print("pad_id:", reward_model.pad_id)
    print("chosen end_scores:", chosen_batch.end_scores.tolist())
    print("rejected end_scores:", rejected_batch.end_scores.tolist())
    print("accuracy:", (chosen_batch.end_scores > rejected_batch.end_scores).float().mean().item())
    print("reward loss:", loss.item())


if __name__ == "__main__":
    main()
