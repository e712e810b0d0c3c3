# Correct program (quiet batch quiet-r77b).
# Ported from open-compass/opencompass @11ce0348ff50403763e471edcf621b8e8be530af: opencompass/models/huggingface.py
#   (HuggingFace._load_tokenizer's pad patch: no pad token -> eos as pad; get_logits, get_ppl, _get_ppl, get_token_len),
#   driven as a PPL inferencer drives it: one prompt per candidate label, the label of lowest score wins, and
#   mask_length = the token length of the prompt part so that only the label part is scored.
# With batch_padding=True the prompts of a batch are tokenized together (padding=True, the tokenizer's padding side:
# right here) and the model is called with `**tokens`, i.e. input_ids and attention_mask. The loss is a per-token
# CrossEntropyLoss with ignore_index=pad_token_id, so padded targets add 0; the length divided by is the count of
# non-pad tokens (minus mask_length when given), and mask_length zeroes the loss of the first mask_length - 1 shifted
# targets.
# The tokenizer is a small word-level stand-in that adds <s> and has no pad token; the model is a tiny
# Qwen2ForCausalLM built from Qwen2Config.
# Self-check: every prompt's score equals a reference computed by running it alone (batch of one, no padding,
# batch_padding=False path; there each text gets its own [mask_length[i]], where upstream hands the whole list on)
# and by a double loop over prompts x target tokens summing -log p; the chosen labels
# agree.
from typing import List, Optional

import numpy as np
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

torch.manual_seed(0)


class WordTokenizer:
    """Stand-in for AutoTokenizer: <s> = 1 added in front, </s> = 2, no pad token, pads on the right."""

    def __init__(self, words):
        self.vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for w in words:
            self.vocab.setdefault(w, len(self.vocab))
        self.bos_token, self.eos_token = "<s>", "</s>"
        self.pad_token = None
        self.padding_side = "right"

    @property
    def pad_token_id(self):
        return None if self.pad_token is None else self.vocab[self.pad_token]

    @pad_token_id.setter
    def pad_token_id(self, value):
        self.pad_token = {v: k for k, v in self.vocab.items()}[value]

    def encode(self, text):
        return [self.vocab["<s>"]] + [self.vocab[w] for w in text.split()]

    def __call__(self, inputs, padding=False, truncation=True, max_length=None):
        ids = [self.encode(t) for t in inputs]
        if truncation and max_length:
            ids = [x[:max_length] for x in ids]
        if not padding:
            return {"input_ids": ids, "attention_mask": [[1] * len(x) for x in ids]}
        longest = max(len(x) for x in ids)
        pad = self.pad_token_id
        if self.padding_side == "right":
            input_ids = [x + [pad] * (longest - len(x)) for x in ids]
            attention_mask = [[1] * len(x) + [0] * (longest - len(x)) for x in ids]
        else:
            input_ids = [[pad] * (longest - len(x)) + x for x in ids]
            attention_mask = [[0] * (longest - len(x)) + [1] * len(x) for x in ids]
        return {"input_ids": input_ids, "attention_mask": attention_mask}


# ---------------------------------------------------------------- opencompass/models/huggingface.py (trimmed)
class HuggingFace:
    def __init__(self, model, tokenizer, max_seq_len=2048, batch_padding=False, pad_token_id=None):
        self.max_seq_len = max_seq_len
        self.pad_token_id = pad_token_id
        self.tokenizer = tokenizer
        self._load_tokenizer()
        self.batch_padding = batch_padding
        self.model = model
        self.model.eval()

    def _load_tokenizer(self):
        # A patch for some models without pad_token_id
        if self.pad_token_id is not None:
            self.tokenizer.pad_token_id = self.pad_token_id
        elif self.tokenizer.pad_token_id is None:
            if self.tokenizer.eos_token is not None:
                self.tokenizer.pad_token = self.tokenizer.eos_token
            else:
                raise ValueError("pad_token_id is not set for this tokenizer.")

    def get_logits(self, inputs: List[str]):
        if self.batch_padding and len(inputs) > 1:
            # batch inference
            tokens = self.tokenizer(inputs, padding=True, truncation=True, max_length=self.max_seq_len)

            tokens = {
                k: torch.tensor(np.array(tokens[k]), device=self.model.device)
                for k in tokens if k in ["input_ids", "attention_mask"]
            }
            outputs = self.model(**tokens)

        else:
            input_ids = self.tokenizer(inputs, padding=False, truncation=True,
                                       max_length=self.max_seq_len)["input_ids"]
            input_ids = torch.tensor(input_ids, device=self.model.device)
            tokens = {"input_ids": input_ids}

            outputs = self.model(input_ids)
        return outputs[0], {"tokens": tokens}

    def get_ppl(self, inputs: List[str], mask_length: Optional[List[int]] = None) -> List[float]:
        if self.batch_padding and len(inputs) > 1:
            assert self.tokenizer.pad_token
            return self._get_ppl(inputs, mask_length=mask_length)
        else:
            return np.concatenate([
                self._get_ppl(inputs=[text], mask_length=None if mask_length is None else [mask_length[i]])
                for i, text in enumerate(inputs)
            ])

    def _get_ppl(self, inputs: List[str], mask_length: Optional[List[int]] = None) -> List[float]:
        outputs, inputs = self.get_logits(inputs)
        shift_logits = outputs[..., :-1, :].contiguous().float()

        shift_labels = inputs["tokens"]["input_ids"][..., 1:].contiguous()

        loss_fct = torch.nn.CrossEntropyLoss(reduction="none", ignore_index=self.tokenizer.pad_token_id)
        loss = loss_fct(shift_logits.view(-1, shift_logits.size(-1)),
                        shift_labels.view(-1)).view(shift_labels.size())

        if mask_length is not None:
            mask = torch.zeros_like(shift_labels)  # [batch,seqlen]
            for i in range(len(mask)):
                for j in range(mask_length[i] - 1, len(mask[i])):
                    mask[i][j] = 1
            loss = loss * mask

        lens = (inputs["tokens"]["input_ids"] != self.tokenizer.pad_token_id).sum(-1).cpu().numpy()
        if mask_length is not None:
            lens -= np.array(mask_length)
        ce_loss = loss.sum(-1).cpu().detach().numpy() / lens
        return ce_loss

    def get_token_len(self, prompt: str) -> int:
        return len(self.tokenizer.encode(prompt))


# ---------------------------------------------------------------- data + model
WORDS = (
    "question answer the a cat dog sat ran on under mat table red blue green what is colour of sky sea grass "
    "review this movie was great terrible sentiment positive negative it good bad film plot acting"
).split()
tok = WordTokenizer(WORDS)
config = Qwen2Config(vocab_size=len(tok.vocab), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                     bos_token_id=1, eos_token_id=2)
hf_model = Qwen2ForCausalLM(config).eval()

batched_lm = HuggingFace(hf_model, tok, max_seq_len=64, batch_padding=True)
assert tok.pad_token_id == 2  # eos used as pad

# PPLInferencer-style: one prompt per (example, label); the in-context part is mask_length tokens long
examples = [
    ("review this movie was great", {"positive": "sentiment positive", "negative": "sentiment negative"}),
    ("review the plot was bad the acting terrible", {"positive": "sentiment positive", "negative": "sentiment negative"}),
    ("question what is the colour of the sky answer", {"blue": "blue", "green": "green grass", "red": "red"}),
    ("review good film", {"positive": "it was good", "negative": "it was bad bad bad"}),
]
prompts, mask_length, owners = [], [], []
for ex_i, (ctx, labels) in enumerate(examples):
    for label, text in labels.items():
        prompts.append(ctx + " " + text)
        mask_length.append(batched_lm.get_token_len(ctx))
        owners.append((ex_i, label))

with torch.no_grad():
    ppl_plain = batched_lm.get_ppl(prompts)
    ppl_norm = batched_lm.get_ppl(prompts, mask_length=mask_length)

    single_lm = HuggingFace(hf_model, tok, max_seq_len=64, batch_padding=False)
    ppl_plain_single = single_lm.get_ppl(prompts)
    ppl_norm_single = single_lm.get_ppl(prompts, mask_length=mask_length)


# ---------------------------------------------------------------- reference: double loop, one prompt at a time
def reference(prompt, skip):
    ids = tok.encode(prompt)
    with torch.no_grad():
        logp = hf_model(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    total = 0.0
    for t in range(max(1, skip), len(ids)):
        total -= logp[t - 1, ids[t]].item()
    return total / (len(ids) - skip)


ref_plain = [reference(p, 0) for p in prompts]
ref_norm = [reference(p, m) for p, m in zip(prompts, mask_length)]
np.testing.assert_allclose(ppl_plain, ref_plain, rtol=1e-4)
np.testing.assert_allclose(ppl_norm, ref_norm, rtol=1e-4)
np.testing.assert_allclose(ppl_plain_single, ref_plain, rtol=1e-4)
np.testing.assert_allclose(ppl_norm_single, ref_norm, rtol=1e-4)

lengths = {len(tok.encode(p)) for p in prompts}
assert len(lengths) > 1  # the batch really is padded


def choose(scores):
    best = {}
    for (ex_i, label), s in zip(owners, scores):
        if ex_i not in best or s < best[ex_i][1]:
            best[ex_i] = (label, s)
    return [best[i][0] for i in range(len(examples))]


assert choose(ppl_norm) == choose(ref_norm)
print("ok: batched get_ppl (plain and mask_length) matches the per-prompt reference; labels", choose(ppl_norm))
