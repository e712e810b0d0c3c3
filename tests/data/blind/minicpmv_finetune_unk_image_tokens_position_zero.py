# OpenBMB/MiniCPM-V commit 5fdf2e0 ("update finetuning code (#165)"), finetune/dataset.py conversation_to_ids.
#
# MiniCPM-V's fine-tuning dataset writes each image as im_start + unk_token * query_nums + im_end and later
# scatters the resampler's query outputs over that span (image_bound). conversation_to_ids built
#     position_ids = torch.where(ids != 0, torch.arange(ids.size(0)), torch.tensor(0))
# and the unk token of the MiniCPM (Llama-style) tokenizer is id 0, so every image slot got position 0 while the
# text around it kept its index: the LLM's rotary positions of the whole image span collapsed onto the first
# position. The fix builds position_ids = torch.arange(ids.size(0)).
#
# Ported trimmed: a tiny tokenizer standing in for the MiniCPM one (unk = 0), preprocess / conversation_to_ids /
# data_collator as written, and MiniCPMV.get_vllm_embedding + the LLM forward (a tiny Llama from its config class,
# resampler output stood in by a linear map of the pixel values).
import sys

import numpy as np
import torch
from torch.nn.utils.rnn import pad_sequence
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class TinyMiniCPMTokenizer:
    # ids: 0 <unk>, 1 <s>, 2 </s>, 3 <image>, 4 </image>, 5 <用户>, 6 <AI>, then characters
    unk_token, bos_token, eos_token = "<unk>", "<s>", "</s>"
    im_start, im_end = "<image>", "</image>"
    unk_id, bos_id, eos_id, im_start_id, im_end_id = 0, 1, 2, 3, 4
    specials = ["<unk>", "<s>", "</s>", "<image>", "</image>", "<用户>", "<AI>"]

    def __init__(self):
        chars = "abcdefghijklmnopqrstuvwxyz .,?\n"
        self.vocab = {t: i for i, t in enumerate(self.specials)}
        for c in chars:
            self.vocab[c] = len(self.vocab)

    def encode(self, text):
        ids = [self.bos_id]
        i = 0
        while i < len(text):
            for s in self.specials:
                if text.startswith(s, i):
                    ids.append(self.vocab[s])
                    i += len(s)
                    break
            else:
                ids.append(self.vocab[text[i]])
                i += 1
        return ids


def conversation_to_ids(conversation, tokenizer, llm_type=None):
    input_ids, context, raw_msg = conversation_to_ids_minicpm(conversation, tokenizer)

    ids = torch.from_numpy(np.hstack(input_ids, dtype=np.int32))
    context = torch.from_numpy(np.hstack(context, dtype=np.int8))

    # build target
    target = torch.full_like(ids, -100, dtype=torch.int32)
    for i in range(1, len(ids)):
        if context[i] == 0:
            target[i - 1] = ids[i]
        if context[i] == 1 and context[i - 1] == 0:
            target[i - 1] = tokenizer.eos_id

    # build image bound
    image_start_tokens = torch.where(ids == tokenizer.im_start_id)[0]
    image_start_tokens += 1
    image_end_tokens = torch.where(ids == tokenizer.im_end_id)[0]
    if len(image_start_tokens) > 0:
        image_bound = torch.hstack([image_start_tokens.unsqueeze(-1), image_end_tokens.unsqueeze(-1)])
    else:
        image_bound = []

    if FIXED:
        position_ids = torch.arange(ids.size(0)).long()
    else:
        position_ids = torch.where(ids != 0, torch.arange(ids.size(0)), torch.tensor(0)).long()
    return {"input_ids": ids, "target": target, "image_bound": image_bound, "raw_msg": raw_msg,
            "position_ids": position_ids}


def conversation_to_ids_minicpm(conversation, tokenizer):
    raw_msg = ""
    input_ids = []
    context = []
    for idx, msg in enumerate(conversation):
        role = msg["role"]
        message = msg["content"]
        prefix = "<用户>" if role == "user" else "<AI>"
        if idx == len(conversation) - 1:
            message = message + tokenizer.eos_token
        prefix_ids = tokenizer.encode(prefix)[1:]  # remove bos
        message_ids = tokenizer.encode(message)[1:]
        input_ids.append(prefix_ids)
        input_ids.append(message_ids)
        context.append(np.ones((len(prefix_ids),), dtype=np.int8))
        if role == "assistant":
            context.append(np.zeros((len(message_ids),), dtype=np.int8))
        else:
            context.append(np.ones((len(message_ids),), dtype=np.int8))
        raw_msg += prefix + message
    return input_ids, context, raw_msg


def preprocess(image, conversation, tokenizer, query_nums=8):
    default_image_placeholder = tokenizer.im_start + tokenizer.unk_token * query_nums + tokenizer.im_end
    conversation = [dict(m) for m in conversation]
    conversation[0]["content"] = default_image_placeholder + "\n" + conversation[0]["content"]
    ret = conversation_to_ids(conversation, tokenizer)
    ret["pixel_values"] = [image]
    ret["tgt_sizes"] = [torch.tensor([2, 2])]
    return ret


def make_example(image, conversation, tokenizer, query_nums):
    ret = preprocess(image, conversation, tokenizer, query_nums=query_nums)
    return dict(
        input_ids=ret["input_ids"],
        position_ids=ret["position_ids"],
        labels=ret["target"],
        attention_mask=torch.ones_like(ret["input_ids"], dtype=torch.bool),
        pixel_values=ret["pixel_values"],
        tgt_sizes=ret["tgt_sizes"],
        image_bound=ret["image_bound"],
    )


def data_collator(examples, padding_value=0, max_length=2048):
    def trim_and_pad(seq, batch_first, padding_value):
        return pad_sequence([s[:max_length] for s in seq], batch_first=True, padding_value=padding_value)

    input_ids = trim_and_pad([e["input_ids"] for e in examples], batch_first=True, padding_value=padding_value)
    position_ids = trim_and_pad([e["position_ids"] for e in examples], batch_first=True, padding_value=padding_value)
    targets = trim_and_pad([e["labels"] for e in examples], batch_first=True, padding_value=-100)
    attention_mask = trim_and_pad([e["attention_mask"] for e in examples], batch_first=True,
                                  padding_value=padding_value)
    return {
        "input_ids": input_ids,
        "position_ids": position_ids,
        "labels": targets,
        "attention_mask": attention_mask,
        "image_bound": [e["image_bound"] for e in examples],
        "tgt_sizes": [e["tgt_sizes"] for e in examples],
        "pixel_values": [e["pixel_values"] for e in examples],
    }


class MiniCPMV(torch.nn.Module):
    def __init__(self, llm_config, query_num, pixel_dim):
        super().__init__()
        self.llm = LlamaForCausalLM(llm_config)
        self.query_num = query_num
        # stand-in for vpm + resampler: (pixel_dim) -> (query_num, hidden)
        self.resampler = torch.nn.Linear(pixel_dim, query_num * llm_config.hidden_size)

    def get_vision_embedding(self, pixel_values):
        return self.resampler(pixel_values).view(-1, self.query_num, self.llm.config.hidden_size)

    def get_vllm_embedding(self, data):
        vision_hidden_states = [self.get_vision_embedding(torch.stack(pv)) for pv in data["pixel_values"]]
        vllm_embedding = self.llm.model.embed_tokens(data["input_ids"])
        new_vllm_embedding = vllm_embedding.clone()
        bs = len(data["input_ids"])
        for i in range(bs):
            cur_vs_hs = vision_hidden_states[i]
            if len(cur_vs_hs) > 0:
                cur_vllm_emb = vllm_embedding[i]
                cur_image_bound = data["image_bound"][i]
                if len(cur_image_bound) > 0:
                    image_indices = torch.stack(
                        [torch.arange(r[0], r[1], dtype=torch.long) for r in cur_image_bound]
                    )
                    cur_vllm_emb = cur_vllm_emb.scatter(
                        0,
                        image_indices.view(-1, 1).repeat(1, cur_vllm_emb.shape[-1]),
                        cur_vs_hs.view(-1, cur_vs_hs.shape[-1]),
                    )
                new_vllm_embedding[i] = cur_vllm_emb
        return new_vllm_embedding, vision_hidden_states

    def forward(self, data, **kwargs):
        vllm_embedding, _ = self.get_vllm_embedding(data)
        position_ids = data["position_ids"]
        if position_ids.dtype != torch.int64:
            position_ids = position_ids.long()
        return self.llm(inputs_embeds=vllm_embedding, attention_mask=data["attention_mask"],
                        position_ids=position_ids, **kwargs)


def main():
    tokenizer = TinyMiniCPMTokenizer()
    query_nums = 8
    cfg = LlamaConfig(vocab_size=len(tokenizer.vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, initializer_range=0.2)
    cfg._attn_implementation = "sdpa"
    model = MiniCPMV(cfg, query_nums, pixel_dim=12).eval()

    raw_data = [
        [{"role": "user", "content": "what is in the picture?"}, {"role": "assistant", "content": "a cat."}],
        [{"role": "user", "content": "describe it."}, {"role": "assistant", "content": "a dog on grass, sleeping."}],
    ]
    examples = [make_example(torch.randn(12), conv, tokenizer, query_nums) for conv in raw_data]
    batch = data_collator(examples, padding_value=0)
    batch["labels"] = batch["labels"].long()

    with torch.no_grad():
        out = model(batch, labels=batch["labels"])
    print("position_ids[0][:14]:", batch["position_ids"][0][:14].tolist())
    print("loss:", round(out.loss.item(), 6))
    pred = out.logits.argmax(-1)
    for i in range(2):
        keep = batch["labels"][i] != -100
        print(f"row {i} predicted answer ids:", pred[i][keep].tolist())


if __name__ == "__main__":
    main()
