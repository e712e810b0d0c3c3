"""Correct program (quiet batch quiet-r89a): ColBERTv2 training step, late interaction over padded documents.

Citation: stanford-futuredata/ColBERT @501c29d9e0b7f7b393e36c4177ec2b141a253114:
colbert/modeling/colbert.py (ColBERT.forward, compute_ib_loss, query, doc, score, mask,
colbert_score_reduce, colbert_score), colbert/modeling/tokenization/query_tokenization.py and
doc_tokenization.py (QueryTokenizer.tensorize / DocTokenizer.tensorize), colbert/modeling/tokenization/utils.py
(_insert_prefix_token), colbert/infra/config/settings.py (defaults: attend_to_mask_tokens=False,
mask_punctuation=True, nway=2, query token [unused0], doc token [unused1]).

Queries are padded to query_maxlen and their [PAD] ids replaced by [MASK] (query augmentation); with
attend_to_mask_tokens=False the [MASK] positions keep attention_mask 0 but their output vectors are scored.
Documents are padded to the longest; doc() zeroes [PAD] and punctuation vectors and returns the mask, and
colbert_score_reduce sets the masked document rows to -9999 before the MaxSim.

The BERT tokenizer is replaced by a fixed word -> id table with bert-base-uncased ids (no download).
Self-check: each document run alone, unpadded and without a mask, its punctuation dropped, scored by a double
loop (for each query vector, max over the kept document vectors, summed); the query's real positions against the
real tokens run alone; the in-batch-negative loss against the same double loop.
"""
import string

import torch
import torch.nn as nn
from transformers import BertConfig, BertModel

torch.manual_seed(0)

# bert-base-uncased ids
PAD, UNUSED0, UNUSED1, CLS, SEP, MASK = 0, 1, 2, 101, 102, 103
PUNCT_IDS = {".": 1012, ",": 1010, "?": 1029, "!": 999, "'": 1005, "-": 1011}
WORDS = ["what", "is", "the", "capital", "of", "france", "paris", "city", "river", "seine", "population",
         "who", "wrote", "hamlet", "shakespeare", "play", "english", "tragedy", "a", "in", "and", "was", "by", "on"]
VOCAB = {w: 2000 + i for i, w in enumerate(WORDS)}
VOCAB.update(PUNCT_IDS)


class ColBERTConfig:
    query_maxlen = 12
    doc_maxlen = 20
    attend_to_mask_tokens = False
    mask_punctuation = True
    nway = 2
    use_ib_negatives = True
    similarity = "cosine"
    interaction = "colbert"
    dim = 16
    total_visible_gpus = 0


class RawTokenizer:
    """Stands in for BertTokenizerFast('bert-base-uncased'): whitespace words + punctuation."""
    pad_token_id, cls_token_id, sep_token_id, mask_token_id = PAD, CLS, SEP, MASK

    def encode(self, text, add_special_tokens=False):
        out = []
        for w in text.replace("?", " ?").replace(",", " ,").replace(".", " .").split():
            out.append(VOCAB[w])
        return ([CLS] + out + [SEP]) if add_special_tokens else out

    def __call__(self, batch_text, padding, truncation, max_length):
        ids = [self.encode(t, add_special_tokens=True)[:max_length] for t in batch_text]
        ids = [x if x[-1] == SEP else x[:-1] + [SEP] for x in ids]
        L = max_length if padding == "max_length" else max(len(x) for x in ids)
        input_ids = torch.tensor([x + [PAD] * (L - len(x)) for x in ids])
        attention_mask = torch.tensor([[1] * len(x) + [0] * (L - len(x)) for x in ids])
        return {"input_ids": input_ids, "attention_mask": attention_mask}


def _insert_prefix_token(tensor: torch.Tensor, prefix_id: int):
    prefix_tensor = torch.full((tensor.size(0), 1), prefix_id, dtype=tensor.dtype, device=tensor.device)
    return torch.cat([tensor[:, :1], prefix_tensor, tensor[:, 1:]], dim=1)


class QueryTokenizer:
    def __init__(self, config):
        self.tok = RawTokenizer()
        self.config = config
        self.query_maxlen = config.query_maxlen
        self.Q_marker_token_id = UNUSED0
        self.mask_token_id = self.tok.mask_token_id
        self.pad_token_id = self.tok.pad_token_id

    def tensorize(self, batch_text):
        max_length = self.query_maxlen
        # tokenize with max_length - 1 to add the marker id afterwards
        obj = self.tok(batch_text, padding="max_length", truncation=True, max_length=(max_length - 1))
        ids = _insert_prefix_token(obj["input_ids"], self.Q_marker_token_id)
        mask = _insert_prefix_token(obj["attention_mask"], 1)
        # postprocess for the [MASK] augmentation
        ids[ids == self.pad_token_id] = self.mask_token_id
        if self.config.attend_to_mask_tokens:
            mask[ids == self.mask_token_id] = 1
        return ids, mask


class DocTokenizer:
    def __init__(self, config):
        self.tok = RawTokenizer()
        self.doc_maxlen = config.doc_maxlen
        self.D_marker_token_id = UNUSED1

    def tensorize(self, batch_text):
        obj = self.tok(batch_text, padding="longest", truncation="longest_first", max_length=(self.doc_maxlen - 1))
        ids = _insert_prefix_token(obj["input_ids"], self.D_marker_token_id)
        mask = _insert_prefix_token(obj["attention_mask"], 1)
        return ids, mask


def flatten(L):
    return [x for y in L for x in y]


class ColBERT(nn.Module):
    def __init__(self, bert_config, colbert_config):
        super().__init__()
        self.colbert_config = colbert_config
        self.raw_tokenizer = RawTokenizer()
        self.bert = BertModel(bert_config, add_pooling_layer=False)
        self.linear = nn.Linear(bert_config.hidden_size, colbert_config.dim, bias=False)
        self.device = torch.device("cpu")
        if self.colbert_config.mask_punctuation:
            self.skiplist = {w: True
                             for symbol in string.punctuation if symbol in PUNCT_IDS
                             for w in [symbol, self.raw_tokenizer.encode(symbol, add_special_tokens=False)[0]]}
        self.pad_token = self.raw_tokenizer.pad_token_id

    def forward(self, Q, D):
        Q = self.query(*Q)
        D, D_mask = self.doc(*D, keep_dims="return_mask")
        # Repeat each query encoding for every corresponding document.
        Q_duplicated = Q.repeat_interleave(self.colbert_config.nway, dim=0).contiguous()
        scores = self.score(Q_duplicated, D, D_mask)
        if self.colbert_config.use_ib_negatives:
            ib_loss = self.compute_ib_loss(Q, D, D_mask)
            return scores, ib_loss
        return scores

    def compute_ib_loss(self, Q, D, D_mask):
        scores = (D.unsqueeze(0) @ Q.permute(0, 2, 1).unsqueeze(1)).flatten(0, 1)  # query-major unsqueeze
        scores = colbert_score_reduce(scores, D_mask.repeat(Q.size(0), 1, 1), self.colbert_config)
        nway = self.colbert_config.nway
        all_except_self_negatives = [list(range(qidx * D.size(0), qidx * D.size(0) + nway * qidx + 1)) +
                                     list(range(qidx * D.size(0) + nway * (qidx + 1), qidx * D.size(0) + D.size(0)))
                                     for qidx in range(Q.size(0))]
        scores = scores[flatten(all_except_self_negatives)]
        scores = scores.view(Q.size(0), -1)
        labels = torch.arange(0, Q.size(0), device=scores.device) * (self.colbert_config.nway)
        return torch.nn.CrossEntropyLoss()(scores, labels)

    def query(self, input_ids, attention_mask):
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        Q = self.bert(input_ids, attention_mask=attention_mask)[0]
        Q = self.linear(Q)
        mask = torch.tensor(self.mask(input_ids, skiplist=[]), device=self.device).unsqueeze(2).float()
        Q = Q * mask
        return torch.nn.functional.normalize(Q, p=2, dim=2)

    def doc(self, input_ids, attention_mask, keep_dims=True):
        assert keep_dims in [True, False, "return_mask"]
        input_ids, attention_mask = input_ids.to(self.device), attention_mask.to(self.device)
        D = self.bert(input_ids, attention_mask=attention_mask)[0]
        D = self.linear(D)
        mask = torch.tensor(self.mask(input_ids, skiplist=self.skiplist), device=self.device).unsqueeze(2).float()
        D = D * mask
        D = torch.nn.functional.normalize(D, p=2, dim=2)
        if keep_dims is False:
            D, mask = D.cpu(), mask.bool().cpu().squeeze(-1)
            D = [d[mask[idx]] for idx, d in enumerate(D)]
        elif keep_dims == "return_mask":
            return D, mask.bool()
        return D

    def score(self, Q, D_padded, D_mask):
        return colbert_score(Q, D_padded, D_mask, config=self.colbert_config)

    def mask(self, input_ids, skiplist):
        mask = [[(x not in skiplist) and (x != self.pad_token) for x in d] for d in input_ids.cpu().tolist()]
        return mask


def colbert_score_reduce(scores_padded, D_mask, config):
    D_padding = ~D_mask.view(scores_padded.size(0), scores_padded.size(1)).bool()
    scores_padded[D_padding] = -9999
    scores = scores_padded.max(1).values
    assert config.interaction in ["colbert", "flipr"], config.interaction
    return scores.sum(-1)


def colbert_score(Q, D_padded, D_mask, config=ColBERTConfig()):
    assert Q.dim() == 3, Q.size()
    assert D_padded.dim() == 3, D_padded.size()
    assert Q.size(0) in [1, D_padded.size(0)]
    scores = D_padded @ Q.to(dtype=D_padded.dtype).permute(0, 2, 1)
    return colbert_score_reduce(scores, D_mask, config)


def main():
    config = ColBERTConfig()
    bert_config = BertConfig(vocab_size=2100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                             intermediate_size=64, max_position_embeddings=64, hidden_dropout_prob=0.0,
                             attention_probs_dropout_prob=0.0)
    model = ColBERT(bert_config, config).eval()
    qtok, dtok = QueryTokenizer(config), DocTokenizer(config)

    queries = ["what is the capital of france?", "who wrote hamlet?"]
    # nway = 2: a positive then a negative per query, query-major
    docs = ["paris is the capital and a city of france, on the river seine.",
            "the seine.",
            "hamlet, a tragedy by shakespeare, was a play in english.",
            "who is the population of paris?"]

    Q_ids, Q_mask = qtok.tensorize(queries)
    D_ids, D_mask_in = dtok.tensorize(docs)
    assert (Q_ids == MASK).any() and (D_mask_in == 0).any()

    with torch.no_grad():
        scores, ib_loss = model((Q_ids, Q_mask), (D_ids, D_mask_in))
        Q = model.query(Q_ids, Q_mask)

        # queries: the real positions against the real tokens run alone, without a mask
        for i in range(len(queries)):
            n = int(Q_mask[i].sum())
            assert bool(Q_mask[i, :n].all()) and not bool(Q_mask[i, n:].any())
            h = model.bert(Q_ids[i:i + 1, :n])[0]
            q_ref = torch.nn.functional.normalize(model.linear(h), p=2, dim=2)[0]
            torch.testing.assert_close(Q[i, :n], q_ref, rtol=1e-4, atol=1e-5)
            # the whole (augmented) query against itself encoded alone
            q_alone = model.query(Q_ids[i:i + 1], Q_mask[i:i + 1])[0]
            torch.testing.assert_close(Q[i], q_alone, rtol=1e-4, atol=1e-5)

        # documents: each run alone, unpadded, no mask; punctuation dropped
        D_ref = []
        for j in range(len(docs)):
            n = int(D_mask_in[j].sum())
            ids = D_ids[j, :n]
            h = model.bert(ids[None])[0][0]
            v = torch.nn.functional.normalize(model.linear(h), p=2, dim=-1)
            keep = [k for k in range(n) if int(ids[k]) not in model.skiplist]
            D_ref.append(v[keep])
        D_list = model.doc(D_ids, D_mask_in, keep_dims=False)
        for j in range(len(docs)):
            torch.testing.assert_close(D_list[j], D_ref[j], rtol=1e-4, atol=1e-5)

        def maxsim(qv, dv):
            total = 0.0
            for a in range(qv.size(0)):
                best = None
                for b in range(dv.size(0)):
                    s = float(qv[a] @ dv[b])
                    best = s if best is None else max(best, s)
                total += best
            return total

        ref_scores = torch.tensor([maxsim(Q[i // config.nway], D_ref[i]) for i in range(len(docs))])
        torch.testing.assert_close(scores, ref_scores, rtol=1e-4, atol=1e-4)

        # in-batch negatives: every query against every document but its own hard negatives
        rows, labels = [], []
        for qi in range(len(queries)):
            row = [maxsim(Q[qi], D_ref[j]) for j in range(len(docs))
                   if not (config.nway * qi < j < config.nway * (qi + 1))]
            rows.append(row)
            labels.append(config.nway * qi)
        ref_loss = torch.nn.CrossEntropyLoss()(torch.tensor(rows), torch.tensor(labels))
        torch.testing.assert_close(ib_loss, ref_loss, rtol=1e-4, atol=1e-4)

    print("scores", [round(float(s), 4) for s in scores], "ib_loss", round(float(ib_loss), 4))
    print("OK")


if __name__ == "__main__":
    main()
