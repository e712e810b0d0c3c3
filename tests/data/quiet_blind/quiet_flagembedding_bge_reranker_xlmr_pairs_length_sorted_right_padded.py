# Citation: FlagOpen/FlagEmbedding @dfdace383d5602240830700b87e19cc91ec5e0a5:
#   FlagEmbedding/inference/reranker/encoder_only/base.py (BaseReranker.compute_score_single_gpu, sigmoid),
#   as used for bge-reranker (XLMRobertaForSequenceClassification, num_labels=1).
# A cross-encoder reranker over (query, passage) pairs: queries and passages are tokenized apart without
# special tokens (the query cut to query_max_length), joined by prepare_for_model as
# <s> q </s></s> p </s> with truncation='only_second', sorted longest first, padded per batch on the right by
# tokenizer.pad (attention_mask 0 on <pad>, XLM-R positions counted from the non-pad ids), scored from the
# classification head on <s>, and put back in the caller's order. The tokenizer is a tiny word-level stand-in
# for XLMRobertaTokenizer (same special tokens, same pair layout), since nothing is downloaded.
# Checked: every score against its pair run alone (unpadded, no attention_mask) and, for one pair, against
# an explicit position_ids / no-padding run built by hand.
from typing import Any, List, Optional, Tuple, Union

import numpy as np
import torch
from transformers import PreTrainedTokenizer, XLMRobertaConfig, XLMRobertaForSequenceClassification

torch.manual_seed(0)


def sigmoid(x):
    return float(1 / (1 + np.exp(-x)))


class TinyXLMRobertaTokenizer(PreTrainedTokenizer):
    """Word-level stand-in for XLMRobertaTokenizer: <s>=0, <pad>=1, </s>=2, <unk>=3, pairs <s> A </s></s> B </s>."""

    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, words, **kwargs):
        self.vocab = {w: i for i, w in enumerate(["<s>", "<pad>", "</s>", "<unk>"] + words + ["<mask>"])}
        self.ids_to_tokens = {i: w for w, i in self.vocab.items()}
        super().__init__(bos_token="<s>", eos_token="</s>", sep_token="</s>", cls_token="<s>", unk_token="<unk>",
                         pad_token="<pad>", mask_token="<mask>", **kwargs)

    @property
    def vocab_size(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)

    def _tokenize(self, text):
        return text.lower().split()

    def _convert_token_to_id(self, token):
        return self.vocab.get(token, self.vocab["<unk>"])

    def _convert_id_to_token(self, index):
        return self.ids_to_tokens[index]

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        if token_ids_1 is None:
            return [self.cls_token_id] + token_ids_0 + [self.sep_token_id]
        cls = [self.cls_token_id]
        sep = [self.sep_token_id]
        return cls + token_ids_0 + sep + sep + token_ids_1 + sep

    def num_special_tokens_to_add(self, pair=False):
        return 4 if pair else 2


class BaseReranker:
    """FlagEmbedding's encoder-only reranker, holding a model and tokenizer built here instead of loaded."""

    def __init__(self, model, tokenizer, batch_size: int = 128, query_max_length: Optional[int] = None,
                 max_length: int = 512, normalize: bool = False, use_fp16: bool = False, devices=None):
        self.model = model
        self.tokenizer = tokenizer
        self.batch_size = batch_size
        self.query_max_length = query_max_length
        self.max_length = max_length
        self.normalize = normalize
        self.use_fp16 = use_fp16
        self.target_devices = devices or ["cpu"]

    @torch.no_grad()
    def compute_score_single_gpu(
        self,
        sentence_pairs: Union[List[Tuple[str, str]], Tuple[str, str]],
        batch_size: Optional[int] = None,
        query_max_length: Optional[int] = None,
        max_length: Optional[int] = None,
        normalize: Optional[bool] = None,
        device: Optional[str] = None,
        **kwargs: Any
    ) -> List[float]:
        if batch_size is None: batch_size = self.batch_size
        if max_length is None: max_length = self.max_length
        if query_max_length is None:
            if self.query_max_length is not None:
                query_max_length = self.query_max_length
            else:
                query_max_length = max_length * 3 // 4
        if normalize is None: normalize = self.normalize

        if device is None:
            device = self.target_devices[0]

        if device == "cpu": self.use_fp16 = False
        if self.use_fp16: self.model.half()

        self.model.to(device)
        self.model.eval()

        assert isinstance(sentence_pairs, list)
        if isinstance(sentence_pairs[0], str):
            sentence_pairs = [sentence_pairs]

        # tokenize without padding to get the correct length
        all_inputs = []
        for start_index in range(0, len(sentence_pairs), batch_size):
            sentences_batch = sentence_pairs[start_index:start_index + batch_size]
            queries = [s[0] for s in sentences_batch]
            passages = [s[1] for s in sentences_batch]
            queries_inputs_batch = self.tokenizer(
                queries,
                return_tensors=None,
                add_special_tokens=False,
                max_length=query_max_length,
                truncation=True,
                **kwargs
            )['input_ids']
            passages_inputs_batch = self.tokenizer(
                passages,
                return_tensors=None,
                add_special_tokens=False,
                max_length=max_length,
                truncation=True,
                **kwargs
            )['input_ids']
            for q_inp, d_inp in zip(queries_inputs_batch, passages_inputs_batch):
                item = self.tokenizer.prepare_for_model(
                    q_inp,
                    d_inp,
                    truncation='only_second',
                    max_length=max_length,
                    padding=False,
                )
                all_inputs.append(item)
        # sort by length for less padding
        length_sorted_idx = np.argsort([-len(x['input_ids']) for x in all_inputs])
        all_inputs_sorted = [all_inputs[i] for i in length_sorted_idx]

        all_scores = []
        self.padded_batches = []
        for start_index in range(0, len(all_inputs_sorted), batch_size):
            sentences_batch = all_inputs_sorted[start_index:start_index + batch_size]
            inputs = self.tokenizer.pad(
                sentences_batch,
                padding=True,
                return_tensors='pt',
                **kwargs
            ).to(device)
            self.padded_batches.append(inputs)

            scores = self.model(**inputs, return_dict=True).logits.view(-1, ).float()
            all_scores.extend(scores.cpu().numpy().tolist())

        all_scores = [all_scores[idx] for idx in np.argsort(length_sorted_idx)]

        if normalize:
            all_scores = [sigmoid(score) for score in all_scores]

        return all_scores, all_inputs


words = ("what is a cat how do birds fly the small animal with whiskers purrs wings lift body air "
         "dogs bark loudly at night capital of france paris city lights river seine flows through").split()
tokenizer = TinyXLMRobertaTokenizer(words)
config = XLMRobertaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                          num_attention_heads=4, intermediate_size=64, max_position_embeddings=40,
                          type_vocab_size=1, pad_token_id=tokenizer.pad_token_id, num_labels=1,
                          initializer_range=0.3)
model = XLMRobertaForSequenceClassification(config)
reranker = BaseReranker(model, tokenizer, batch_size=3, max_length=20)

pairs = [
    ("what is a cat", "a small animal with whiskers purrs"),
    ("how do birds fly", "wings lift the body through the air"),
    ("what is a cat", "dogs bark loudly at night"),
    ("capital of france", "paris"),
    ("capital of france", "paris is a city of lights the river seine flows through the city at night "
                          "and dogs bark loudly"),
    ("how do birds fly", "birds"),
    ("what is the capital of france what is the city of lights what river flows through paris", "the seine"),
]
scores, all_inputs = reranker.compute_score_single_gpu(pairs)
probs, _ = reranker.compute_score_single_gpu(pairs, normalize=True)

lengths = [len(x["input_ids"]) for x in all_inputs]
assert max(lengths) == 20 and min(lengths) < 10, lengths
assert any((b["attention_mask"] == 0).any() for b in reranker.padded_batches)
assert max(scores) - min(scores) > 0.1, scores

# ---- reference: each pair alone, unpadded, no attention_mask ----------------------------------------
for i, item in enumerate(all_inputs):
    ids = torch.tensor([item["input_ids"]])
    assert (ids != tokenizer.pad_token_id).all()
    with torch.no_grad():
        alone = model(input_ids=ids).logits.view(-1).item()
    assert abs(scores[i] - alone) < 1e-5, (i, scores[i], alone)
    assert abs(probs[i] - sigmoid(alone)) < 1e-6

# one pair by hand: XLM-R positions start after padding_idx
ids = torch.tensor([all_inputs[3]["input_ids"]])
pos = torch.arange(ids.shape[1]).unsqueeze(0) + config.pad_token_id + 1
with torch.no_grad():
    by_hand = model(input_ids=ids, position_ids=pos).logits.view(-1).item()
assert abs(scores[3] - by_hand) < 1e-5

for q in sorted(set(p[0] for p in pairs)):
    ranked = sorted([(s, p[1]) for s, p in zip(scores, pairs) if p[0] == q], reverse=True)
    print(q, "->", [round(s, 4) for s, _ in ranked])
print("ok: length-sorted, right-padded batch scores match each (query, passage) pair run alone")
