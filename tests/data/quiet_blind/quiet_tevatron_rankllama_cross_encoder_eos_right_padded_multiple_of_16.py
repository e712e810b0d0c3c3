# Correct program (quiet batch quiet-r103b): tevatron's RankLLaMA cross-encoder reranker.
#
# Citation: texttron/tevatron src/tevatron/reranker/collator.py @0b804c1fe6d08b786ceb01129cede0691b48e02f
# (RerankerTrainCollator, RerankerInferenceCollator), src/tevatron/reranker/modeling.py
# @0d49039acb6b812b1372594f28d9042e113e41c4 (RerankerModel.forward), src/tevatron/reranker/dataset.py and
# driver/rerank.py @13512028dbbba0aa731986b93d3fb57eef633804 (format_pair; pad_token_id 0, padding_side 'right'),
# driver/train.py @0b804c1f (pad_token_id = unk). DataArguments.pad_to_multiple_of defaults to 16 there.
# Read through the stored index.
#
# Each (query, passage) pair is one string 'query: q document: title text', tokenized with BOS and no padding,
# an EOS appended by hand (append_eos_token), then tokenizer.pad(...) pads right to a multiple of 16 and builds
# the attention_mask. LlamaForSequenceClassification (num_labels=1, config.pad_token_id = the pad id) runs causally
# with that mask and reads the score at each row's last non-pad token, the appended EOS. Training groups one
# positive and the negatives per query and takes cross entropy with the positive at index 0.
# Tiny LlamaConfig and an in-memory word tokenizer (transformers' PreTrainedTokenizer) stand in for the 7B
# checkpoint; no download. Checks itself against each pair scored alone, unpadded, from its last position.
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import nn, Tensor
from transformers import LlamaConfig, LlamaForSequenceClassification, PreTrainedModel, PreTrainedTokenizer
from transformers.utils import ModelOutput


@dataclass
class DataArguments:
    query_prefix: str = 'query:'
    passage_prefix: str = 'document:'
    rerank_max_len: int = 24
    append_eos_token: bool = True
    pad_to_multiple_of: Optional[int] = 16


def format_pair(query: str, passage: str, title: str, query_prefix: str, passage_prefix: str):
    title = title.replace('-', ' ').strip()
    return f'{query_prefix} {query} {passage_prefix} {title} {passage}'.strip()


@dataclass
class RerankerTrainCollator:
    data_args: DataArguments
    tokenizer: PreTrainedTokenizer

    def __call__(self, features: List[List[str]]):
        all_pairs = []
        for pairs in features:
            all_pairs.extend(pairs)

        tokenized_pairs = self.tokenizer(
            all_pairs,
            padding=False,
            truncation=True,
            max_length=(
                self.data_args.rerank_max_len - 1
                if self.data_args.append_eos_token
                else self.data_args.rerank_max_len
            ),
            return_attention_mask=False,
            return_token_type_ids=False,
            add_special_tokens=True,
        )

        if self.data_args.append_eos_token:
            tokenized_pairs["input_ids"] = [
                p + [self.tokenizer.eos_token_id] for p in tokenized_pairs["input_ids"]
            ]

        pairs_collated = self.tokenizer.pad(
            tokenized_pairs,
            padding=True,
            pad_to_multiple_of=self.data_args.pad_to_multiple_of,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return pairs_collated


@dataclass
class RerankerInferenceCollator:
    data_args: DataArguments
    tokenizer: PreTrainedTokenizer

    def __call__(self, features: List[Tuple[str, str, str]]):
        query_ids = [x[0] for x in features]
        text_ids = [x[1] for x in features]
        pairs = [x[2] for x in features]
        collated_pairs = self.tokenizer(
            pairs,
            padding=False,
            truncation=True,
            max_length=(
                self.data_args.rerank_max_len - 1
                if self.data_args.append_eos_token
                else self.data_args.rerank_max_len
            ),
            return_attention_mask=False,
            return_token_type_ids=False,
            add_special_tokens=True,
        )
        if self.data_args.append_eos_token:
            collated_pairs["input_ids"] = [
                x + [self.tokenizer.eos_token_id] for x in collated_pairs["input_ids"]
            ]
        collated_pairs = self.tokenizer.pad(
            collated_pairs,
            padding=True,
            pad_to_multiple_of=self.data_args.pad_to_multiple_of,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return query_ids, text_ids, collated_pairs


@dataclass
class RerankerOutput(ModelOutput):
    loss: Optional[Tensor] = None
    scores: Optional[Tensor] = None


class RerankerModel(nn.Module):
    TRANSFORMER_CLS = LlamaForSequenceClassification

    def __init__(self, hf_model: PreTrainedModel, train_batch_size: int = None):
        super().__init__()
        self.hf_model = hf_model
        self.train_batch_size = train_batch_size
        self.cross_entropy = nn.CrossEntropyLoss(reduction='mean')
        if train_batch_size:
            self.register_buffer(
                'target_label',
                torch.zeros(self.train_batch_size, dtype=torch.long)
            )

    def forward(self, pair: Dict[str, Tensor] = None):
        ranker_logits = self.hf_model(**pair, return_dict=True).logits
        if self.train_batch_size:
            grouped_logits = ranker_logits.view(self.train_batch_size, -1)
            loss = self.cross_entropy(grouped_logits, self.target_label)
            return RerankerOutput(
                loss=loss,
                scores=ranker_logits
            )

        return RerankerOutput(
            loss=None,
            scores=ranker_logits
        )


class WordTokenizer(PreTrainedTokenizer):
    """Whitespace word tokenizer with LLaMA's special tokens (<unk>=0, <s>=1, </s>=2; BOS prepended)."""
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, words, **kwargs):
        self.vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
        for w in words:
            self.vocab.setdefault(w, len(self.vocab))
        self.ids_to_tokens = {i: w for w, i in self.vocab.items()}
        super().__init__(unk_token="<unk>", bos_token="<s>", eos_token="</s>", **kwargs)

    @property
    def vocab_size(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)

    def _tokenize(self, text):
        return text.lower().split()

    def _convert_token_to_id(self, token):
        return self.vocab.get(token, 0)

    def _convert_id_to_token(self, index):
        return self.ids_to_tokens[index]

    def build_inputs_with_special_tokens(self, token_ids_0, token_ids_1=None):
        return [self.bos_token_id] + token_ids_0 + (token_ids_1 or [])


CORPUS = {
    "q1": ("what is a dense retriever", [
        ("d1", "dense retrieval", "dual encoders map questions and passages to vectors compared by inner product"),
        ("d2", "bm25", "sparse lexical matching of query terms"),
        ("d3", "llama", "a decoder"),
    ]),
    "q2": ("how does bm25 rank passages", [
        ("d2", "bm25", "sparse lexical matching of query terms with term frequency saturation and length normalisation"),
        ("d4", "colbert", "late interaction"),
        ("d1", "dense-retrieval", "dual encoders"),
    ]),
}


def main():
    torch.manual_seed(0)
    data_args = DataArguments()
    words = set("query: document:".split())
    for q, docs in CORPUS.values():
        words.update(q.split())
        for _, title, text in docs:
            words.update(title.replace('-', ' ').split())
            words.update(text.split())
    tokenizer = WordTokenizer(sorted(words))
    # driver/rerank.py
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = 0
    tokenizer.padding_side = 'right'

    config = LlamaConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, num_labels=1, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=1, eos_token_id=2)
    hf_model = LlamaForSequenceClassification(config).eval()

    # Inference: RerankerInferenceDataset rows (query_id, docid, formatted pair), one batch.
    features = []
    for qid, (query, docs) in CORPUS.items():
        for docid, title, text in docs:
            features.append((qid, docid, format_pair(query, text, title, data_args.query_prefix,
                                                     data_args.passage_prefix)))
    collator = RerankerInferenceCollator(data_args=data_args, tokenizer=tokenizer)
    query_ids, text_ids, batch = collator(features)
    assert batch["input_ids"].shape[1] % 16 == 0
    lengths = batch["attention_mask"].sum(1)
    assert len(set(lengths.tolist())) > 1

    model = RerankerModel(hf_model=hf_model)
    model.eval()
    with torch.no_grad():
        scores = model(batch).scores
    all_results = {}
    for i in range(len(scores)):
        all_results.setdefault(query_ids[i], []).append((text_ids[i], float(scores[i][0])))

    # Reference: each pair alone, no padding, no attention_mask, score read at its last position (the EOS).
    ref = []
    for _, _, pair in features:
        ids = tokenizer(pair, truncation=True, max_length=data_args.rerank_max_len - 1,
                        add_special_tokens=True)["input_ids"] + [tokenizer.eos_token_id]
        with torch.no_grad():
            h = hf_model.model(input_ids=torch.tensor([ids])).last_hidden_state
            ref.append(hf_model.score(h[0, -1]).item())
    ref = torch.tensor(ref)
    torch.testing.assert_close(scores[:, 0], ref, atol=1e-5, rtol=1e-4)
    for i in range(len(features)):
        assert batch["input_ids"][i, lengths[i] - 1].item() == tokenizer.eos_token_id

    # Training: groups of (positive, negatives) per query, positive first.
    train_features = []
    for qid, (query, docs) in CORPUS.items():
        train_features.append([format_pair(query, text, title, data_args.query_prefix, data_args.passage_prefix)
                               for _, title, text in docs])
    train_batch = RerankerTrainCollator(data_args, tokenizer)(train_features)
    train_model = RerankerModel(hf_model=hf_model, train_batch_size=len(train_features))
    with torch.no_grad():
        out = train_model(train_batch)
    ref_loss = nn.functional.cross_entropy(ref.view(len(train_features), -1),
                                           torch.zeros(len(train_features), dtype=torch.long))
    torch.testing.assert_close(out.loss, ref_loss, atol=1e-5, rtol=1e-4)

    for qid in all_results:
        ranked = sorted(all_results[qid], key=lambda x: x[1], reverse=True)
        print(qid, [(d, round(s, 4)) for d, s in ranked])
    print("loss", round(out.loss.item(), 5))
    print("ok")


if __name__ == "__main__":
    main()
