# Correct program (quiet batch quiet-r77b).
# Ported from huggingface/lighteval @0178e9a24ce24b8e0cbdcca9d9b3f46bcfa52b96:
#   src/lighteval/models/transformers/transformers_model.py (TransformersModel._loglikelihood_tokens,
#   prepare_batch_logprob, _model_call, loglikelihood), tok_encode_pair from
#   src/lighteval/models/abstract_model.py (pairwise=True: context and continuation encoded apart).
# Multiple-choice scoring: every (context, choice) pair of every doc in the batch becomes one flat row
# `context + continuation`, left-truncated to the model's max length and right-padded with pad_token_id to the
# batch's longest row; prepare_batch_logprob also builds a boolean input_mask (True on real tokens), but
# _model_call feeds only input_ids (`self.model(inputs).logits`), as lighteval does. The log-probs of the
# continuation are read at rows [input_length - continuation_length - 1 : input_length - 1] of each flat row, so
# only real positions (which a causal model computes from real tokens only) are read. (Rolling mode is left out.)
# The tokenizer is a small word-level stand-in; the model is a tiny LlamaForCausalLM built from LlamaConfig.
# Self-check: every choice's summed log-likelihood and greedy exact-match equals a reference computed by running
# context + choice alone (batch of one, no padding, same left truncation) and reading each continuation token's
# log-prob in a double loop (choices x tokens).
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)


# ---------------------------------------------------------------- stand-ins for lighteval's small types
@dataclass
class Doc:
    query: str
    choices: list
    gold_index: int = 0


@dataclass
class Batch:
    input_ids: torch.Tensor
    input_mask: torch.Tensor
    input_lengths: list
    truncated: list
    padded: list


@dataclass
class ModelResponse:
    input: str = ""
    argmax_logits_eq_gold: list = field(default_factory=list)
    logprobs: list = field(default_factory=list)
    input_tokens: list = field(default_factory=list)
    output_tokens: list = field(default_factory=list)


class WordTokenizer:
    """Word-level stand-in for an AutoTokenizer: ids 0 = <pad>, 1 = <s>, 2 = </s>."""

    def __init__(self, words):
        self.vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
        for w in words:
            self.vocab.setdefault(w, len(self.vocab))
        self.pad_token_id = 0
        self.bos_token_id = 1
        self.eos_token_id = 2

    def encode(self, text, add_special_tokens=True):
        ids = [self.vocab[w] for w in text.split()]
        return ([self.bos_token_id] if add_special_tokens else []) + ids


class PromptManager:
    def prepare_prompt(self, doc: Doc) -> str:
        return doc.query


class LoglikelihoodDataset:
    """lighteval.data.LoglikelihoodDataset, one split, sorted by length (longest first) with original order kept."""

    def __init__(self, requests, model):
        self.original = list(requests)
        lengths = [
            -(len(model.tok_encode(d.query)) + max(len(model.tok_encode(c, False)) for c in d.choices))
            for d in requests
        ]
        self.order = sorted(range(len(requests)), key=lambda i: lengths[i])
        self.sorted_data = [self.original[i] for i in self.order]

    def splits_iterator(self):
        yield self.sorted_data

    def get_original_order(self, new_arr):
        out = [None] * len(new_arr)
        for pos, i in enumerate(self.order):
            out[i] = new_arr[pos]
        return out


# ---------------------------------------------------------------- transformers_model.py (trimmed)
class TransformersModel:
    def __init__(self, model, tokenizer, max_length, batch_size):
        self.model = model
        self._tokenizer = tokenizer
        self._max_length = max_length
        self.batch_size = batch_size
        self._device = "cpu"
        self.accelerator = None
        self.prompt_manager = PromptManager()
        self.disable_tqdm = True
        self._add_special_tokens = True

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_length(self):
        return self._max_length

    @property
    def device(self):
        return self._device

    def tok_encode(self, str_to_encode, add_special_tokens=None):
        if add_special_tokens is None:
            add_special_tokens = self._add_special_tokens
        return self.tokenizer.encode(str_to_encode, add_special_tokens=add_special_tokens)

    def tok_encode_pair(self, context, continuations, pairwise=False):
        # abstract_model.py: pairwise -> context and continuation tokenized separately
        if isinstance(context, str):
            context = [context for _ in continuations]
        context_enc = [self.tok_encode(c) for c in context]
        continuation_enc = [self.tok_encode(c, add_special_tokens=False) for c in continuations]
        return context_enc, continuation_enc

    def _model_call(self, inputs: torch.Tensor) -> torch.Tensor:
        return self.model(inputs).logits  # [batch, padding_length, vocab]

    def loglikelihood(self, docs):
        return self._loglikelihood_tokens(docs)

    def _loglikelihood_tokens(self, docs):
        dataset = LoglikelihoodDataset(requests=docs, model=self)
        res = []

        for split in dataset.splits_iterator():
            batch_size = self.batch_size
            dataloader = DataLoader(split, batch_size=batch_size, collate_fn=lambda batch: batch)

            for batch in dataloader:
                contexts = [self.prompt_manager.prepare_prompt(doc) for doc in batch]
                tokenized_contexts_batch = []
                tokenized_continuations_batch = []

                for context, doc in zip(contexts, batch):
                    tokenized_contexts, tokenized_continuations = self.tok_encode_pair(
                        context, doc.choices, pairwise=True
                    )
                    tokenized_contexts_batch.append(tokenized_contexts)
                    tokenized_continuations_batch.append(tokenized_continuations)

                prepared_batch = self.prepare_batch_logprob(
                    tokenized_contexts=tokenized_contexts_batch,
                    tokenized_continuations=tokenized_continuations_batch,
                    max_context=None,
                )

                model_output = self._model_call(prepared_batch.input_ids)
                logits = F.log_softmax(model_output, dim=-1)  # [batch, sequence_length, vocab]

                flat_index = 0
                for i, doc in enumerate(batch):
                    choices_count = len(tokenized_continuations_batch[i])
                    tokenized_continuations = tokenized_continuations_batch[i]
                    logits_for_doc = logits[flat_index : flat_index + choices_count]
                    input_lengths = prepared_batch.input_lengths[flat_index : flat_index + choices_count]
                    flat_index += choices_count

                    logits_sum_doc = []
                    max_equals_doc = []
                    batch_cont_tokens_doc = []

                    for logits_for_request, input_length, tokenized_continuation in zip(
                        logits_for_doc, input_lengths, tokenized_continuations
                    ):
                        tokenized_continuation = torch.tensor(
                            tokenized_continuation, dtype=torch.long, device=self.device
                        )
                        continuation_length = len(tokenized_continuation)
                        logits_for_request = (
                            logits_for_request[input_length - continuation_length - 1 : input_length - 1]
                            .unsqueeze(0)
                            .to(self.device)
                        )
                        tokenized_continuation = tokenized_continuation.unsqueeze(0).to(self.device)  # [1, seq]

                        greedy_tokens = logits_for_request.argmax(dim=-1).to(self.device)
                        max_equal = (greedy_tokens == tokenized_continuation).all().squeeze(0).to(self.device)

                        logits_for_request = torch.gather(
                            logits_for_request, 2, tokenized_continuation.unsqueeze(-1)
                        ).squeeze(-1)  # [1, seq]

                        logits_sum_doc.append(logits_for_request.sum())
                        max_equals_doc.append(max_equal)
                        batch_cont_tokens_doc.append(tokenized_continuation)

                    answer = ModelResponse(
                        input=contexts[i],
                        argmax_logits_eq_gold=[max_equal.cpu().item() for max_equal in max_equals_doc],
                        logprobs=[s.cpu().item() for s in logits_sum_doc],
                        input_tokens=tokenized_contexts_batch[i],
                        output_tokens=tokenized_continuations_batch[i],
                    )
                    res.append(answer)

        return dataset.get_original_order(res)

    def prepare_batch_logprob(self, tokenized_contexts, tokenized_continuations, max_context: Optional[int] = None):
        inputs = []
        for tokenized_context, tokenized_continuation in zip(tokenized_contexts, tokenized_continuations):
            inputs.extend(
                [context + continuation for context, continuation in zip(tokenized_context, tokenized_continuation)]
            )

        input_tokens = []
        attention_masks = []
        input_lengths = []
        truncated = []
        padded = []

        if max_context is None:
            max_context = self.max_length

        max_sequence_length = max(len(seq) for seq in inputs)
        effective_max_length = min(max_sequence_length, max_context)

        for orig_tokens in inputs:
            truncated.append(max(len(orig_tokens) - effective_max_length, 0))

            # Truncate from the left if needed to fit in the model's context
            tokens = torch.tensor((orig_tokens)[-effective_max_length:], dtype=torch.long).to(self.device)
            sequence_len = tokens.shape[0]

            padding_needed = effective_max_length - sequence_len
            padded.append(padding_needed)

            # Right padding to reach effective_max_length
            tokens = F.pad(tokens, (0, padding_needed), value=self.tokenizer.pad_token_id)

            # Create attention mask (1 for real tokens, 0 for padding)
            mask = torch.ones_like(tokens, dtype=torch.bool)
            mask[sequence_len:] = False
            attention_masks.append(mask)

            input_tokens.append(tokens.unsqueeze(0))
            input_lengths.append(sequence_len)

        batched_inputs = torch.cat(input_tokens, dim=0)
        attention_masks = torch.cat(attention_masks, dim=0)

        return Batch(
            input_ids=batched_inputs,
            input_mask=attention_masks,
            input_lengths=input_lengths,
            truncated=truncated,
            padded=padded,
        )


# ---------------------------------------------------------------- data + model
WORDS = (
    "the a cat dog sat ran on under mat table red blue green what is colour of sky sea grass answer question "
    "paris london rome berlin capital france italy germany city which one two three four five plus equals"
).split()
tok = WordTokenizer(WORDS)

config = LlamaConfig(
    vocab_size=len(tok.vocab),
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
hf_model = LlamaForCausalLM(config).eval()

docs = [
    Doc("question : what is the colour of the sky ? answer :", ["blue", "green", "red the sea"], 0),
    Doc("question : capital of france ? answer :", ["paris", "london", "rome", "berlin city"], 0),
    Doc("one plus two equals", ["three", "four five"], 0),
    Doc("question : which city is the capital of italy and not germany ? answer :", ["rome", "berlin"], 0),
    Doc("the cat sat on the", ["mat", "table", "red mat under the table"], 0),
]
for d in docs:
    d.query = d.query.replace(" ? ", " ").replace(" : ", " ").replace("?", "").replace(":", "")
    d.query = " ".join(w for w in d.query.split() if w in tok.vocab)

lm = TransformersModel(hf_model, tok, max_length=10, batch_size=2)

with torch.no_grad():
    responses = lm.loglikelihood(docs)


# ---------------------------------------------------------------- reference: one row at a time, no padding
def reference_choice(context_ids, cont_ids, max_length):
    full = (context_ids + cont_ids)[-max_length:]
    out = hf_model(torch.tensor([full])).logits[0].log_softmax(-1)
    total = 0.0
    greedy_ok = True
    start = len(full) - len(cont_ids)
    for k in range(len(cont_ids)):
        pos = start + k - 1
        row = out[pos]
        total += row[cont_ids[k]].item()
        greedy_ok = greedy_ok and int(row.argmax()) == cont_ids[k]
    return total, greedy_ok


n_checked = 0
n_truncated = 0
with torch.no_grad():
    for doc, resp in zip(docs, responses):
        ctx = lm.tok_encode(doc.query)
        for j, choice in enumerate(doc.choices):
            cont = lm.tok_encode(choice, add_special_tokens=False)
            n_truncated += len(ctx + cont) > lm.max_length
            ref_lp, ref_eq = reference_choice(ctx, cont, lm.max_length)
            assert abs(resp.logprobs[j] - ref_lp) < 1e-4, (doc.query, choice, resp.logprobs[j], ref_lp)
            assert bool(resp.argmax_logits_eq_gold[j]) == ref_eq, (doc.query, choice)
            n_checked += 1
assert n_truncated > 0  # some rows are left-truncated to max_length

print(f"ok: {n_checked} continuation log-likelihoods match the unpadded per-row reference")
