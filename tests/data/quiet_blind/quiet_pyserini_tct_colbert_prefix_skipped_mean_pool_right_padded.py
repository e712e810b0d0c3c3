# Correct program (quiet batch quiet-r103b): pyserini's TCT-ColBERT dense encoders.
#
# Citation: castorini/pyserini @063ab4fa98ac5b32dea127845304d70decbd98f4: pyserini/encode/_tct_colbert.py
# (TctColBertDocumentEncoder.encode, TctColBertQueryEncoder.encode); pyserini/encode/_base.py
# @00f967b583325bfcc32c95ece91aa8283ade8bb9 (DocumentEncoder._mean_pooling). Read through the stored index.
#
# Documents are written as '[CLS] [D] ' + text, tokenized without special tokens and right-padded to the longest in
# the batch; the BERT backbone gets the tokenizer's attention_mask, and the embedding is the mean over the tokens
# after the 4-token prefix ([CLS] [ D ]), weighted by attention_mask[:, 4:] so the pads count for nothing.
# Queries are '[CLS] [Q] ' + query + '[MASK]' * 36 truncated to 36 tokens: every position is real (the [MASK]
# tokens are query augmentation, attended and averaged), so the embedding is a plain average over [:, 4:].
# Built from a tiny BertConfig and an in-memory word vocabulary; no download. Checks itself against each document
# encoded alone (no padding) and pooled by a loop over its real tokens.
import numpy as np
import torch
from transformers import BertConfig, BertModel, BertTokenizer


class DocumentEncoder:
    def encode(self, texts, **kwargs):
        pass

    @staticmethod
    def _mean_pooling(last_hidden_state, attention_mask):
        token_embeddings = last_hidden_state
        input_mask_expanded = attention_mask.unsqueeze(-1).expand(token_embeddings.size()).float()
        sum_embeddings = torch.sum(token_embeddings * input_mask_expanded, 1)
        sum_mask = torch.clamp(input_mask_expanded.sum(1), min=1e-9)
        return sum_embeddings / sum_mask


class QueryEncoder:
    def __init__(self, encoded_query_dir: str = None):
        self.has_model = False
        self.has_encoded_query = False

    def encode(self, query: str):
        return self.embedding[query]


class TctColBertDocumentEncoder(DocumentEncoder):
    def __init__(self, model, tokenizer, device='cpu'):
        self.device = device
        self.onnx = False
        # pyserini: BertModel.from_pretrained(model_name) / load_bert_tokenizer(model_name)
        self.model = model
        self.model.to(self.device)
        self.tokenizer = tokenizer

    def encode(self, texts, titles=None, fp16=False, max_length=512, **kwargs):
        if titles is not None:
            texts = [f'[CLS] [D] {title} {text}' for title, text in zip(titles, texts)]
        else:
            texts = ['[CLS] [D] ' + text for text in texts]
        inputs = self.tokenizer(
            texts,
            max_length=max_length,
            padding="longest",
            truncation=True,
            add_special_tokens=False,
            return_tensors='pt'
        )
        inputs.to(self.device)
        with torch.no_grad():
            outputs = self.model(**inputs)
        embeddings = self._mean_pooling(outputs["last_hidden_state"][:, 4:, :], inputs['attention_mask'][:, 4:])
        return embeddings.detach().cpu().numpy()


class TctColBertQueryEncoder(QueryEncoder):
    def __init__(self, model, tokenizer, device: str = 'cpu', **kwargs):
        super().__init__(None)
        self.device = device
        self.model = model
        self.model.to(self.device)
        self.tokenizer = tokenizer
        self.has_model = True

    def encode(self, query: str):
        if self.has_model:
            max_length = 36  # hardcode for now
            inputs = self.tokenizer(
                '[CLS] [Q] ' + query + '[MASK]' * max_length,
                max_length=max_length,
                truncation=True,
                add_special_tokens=False,
                return_tensors='pt'
            )
            inputs.to(self.device)
            outputs = self.model(**inputs)
            embeddings = outputs.last_hidden_state.detach().cpu().numpy()
            return np.average(embeddings[:, 4:, :], axis=-2).flatten()
        else:
            return super().encode(query)


WORDS = ("what is a dense retriever how does bm25 rank passages sparse lexical matching of query terms "
         "dual encoders map questions and passages to vectors compared by inner product the index stores "
         "one vector per passage title wikipedia msmarco late interaction distillation from colbert teacher").split()


def build():
    torch.manual_seed(0)
    vocab = {w: i for i, w in enumerate(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[", "]", "d", "q"])}
    for w in WORDS:
        vocab.setdefault(w, len(vocab))
    tokenizer = BertTokenizer(vocab=vocab)
    config = BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    model = BertModel(config).eval()
    return model, tokenizer


def main():
    model, tokenizer = build()
    doc_encoder = TctColBertDocumentEncoder(model, tokenizer)
    query_encoder = TctColBertQueryEncoder(model, tokenizer)

    titles = ["bm25", "dense retriever", "colbert"]
    texts = [
        "sparse lexical matching of query terms",
        "dual encoders map questions and passages to vectors compared by inner product the index stores one vector per passage",
        "late interaction",
    ]
    queries = ["what is a dense retriever", "how does bm25 rank passages"]

    # Batched, right-padded to the longest document, as pyserini's encode loop hands a batch.
    doc_emb = doc_encoder.encode(texts, titles=titles)
    doc_emb_untitled = doc_encoder.encode(texts)
    q_emb = np.stack([query_encoder.encode(q) for q in queries])

    # Reference: each document alone (no padding), mean over its tokens after the 4-token prefix.
    def reference_doc(text):
        ids = tokenizer(text, add_special_tokens=False, return_tensors='pt')['input_ids']
        with torch.no_grad():
            h = model(input_ids=ids).last_hidden_state[0]
        total = torch.zeros(h.shape[-1])
        for t in range(4, h.shape[0]):
            total += h[t]
        return (total / (h.shape[0] - 4)).numpy()

    ref = np.stack([reference_doc(f'[CLS] [D] {ti} {tx}') for ti, tx in zip(titles, texts)])
    ref_untitled = np.stack([reference_doc('[CLS] [D] ' + tx) for tx in texts])
    lens = tokenizer(['[CLS] [D] ' + tx for tx in texts], add_special_tokens=False)['input_ids']
    assert len({len(x) for x in lens}) > 1, "batch should be padded"
    np.testing.assert_allclose(doc_emb, ref, atol=1e-5, rtol=1e-4)
    np.testing.assert_allclose(doc_emb_untitled, ref_untitled, atol=1e-5, rtol=1e-4)

    # Query reference: the [MASK]-augmented query is 36 real tokens; average positions 4..35 by a loop.
    for q, e in zip(queries, q_emb):
        ids = tokenizer('[CLS] [Q] ' + q + '[MASK]' * 36, max_length=36, truncation=True,
                        add_special_tokens=False, return_tensors='pt')['input_ids']
        assert ids.shape[1] == 36
        with torch.no_grad():
            h = model(input_ids=ids).last_hidden_state[0]
        np.testing.assert_allclose(e, h[4:].mean(0).numpy(), atol=1e-5, rtol=1e-4)

    scores = q_emb @ doc_emb.T
    ref_scores = q_emb @ ref.T
    np.testing.assert_allclose(scores, ref_scores, atol=1e-4, rtol=1e-4)
    print("scores", np.round(scores, 4).tolist())
    print("ranking", np.argsort(-scores, axis=1).tolist())
    print("ok")


if __name__ == "__main__":
    main()
