# LLaVA-NeXT training collator, LLaVA-VL/LLaVA-NeXT commit db8bc66 ("Fix tokenizer pad token issue for llama3 model").
# With pad_token_id set to eos (<|eot_id|>), attention_mask = input_ids.ne(pad_token_id) marks every real turn-ending
# eot token as padding, so prepare_inputs_labels_for_multimodal drops those tokens (and their labels) from the sequence.
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)

IGNORE_INDEX = -100
IMAGE_TOKEN_INDEX = -200
EOT_ID = 9  # llama3 <|eot_id|> == tokenizer.eos_token_id here


class Tokenizer:  # the llama3 tokenizer as seen by the collator: no pad token, right padding
    pad_token_id = None
    eos_token_id = EOT_ID
    padding_side = "right"
    model_max_length = 64


@dataclass
class DataCollatorForSupervisedDataset(object):
    tokenizer: Tokenizer

    def pad_sequence(self, input_ids, batch_first, padding_value):
        if self.tokenizer.padding_side == "left":
            input_ids = [torch.flip(_input_ids, [0]) for _input_ids in input_ids]
        input_ids = torch.nn.utils.rnn.pad_sequence(input_ids, batch_first=batch_first, padding_value=padding_value)
        if self.tokenizer.padding_side == "left":
            input_ids = torch.flip(input_ids, [1])
        return input_ids

    def __call__(self, instances):
        input_ids, labels = tuple([instance[key] for instance in instances] for key in ("input_ids", "labels"))
        input_ids = [_input_ids[: self.tokenizer.model_max_length] for _input_ids in input_ids]
        labels = [_labels[: self.tokenizer.model_max_length] for _labels in labels]
        if self.tokenizer.pad_token_id is None:
            if FIXED:
                self.tokenizer.pad_token_id = 0  # This gets the best result. Don't know why.
            else:
                self.tokenizer.pad_token_id = self.tokenizer.eos_token_id  # FIXME: this could only be triggered for llama3 model.
        input_ids = self.pad_sequence(input_ids, batch_first=True, padding_value=self.tokenizer.pad_token_id)
        labels = self.pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX)
        batch = dict(input_ids=input_ids, labels=labels.long() if labels.dtype == torch.int32 else labels,
                     attention_mask=input_ids.ne(self.tokenizer.pad_token_id))
        batch["images"] = torch.stack([instance["image"] for instance in instances])
        return batch


class LlavaLlamaForCausalLM(nn.Module):
    def __init__(self):
        super().__init__()
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
        cfg._attn_implementation = "eager"
        self.llm = LlamaForCausalLM(cfg)
        self.mm_projector = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32))
        self.config = cfg

    def embed_tokens(self, ids):
        return self.llm.get_input_embeddings()(ids)

    def encode_images(self, images):  # (N, P, 16) stand-in vision tower output -> projector
        return self.mm_projector(images)

    def prepare_inputs_labels_for_multimodal(self, input_ids, position_ids, attention_mask, past_key_values, labels, images):
        image_features = self.encode_images(images)
        _labels = labels
        _position_ids = position_ids
        _attention_mask = attention_mask
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids, dtype=torch.bool)
        else:
            attention_mask = attention_mask.bool()
        if position_ids is None:
            position_ids = torch.arange(0, input_ids.shape[1], dtype=torch.long, device=input_ids.device)
        if labels is None:
            labels = torch.full_like(input_ids, IGNORE_INDEX)

        # remove the padding using attention_mask -- FIXME
        input_ids = [cur_input_ids[cur_attention_mask] for cur_input_ids, cur_attention_mask in zip(input_ids, attention_mask)]
        labels = [cur_labels[cur_attention_mask] for cur_labels, cur_attention_mask in zip(labels, attention_mask)]

        new_input_embeds, new_labels = [], []
        cur_image_idx = 0
        for batch_idx, cur_input_ids in enumerate(input_ids):
            num_images = (cur_input_ids == IMAGE_TOKEN_INDEX).sum()
            image_token_indices = [-1] + torch.where(cur_input_ids == IMAGE_TOKEN_INDEX)[0].tolist() + [cur_input_ids.shape[0]]
            cur_input_ids_noim, cur_labels_noim = [], []
            cur_labels = labels[batch_idx]
            for i in range(len(image_token_indices) - 1):
                cur_input_ids_noim.append(cur_input_ids[image_token_indices[i] + 1: image_token_indices[i + 1]])
                cur_labels_noim.append(cur_labels[image_token_indices[i] + 1: image_token_indices[i + 1]])
            split_sizes = [x.shape[0] for x in cur_labels_noim]
            cur_input_embeds = self.embed_tokens(torch.cat(cur_input_ids_noim))
            cur_input_embeds_no_im = torch.split(cur_input_embeds, split_sizes, dim=0)
            cur_new_input_embeds, cur_new_labels = [], []
            for i in range(num_images + 1):
                cur_new_input_embeds.append(cur_input_embeds_no_im[i])
                cur_new_labels.append(cur_labels_noim[i])
                if i < num_images:
                    cur_image_features = image_features[cur_image_idx]
                    cur_image_idx += 1
                    cur_new_input_embeds.append(cur_image_features)
                    cur_new_labels.append(torch.full((cur_image_features.shape[0],), IGNORE_INDEX, dtype=cur_labels.dtype))
            new_input_embeds.append(torch.cat(cur_new_input_embeds))
            new_labels.append(torch.cat(cur_new_labels))

        max_len = max(x.shape[0] for x in new_input_embeds)
        batch_size = len(new_input_embeds)
        new_input_embeds_padded = []
        new_labels_padded = torch.full((batch_size, max_len), IGNORE_INDEX, dtype=new_labels[0].dtype)
        attention_mask = torch.zeros((batch_size, max_len), dtype=attention_mask.dtype)
        position_ids = torch.zeros((batch_size, max_len), dtype=position_ids.dtype)
        for i, (cur_new_embed, cur_new_labels) in enumerate(zip(new_input_embeds, new_labels)):
            cur_len = cur_new_embed.shape[0]
            new_input_embeds_padded.append(torch.cat(
                (cur_new_embed, torch.zeros((max_len - cur_len, cur_new_embed.shape[1]), dtype=cur_new_embed.dtype)), dim=0))
            if cur_len > 0:
                new_labels_padded[i, :cur_len] = cur_new_labels
                attention_mask[i, :cur_len] = True
                position_ids[i, :cur_len] = torch.arange(0, cur_len, dtype=position_ids.dtype)
        new_input_embeds = torch.stack(new_input_embeds_padded, dim=0)
        new_labels = None if _labels is None else new_labels_padded
        attention_mask = None if _attention_mask is None else attention_mask.to(dtype=_attention_mask.dtype)
        if _position_ids is None:
            position_ids = None
        return None, position_ids, attention_mask, past_key_values, new_input_embeds, new_labels

    def forward(self, input_ids, labels, images, attention_mask=None, position_ids=None):
        (_, position_ids, attention_mask, _, inputs_embeds, labels) = self.prepare_inputs_labels_for_multimodal(
            input_ids, position_ids, attention_mask, None, labels, images)
        return self.llm(inputs_embeds=inputs_embeds, attention_mask=attention_mask, position_ids=position_ids,
                        labels=labels)


def preprocess_llama3(user_ids, answer_ids):
    # <|start_header_id|>user<|end_header_id|>\n\n<image>... <|eot_id|><|start_header_id|>assistant ... <|eot_id|>
    inp = [1, 2, 3, IMAGE_TOKEN_INDEX] + user_ids + [EOT_ID] + [1, 4, 3] + answer_ids + [EOT_ID]
    tgt = [IGNORE_INDEX] * (len(inp) - len(answer_ids) - 1) + answer_ids + [EOT_ID]
    return dict(input_ids=torch.tensor(inp), labels=torch.tensor(tgt))


instances = []
for n_user, n_ans in [(5, 6), (2, 3), (7, 2)]:
    ex = preprocess_llama3(torch.randint(10, 64, (n_user,)).tolist(), torch.randint(10, 64, (n_ans,)).tolist())
    ex["image"] = torch.randn(4, 16)
    instances.append(ex)

model = LlavaLlamaForCausalLM().eval()
batch = DataCollatorForSupervisedDataset(Tokenizer())(instances)
with torch.no_grad():
    loss = model(**batch).loss
    # reference: each conversation alone, no padding, every token kept
    tot, cnt = 0.0, 0
    for ex in instances:
        out = model(ex["input_ids"][None], ex["labels"][None], ex["image"][None])
        n = int((ex["labels"][1:] != IGNORE_INDEX).sum())
        tot, cnt = tot + out.loss.item() * n, cnt + n
ref = tot / cnt
lengths = torch.tensor([len(ex["input_ids"]) for ex in instances])
real = torch.arange(batch["input_ids"].shape[1])[None] < lengths[:, None]
print(f"real tokens marked as padding by the collator = {int((real & ~batch['attention_mask']).sum())}")
print(f"|batched training loss - per-conversation reference loss| = {abs(loss.item() - ref):.6f}")
