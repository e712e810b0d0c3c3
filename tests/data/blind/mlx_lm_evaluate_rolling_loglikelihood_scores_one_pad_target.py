"""mlx_lm.evaluate: batched loglikelihood_rolling counts one pad target per short document.

Citation: ml-explore/mlx-lm#1855 ("Fix padding-token inflation in batched perplexity
evals", merged; description read, pre-fix mlx_lm/evaluate.py read at d78bf58e).
Torch port of the MLX code (mx -> torch, a tiny LlamaForCausalLM stands in for
`load(...)`, a DynamicCache for `make_prompt_cache`).

Bug: `_pad_inputs` right-pads the batch with 0 and returns the token counts
`lengths`; `_score_fn` then shifts (`inputs[..., :-1]`, `inputs[..., 1:]`), so a
document of L tokens has L - 1 scored targets. `loglikelihood_rolling` still keeps
`mx.arange(T) < lengths[:, None]`, i.e. L positions: every document shorter than
the longest of its batch also sums the log-probability of predicting the pad id 0
after its last token (and `_score_fn`'s is_greedy window is one slot too wide the
same way). Perplexity changes with --batch-size.

Fix (as the PR describes it): only the L - 1 real targets are kept, the window
is `arange < lengths - 1`.
"""
import collections
import sys
from typing import Any, Optional

import numpy as np
import torch
import torch.nn.functional as F
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _pad_inputs(inputs):
    lengths = np.array([len(x) for x in inputs])
    maxlen = lengths.max()
    padded = np.stack(
        [np.pad(np.array(x), (0, maxlen - len(x))) for x in inputs],
        axis=0,
    )
    return torch.tensor(padded, dtype=torch.long), torch.tensor(lengths)


def make_prompt_cache(model):
    return DynamicCache()


class CharTokenizer:
    """Byte-level stand-in for the HF tokenizer: 0 is never a real token."""

    name_or_path = "tiny/char-llama"
    chat_template = None

    def encode(self, text, add_special_tokens=True):
        ids = [1 + (ord(c) % 62) for c in text]
        return ([63] if add_special_tokens else []) + ids


Instance = collections.namedtuple("Instance", ["args"])


class MLXLM:
    def __init__(self, model, tokenizer, batch_size: int = 8, use_chat_template=None):
        self._model, self.tokenizer = model, tokenizer
        self._batch_size = batch_size
        self.use_chat_template = use_chat_template
        if use_chat_template is None:
            self.use_chat_template = self.tokenizer.chat_template is not None

    @torch.no_grad()
    def _score_fn(self, inputs, cache: Optional[Any] = None, step_size: int = 2048):
        inputs, lengths = _pad_inputs(inputs)
        inputs, targets = inputs[..., :-1], inputs[..., 1:]
        if FIXED:
            lengths = lengths - 1

        cache = cache or make_prompt_cache(self._model)
        offset = 0
        scores, is_greedy = [], []
        for i in range(0, inputs.shape[1], step_size):
            inp = inputs[:, i : i + step_size]
            T = inp.shape[1]

            logits = self._model(input_ids=inp, past_key_values=cache, use_cache=True).logits
            log_probs = F.log_softmax(logits.float(), dim=-1)

            score = torch.take_along_dim(
                log_probs, targets[:, i : i + step_size, None], dim=-1
            )[..., 0]

            ig = targets[:, i : i + step_size] == torch.argmax(logits, dim=-1)
            ig = torch.where(torch.arange(offset, T + offset) < lengths[:, None], ig, False)

            is_greedy.append(ig)
            scores.append(score)
            offset += T

        scores = torch.cat(scores, dim=1)
        is_greedy = torch.cat(is_greedy, dim=1)

        return scores, lengths, is_greedy

    def _tokenize(self, texts):
        return [
            tuple(self.tokenizer.encode(t, add_special_tokens=not self.use_chat_template))
            for t in texts
        ]

    def loglikelihood_rolling(self, requests):
        inputs = self._tokenize([req.args[0] for req in requests])
        all_scores = []
        for i in range(0, len(inputs), self._batch_size):
            batch = inputs[i : i + self._batch_size]
            scores, lengths, _ = self._score_fn(batch)
            mask = torch.arange(scores.shape[-1]) < lengths[:, None]
            all_scores.extend((mask * scores).sum(dim=-1).tolist())

        return all_scores


def main():
    config = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=0,
        bos_token_id=63,
        eos_token_id=62,
        attn_implementation="sdpa",
    )
    model = LlamaForCausalLM(config).eval()
    lm = MLXLM(model, CharTokenizer(), batch_size=4)

    docs = [
        "the quick brown fox jumps over the lazy dog",
        "a short line",
        "perplexity should not depend on batch size",
        "wikitext",
    ]
    requests = [Instance(args=(d,)) for d in docs]
    scores = lm.loglikelihood_rolling(requests)
    n_tokens = [len(d) for d in docs]
    for d, s, n in zip(docs, scores, n_tokens):
        print(f"{d[:24]:<24s} logprob={s:9.4f} ppl={np.exp(-s / n):8.4f}")
    print(f"word-level total logprob: {sum(scores):.4f}")


if __name__ == "__main__":
    main()
