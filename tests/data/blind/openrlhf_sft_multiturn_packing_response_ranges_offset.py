"""OpenRLHF multi-turn SFT with --packing_samples: the response ranges of packed samples were shifted
by the wrong offset.

Citation: OpenRLHF/OpenRLHF#781 "Fix SFT packing_samples" (commit 7a56f00f), files
openrlhf/datasets/sft_dataset.py (SFTDataset.packing_collate_fn) and openrlhf/trainer/sft_trainer.py
(SFTTrainer.fit, the loss-label block).

The bug: packing_collate_fn concatenates the samples of a micro batch into one row (attention_mask holds
the sample index 1..n) and moves each sample's multi-turn ``response_ranges`` (computed from 0 at the
sample's start) into row coordinates by adding ``infos["response_ranges"][-1][-1][1]``, the end index of
the last response of the previous sample, instead of the number of tokens before the sample. The trainer
then copied ``labels[start:end]`` into an all-IGNORE label row, treating the inclusive end index as
exclusive. Whenever a sample does not end exactly at its last response's end index (here the tokenizer's
eos ``<|end_of_text|>`` is appended after the turn terminator ``<|eot_id|>``), every later sample's
supervised span slides off its assistant turns into the header tokens before them.

The fix: offset by ``sum(infos["input_length"][:-1])`` and copy ``labels[start:end + 1]``.

Ported at toy sizes: a word-level stand-in for the Llama-3 tokenizer and chat template, a tiny
LlamaForCausalLM (SDPA) called the way Actor.forward calls it for packed samples (position_ids from
reset_position_ids, attention_mask dropped), and GPTLMLoss.
"""

import re
import sys
from types import SimpleNamespace

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---- a word-level stand-in for a Llama-3 tokenizer ----------------------------------------------
class ToyLlama3Tokenizer:
    TOKEN_RE = re.compile(r"<\|[a-z_]+\|>|\n\n|[^\s<]+")

    def __init__(self, corpus):
        self.eos_token = "<|end_of_text|>"
        self.pad_token = "<|end_of_text|>"
        specials = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                    "<|eot_id|>", "\n\n", "user", "assistant"]
        words = sorted({w for text in corpus for w in self.TOKEN_RE.findall(text)} - set(specials))
        self.vocab = {t: i for i, t in enumerate(specials + words)}
        self.eos_token_id = self.vocab[self.eos_token]
        self.pad_token_id = self.vocab[self.pad_token]

    def __call__(self, text, max_length=None, padding=False, truncation=False, return_tensors=None,
                 add_special_tokens=False):
        ids = [self.vocab[t] for t in self.TOKEN_RE.findall(text)]
        if truncation and max_length is not None:
            ids = ids[:max_length]
        ids = torch.tensor([ids], dtype=torch.long)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "<|begin_of_text|>"
        for m in messages:
            text += f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content']}<|eot_id|>"
        if add_generation_prompt:
            text += "<|start_header_id|>assistant<|end_header_id|>\n\n"
        return text


# ---- openrlhf/datasets/sft_dataset.py -----------------------------------------------------------
def preprocess_data(data, input_template=None, input_key="input", output_key=None, apply_chat_template=None,
                    multiturn=False):
    if apply_chat_template:
        if output_key:
            prompt_message = data[input_key]
            response_message = data[output_key]
            prompt = apply_chat_template(prompt_message, tokenize=False, add_generation_prompt=True)
            response = apply_chat_template(prompt_message + response_message, tokenize=False)[len(prompt):]
        else:
            prompt = apply_chat_template(data[input_key][:-1], tokenize=False, add_generation_prompt=True)
            response = apply_chat_template(data[input_key], tokenize=False)[len(prompt):]
    else:
        prompt = data[input_key]
        if input_template:
            prompt = input_template.format(prompt)
        response = data[output_key] if output_key else ""
    return prompt, response


class SFTDataset:
    def __init__(self, dataset, tokenizer, max_length, strategy, input_template=None, pretrain_mode=False,
                 multiple_of=1, multiturn=False):
        self.tokenizer = tokenizer
        self.strategy = strategy
        self.pretrain_mode = pretrain_mode
        self.max_length = max_length
        self.multiple_of = multiple_of
        self.multiturn = multiturn

        self.input_template = input_template
        self.input_key = getattr(self.strategy.args, "input_key", None)
        self.output_key = getattr(self.strategy.args, "output_key", None)
        self.apply_chat_template = getattr(self.strategy.args, "apply_chat_template", False)
        if self.apply_chat_template:
            self.apply_chat_template = self.tokenizer.apply_chat_template

        # (datasets.map + filter in OpenRLHF)
        processed = [self.process_data(dict(d)) for d in dataset]
        processed = [x for x in processed if x["prompt"] is not None]
        self.prompts = [x["prompt"] for x in processed]
        self.responses = [x["response"] for x in processed]
        self.prompt_ids_lens = [x["prompt_ids_len"] for x in processed]
        # Arrow hands tuples back as lists
        self.response_ranges = [[list(r) for r in x["response_ranges"]] for x in processed] if self.multiturn else None

    def process_data(self, data):
        if self.multiturn:
            input_key = self.input_key
            apply_chat_template = self.apply_chat_template
            response_ranges = []
            for idx, message in enumerate(data[input_key]):
                if message["role"] == "assistant":
                    prompt = apply_chat_template(data[input_key][:idx], tokenize=False, add_generation_prompt=True)
                    response = apply_chat_template(data[input_key][: idx + 1], tokenize=False)[len(prompt):]

                    start_idx = (
                        self.tokenizer(prompt, max_length=self.max_length, padding=False, truncation=True,
                                       return_tensors="pt", add_special_tokens=False)["attention_mask"]
                        .int().sum().item()
                    )
                    end_idx = (
                        start_idx
                        + self.tokenizer(response, max_length=self.max_length, padding=False, truncation=True,
                                         return_tensors="pt", add_special_tokens=False)["attention_mask"]
                        .int().sum().item()
                        - 1
                    )
                    response_ranges.append((start_idx, end_idx))  # left close right open

        prompt, response = preprocess_data(
            data,
            None if self.pretrain_mode else self.input_template,
            self.input_key,
            self.output_key,
            apply_chat_template=None if self.pretrain_mode else self.apply_chat_template,
            multiturn=self.multiturn,
        )

        if not self.pretrain_mode:
            prompt_token = self.tokenizer(prompt, max_length=self.max_length, padding=False, truncation=True,
                                          return_tensors="pt", add_special_tokens=False)
            prompt_ids_len = prompt_token["attention_mask"].int().sum().item()
            if not prompt or not response or prompt_ids_len >= self.max_length - 2:
                prompt = None
        else:
            prompt_ids_len = 0

        return {
            "prompt": prompt,
            "response": response,
            "prompt_ids_len": prompt_ids_len,
            "response_ranges": response_ranges if self.multiturn else None,
        }

    def __len__(self):
        return len(self.prompts)

    def __getitem__(self, idx):
        prompt_ids_len = self.prompt_ids_lens[idx]
        prompt = self.prompts[idx]
        response = self.responses[idx]

        if not self.pretrain_mode:
            text = (prompt + response).rstrip("\n")
            if not text.endswith(self.tokenizer.eos_token):
                text += " " + self.tokenizer.eos_token
        else:
            text = prompt

        input_token = self.tokenizer(text, max_length=self.max_length, padding=False, truncation=True,
                                     return_tensors="pt", add_special_tokens=False)
        if not self.pretrain_mode:
            input_token["input_ids"][0][-1] = self.tokenizer.eos_token_id
            input_token["attention_mask"][0][-1] = True
        info = {
            "input": prompt,
            "output": response,
            "input_length": input_token["attention_mask"].int().sum().item(),
            "response_ranges": [list(r) for r in self.response_ranges[idx]] if self.multiturn else None,
        }
        return prompt_ids_len, input_token["input_ids"], input_token["attention_mask"], info

    def packing_collate_fn(self, item_list):
        packed_input_ids = []
        packed_attention_masks = []
        prompt_ids_lens = []
        infos = {"input_length": [], "response_ranges": [] if self.multiturn else None}
        index = 1
        for prompt_ids_len, input_id, attention_mask, info in item_list:
            packed_input_ids.append(input_id.flatten())
            packed_attention_masks.append(torch.full_like(input_id.flatten(), index))
            prompt_ids_lens.append(prompt_ids_len)
            infos["input_length"].append(info["input_length"])
            if self.multiturn:
                if len(infos["response_ranges"]) >= 1:
                    for i in range(len(info["response_ranges"])):
                        if FIXED:
                            info["response_ranges"][i][0] += sum(infos["input_length"][:-1])
                            info["response_ranges"][i][1] += sum(infos["input_length"][:-1])
                        else:
                            info["response_ranges"][i][0] += infos["response_ranges"][-1][-1][
                                1
                            ]  # end_index of the last response of the last item
                            info["response_ranges"][i][1] += infos["response_ranges"][-1][-1][1]
                infos["response_ranges"].append(info["response_ranges"])
            index += 1

        packed_input_ids = torch.cat(packed_input_ids, dim=0).unsqueeze(0)
        packed_attention_masks = torch.cat(packed_attention_masks, dim=0).unsqueeze(0)

        if self.multiple_of > 1 and packed_input_ids.numel() % self.multiple_of != 0:
            padding_len = self.multiple_of - (packed_input_ids.numel() % self.multiple_of)
            packed_input_ids = F.pad(packed_input_ids, (0, padding_len), value=self.tokenizer.pad_token_id)
            packed_attention_masks = F.pad(packed_attention_masks, (0, padding_len), value=0)

        return prompt_ids_lens, packed_input_ids, packed_attention_masks, infos


# ---- openrlhf/models/utils.py, actor.py, loss.py ------------------------------------------------
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
        self.packing_samples = packing_samples

    def forward(self, sequences, num_actions=None, attention_mask=None, return_output=False):
        if not self.packing_samples:
            position_ids = attention_mask.long().cumsum(-1) - 1
            position_ids.masked_fill_(attention_mask == 0, 1)
        else:
            position_ids = reset_position_ids(attention_mask)
            # explicitly ignore attention_mask for packing_samples
            attention_mask = None
        output = self.model(sequences, attention_mask=attention_mask, position_ids=position_ids)
        output["logits"] = output["logits"].to(torch.float32)
        assert return_output
        return output


class GPTLMLoss(nn.Module):
    def __init__(self):
        super().__init__()
        self.IGNORE_INDEX = -100
        self.loss = nn.CrossEntropyLoss(ignore_index=self.IGNORE_INDEX)

    def forward(self, logits, labels):
        shift_logits = logits[..., :-1, :].contiguous()
        shift_labels = labels[..., 1:].contiguous()
        return self.loss(shift_logits.view(-1, shift_logits.size(-1)), shift_labels.view(-1))


# ---- data, model, one SFTTrainer.fit step ------------------------------------------------------
conversations = [
    {"conversations": [
        {"role": "user", "content": "what is two plus two"},
        {"role": "assistant", "content": "two plus two is four"},
        {"role": "user", "content": "and times three"},
        {"role": "assistant", "content": "four times three is twelve"},
    ]},
    {"conversations": [
        {"role": "user", "content": "name a red fruit"},
        {"role": "assistant", "content": "an apple is red"},
        {"role": "user", "content": "a yellow one"},
        {"role": "assistant", "content": "a banana is yellow"},
    ]},
    {"conversations": [
        {"role": "user", "content": "say hello"},
        {"role": "assistant", "content": "hello there friend"},
        {"role": "user", "content": "say goodbye"},
        {"role": "assistant", "content": "goodbye my friend"},
    ]},
]

corpus = [m["content"] for c in conversations for m in c["conversations"]]
tokenizer = ToyLlama3Tokenizer(corpus)
strategy = SimpleNamespace(args=SimpleNamespace(input_key="conversations", output_key=None, apply_chat_template=True))
train_dataset = SFTDataset(conversations, tokenizer, max_length=128, strategy=strategy, multiturn=True)

config = LlamaConfig(vocab_size=len(tokenizer.vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
config._attn_implementation = "sdpa"
model = Actor(LlamaForCausalLM(config).eval(), packing_samples=True)
loss_fn = GPTLMLoss()

prompt_id_lens, inputs, attention_masks, infos = train_dataset.packing_collate_fn(
    [train_dataset[i] for i in range(len(train_dataset))]
)
attention_mask = attention_masks
output = model(inputs, attention_mask=attention_mask, return_output=True)

labels = torch.where(attention_mask.bool(), inputs, loss_fn.IGNORE_INDEX)
if infos["response_ranges"]:
    dump_labels = torch.full(labels.size(), loss_fn.IGNORE_INDEX).to(labels.device)
    for response_ranges in infos["response_ranges"]:
        for response_range in response_ranges:
            if FIXED:
                dump_labels[0][response_range[0] : response_range[1] + 1] = labels[0][
                    response_range[0] : response_range[1] + 1
                ]
            else:
                dump_labels[0][response_range[0] : response_range[1]] = labels[0][
                    response_range[0] : response_range[1]
                ]
    labels = dump_labels
else:
    index = 0
    for input_length, source_len in zip(infos["input_length"], prompt_id_lens):
        labels[0][index : index + source_len] = loss_fn.IGNORE_INDEX
        index += input_length

gpt_loss = loss_fn(output.logits, labels)
gpt_loss.backward()

inv_vocab = {i: t for t, i in tokenizer.vocab.items()}
print("input_length:", infos["input_length"])
print("response_ranges:", infos["response_ranges"])
print("supervised tokens:", [inv_vocab[int(t)].replace("\n", "\\n") for t in labels[0] if t != loss_fn.IGNORE_INDEX])
print(f"gpt_loss: {gpt_loss.item():.6f}")
