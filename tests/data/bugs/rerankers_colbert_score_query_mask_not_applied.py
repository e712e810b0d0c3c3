# AnswerDotAI/rerankers #75 / PR #76: ColBERTRanker._colbert_score (MaxSim late interaction).
# The [MASK]-augmented query positions (attention_mask 0) were summed into the score but the sum was divided
# by q_mask.sum(), so scores are inflated; the fix multiplies the per-token MaxSim by the query mask first.
import sys
from math import ceil

import torch
import torch.nn as nn
from transformers import BertConfig, BertModel, BertPreTrainedModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


def _insert_token(output, insert_token_id, insert_position=1, token_type_id=0, attention_value=1):
    updated_output = {}
    for key in output:
        updated_tensor_list = []
        for seqs in output[key]:
            if len(seqs.shape) == 1:
                seqs = seqs.unsqueeze(0)
            for seq in seqs:
                first_part = seq[:insert_position]
                second_part = seq[insert_position:]
                new_element = (torch.tensor([insert_token_id]) if key == "input_ids" else torch.tensor([token_type_id]))
                if key == "attention_mask":
                    new_element = torch.tensor([attention_value])
                updated_seq = torch.cat((first_part, new_element, second_part), dim=0)
                updated_tensor_list.append(updated_seq)
        updated_output[key] = torch.stack(updated_tensor_list)
    return updated_output


def _colbert_score(q_reps, p_reps, q_mask: torch.Tensor, p_mask: torch.Tensor):
    # base code from FlagEmbedding BGE_M3/modeling.py
    assert q_reps.shape[1] >= q_mask.shape[1]
    token_scores = torch.einsum("qin,pjn->qipj", q_reps, p_reps)
    token_scores = token_scores.masked_fill(p_mask.unsqueeze(0).unsqueeze(0) == 0, -1e4)
    scores, _ = token_scores.max(-1)
    if FIXED:
        scores = scores * q_mask.unsqueeze(-1)
    scores = scores.sum(1) / q_mask.sum(-1, keepdim=True)
    return scores


class ColBERTModel(BertPreTrainedModel):
    def __init__(self, config):
        super().__init__(config)
        self.bert = BertModel(config)
        self.linear = nn.Linear(config.hidden_size, 32, bias=False)
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, token_type_ids=None):
        outputs = self.bert(input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids,
                            output_hidden_states=True)
        return self.linear(outputs[0])


class TinyBertTokenizer:
    """Stand-in for the checkpoint's BertTokenizerFast: words are already ids; right padding."""
    pad_token_id, cls_token_id, sep_token_id, mask_token_id = 0, 1, 2, 3

    def __call__(self, texts, return_tensors="pt", padding=True, max_length=None, truncation=True):
        seqs = [[self.cls_token_id] + t[: max_length - 2] + [self.sep_token_id] for t in texts]
        L = max(len(s) for s in seqs)
        ids = torch.tensor([s + [self.pad_token_id] * (L - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (L - len(s)) for s in seqs])
        return {"input_ids": ids, "token_type_ids": torch.zeros_like(ids), "attention_mask": mask}


class ColBERTRanker:
    def __init__(self):
        self.tokenizer = TinyBertTokenizer()
        config = BertConfig(vocab_size=60, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                            intermediate_size=128, max_position_embeddings=64)
        self.model = ColBERTModel(config).eval()
        self.device = "cpu"
        self.batch_size = 32
        self.query_max_length = 32
        self.doc_max_length = config.max_position_embeddings - 2
        self.query_token_id = 4      # [unused0]
        self.document_token_id = 5   # [unused1]
        self.normalize = True

    @torch.inference_mode()
    def _colbert_rank(self, query, docs):
        query_encoding = self._query_encode([query])
        documents_encoding = self._document_encode(docs)
        query_embeddings = self._to_embs(query_encoding)
        document_embeddings = self._to_embs(documents_encoding)
        return _colbert_score(query_embeddings, document_embeddings, query_encoding["attention_mask"],
                              documents_encoding["attention_mask"]).cpu().tolist()[0]

    def _query_encode(self, query):
        return self._encode(query, self.query_token_id, max_length=self.doc_max_length, is_query=True)

    def _document_encode(self, documents):
        max_length = max(len(d) + 2 for d in documents)
        max_length = ceil(max_length / 32) * 32
        max_length = max(max_length, self.query_max_length)
        max_length = int(min(max_length, self.doc_max_length))
        return self._encode(documents, self.document_token_id, max_length)

    def _encode(self, texts, insert_token_id, max_length, is_query=False):
        encoding = self.tokenizer(texts, return_tensors="pt", padding=True, max_length=max_length - 1, truncation=True)
        encoding = _insert_token(encoding, insert_token_id)
        if is_query:
            mask_token_id = self.tokenizer.mask_token_id
            new_encodings = {"input_ids": [], "attention_mask": []}
            for i, input_ids in enumerate(encoding["input_ids"]):
                original_length = (input_ids != self.tokenizer.pad_token_id).sum().item()
                if original_length % 16 <= 8:
                    QLEN = original_length + 8
                else:
                    QLEN = ceil(original_length / 16) * 16
                if original_length < QLEN:
                    pad_length = QLEN - original_length
                    padded_input_ids = input_ids.tolist() + [mask_token_id] * pad_length
                    padded_attention_mask = encoding["attention_mask"][i].tolist() + [0] * pad_length
                else:
                    padded_input_ids = input_ids[:QLEN].tolist()
                    padded_attention_mask = encoding["attention_mask"][i][:QLEN].tolist()
                new_encodings["input_ids"].append(padded_input_ids)
                new_encodings["attention_mask"].append(padded_attention_mask)
            encoding = {k: torch.tensor(v, device=self.device) for k, v in new_encodings.items()}
        return {key: value.to(self.device) for key, value in encoding.items()}

    def _to_embs(self, encoding):
        with torch.inference_mode():
            batched = []
            for i in range(0, encoding["input_ids"].size(0), self.batch_size):
                batched.append(self.model(**{k: v[i:i + self.batch_size] for k, v in encoding.items()}))
            embs = torch.cat(batched, dim=0)
        if self.normalize:
            embs = embs / embs.norm(dim=-1, keepdim=True)
        return embs


ranker = ColBERTRanker()
g = torch.Generator().manual_seed(1)
query = torch.randint(6, 60, (3,), generator=g).tolist()
docs = [torch.randint(6, 60, (n,), generator=g).tolist() for n in (9, 20, 4)]
scores = torch.tensor(ranker._colbert_rank(query, docs))

# reference: average MaxSim over the real (attended) query tokens only, as in the ColBERT paper / stanford ColBERT
qe = ranker._query_encode([query]); de = ranker._document_encode(docs)
Q = ranker._to_embs(qe)[0][qe["attention_mask"][0].bool()]
ref = []
for j in range(len(docs)):
    D = ranker._to_embs(de)[j][de["attention_mask"][j].bool()]
    ref.append((Q @ D.T).max(-1).values.mean().item())
ref = torch.tensor(ref)
print(f"scores {scores.tolist()}; max |score - masked-mean MaxSim| = {(scores - ref).abs().max().item():.6f}")
