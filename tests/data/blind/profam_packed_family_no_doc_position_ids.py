# Citation: alex-hh/profam#468 (commit 26fd81bd, "default to pass_res_pos_in_doc_as_position_ids: true").
# Source read at 26fd81bd^: src/models/llama.py (LlamaLitModule, WrappedLlamaForCausalLM), src/models/base.py
# (training_step, get_forward_kwargs), src/data/collators.py (DataCollatorWithFlattening). The wrapper mixin
# (src/models/wrapper.py) was not readable in the mirror; its position_ids hand-off is written from the PR text.
#
# Bug: with sequence packing (pack_to_max_tokens) the collator flattens several protein documents into one row
# [1, total_tokens] and returns per-document position_ids, but LlamaLitModule defaulted to
# pass_res_pos_in_doc_as_position_ids=False, so the wrapped Llama was called without position_ids: the model
# made its own arange positions and, with no boundaries to see, attended across documents.
# Fix: default pass_res_pos_in_doc_as_position_ids=True (and a config check that packing requires it), so
# the per-document position_ids reach the model, which then keeps each packed document to itself.
import sys
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.data.data_collator import DefaultDataCollator

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def np_flatten(current_feature_val, new_feature_val, separator_id=None, is_labels=False):
    if is_labels:
        new_feature_val = [separator_id] + list(new_feature_val[1:])
    if current_feature_val is None:
        return list(new_feature_val)
    return current_feature_val + list(new_feature_val)


@dataclass
class DataCollatorWithFlattening(DefaultDataCollator):
    def __init__(self, *args, return_position_ids=True, additional_features_to_flatten=None,
                 separator_id=-100, **kwargs):
        super().__init__(*args, **kwargs)
        self.return_position_ids = return_position_ids
        self.additional_features_to_flatten = additional_features_to_flatten
        self.separator_id = separator_id

    @staticmethod
    def append_flattened_features(ret, single_example_features, feature_names_to_flatten,
                                  flatten_fn=np_flatten, separator_id=-100, append_position_ids=True):
        for feature_name in feature_names_to_flatten:
            ret[feature_name] = flatten_fn(ret.get(feature_name, None), single_example_features[feature_name],
                                           separator_id=separator_id, is_labels=feature_name == "labels")
        if "labels" not in feature_names_to_flatten:
            ret["labels"] = flatten_fn(ret.get("labels", None), single_example_features["input_ids"],
                                       separator_id=separator_id, is_labels=True)
        if append_position_ids:
            position_ids = list(range(len(single_example_features["input_ids"])))
            if "position_ids" not in ret:
                ret["position_ids"] = position_ids
            else:
                ret["position_ids"] += position_ids
        return ret

    def __call__(self, features: List[Dict[str, Any]], return_tensors=None):
        names = ["input_ids"] + list(self.additional_features_to_flatten or [])
        ret = {}
        for f in features:
            self.append_flattened_features(ret, f, names, separator_id=self.separator_id,
                                           append_position_ids=self.return_position_ids)
        return {k: torch.tensor([v], dtype=torch.long) for k, v in ret.items()}


class WrappedHFModelWithPositionEmbeddingsMixin:
    def __init__(self, config, pass_res_pos_in_doc_as_position_ids: bool = False, **kwargs):
        super().__init__(config)
        self.pass_res_pos_in_doc_as_position_ids = pass_res_pos_in_doc_as_position_ids

    def forward(self, input_ids=None, attention_mask=None, labels=None, position_ids=None,
                past_key_values=None, use_cache=False, **kwargs):
        if not self.pass_res_pos_in_doc_as_position_ids:
            position_ids = None
        return super().forward(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                               position_ids=position_ids, past_key_values=past_key_values,
                               use_cache=use_cache, **kwargs)


class WrappedLlamaForCausalLM(WrappedHFModelWithPositionEmbeddingsMixin, LlamaForCausalLM):
    pass


class LlamaLitModule(torch.nn.Module):
    def __init__(self, config: LlamaConfig,
                 pass_res_pos_in_doc_as_position_ids: bool = True if FIXED else False):
        super().__init__()
        self.model = WrappedLlamaForCausalLM(
            config, pass_res_pos_in_doc_as_position_ids=pass_res_pos_in_doc_as_position_ids)

    def get_forward_kwargs(self, batch):
        forward_kwargs = {}
        if "position_ids" in batch:
            forward_kwargs["position_ids"] = batch["position_ids"]
        return forward_kwargs

    def forward(self, input_ids, attention_mask=None, labels=None, past_key_values=None,
                use_cache=False, **kwargs):
        return self.model(input_ids=input_ids, attention_mask=attention_mask, labels=labels,
                          past_key_values=past_key_values, use_cache=use_cache, **kwargs)

    def training_step(self, batch, batch_idx):
        forward_kwargs = self.get_forward_kwargs(batch)
        outputs = self(input_ids=batch["input_ids"], attention_mask=batch.get("attention_mask"),
                       labels=batch["labels"], **forward_kwargs)
        return outputs


config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2)
config._attn_implementation = "sdpa"
module = LlamaLitModule(config).eval()

# three protein "documents" (a family prompt each), packed to max tokens
rng = np.random.default_rng(0)
docs = [[1] + rng.integers(5, 40, size=n).tolist() + [2] for n in (9, 6, 12)]
collator = DataCollatorWithFlattening(return_position_ids=True)
batch = collator([{"input_ids": d} for d in docs])

with torch.no_grad():
    out = module.training_step(batch, 0)
print("loss", round(out.loss.item(), 6))
print("logits of last document, first token", out.logits[0, len(docs[0]) + len(docs[1]), :4].tolist())
