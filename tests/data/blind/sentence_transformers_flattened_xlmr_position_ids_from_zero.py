"""sentence-transformers: flattened (unpadded) text batches handed XLM-R 0-based position_ids.

Citation: huggingface/sentence-transformers#3879 (merge commit 7bfcf6cb, "Fix position_ids offsetting for
RoBERTa-family models when flattening inputs"); same cause as huggingface/transformers#47496.
Files: sentence_transformers/base/modules/transformer.py (Transformer._can_flatten_inputs, preprocess,
forward) and sentence_transformers/sentence_transformer/modules/pooling.py (Pooling._forward_flattened).

The bug: since v5.5 the Transformer module, when flash attention's varlen kernel is requested, skips
padding for text-only batches: it tokenizes without padding and hands the per-sample lists to
transformers' ``DataCollatorWithFlattening(return_seq_idx=True, return_flash_attn_kwargs=True,
return_position_ids=True)``, which concatenates them into one row with ``cu_seq_lens_q/k`` and
``position_ids`` restarting at 0 for every text. RoBERTa-family embeddings (XLM-R, MPNet, ...) number
their positions from ``padding_idx + 1`` (2 for XLM-R) when they build them themselves, so every token
of the flattened batch reads the position embedding two rows too early (the first two tokens of each
text read rows 0 and ``padding_idx``). No crash; the sentence embeddings are just different.

The fix: ``_infer_flatten_position_offset`` finds a module with an int ``padding_idx`` next to a learned
``position_embeddings`` table and stores ``padding_idx + 1``; ``preprocess`` adds it to the collator's
``position_ids``.

Here: a tiny XLMRobertaModel (random weights, pad_token_id=1) built from its config, a word-level vocab
written by hand in place of the tokenizer, mean pooling. The flash varlen kernel is not on CPU: the model
runs SDPA, where transformers builds the same per-text blocks from the restarting position_ids (packed
sequence detection, no attention_mask), which is what flash's cu_seq_lens do.
"""

import sys
from typing import Any

import torch
from transformers import DataCollatorWithFlattening, XLMRobertaConfig, XLMRobertaModel

FIXED = "--fixed" in sys.argv


class WordTokenizer:
    """Stand-in for XLMRobertaTokenizerFast: <s>=0, <pad>=1, </s>=2, words from 4 up."""

    bos_token_id, pad_token_id, eos_token_id = 0, 1, 2

    def __init__(self, texts: list[str]):
        words = sorted({w for t in texts for w in t.lower().split()})
        self.vocab = {w: i + 4 for i, w in enumerate(words)}

    def __call__(self, texts: list[str], return_attention_mask: bool = True, **kwargs) -> dict[str, Any]:
        input_ids = [[self.bos_token_id] + [self.vocab[w] for w in t.lower().split()] + [self.eos_token_id] for t in texts]
        out = {"input_ids": input_ids}
        if return_attention_mask:
            out["attention_mask"] = [[1] * len(ids) for ids in input_ids]
        return out


class Transformer(torch.nn.Module):
    """sentence_transformers.base.modules.transformer.Transformer, trimmed to the text path."""

    def __init__(self, model: XLMRobertaModel, tokenizer: WordTokenizer):
        super().__init__()
        self.model = model
        self.tokenizer = tokenizer
        self.config = model.config
        self.model_forward_params = {"input_ids", "attention_mask", "token_type_ids", "position_ids", "return_dict"}
        self.can_flatten_inputs = self._can_flatten_inputs()

    def _can_flatten_inputs(self) -> bool:
        # Upstream: only when is_flash_attention_requested(...) and a flash varlen function exists.
        # On CPU the model runs "sdpa" in its place (see the header).
        self.data_collator = DataCollatorWithFlattening(
            return_seq_idx=True,  # Not always necessary, perhaps only Mamba/Bamba?
            return_flash_attn_kwargs=True,
            return_position_ids=True,  # Crucial for performance
        )
        self.model_forward_params |= {
            "cu_seq_lens_q",
            "cu_seq_lens_k",
            "max_length_q",
            "max_length_k",
            "seq_idx",
        }
        if FIXED:
            self._flatten_position_offset = self._infer_flatten_position_offset()
        return True

    def _infer_flatten_position_offset(self) -> int:
        # DataCollatorWithFlattening emits 0-based position_ids, but RoBERTa-family embeddings
        # (XLM-R, MPNet, ...) expect positions from padding_idx + 1. No 0-based or rotary module
        # pairs an int padding_idx with a learned position_embeddings table.
        for module in self.model.modules():
            padding_idx = getattr(module, "padding_idx", None)
            if isinstance(padding_idx, int) and isinstance(
                getattr(module, "position_embeddings", None), torch.nn.Embedding
            ):
                return padding_idx + 1
        return 0

    def preprocess(self, texts: list[str]) -> dict[str, Any]:
        common_kwargs = {"return_tensors": "pt"}
        text_kwargs = {"padding": True}
        should_flatten = self.can_flatten_inputs
        if should_flatten:
            del common_kwargs["return_tensors"]
            text_kwargs.pop("padding", None)
            text_kwargs["return_attention_mask"] = False

        processor_output = self.tokenizer(texts, **text_kwargs, **common_kwargs)

        if should_flatten:
            # DataCollatorWithFlattening expects list[dict], but the processor returns dict[str, list].
            per_sample = [dict(zip(processor_output, values)) for values in zip(*processor_output.values())]
            processor_output = self.data_collator(per_sample)
            processor_output.pop("labels", None)
            if FIXED and self._flatten_position_offset:
                processor_output["position_ids"] = processor_output["position_ids"] + self._flatten_position_offset

        processor_output["modality"] = "text"
        return processor_output

    def forward(self, features: dict[str, Any]) -> dict[str, Any]:
        all_kwargs = {**features, "return_dict": True}
        filtered_kwargs = {key: value for key, value in all_kwargs.items() if key in self.model_forward_params}
        model_output = self.model(**filtered_kwargs)
        features["token_embeddings"] = model_output["last_hidden_state"]
        return features


class Pooling(torch.nn.Module):
    """sentence_transformers.sentence_transformer.modules.pooling.Pooling, mean mode, flattened path."""

    def forward(self, features: dict[str, Any]) -> dict[str, Any]:
        token_embeddings = features["token_embeddings"]
        output_vectors = self._forward_flattened(token_embeddings, features)
        features["sentence_embedding"] = torch.cat(output_vectors, 1)
        return features

    def _forward_flattened(self, token_embeddings: torch.Tensor, features: dict[str, Any]) -> list[torch.Tensor]:
        all_embeddings = token_embeddings.squeeze(0)  # (total_tokens, hidden_dim)
        cu_seq_lens_q = features["cu_seq_lens_q"]  # (num_seqs + 1,)
        seq_lengths = cu_seq_lens_q[1:] - cu_seq_lens_q[:-1]  # (num_seqs,)
        num_seqs = seq_lengths.shape[0]
        hidden_dim = all_embeddings.shape[1]
        segment_ids = features["seq_idx"].squeeze(0).long()
        num_seqs = int(segment_ids.max().item()) + 1
        effective_lengths = torch.bincount(segment_ids, minlength=num_seqs)
        mean_sum = torch.zeros(num_seqs, hidden_dim, dtype=all_embeddings.dtype)
        mean_sum = mean_sum.index_add(0, segment_ids, all_embeddings)
        return [mean_sum / torch.clamp(effective_lengths.unsqueeze(1), min=1e-9).to(mean_sum.dtype)]


def main() -> None:
    torch.manual_seed(0)
    texts = [
        "the cat sat on the mat",
        "a dog barked",
        "stock markets fell sharply on monday morning",
        "rain again",
    ]
    config = XLMRobertaConfig(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=24,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
        attn_implementation="sdpa",
    )
    model = XLMRobertaModel(config, add_pooling_layer=False).eval()
    transformer = Transformer(model, WordTokenizer(texts))
    pooling = Pooling()

    with torch.no_grad():
        features = transformer.preprocess(texts)
        features = transformer(features)
        features = pooling(features)
    embeddings = torch.nn.functional.normalize(features["sentence_embedding"], dim=-1)

    print("position_ids:", features["position_ids"].tolist())
    print("embeddings[:, :4]:", embeddings[:, :4])
    print("cosine(text0, text1..):", (embeddings[0] @ embeddings[1:].T).tolist())


if __name__ == "__main__":
    main()
