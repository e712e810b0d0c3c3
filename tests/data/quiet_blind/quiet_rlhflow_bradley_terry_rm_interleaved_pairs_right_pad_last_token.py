# Correct program (quiet batch quiet-r135a).
# Ported from RLHFlow/RLHF-Reward-Modeling @69bd2d72363a94b8d211797cff7d24ea0208f7e8: bradley-terry-rm/llama3_rm.py
#   (build_dataset.tokenize: chat template applied to the chosen and rejected conversations, the bos stripped from the
#   text because the tokenizer adds it again, input_ids_j / attention_mask_j and input_ids_k / attention_mask_k;
#   tokenizer.add_special_tokens({'pad_token': '[PAD]'}), truncation_side "left", the tokenizer's default right
#   padding; RewardDataCollatorWithPadding: chosen and rejected of every pair interleaved [j0, k0, j1, k1, ...] and
#   padded together by tokenizer.pad; RewardTrainer.compute_loss: one forward of AutoModelForSequenceClassification
#   (num_labels=1, config.pad_token_id = the new [PAD] id, resize_token_embeddings), rewards[0::2] vs rewards[1::2],
#   -logsigmoid(r_j - r_k); compute_metrics accuracy).
# The model is a tiny LlamaForSequenceClassification from a LlamaConfig (sdpa here; the script asks for
# flash_attention_2, which needs a GPU), and the tokenizer a word-level PreTrainedTokenizerFast with a Llama-3-like
# chat template and a post-processor that prepends <|begin_of_text|>. LlamaForSequenceClassification pools at each
# row's last token that is not config.pad_token_id, i.e. the closing <|eot_id|> of each right-padded conversation.
# Self-check: every conversation alone, unpadded, through the base model; its reward is the score head on the last
# hidden state; the rewards, the pairwise loss, the accuracy and the gradients of the loss must match the batch's.
import sys

import numpy as np
import torch
import torch.nn as nn
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Union

from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedTokenizerFast
from transformers.utils import PaddingStrategy

torch.manual_seed(0)

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|> {{ message['role'] }} <|end_header_id|> {{ message['content'] }} <|eot_id|> "
    "{% endfor %}"
)

PAIRS = [
    {
        "chosen": [{"role": "user", "content": "how do i boil an egg"},
                   {"role": "assistant", "content": "put the egg in boiling water for nine minutes then cool it"}],
        "rejected": [{"role": "user", "content": "how do i boil an egg"},
                     {"role": "assistant", "content": "eggs are nice"}],
    },
    {
        "chosen": [{"role": "user", "content": "name a prime number"},
                   {"role": "assistant", "content": "seven is prime"}],
        "rejected": [{"role": "user", "content": "name a prime number"},
                     {"role": "assistant", "content": "nine is prime because it is odd and odd numbers are prime"}],
    },
    {
        "chosen": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "hi"}],
        "rejected": [{"role": "user", "content": "say hi"}, {"role": "assistant", "content": "no"}],
    },
]


def build_tokenizer():
    specials = ["<|begin_of_text|>", "<|eot_id|>", "<|start_header_id|>", "<|end_header_id|>", "<unk>"]
    words = sorted({w for p in PAIRS for side in ("chosen", "rejected") for m in p[side]
                    for w in (m["role"] + " " + m["content"]).split()})
    vocab = {tok: i for i, tok in enumerate(specials + words)}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    bos_id = vocab["<|begin_of_text|>"]
    backend.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
        special_tokens=[("<|begin_of_text|>", bos_id)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>",
                                  unk_token="<unk>", additional_special_tokens=specials[2:4])
    tok.chat_template = CHAT_TEMPLATE
    return tok


# --- llama3_rm.py: tokenizer set-up ---
tokenizer = build_tokenizer()
tokenizer.add_special_tokens({'pad_token': '[PAD]'})
tokenizer.truncation_side = "left"
tokenizer.model_max_length = 64
assert tokenizer.padding_side == "right"


# --- llama3_rm.py: build_dataset.tokenize ---
def tokenize(sample):
    sample['positive'] = tokenizer.apply_chat_template(
        sample['chosen'], tokenize=False, add_generation_prompt=False).replace(tokenizer.bos_token, "")
    sample['negative'] = tokenizer.apply_chat_template(
        sample['rejected'], tokenize=False, add_generation_prompt=False).replace(tokenizer.bos_token, "")
    tokenized_pos = tokenizer(sample['positive'], truncation=True)
    tokenized_neg = tokenizer(sample['negative'], truncation=True)
    sample["input_ids_j"] = tokenized_pos["input_ids"]
    sample["attention_mask_j"] = tokenized_pos["attention_mask"]
    sample["input_ids_k"] = tokenized_neg["input_ids"]
    sample["attention_mask_k"] = tokenized_neg["attention_mask"]
    return sample


train_dataset = [tokenize(dict(p)) for p in PAIRS]

# --- llama3_rm.py: model set-up (a tiny Llama instead of Meta-Llama-3-8B-Instruct) ---
config = LlamaConfig(vocab_size=len(tokenizer) - 1, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, num_labels=1,
                     bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                     attn_implementation="sdpa")
model = LlamaForSequenceClassification(config)
model.config.use_cache = False
model.config.pad_token_id = tokenizer.pad_token_id
model.resize_token_embeddings(len(tokenizer))


# --- llama3_rm.py: RewardDataCollatorWithPadding ---
@dataclass
class RewardDataCollatorWithPadding:
    tokenizer: Any
    padding: Union[bool, str, PaddingStrategy] = True
    max_length: Optional[int] = None
    pad_to_multiple_of: Optional[int] = None
    return_tensors: str = "pt"

    def __call__(self, features: List[Dict[str, Any]]) -> Dict[str, Any]:
        merged_features = []

        for feature in features:
            merged_features.append(
                {
                    "input_ids": feature["input_ids_j"],
                    "attention_mask": feature["attention_mask_j"],
                }
            )
            merged_features.append(
                {
                    "input_ids": feature["input_ids_k"],
                    "attention_mask": feature["attention_mask_k"],
                }
            )
        batch = self.tokenizer.pad(
            merged_features,
            padding=self.padding,
            max_length=self.max_length,
            pad_to_multiple_of=self.pad_to_multiple_of,
            return_tensors=self.return_tensors,
        )
        batch = {
            "input_ids": batch["input_ids"],
            "attention_mask": batch["attention_mask"],
            "return_loss": True,
        }
        return batch


def compute_metrics(eval_pred):
    result = {}
    pos_predictions_scores = eval_pred[0]
    neg_predictions_scores = eval_pred[1]
    # We assume that the first sample is preferred by default in groundtruth
    result['accuracy'] = np.sum(
        pos_predictions_scores > neg_predictions_scores) / len(pos_predictions_scores)
    return result


# --- llama3_rm.py: RewardTrainer.compute_loss ---
def compute_loss(model, inputs, return_outputs=False):
    rewards = model(
        input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]
    )[0]
    bsz = rewards.size(0)
    jidx = torch.arange(0, bsz, 2)
    kidx = jidx + 1
    rewards_j = rewards[jidx]
    rewards_k = rewards[kidx]
    loss = -nn.functional.logsigmoid(rewards_j - rewards_k).mean()
    if return_outputs:
        return loss, {"rewards_j": rewards_j, "rewards_k": rewards_k}
    return loss


collator = RewardDataCollatorWithPadding(tokenizer=tokenizer, max_length=64)
inputs = collator(train_dataset)
print("batch input_ids:\n", inputs["input_ids"])
print("batch attention_mask:\n", inputs["attention_mask"])

model.zero_grad()
loss, outputs = compute_loss(model, inputs, return_outputs=True)
loss.backward()
batch_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
metrics = compute_metrics((outputs["rewards_j"].detach().numpy(), outputs["rewards_k"].detach().numpy()))
print(f"batched: loss {loss.item():.6f} accuracy {metrics['accuracy']:.3f}")


# --- reference: each conversation alone, no padding, reward read at its last token ---
def reward_alone(ids):
    ids = torch.tensor([ids])
    hidden = model.model(input_ids=ids).last_hidden_state
    return model.score(hidden[0, -1])


model.zero_grad()
ref_j = torch.stack([reward_alone(f["input_ids_j"]) for f in train_dataset])
ref_k = torch.stack([reward_alone(f["input_ids_k"]) for f in train_dataset])
ref_loss = -nn.functional.logsigmoid(ref_j - ref_k).mean()
ref_loss.backward()
ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
ref_metrics = compute_metrics((ref_j.detach().numpy(), ref_k.detach().numpy()))
print(f"reference: loss {ref_loss.item():.6f} accuracy {ref_metrics['accuracy']:.3f}")

err_j = (outputs["rewards_j"] - ref_j).abs().max().item()
err_k = (outputs["rewards_k"] - ref_k).abs().max().item()
err_g = max((batch_grads[n] - ref_grads[n]).abs().max().item() for n in ref_grads)
print(f"max |reward err| chosen {err_j:.2e} rejected {err_k:.2e}; max |grad err| {err_g:.2e}")
assert set(batch_grads) == set(ref_grads)
assert err_j < 1e-5 and err_k < 1e-5, (err_j, err_k)
assert abs(loss.item() - ref_loss.item()) < 1e-6
assert metrics["accuracy"] == ref_metrics["accuracy"]
assert err_g < 1e-5, err_g
print("OK")
sys.exit(0)
