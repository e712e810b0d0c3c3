"""Padding-free DPO whose concatenated cu_seq_lens fold the chosen padding into the first rejected sequence.

Citation: allenai/open-instruct#1900 ("Fix packing in olmo-core DPO path", open when read).
Upstream: `concatenated_inputs` in open_instruct/padding_free_collator.py (offset introduced by
#1466), consumed by `concatenated_forward_olmo` in dpo_utils.py through
`olmo_core_utils.doc_lens_from_cu_seq_lens` -> the model's `doc_lens` (intra-document attention).

Bug (from the PR description): `TensorDataCollatorWithFlattening(max_seq_length=...)` pads the
packed chosen row and the packed rejected row to max_seq_length; `concatenated_inputs` then
offsets the rejected boundaries by `chosen_input_len` (the padded length) but keeps the chosen
boundaries, which end at the last real chosen token. The chosen padding therefore becomes the
head of the first rejected document (the PR's example: `[0, 50, 100, 550, 600]` with a spurious
sequence 100..550), so the first rejected response attends to the chosen padding.

Fix: I did not read the PR's diff. The fixed mode here closes the chosen part with a boundary
at `chosen_input_len` when the chosen row was padded, so the padding is a document of its own
(the same treatment `doc_lens_from_cu_seq_lens` already gives the trailing pad span).

Reproduction: the collators and `concatenated_inputs` as upstream (unused flash-attn kwargs and
truncation branches trimmed), `doc_lens_from_cu_seq_lens` as upstream, and a one-layer stand-in
for the OLMo-core model that turns `doc_lens` into a causal same-document mask for
F.scaled_dot_product_attention (flash-attn varlen is not available on CPU).
"""
import sys
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv


@dataclass
class TensorDataCollatorWithFlattening:
    return_flash_attn_kwargs: bool = True
    return_position_ids: bool = True
    separator_id: int = -100
    max_seq_length: int | None = None

    def __call__(self, features, separator_id=None):
        if separator_id is None:
            separator_id = self.separator_id
        cu_seq_lens = [0]
        max_length = 0
        pos_ids = []
        ret = {"input_ids": [], "labels": []}
        separator = torch.tensor([separator_id], dtype=features[0]["input_ids"].dtype)
        for item in features:
            input_ids = item["input_ids"]
            ret["input_ids"].append(input_ids)
            ret["labels"].append(separator)
            ret["labels"].append(item["labels"][1:])
            cu_seq_lens.append(cu_seq_lens[-1] + len(input_ids))
            max_length = max(max_length, len(input_ids))
            pos_ids.append(torch.arange(input_ids.numel()))
        ret["cu_seq_lens_q"] = ret["cu_seq_lens_k"] = torch.tensor(cu_seq_lens, dtype=torch.int32)
        ret["max_length_q"] = ret["max_length_k"] = max_length
        position_ids_tensor = torch.cat(pos_ids, dim=0)[None]
        input_ids_tensor = torch.cat(ret["input_ids"], dim=0)[None]
        labels_tensor = torch.cat(ret["labels"], dim=0)[None]
        if self.max_seq_length is not None:
            current_len = input_ids_tensor.shape[1]
            if current_len < self.max_seq_length:
                pad_len = self.max_seq_length - current_len
                input_ids_tensor = F.pad(input_ids_tensor, (0, pad_len), value=0)
                labels_tensor = F.pad(labels_tensor, (0, pad_len), value=-100)
                position_ids_tensor = F.pad(position_ids_tensor, (0, pad_len), value=0)
        ret["input_ids"] = input_ids_tensor
        ret["labels"] = labels_tensor
        ret["position_ids"] = position_ids_tensor
        return ret


@dataclass
class TensorDataCollatorWithFlatteningDPO(TensorDataCollatorWithFlattening):
    def __call__(self, features, separator_id=None):
        def filter_batch(match_string, features):
            return [{k.replace(match_string, ""): v for k, v in f.items() if match_string in k} for f in features]

        chosen_features = super().__call__(filter_batch("chosen_", features), separator_id=separator_id)
        rejected_features = super().__call__(filter_batch("rejected_", features), separator_id=separator_id)
        result = {}
        for k in chosen_features:
            result["chosen_" + k] = chosen_features[k]
        for k in rejected_features:
            result["rejected_" + k] = rejected_features[k]
        return result


# - dpo concatenation  for padding free
def concatenated_inputs(batch, tag="concatenated_"):
    chosen_features, rejected_features = {}, {}
    for k in batch:
        if k.startswith("chosen_"):
            chosen_features[k.replace("chosen_", "")] = batch[k]
        else:
            rejected_features[k.replace("rejected_", "")] = batch[k]

    ret = {f"{tag}input_ids": torch.cat([chosen_features["input_ids"], rejected_features["input_ids"]], dim=-1)}
    ret[f"{tag}labels"] = torch.cat([chosen_features["labels"], rejected_features["labels"]], dim=-1)
    if "cu_seq_lens_q" in chosen_features:
        # Skip rejected's leading 0 to avoid a duplicate boundary, and offset by chosen length.
        chosen_input_len = chosen_features["input_ids"].shape[-1]
        chosen_cu_q, chosen_cu_k = chosen_features["cu_seq_lens_q"], chosen_features["cu_seq_lens_k"]
        if FIXED and int(chosen_cu_k[-1]) < chosen_input_len:
            pad_boundary = torch.tensor([chosen_input_len], dtype=chosen_cu_k.dtype)
            chosen_cu_q = torch.cat([chosen_cu_q, pad_boundary])
            chosen_cu_k = torch.cat([chosen_cu_k, pad_boundary])
        ret[f"{tag}cu_seq_lens_q"] = torch.cat([chosen_cu_q, rejected_features["cu_seq_lens_q"][1:] + chosen_input_len])
        ret[f"{tag}cu_seq_lens_k"] = torch.cat([chosen_cu_k, rejected_features["cu_seq_lens_k"][1:] + chosen_input_len])
        ret[f"{tag}max_length_q"] = max(chosen_features["max_length_q"], rejected_features["max_length_q"])
        ret[f"{tag}max_length_k"] = max(chosen_features["max_length_k"], rejected_features["max_length_k"])
    ret[f"{tag}position_ids"] = torch.cat([chosen_features["position_ids"], rejected_features["position_ids"]], dim=-1)
    return ret, len(chosen_features["cu_seq_lens_k"]) - 1


def doc_lens_from_cu_seq_lens(cu_seq_lens_k_D1, seq_len):
    """Convert flash-attn ``cu_seq_lens_k`` to OLMo-core ``doc_lens`` / ``max_doc_lens``."""
    seq_lens_D = cu_seq_lens_k_D1.diff().to(torch.int32)
    total = int(cu_seq_lens_k_D1[-1].item())
    if total < seq_len:
        pad_D = torch.tensor([seq_len - total], dtype=torch.int32)
        seq_lens_D = torch.cat([seq_lens_D, pad_D])
    doc_lens_BD = seq_lens_D.unsqueeze(0)
    max_doc_lens_B = [int(doc_lens_BD.max().item())]
    return doc_lens_BD, max_doc_lens_B


class TinyOlmo(nn.Module):
    """Stand-in for the OLMo-core Transformer: `doc_lens` restricts attention to each document."""

    def __init__(self, vocab=50, d=32, n_heads=4):
        super().__init__()
        self.n_heads = n_heads
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(64, d)
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)
        self.lm_head = nn.Linear(d, vocab)

    def forward(self, input_ids, position_ids=None, doc_lens=None, max_doc_lens=None):
        b, t = input_ids.shape
        x = self.embed(input_ids) + self.pos(position_ids)
        doc_ids = torch.repeat_interleave(torch.arange(doc_lens.shape[-1]), doc_lens[0])[None]
        mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
        q, k, v = self.qkv(x).view(b, t, 3, self.n_heads, -1).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
        return self.lm_head(x + self.out(h.transpose(1, 2).reshape(b, t, -1)))


def main():
    torch.manual_seed(0)

    def example(prompt, chosen, rejected):
        c, r = torch.tensor(prompt + chosen), torch.tensor(prompt + rejected)
        return {"chosen_input_ids": c, "chosen_labels": c, "rejected_input_ids": r, "rejected_labels": r}

    features = [example([3, 4], [5], [6, 7]), example([8, 9], [10, 11], [12])]
    collator = TensorDataCollatorWithFlatteningDPO(max_seq_length=12)
    batch, bs = concatenated_inputs(collator(features))
    input_ids = batch["concatenated_input_ids"]
    doc_lens, max_doc_lens = doc_lens_from_cu_seq_lens(batch["concatenated_cu_seq_lens_k"], seq_len=input_ids.shape[-1])
    model = TinyOlmo().eval()
    with torch.no_grad():
        logits = model(input_ids, position_ids=batch["concatenated_position_ids"], doc_lens=doc_lens, max_doc_lens=max_doc_lens)
    print("cu_seq_lens", batch["concatenated_cu_seq_lens_k"].tolist(), "first rejected logit %.4f" % logits[0, 12, 0].item())


if __name__ == "__main__":
    main()
