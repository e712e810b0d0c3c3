"""nnsight LanguageModel: a multi-invoke trace left-pads the batch but passes no position_ids.

Citation: ndif-team/nnsight#673 ("fix(language): derive position_ids from the mask for
left-padded batches", closes #672), src/nnsight/modeling/language.py. Pre-fix code read at
003250af (LanguageModel._load_tokenizer, _tokenize, _prepare_input, _batch); the fix is written
from the PR description (the merged diff was not in the stored mirror).

The bug: LanguageModel loads its tokenizer with padding_side="left" and, when several invokes
are batched into one trace, re-pads all their input_ids with tokenizer.pad and splices each
invoke's attention_mask into the right-aligned columns. It forwards input_ids + attention_mask
but never position_ids, so GPT-2 (learned absolute position embeddings) falls back to a
mask-blind arange: every prompt shorter than the longest gets positions shifted by its pad
count, and its activations / logits differ from the same prompt traced alone.

The fix: LanguageModel._supply_left_pad_position_ids, called from _prepare_input and _batch:
when the tokenizer pads on the left, no position_ids were given and the attention_mask has
padding, position_ids = attention_mask.cumsum(-1) - 1 with padded positions set to 0 (what
generate() does in prepare_inputs_for_generation). _batch drops stale per-invoke position_ids
and recomputes them from the combined mask.

This program keeps nnsight's tokenize / prepare / batch methods (the interleaver, envoys and
tracing machinery are reduced to a loop over invokes) and runs them over a tiny random GPT-2
built from GPT2Config with an in-memory word-level tokenizer: two invokes, a long prompt and a
short one, and the short prompt traced alone for comparison.
"""

import sys
from typing import Any, Dict, List, Optional, Tuple, Union

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import BatchEncoding, GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

FIXED = "--fixed" in sys.argv

WORDS = ["<|endoftext|>", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "to", "park",
         "and", "then", "slept", "in", "sun", "big", "red", "ball", "house"]


def build_tokenizer(**kwargs) -> PreTrainedTokenizerFast:
    vocab = {w: i for i, w in enumerate(WORDS)}
    tok = Tokenizer(WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>", **kwargs)


class LanguageModel:
    """Trimmed from nnsight.modeling.language.LanguageModel."""

    def __init__(self, model: torch.nn.Module, tokenizer=None, repo_id: Optional[str] = None):
        self._model = model
        self.tokenizer = tokenizer
        self.repo_id = repo_id

    def _load_tokenizer(self, repo_id: str, **kwargs):
        if self.tokenizer is None:
            if "padding_side" not in kwargs:
                kwargs["padding_side"] = "left"
            # AutoTokenizer.from_pretrained(repo_id, config=self.config, **kwargs)
            self.tokenizer = build_tokenizer(**kwargs)
            if getattr(self.tokenizer, "pad_token", None) is None:
                self.tokenizer.pad_token = self.tokenizer.eos_token

    def _tokenize(self, inputs: Union[str, List[str], List[int], torch.Tensor, Dict[str, Any]], **kwargs):
        if isinstance(inputs, torch.Tensor):
            if inputs.ndim == 1:
                inputs = inputs.unsqueeze(0)
            return BatchEncoding({"input_ids": inputs})

        if self.tokenizer is None:
            if self.repo_id is not None:
                self._load_tokenizer(self.repo_id, **kwargs)
            else:
                raise AttributeError("Tokenizer not found.")

        if isinstance(inputs, str) or (isinstance(inputs, list) and isinstance(inputs[0], int)):
            inputs = [inputs]

        if not isinstance(inputs[0], str):
            inputs = [{"input_ids": ids} for ids in inputs]
            return self.tokenizer.pad(inputs, return_tensors="pt", **kwargs)

        return self.tokenizer(inputs, return_tensors="pt", padding=True, **kwargs)

    def _supply_left_pad_position_ids(self, inputs: Dict[str, Any]) -> None:
        if self.tokenizer is None or self.tokenizer.padding_side != "left":
            return
        if inputs.get("position_ids", None) is not None:
            return
        attention_mask = inputs.get("attention_mask", None)
        if attention_mask is None or bool(attention_mask.all()):
            return
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 0)
        inputs["position_ids"] = position_ids

    def _prepare_input(self, *inputs, input_ids=None, labels: Any = None, attention_mask: Any = None,
                       **kwargs) -> Tuple[Tuple[()], Dict[str, Any]]:
        if input_ids is not None:
            assert len(inputs) == 0
            inputs = (input_ids,)

        assert len(inputs) == 1
        inputs = inputs[0]

        if isinstance(inputs, dict):
            inputs = BatchEncoding(inputs)
        elif isinstance(inputs, BatchEncoding):
            pass
        else:
            inputs = self._tokenize(inputs, **kwargs)
            if labels is not None:
                labels = self._tokenize(labels, **kwargs)["input_ids"]

        if attention_mask is not None:
            inputs["attention_mask"] = attention_mask

        if FIXED:
            self._supply_left_pad_position_ids(inputs)

        return tuple(), {**inputs, "labels": labels}

    def _batch(self, batched_inputs: Optional[Tuple[Tuple[BatchEncoding], Dict[str, Any]]],
               **prepared_kwargs) -> Tuple[Dict[str, Any]]:
        if batched_inputs is None:
            return (tuple(), prepared_kwargs), len(prepared_kwargs["input_ids"])

        batched_inputs = batched_inputs[1]
        batched_labels = batched_inputs["labels"]
        attention_mask = batched_inputs["attention_mask"]

        batched_ids = [
            {"input_ids": ids}
            for ids in [*batched_inputs["input_ids"].tolist(), *prepared_kwargs["input_ids"].tolist()]
        ]
        new_batched_inputs = self.tokenizer.pad(batched_ids, return_tensors="pt")

        labels = prepared_kwargs.get("labels", None)
        if labels is not None:
            batched_labels = torch.cat((batched_labels, labels))

        if attention_mask is not None:
            if self.tokenizer.padding_side == "left":
                new_batched_inputs["attention_mask"][: attention_mask.shape[0], -attention_mask.shape[1]:] = attention_mask
            else:
                new_batched_inputs["attention_mask"][: attention_mask.shape[0], : attention_mask.shape[1]] = attention_mask

        batched_inputs.pop("input_ids", None)
        batched_inputs.pop("attention_mask", None)

        if FIXED:
            batched_inputs.pop("position_ids", None)
            self._supply_left_pad_position_ids(new_batched_inputs)

        return (
            tuple(),
            {**new_batched_inputs, **batched_inputs, "labels": batched_labels},
        ), len(prepared_kwargs["input_ids"])

    # The tracer: each invoke's input is prepared, then batched into the running batch; the
    # model runs once on the batch and each invoke reads back its own rows.
    def trace(self, *invokes: str) -> List[torch.Tensor]:
        batched = None
        sizes = []
        for prompt in invokes:
            _, prepared = self._prepare_input(prompt)
            batched, size = self._batch(batched, **prepared)
            sizes.append(size)
        _, kwargs = batched
        kwargs = {k: v for k, v in kwargs.items() if v is not None}
        with torch.no_grad():
            out = self._model(**kwargs)
        rows, start = [], 0
        for size in sizes:
            rows.append(out.logits[start:start + size])
            start += size
        return rows


def main():
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=len(WORDS), n_positions=32, n_embd=32, n_layer=2, n_head=4,
                        bos_token_id=0, eos_token_id=0)
    model = GPT2LMHeadModel(config).eval()
    with torch.no_grad():  # make the learned position table matter at toy size
        model.transformer.wpe.weight.normal_(0.0, 1.0)

    lm = LanguageModel(model, repo_id="openai-community/gpt2")
    lm._load_tokenizer(lm.repo_id)

    long_prompt = "the big red dog ran to the park and then slept in the sun"
    short_prompt = "a cat sat on the mat"

    long_logits, short_logits = lm.trace(long_prompt, short_prompt)
    (alone_logits,) = lm.trace(short_prompt)

    last_batched = short_logits[0, -1]
    last_alone = alone_logits[0, -1]
    print("short prompt next-token argmax, batched:", int(last_batched.argmax()),
          "alone:", int(last_alone.argmax()))
    print("short prompt last-position logits, batched:", [round(v, 4) for v in last_batched[:6].tolist()])
    print("short prompt last-position logits, alone:  ", [round(v, 4) for v in last_alone[:6].tolist()])
    print("max |batched - alone| at last position: %.6f" % (last_batched - last_alone).abs().max().item())
    print("long prompt last-position logits:", [round(v, 4) for v in long_logits[0, -1, :6].tolist()])


if __name__ == "__main__":
    main()
