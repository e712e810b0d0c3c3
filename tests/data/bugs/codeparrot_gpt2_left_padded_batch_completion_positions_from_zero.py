"""CodeParrot-style batched code completion with GPT2LMHeadModel, prompts left-padded.

Citation: huggingface/transformers#7552 ("Add batch inferencing support for GPT2LMHeadModel", fixes #3021).
GPT2LMHeadModel.prepare_inputs_for_generation (written here as it read, from memory) handed the model only the ids,
the past and the attention mask; GPT2Model then numbered the positions 0..L-1 from column 0, so each left-padded
prompt's code tokens read the learned position embeddings of a shifted position (wpe[pads + i] instead of wpe[i]),
and every decode step after them too.  The fix builds position_ids from the attention mask
(cumsum(-1) - 1, pads filled with 1) and keeps its last column once a past exists.

CodeParrot (codeparrot/codeparrot-small) is a GPT-2; here a tiny GPT2Config, a character tokenizer, a greedy loop
with the model's cache.  `python FILE` is the code before the fix, `python FILE --fixed` after it.
"""
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv


class CharTokenizer:
    """Stand-in for the CodeParrot tokenizer: pad = eos, padding_side = "left" as in the batched completion."""

    def __init__(self):
        chars = " \n()[]:,.=+-*<>_'\"#abcdefghijklmnopqrstuvwxyz0123456789"
        self.vocab = {c: i + 1 for i, c in enumerate(chars)}
        self.inv = {i: c for c, i in self.vocab.items()}
        self.eos_token_id = 0
        self.pad_token_id = self.eos_token_id
        self.padding_side = "left"

    def __len__(self):
        return len(self.vocab) + 1

    def __call__(self, texts):
        ids = [[self.vocab[c] for c in t] for t in texts]
        n = max(len(x) for x in ids)
        input_ids, attention_mask = [], []
        for x in ids:
            pad = n - len(x)
            input_ids.append([self.pad_token_id] * pad + x)
            attention_mask.append([0] * pad + [1] * len(x))
        return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention_mask)}

    def decode(self, ids):
        return "".join(self.inv.get(int(i), "") for i in ids)


def prepare_inputs_for_generation(input_ids, past=None, **kwargs):
    # only last token for inputs_ids if past is defined in kwargs
    if past is not None:
        input_ids = input_ids[:, -1].unsqueeze(-1)

    attention_mask = kwargs.get("attention_mask", None)
    if not FIXED:
        return {
            "input_ids": input_ids,
            "past_key_values": past,
            "use_cache": kwargs.get("use_cache"),
            "attention_mask": attention_mask,
        }

    position_ids = kwargs.get("position_ids", None)
    if attention_mask is not None and position_ids is None:
        # create position_ids on the fly for batch generation
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        if past is not None:
            position_ids = position_ids[:, -1].unsqueeze(-1)
    else:
        position_ids = None
    return {
        "input_ids": input_ids,
        "past_key_values": past,
        "use_cache": kwargs.get("use_cache"),
        "position_ids": position_ids,
        "attention_mask": attention_mask,
    }


@torch.no_grad()
def greedy_search(model, input_ids, attention_mask, max_length, eos_token_id, pad_token_id):
    past = None
    unfinished = torch.ones(input_ids.shape[0], dtype=torch.long)
    while input_ids.shape[-1] < max_length:
        model_inputs = prepare_inputs_for_generation(input_ids, past=past, attention_mask=attention_mask, use_cache=True)
        outputs = model(**model_inputs)
        next_token_logits = outputs.logits[:, -1, :]
        next_tokens = torch.argmax(next_token_logits, dim=-1)
        next_tokens = next_tokens * unfinished + pad_token_id * (1 - unfinished)
        input_ids = torch.cat([input_ids, next_tokens[:, None]], dim=-1)
        past = outputs.past_key_values
        attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))], dim=-1)
        unfinished = unfinished.mul((next_tokens != eos_token_id).long())
    return input_ids


def main():
    torch.manual_seed(0)
    tokenizer = CharTokenizer()
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        attn_implementation="eager",
    )
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        model.transformer.wpe.weight.normal_(0.0, 0.5)

    prompts = [
        "def add(a, b):\n    return",
        "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) +",
        "import os\n",
    ]
    batch = tokenizer(prompts)
    sequences = greedy_search(
        model,
        batch["input_ids"],
        batch["attention_mask"],
        max_length=batch["input_ids"].shape[1] + 12,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    prompt_len = batch["input_ids"].shape[1]
    for prompt, seq in zip(prompts, sequences):
        completion = tokenizer.decode(seq[prompt_len:])
        print(repr(prompt[-12:]), "->", repr(completion))


if __name__ == "__main__":
    main()
