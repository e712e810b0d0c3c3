# axolotl, axolotl-ai-cloud/axolotl#2227 (commit 3915abee4, "make sure padding is labeled as -100 for pretraining").
# Streaming pretraining without sample packing: encode_pretraining appends [eos, pad] to every document (attention
# mask [1, 0]), concatenates documents into max_tokens rows and fills the tail with pad (attention mask 0), then
# returns `labels` as a copy of those padded input_ids, so every pad position is a training target.
# Fix: build the labels alongside, with -100 for the appended pad and for the row's tail padding.
import sys
from typing import Dict, List

import torch
from transformers import LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


class ToyTokenizer:
    """Whitespace tokenizer standing in for a Llama tokenizer (bos added, pad id 0)."""

    bos_token_id, eos_token_id, pad_token_id = 1, 2, 0

    def __init__(self):
        self.vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}

    def __call__(self, texts, truncation=True, max_length=None, add_special_tokens=True):
        input_ids, attention_mask = [], []
        for text in texts:
            ids = ([self.bos_token_id] if add_special_tokens else []) + [
                self.vocab.setdefault(w, len(self.vocab)) for w in text.split()
            ]
            if truncation and max_length is not None:
                ids = ids[:max_length]
            input_ids.append(ids)
            attention_mask.append([1] * len(ids))
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def _pad_tail(buffer, max_tokens, value):
    return torch.cat((buffer, torch.full((max_tokens - buffer.numel(),), value, dtype=torch.long)), dim=0)


def encode_pretraining(tokenizer, max_tokens: int, examples: Dict[str, List]) -> Dict[str, List]:
    """src/axolotl/utils/data/pretraining.py encode_pretraining (the non-sample-packing path)."""
    res = tokenizer(examples["text"], truncation=True, max_length=max_tokens - 2, add_special_tokens=True)
    input_ids = [torch.tensor(seq) for seq in res["input_ids"]]
    targets = [torch.tensor(seq) for seq in res["input_ids"]]
    attention_mask = [torch.tensor(seq) for seq in res["attention_mask"]]
    new_input_ids, new_labels, new_attention_mask = [], [], []
    # Append EOS and PAD tokens to input_ids, and correct attention_mask
    for i, _ in enumerate(input_ids):
        input_ids[i] = torch.cat((input_ids[i], torch.tensor([tokenizer.eos_token_id, tokenizer.pad_token_id])), dim=0)
        if FIXED:
            targets[i] = torch.cat((targets[i], torch.tensor([tokenizer.eos_token_id, -100])), dim=0)
        else:  # before the fix there were no separate targets: the labels are the input_ids
            targets[i] = input_ids[i]
        attention_mask[i] = torch.cat((attention_mask[i], torch.tensor([1, 0])), dim=0)

    # Concatenate tokens so that their lengths are less than max_tokens
    buffer_input_ids = torch.tensor([], dtype=torch.long)
    buffer_labels = torch.tensor([], dtype=torch.long)
    buffer_attention_mask = torch.tensor([], dtype=torch.long)

    for ids, labels, mask in zip(input_ids, targets, attention_mask):
        if buffer_input_ids.numel() == max_tokens:
            new_input_ids.append(buffer_input_ids)
            new_labels.append(buffer_labels)
            new_attention_mask.append(buffer_attention_mask)
            buffer_input_ids = ids.clone()
            buffer_labels = labels.clone()
            buffer_attention_mask = mask.clone()
        elif buffer_input_ids.numel() + ids.numel() <= max_tokens:
            buffer_input_ids = torch.cat((buffer_input_ids, ids), dim=0)
            buffer_labels = torch.cat((buffer_labels, labels), dim=0)
            buffer_attention_mask = torch.cat((buffer_attention_mask, mask), dim=0)
        else:
            buffer_input_ids = _pad_tail(buffer_input_ids, max_tokens, tokenizer.pad_token_id)
            buffer_labels = _pad_tail(buffer_labels, max_tokens, -100)
            buffer_attention_mask = _pad_tail(buffer_attention_mask, max_tokens, 0)
            new_input_ids.append(buffer_input_ids)
            new_labels.append(buffer_labels)
            new_attention_mask.append(buffer_attention_mask)
            buffer_input_ids = ids.clone()
            buffer_labels = labels.clone()
            buffer_attention_mask = mask.clone()

    if buffer_input_ids.numel() > 0:  # for any leftover tokens
        while buffer_input_ids.numel() < max_tokens:  # make all sequences equal in size
            buffer_input_ids = _pad_tail(buffer_input_ids, max_tokens, tokenizer.pad_token_id)
            buffer_labels = _pad_tail(buffer_labels, max_tokens, -100)
            buffer_attention_mask = _pad_tail(buffer_attention_mask, max_tokens, 0)
        new_input_ids.append(buffer_input_ids)
        new_labels.append(buffer_labels)
        new_attention_mask.append(buffer_attention_mask)

    if FIXED:
        labels_out = [seq.tolist() for seq in new_labels]
    else:
        labels_out = [seq.tolist() for seq in new_input_ids]
    return {
        "input_ids": [seq.tolist() for seq in new_input_ids],
        "labels": labels_out,
        "attention_mask": [seq.tolist() for seq in new_attention_mask],
    }


def main():
    tokenizer = ToyTokenizer()
    docs = {"text": [
        "the cat sat on the mat and looked at the dog",
        "a short note",
        "rain fell all night over the quiet town and the river rose",
        "birds sing at dawn",
        "the end of the stream",
    ]}
    max_tokens = 16
    ret = encode_pretraining(tokenizer, max_tokens, docs)
    batch = {k: torch.tensor(v) for k, v in ret.items()}

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.train()
    for step in range(3):
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"])
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        print(f"step {step} loss {out.loss.item():.6f}")
    print("rows", batch["input_ids"].shape[0], "targets", int((batch["labels"][:, 1:] != -100).sum()))
    print("labels row0", ret["labels"][0])


if __name__ == "__main__":
    main()
