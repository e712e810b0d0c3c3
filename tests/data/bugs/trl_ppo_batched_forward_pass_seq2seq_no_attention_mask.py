"""TRL PPOTrainer.batched_forward_pass: padded seq2seq batches run with no attention masks.

Citation: huggingface/trl#139 ("fix forward batching for seq2seq and right padding models", merged
2023-02-09, commit ccd2641b5).

Bug: ``batched_forward_pass`` padded each forward mini-batch with the trainer's
``DataCollatorForLanguageModeling(tokenizer, mlm=False)`` on bare tensors and kept only ``["input_ids"]``:
for an encoder-decoder policy (T5) the model was called as
``self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids)`` -- no ``attention_mask``, no
``decoder_attention_mask``.  The shorter queries' pad tokens were attended by the encoder's bidirectional
self-attention and by every decoder cross-attention, so log-probs / values (and the PPO ratios) of a sample
depended on what it was batched with.

Fix (#139): the collator is given ``{"input_ids": q, "attention_mask": torch.ones_like(q)}`` dicts, so it
pads the masks too; ``attention_mask`` and ``decoder_attention_mask`` are passed to the model, and the
response span end is read from the decoder mask.

This program keeps the trainer method's structure and names; the collator and the T5-with-value-head are
small stand-ins (right padding, pad id 0) built on ``nn.Transformer`` with ``src_key_padding_mask`` /
``memory_key_padding_mask`` / ``tgt_key_padding_mask``.  Queries of 6 and 3 tokens, responses of 5 and 4.
"""
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

FIXED = "--fixed" in sys.argv
# nn.Transformer notes that a custom activation keeps its encoder off the nested-tensor fast path
warnings.filterwarnings("ignore", message="enable_nested_tensor is True")


@dataclass
class PPOConfig:
    batch_size: int = 2
    forward_batch_size: int = 2


class T5TokenizerStub:
    pad_token_id = 0
    padding_side = "right"

    def pad(self, features):
        max_len = max(len(f["input_ids"]) for f in features)
        out = {"input_ids": [], "attention_mask": []}
        for f in features:
            n = max_len - len(f["input_ids"])
            out["input_ids"].append(F.pad(f["input_ids"], (0, n), value=self.pad_token_id))
            out["attention_mask"].append(F.pad(f["attention_mask"], (0, n), value=0))
        return {k: torch.stack(v) for k, v in out.items()}


class DataCollatorForLanguageModeling:
    def __init__(self, tokenizer, mlm=False):
        self.tokenizer = tokenizer
        self.mlm = mlm

    def __call__(self, examples):
        if isinstance(examples[0], dict):
            batch = self.tokenizer.pad(examples)
        else:
            # _torch_collate_batch: pad the bare tensors, no attention mask
            max_len = max(len(e) for e in examples)
            batch = {"input_ids": torch.stack(
                [F.pad(e, (0, max_len - len(e)), value=self.tokenizer.pad_token_id) for e in examples])}
        labels = batch["input_ids"].clone()
        labels[labels == self.tokenizer.pad_token_id] = -100
        batch["labels"] = labels
        return batch


def gelu_new(x):
    """T5 v1.1's feed-forward activation (tanh-approximated GELU)."""
    return F.gelu(x, approximate="tanh")


class AutoModelForSeq2SeqLMWithValueHead(nn.Module):
    """A tiny T5-like policy: returns (lm_logits, loss, value) like trl's wrapper."""

    def __init__(self, vocab=64, d_model=32):
        super().__init__()
        self.shared = nn.Embedding(vocab, d_model)
        self.transformer = nn.Transformer(d_model, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                                          dim_feedforward=64, dropout=0.0, batch_first=True,
                                          activation=gelu_new)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.v_head = nn.Linear(d_model, 1)

    def forward(self, input_ids, decoder_input_ids, attention_mask=None, decoder_attention_mask=None):
        src_key_padding_mask = None if attention_mask is None else attention_mask == 0
        tgt_key_padding_mask = None if decoder_attention_mask is None else decoder_attention_mask == 0
        T = decoder_input_ids.shape[1]
        tgt_mask = torch.triu(torch.ones(T, T, dtype=torch.bool), diagonal=1)
        hidden = self.transformer(
            self.shared(input_ids), self.shared(decoder_input_ids), tgt_mask=tgt_mask,
            src_key_padding_mask=src_key_padding_mask, tgt_key_padding_mask=tgt_key_padding_mask,
            memory_key_padding_mask=src_key_padding_mask)
        return self.lm_head(hidden), None, self.v_head(hidden).squeeze(-1)


def logprobs_from_logits(logits, labels):
    logp = F.log_softmax(logits, dim=2)
    return torch.gather(logp, 2, labels.unsqueeze(2)).squeeze(-1)


class PPOTrainer:
    def __init__(self, config, model, ref_model, tokenizer):
        self.config = config
        self.model = model
        self.ref_model = ref_model
        self.tokenizer = tokenizer
        self.is_encoder_decoder = True
        self.data_collator = DataCollatorForLanguageModeling(self.tokenizer, mlm=False)

    def batched_forward_pass(self, queries, responses):
        bs = self.config.batch_size
        fbs = self.config.forward_batch_size
        all_logprobs, all_ref_logprobs, all_values = [], [], []
        if FIXED:
            # attention_masks are create with the same shape as inputs and are
            # automatically padded by the datacollator to indicate padding tokens
            input_data = self.data_collator([{"input_ids": q, "attention_mask": torch.ones_like(q)} for q in queries])
            decoder_inputs = self.data_collator(
                [{"input_ids": r, "attention_mask": torch.ones_like(r)} for r in responses])
            input_data["decoder_input_ids"] = decoder_inputs["input_ids"]
            input_data["decoder_attention_mask"] = decoder_inputs["attention_mask"]
            input_data.pop("labels")  # we don't want to compute LM losses

        for i in range(int(bs / fbs)):
            query_batch = queries[i * fbs: (i + 1) * fbs]
            response_batch = responses[i * fbs: (i + 1) * fbs]
            if FIXED:
                input_kwargs = {key: value[i * fbs: (i + 1) * fbs] for key, value in input_data.items()}
            else:
                input_ids = self.data_collator(query_batch)["input_ids"]
                decoder_input_ids = self.data_collator(response_batch)["input_ids"]
                input_kwargs = {"input_ids": input_ids, "decoder_input_ids": decoder_input_ids}

            with torch.no_grad():
                logits, _, v = self.model(**input_kwargs)
                ref_logits, _, _ = self.ref_model(**input_kwargs)
            decoder_input_ids = input_kwargs["decoder_input_ids"]
            logprobs = logprobs_from_logits(logits[:, :-1, :], decoder_input_ids[:, 1:])
            ref_logprobs = logprobs_from_logits(ref_logits[:, :-1, :], decoder_input_ids[:, 1:])
            for j in range(fbs):
                # Decoder sentence starts always in the index 1 after padding in the Enc-Dec Models
                start = 1
                if FIXED:
                    end = int(input_kwargs["decoder_attention_mask"][j, :].sum()) - 1
                else:
                    end = response_batch[j].shape[-1] - 1
                all_values.append(v[j, start:end])
                all_logprobs.append(logprobs[j, start:end])
                all_ref_logprobs.append(ref_logprobs[j, start:end])
        return all_logprobs, all_ref_logprobs, all_values


def main():
    torch.manual_seed(0)
    model = AutoModelForSeq2SeqLMWithValueHead().eval()
    ref_model = AutoModelForSeq2SeqLMWithValueHead().eval()
    trainer = PPOTrainer(PPOConfig(), model, ref_model, T5TokenizerStub())
    queries = [torch.tensor([5, 6, 7, 8, 9, 1]), torch.tensor([10, 11, 1])]
    responses = [torch.tensor([0, 20, 21, 22, 1]), torch.tensor([0, 23, 24, 1])]
    logprobs, _, values = trainer.batched_forward_pass(queries, responses)
    print(f"{'fixed' if FIXED else 'buggy'} logprob sums {[round(l.sum().item(), 4) for l in logprobs]}")


if __name__ == "__main__":
    main()
