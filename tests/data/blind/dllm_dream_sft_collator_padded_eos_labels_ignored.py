# ZHZisZZ/dllm commit e7051611 ("Fix DreamSFTCollator padding loss"), examples/dream/sft.py +
# dllm/pipelines/dream/utils.py (DreamSFTCollator, a DataCollatorForSeq2Seq subclass).
# Dream is a masked-diffusion LM that must learn to emit the <eos> padding that ends a fixed-length
# canvas (the padding is pad_token == eos, right side). Before the fix the collator was built without
# label_pad_token_id, so DataCollatorForSeq2Seq padded the labels with -100: the padded <eos> slots
# were noised but never scored. The fix passes label_pad_token_id=tokenizer.pad_token_id
# ("finetune on padded <eos_token>"), so the padded eos positions are part of the diffusion loss.
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
import transformers

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)
np.random.seed(0)

VOCAB, EOS, MASK_ID = 64, 1, 63


class Tok:
    """Minimal tokenizer stand-in for DataCollatorForSeq2Seq (pad == eos, right padding)."""
    pad_token_id = EOS
    eos_token_id = EOS
    padding_side = "right"

    def pad(self, features, padding=True, max_length=None, pad_to_multiple_of=None, return_tensors="pt"):
        L = max(len(f["input_ids"]) for f in features)
        out = {"input_ids": [], "attention_mask": []}
        for f in features:
            n = L - len(f["input_ids"])
            out["input_ids"].append(list(f["input_ids"]) + [self.pad_token_id] * n)
            out["attention_mask"].append(list(f["attention_mask"]) + [0] * n)
            for k, v in f.items():
                if k not in ("input_ids", "attention_mask"):
                    out.setdefault(k, []).append(v)
        return {k: torch.tensor(v) for k, v in out.items()}


@dataclass
class DreamSFTCollator(transformers.DataCollatorForSeq2Seq):
    perbatch_cutoff: bool = False
    resp_cutoff_ratio: float = 0.0

    def __call__(self, features, return_tensors=None):
        batch = super().__call__(features, return_tensors)
        batch.pop("prompt_len", None)
        return batch


def default_sft_map_fn(prompt, response):
    ids = prompt + response + [EOS]
    labels = [-100] * len(prompt) + response + [EOS]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels, "prompt_len": len(prompt)}


tok = Tok()
features = [
    default_sft_map_fn([5, 6, 7, 8], [10, 11, 12, 13, 14, 15, 16]),
    default_sft_map_fn([5, 9], [20, 21, 22]),
]

collator_kwargs = dict(return_tensors="pt", padding=True, perbatch_cutoff=False, resp_cutoff_ratio=0.0)
if FIXED:
    collator_kwargs["label_pad_token_id"] = tok.pad_token_id  # finetune on padded <eos_token>
collator = DreamSFTCollator(tok, **collator_kwargs)
batch = collator([dict(f) for f in features])

cfg = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
model = transformers.Qwen2ForCausalLM(cfg).eval()

# DreamTrainer.compute_loss: noise the answer (labels != -100) at rate t, score masked slots, 1/t weight.
input_ids, labels = batch["input_ids"], batch["labels"]
b, l = input_ids.shape
t = torch.full((b, 1), 0.5)
maskable = labels != -100
masked = (torch.rand(b, l) < t) & maskable
noised = torch.where(masked, torch.full_like(input_ids, MASK_ID), input_ids)
with torch.no_grad():
    logits = model(input_ids=noised).logits
logits = torch.cat([logits[:, :1], logits[:, :-1]], dim=1)  # Dream's right-shifted logits
tok_loss = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
loss = (tok_loss * masked / t).sum() / maskable.sum()
print("labels", labels.tolist())
print("masked slots", int(masked.sum()), "loss %.6f" % loss.item())
