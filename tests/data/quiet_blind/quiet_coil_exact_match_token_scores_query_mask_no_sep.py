# Correct program (quiet batch quiet-r81a).
# Ported from luyug/COIL @015ec014f027063da0744b5a147fcc4d09e50f7c:
#   modeling.py (COIL.forward: the HF encoder run on qry_input / doc_input with their attention masks, cls_proj of
#     [CLS], tok_proj of every token; mask_sep (no_sep) zeroing the query's [SEP] at attention_mask.sum(1) - 1 in
#     place after the encoder ran; compute_tok_score_pair (eval, Q == D) and compute_tok_score_cart (training, every
#     query against every passage of the group batch): exact lexical match of input ids times the token dot products,
#     max over the passage tokens, then `(tok_scores * qry_attention_mask)[:, 1:].sum(...)` dropping the query's
#     padding and [CLS]; cls score added; CE with labels arange(Q) * train_group_size),
#   arguments.py (ModelArguments: token_dim, cls_dim, pooling='max', no_sep, no_cls, cls_only, relu, ...;
#     DataArguments.train_group_size).
# The encoder is a tiny transformers BertModel from a BertConfig (hidden 768 because COIL's projections are written
# nn.Linear(768, ...); one layer, dropout 0). Queries and passages are right-padded with id 0 as the HF tokenizer's
# padding=max_length does; a passage's pads are kept out of the score by the ids (a real query token never equals 0)
# and the query's pads, [CLS] and [SEP] by qry_attention_mask.
# Self-check: every query and passage alone, unpadded, through the encoder with no mask, and the scores written as a
# double loop over query tokens (1 .. len-2) and passage tokens with equal ids; the eval pair scores, the training
# score matrix and the loss must match.
import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Dict

import torch
from torch import nn
from torch import Tensor
from transformers import BertConfig, BertModel, PreTrainedModel
from transformers.modeling_outputs import BaseModelOutputWithPooling

logger = logging.getLogger(__name__)


# --- arguments.py (trimmed) ---
@dataclass
class ModelArguments:
    model_name_or_path: str = field(default=None)
    token_dim: int = field(default=768)
    cls_dim: int = field(default=768)
    relu: bool = field(default=False, )
    token_norm_after: bool = field(default=False)
    cls_norm_after: bool = field(default=False)
    x_device_negatives: bool = field(default=False)
    pooling: str = field(default='max')
    no_sep: bool = field(default=False, )
    no_cls: bool = field(default=False, )
    cls_only: bool = field(default=False, )


@dataclass
class DataArguments:
    train_group_size: int = field(default=8)
    q_max_len: int = field(default=128)
    p_max_len: int = field(default=128)


# --- modeling.py ---
class COIL(nn.Module):
    def __init__(self, model: PreTrainedModel, model_args: ModelArguments, data_args: DataArguments, train_args):
        super().__init__()
        self.model: PreTrainedModel = model
        self.cross_entropy = nn.CrossEntropyLoss(reduction='mean')
        self.data_args, self.model_args, self.train_args = data_args, model_args, train_args
        self.tok_proj = nn.Linear(768, model_args.token_dim)
        self.cls_proj = nn.Linear(768, model_args.cls_dim)

        if model_args.token_norm_after:
            self.ln_tok = nn.LayerNorm(model_args.token_dim)
        if model_args.cls_norm_after:
            self.ln_cls = nn.LayerNorm(model_args.cls_dim)

    def encode(self, **features):
        assert all([x in features for x in ['input_ids', 'attention_mask', 'token_type_ids']])
        model_out: BaseModelOutputWithPooling = self.model(**features, return_dict=True)
        cls = self.cls_proj(model_out.last_hidden_state[:, 0])
        reps = self.tok_proj(model_out.last_hidden_state)
        if self.model_args.cls_norm_after:
            cls = self.ln_cls(cls)
        if self.model_args.token_norm_after:
            reps = self.ln_tok(reps)
        return cls, reps

    def forward(self, qry_input: Dict, doc_input: Dict):
        qry_out: BaseModelOutputWithPooling = self.model(**qry_input, return_dict=True)
        doc_out: BaseModelOutputWithPooling = self.model(**doc_input, return_dict=True)

        qry_cls = self.cls_proj(qry_out.last_hidden_state[:, 0])
        doc_cls = self.cls_proj(doc_out.last_hidden_state[:, 0])

        qry_reps = self.tok_proj(qry_out.last_hidden_state)  # Q * LQ * d
        doc_reps = self.tok_proj(doc_out.last_hidden_state)  # D * LD * d

        if self.model_args.cls_norm_after:
            qry_cls, doc_cls = self.ln_cls(qry_cls), self.ln_cls(doc_cls)
        if self.model_args.token_norm_after:
            qry_reps, doc_reps = self.ln_tok(qry_reps), self.ln_tok(doc_reps)

        if self.model_args.relu:
            qry_reps = nn.ReLU()(qry_reps)
            doc_reps = nn.ReLU()(doc_reps)

        # mask ingredients
        doc_input_ids: Tensor = doc_input['input_ids']
        qry_input_ids: Tensor = qry_input['input_ids']
        qry_attention_mask: Tensor = qry_input['attention_mask']

        self.mask_sep(qry_attention_mask)

        if not self.training:
            # in testing phase, we have Q == D
            assert doc_input_ids.size(0) == qry_input_ids.size(0), \
                'we expect same number of query/doc'
            tok_scores = self.compute_tok_score_pair(
                doc_reps, doc_input_ids,
                qry_reps, qry_input_ids, qry_attention_mask
            )
            cls_scores = (qry_cls * doc_cls).sum(-1)
            if self.model_args.no_cls:
                scores = tok_scores
            elif self.model_args.cls_only:
                scores = cls_scores
            else:
                scores = tok_scores + cls_scores  # B
            return scores.view(-1)

        else:
            # for training phase, we have D = Q * group_size
            tok_scores = self.compute_tok_score_cart(
                doc_reps, doc_input_ids,
                qry_reps, qry_input_ids, qry_attention_mask
            )
            if self.model_args.no_cls:
                scores = tok_scores
            elif self.model_args.cls_only:
                scores = torch.matmul(qry_cls, doc_cls.transpose(1, 0))  # Q * D
            else:
                cls_scores = torch.matmul(qry_cls, doc_cls.transpose(1, 0))  # Q * D
                scores = tok_scores.float() + cls_scores.float()  # Q * D

            labels = torch.arange(
                scores.size(0),
                device=doc_input['input_ids'].device,
                dtype=torch.long
            )
            # offset the labels
            labels = labels * self.data_args.train_group_size
            loss = self.cross_entropy(scores, labels)
            return loss, scores.view(-1)

    def mask_sep(self, qry_attention_mask):
        if self.model_args.no_sep:
            sep_pos = qry_attention_mask.sum(1).unsqueeze(1) - 1  # the sep token position
            _zeros = torch.zeros_like(sep_pos)
            qry_attention_mask.scatter_(1, sep_pos.long(), _zeros)
        return qry_attention_mask

    def compute_tok_score_pair(self, doc_reps, doc_input_ids, qry_reps, qry_input_ids, qry_attention_mask):
        exact_match = qry_input_ids.unsqueeze(2) == doc_input_ids.unsqueeze(1)  # B * LQ * LD
        exact_match = exact_match.float()
        scores_no_masking = torch.bmm(qry_reps, doc_reps.permute(0, 2, 1))  # B * LQ * LD
        if self.model_args.pooling == 'max':
            tok_scores, _ = (scores_no_masking * exact_match).max(dim=2)  # B * LQ
        else:
            raise NotImplementedError(f'{self.model_args.pooling} pooling is not defined')
        # remove padding and cls token
        tok_scores = (tok_scores * qry_attention_mask)[:, 1:].sum(-1)
        return tok_scores

    def compute_tok_score_cart(self, doc_reps, doc_input_ids, qry_reps, qry_input_ids, qry_attention_mask):
        qry_input_ids = qry_input_ids.unsqueeze(2).unsqueeze(3)  # Q * LQ * 1 * 1
        doc_input_ids = doc_input_ids.unsqueeze(0).unsqueeze(1)  # 1 * 1 * D * LD
        exact_match = doc_input_ids == qry_input_ids  # Q * LQ * D * LD
        exact_match = exact_match.float()
        scores_no_masking = torch.matmul(
            qry_reps.view(-1, self.model_args.token_dim),  # (Q * LQ) * d
            doc_reps.view(-1, self.model_args.token_dim).transpose(0, 1)  # d * (D * LD)
        )
        scores_no_masking = scores_no_masking.view(
            *qry_reps.shape[:2], *doc_reps.shape[:2])  # Q * LQ * D * LD
        if self.model_args.pooling == 'max':
            scores, _ = (scores_no_masking * exact_match).max(dim=3)  # Q * LQ * D
        else:
            raise NotImplementedError(f'{self.model_args.pooling} pooling is not defined')

        tok_scores = (scores * qry_attention_mask.unsqueeze(2))[:, 1:].sum(1)
        return tok_scores


# --- a tokenizer's padding=max_length output, written by hand ---
PAD, CLS, SEP = 0, 1, 2


def tensorize(seqs, max_len):
    ids = torch.zeros(len(seqs), max_len, dtype=torch.long)  # pad id 0, right padding
    mask = torch.zeros(len(seqs), max_len, dtype=torch.long)
    for i, s in enumerate(seqs):
        toks = [CLS] + s + [SEP]
        ids[i, :len(toks)] = torch.tensor(toks)
        mask[i, :len(toks)] = 1
    return {'input_ids': ids, 'attention_mask': mask, 'token_type_ids': torch.zeros_like(ids)}


def reference_scores(coil, qry_seqs, doc_seqs):
    """Each text alone, unpadded, no mask; the COIL score as a double loop."""
    def alone(s):
        ids = torch.tensor([[CLS] + s + [SEP]])
        out = coil.model(input_ids=ids, token_type_ids=torch.zeros_like(ids), return_dict=True)
        h = out.last_hidden_state[0]
        return ids[0], coil.cls_proj(h[0]), coil.tok_proj(h)

    qs = [alone(s) for s in qry_seqs]
    ds = [alone(s) for s in doc_seqs]
    scores = torch.zeros(len(qs), len(ds))
    for a, (q_ids, q_cls, q_reps) in enumerate(qs):
        for b, (d_ids, d_cls, d_reps) in enumerate(ds):
            total = (q_cls * d_cls).sum()
            for i in range(1, len(q_ids) - 1):  # neither [CLS] nor [SEP] (no_sep)
                best = max(float(q_reps[i] @ d_reps[j]) if int(q_ids[i]) == int(d_ids[j]) else 0.0
                           for j in range(len(d_ids)))
                total = total + best
            scores[a, b] = total
    return scores


def main():
    torch.manual_seed(0)
    config = BertConfig(vocab_size=40, hidden_size=768, num_hidden_layers=1, num_attention_heads=12,
                        intermediate_size=64, max_position_embeddings=32, hidden_dropout_prob=0.0,
                        attention_probs_dropout_prob=0.0)
    hf_model = BertModel(config)
    model_args = ModelArguments(token_dim=16, cls_dim=16, no_sep=True)
    data_args = DataArguments(train_group_size=2, q_max_len=8, p_max_len=12)
    train_args = SimpleNamespace(fp16=False, local_rank=-1)
    coil = COIL(hf_model, model_args, data_args, train_args)

    qry_seqs = [[5, 9, 7], [12, 5], [20, 21, 9, 22, 12]]
    doc_seqs = [[7, 5, 30, 9, 9, 11], [12, 33, 5],                 # group of query 0
                [5, 14, 12, 12, 15, 16, 17, 18], [31, 32],         # group of query 1
                [22, 9, 20], [21, 21, 25, 26, 12, 27]]             # group of query 2

    with torch.no_grad():
        ref = reference_scores(coil, qry_seqs, doc_seqs)

        # training phase: every query against the whole group batch
        coil.train()
        qry_input = tensorize(qry_seqs, data_args.q_max_len)
        doc_input = tensorize(doc_seqs, data_args.p_max_len)
        loss, scores = coil(qry_input, doc_input)
        scores = scores.view(len(qry_seqs), len(doc_seqs))
        assert torch.allclose(scores, ref, atol=1e-4), (scores, ref)
        labels = torch.arange(len(qry_seqs)) * data_args.train_group_size
        ref_loss = torch.nn.functional.cross_entropy(ref, labels)
        assert torch.allclose(loss, ref_loss, atol=1e-5), (loss, ref_loss)

        # testing phase: query i against passage i (Q == D)
        coil.eval()
        pair_docs = [doc_seqs[2 * i + 1] for i in range(len(qry_seqs))]
        qry_input = tensorize(qry_seqs, data_args.q_max_len)
        doc_input = tensorize(pair_docs, data_args.p_max_len)
        pair_scores = coil(qry_input, doc_input)
        ref_pair = torch.stack([ref[i, 2 * i + 1] for i in range(len(qry_seqs))])
        assert torch.allclose(pair_scores, ref_pair, atol=1e-4), (pair_scores, ref_pair)

    print(f"ok: {len(qry_seqs)}x{len(doc_seqs)} training scores, {len(qry_seqs)} pair scores and the loss "
          f"({loss.item():.4f}) match the unpadded double loop")


if __name__ == '__main__':
    main()
