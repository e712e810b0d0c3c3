# ndif-team/nnsight#673 (closes ndif-team/nnsight#672), "fix(language): derive position_ids from the mask
# for left-padded batches".
#
# nnsight's LanguageModel tokenizes a multi-prompt batch with the tokenizer's padding side (left for
# generation) and hands the model input_ids + attention_mask only. A model with learned absolute position
# embeddings (GPT-2) then builds position_ids as arange(seq_len) for every row, so each shorter, left-padded
# prompt reads the position embeddings of slots it does not occupy.
# Fix: LanguageModel._supply_left_pad_position_ids, called from _prepare_input and _batch, derives
# position_ids = attention_mask.cumsum(-1) - 1 (pads set to 0) when the tokenizer pads left, no
# position_ids were given and the mask has padding.
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel

FIXED = "--fixed" in sys.argv

torch.manual_seed(0)


class TinyTokenizer:
    """Stands in for the HF tokenizer nnsight loads (padding_side='left', pad = eos)."""

    padding_side = "left"
    pad_token_id = 0

    def __call__(self, prompts, return_tensors="pt", padding=True):
        ids = [[3 + (ord(c) % 90) for c in p] for p in prompts]
        n = max(len(x) for x in ids)
        input_ids, attention_mask = [], []
        for x in ids:
            pad = [self.pad_token_id] * (n - len(x))
            m = [1] * len(x)
            if self.padding_side == "left":
                input_ids.append(pad + x)
                attention_mask.append([0] * len(pad) + m)
            else:
                input_ids.append(x + pad)
                attention_mask.append(m + [0] * len(pad))
        return {"input_ids": torch.tensor(input_ids), "attention_mask": torch.tensor(attention_mask)}


class LanguageModel:
    def __init__(self, model, tokenizer):
        self._model = model
        self.tokenizer = tokenizer

    def _tokenize(self, inputs, **kwargs):
        return self.tokenizer(inputs, return_tensors="pt", padding=True, **kwargs)

    def _supply_left_pad_position_ids(self, batch):
        if self.tokenizer.padding_side != "left":
            return batch
        if batch.get("position_ids") is not None:
            return batch
        attention_mask = batch.get("attention_mask")
        if attention_mask is None or bool(attention_mask.all()):
            return batch
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 0)
        batch["position_ids"] = position_ids
        return batch

    def _prepare_input(self, *inputs, **kwargs):
        prompts = [p for p in inputs[0]] if isinstance(inputs[0], list) else list(inputs)
        batch = self._tokenize(prompts)
        batch.update(kwargs)
        if FIXED:
            batch = self._supply_left_pad_position_ids(batch)
        return (batch,), len(prompts)

    def _batch(self, batched_inputs, prepared_inputs):
        # several invokes are concatenated into one left-padded batch
        if batched_inputs is None:
            return prepared_inputs
        a, b = batched_inputs[0], prepared_inputs[0]
        n = max(a["input_ids"].shape[1], b["input_ids"].shape[1])

        def lpad(t, n, v):
            return torch.cat([t.new_full((t.shape[0], n - t.shape[1]), v), t], dim=1)

        out = {
            "input_ids": torch.cat([lpad(a["input_ids"], n, self.tokenizer.pad_token_id),
                                    lpad(b["input_ids"], n, self.tokenizer.pad_token_id)]),
            "attention_mask": torch.cat([lpad(a["attention_mask"], n, 0), lpad(b["attention_mask"], n, 0)]),
        }
        if FIXED:
            out = self._supply_left_pad_position_ids(out)
        return (out,)

    def _execute(self, prepared):
        with torch.no_grad():
            return self._model(**prepared[0])

    def trace(self, *invokes):
        batched = None
        for prompts in invokes:
            prepared, _ = self._prepare_input(prompts)
            batched = self._batch(batched, prepared)
        return self._execute(batched)


config = GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, bos_token_id=0,
                    eos_token_id=0, attn_implementation="eager")
model = GPT2LMHeadModel(config).eval()
lm = LanguageModel(model, TinyTokenizer())

out = lm.trace(["The Eiffel Tower is in", "Paris"], ["A cat"])
logits = out.logits[:, -1]
print("next tokens:", logits.argmax(-1).tolist())
print("last-token logits[:, :4]:", logits[:, :4])
