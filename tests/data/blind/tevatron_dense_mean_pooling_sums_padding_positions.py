# Citation: texttron/tevatron#121 ("Fix average pooling in dense model"), fix commit 9b51e84914d4be5fa369b3df40ff4988f5e746a6,
#   merged as c56b9d7dd2e5d913c2fa05dac0a60773c90c67c6; 9b51e84^ is the code before the fix.
# Upstream: src/tevatron/retriever/modeling/dense.py (DenseModel.encode_query / encode_passage / _pooling),
#   src/tevatron/retriever/modeling/encoder.py (EncoderModel.forward: in-batch contrastive loss),
#   src/tevatron/retriever/collator.py (TrainCollator: tokenizer(...) then tokenizer.pad(padding=True,
#   pad_to_multiple_of=...), right padding).
# Bug: with pooling='mean' the representation was last_hidden_state.sum(dim=1) / attention_mask.sum(dim=1):
#   the numerator summed the encoder outputs at the padding positions too (only the divisor used the mask),
#   so each query/passage embedding depends on how much padding its batch added.
# Fix: masked_hiddens = last_hidden_state.masked_fill(~attention_mask[..., None].bool(), 0.0) before the sum.
import sys
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn
from transformers import BertConfig, BertModel

FIXED = "--fixed" in sys.argv
torch.manual_seed(0)


# ---------------------------------------------------------------- tokenizer stand-in (BERT-like, right padding)
class TinyTokenizer:
    pad_token_id = 0
    cls_token_id = 1
    sep_token_id = 2
    eos_token_id = None
    vocab_size = 60
    padding_side = "right"

    def _id(self, w):
        return 3 + (sum(ord(c) * (i + 1) for i, c in enumerate(w)) % (self.vocab_size - 3))

    def __call__(self, texts, padding=False, truncation=True, max_length=32, return_attention_mask=False,
                 return_token_type_ids=False, add_special_tokens=True):
        out = []
        for t in texts:
            ids = [self._id(w) for w in t.split()]
            if add_special_tokens:
                ids = [self.cls_token_id] + ids[: max_length - 2] + [self.sep_token_id]
            out.append(ids[:max_length])
        return {"input_ids": out}

    def pad(self, encoded, padding=True, pad_to_multiple_of=None, return_attention_mask=True, return_tensors="pt"):
        seqs = encoded["input_ids"]
        L = max(len(s) for s in seqs)
        if pad_to_multiple_of:
            L = ((L + pad_to_multiple_of - 1) // pad_to_multiple_of) * pad_to_multiple_of
        input_ids = torch.full((len(seqs), L), self.pad_token_id, dtype=torch.long)
        attention_mask = torch.zeros((len(seqs), L), dtype=torch.long)
        for i, s in enumerate(seqs):
            input_ids[i, : len(s)] = torch.tensor(s)
            attention_mask[i, : len(s)] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask}


@dataclass
class DataArguments:
    query_max_len: int = 32
    passage_max_len: int = 64
    append_eos_token: bool = False
    pad_to_multiple_of: Optional[int] = 16


# ---------------------------------------------------------------- tevatron/retriever/collator.py
@dataclass
class TrainCollator:
    data_args: DataArguments
    tokenizer: TinyTokenizer

    def __call__(self, features: List[Tuple[str, List[str]]]):
        all_queries = [f[0] for f in features]
        all_passages = []
        for f in features:
            all_passages.extend(f[1])
        q_collated = self.tokenizer(
            all_queries, padding=False, truncation=True,
            max_length=self.data_args.query_max_len - 1 if self.data_args.append_eos_token else self.data_args.query_max_len,
            return_attention_mask=False, return_token_type_ids=False, add_special_tokens=True,
        )
        d_collated = self.tokenizer(
            all_passages, padding=False, truncation=True,
            max_length=self.data_args.passage_max_len - 1 if self.data_args.append_eos_token else self.data_args.passage_max_len,
            return_attention_mask=False, return_token_type_ids=False, add_special_tokens=True,
        )
        if self.data_args.append_eos_token:
            q_collated["input_ids"] = [q + [self.tokenizer.eos_token_id] for q in q_collated["input_ids"]]
            d_collated["input_ids"] = [d + [self.tokenizer.eos_token_id] for d in d_collated["input_ids"]]
        q_collated = self.tokenizer.pad(q_collated, padding=True, pad_to_multiple_of=self.data_args.pad_to_multiple_of,
                                        return_attention_mask=True, return_tensors="pt")
        d_collated = self.tokenizer.pad(d_collated, padding=True, pad_to_multiple_of=self.data_args.pad_to_multiple_of,
                                        return_attention_mask=True, return_tensors="pt")
        return q_collated, d_collated


# ---------------------------------------------------------------- tevatron/retriever/modeling/encoder.py
@dataclass
class EncoderOutput:
    q_reps: Optional[Tensor] = None
    p_reps: Optional[Tensor] = None
    loss: Optional[Tensor] = None
    scores: Optional[Tensor] = None


class EncoderModel(nn.Module):
    def __init__(self, encoder, pooling: str = "cls", normalize: bool = False, temperature: float = 1.0):
        super().__init__()
        self.config = encoder.config
        self.encoder = encoder
        self.pooling = pooling
        self.normalize = normalize
        self.temperature = temperature
        self.cross_entropy = nn.CrossEntropyLoss(reduction="mean")
        self.is_ddp = False

    def forward(self, query: Dict[str, Tensor] = None, passage: Dict[str, Tensor] = None):
        q_reps = self.encode_query(query) if query else None
        p_reps = self.encode_passage(passage) if passage else None
        if q_reps is None or p_reps is None:
            return EncoderOutput(q_reps=q_reps, p_reps=p_reps)
        if self.training:
            scores = self.compute_similarity(q_reps, p_reps)
            scores = scores.view(q_reps.size(0), -1)
            target = torch.arange(scores.size(0), device=scores.device, dtype=torch.long)
            target = target * (p_reps.size(0) // q_reps.size(0))
            loss = self.compute_loss(scores / self.temperature, target)
        else:
            scores = self.compute_similarity(q_reps, p_reps)
            loss = None
        return EncoderOutput(loss=loss, scores=scores, q_reps=q_reps, p_reps=p_reps)

    def compute_similarity(self, q_reps, p_reps):
        return torch.matmul(q_reps, p_reps.transpose(0, 1))

    def compute_loss(self, scores, target):
        return self.cross_entropy(scores, target)


# ---------------------------------------------------------------- tevatron/retriever/modeling/dense.py
class DenseModel(EncoderModel):
    def encode_query(self, qry):
        query_hidden_states = self.encoder(**qry, return_dict=True)
        query_hidden_states = query_hidden_states.last_hidden_state
        return self._pooling(query_hidden_states, qry["attention_mask"])

    def encode_passage(self, psg):
        # encode passage is the same as encode query
        return self.encode_query(psg)

    def _pooling(self, last_hidden_state, attention_mask):
        if self.pooling in ["cls", "first"]:
            reps = last_hidden_state[:, 0]
        elif self.pooling in ["mean", "avg", "average"]:
            if not FIXED:
                reps = last_hidden_state.sum(dim=1) / attention_mask.sum(dim=1)[..., None]
            else:
                masked_hiddens = last_hidden_state.masked_fill(~attention_mask[..., None].bool(), 0.0)
                reps = masked_hiddens.sum(dim=1) / attention_mask.sum(dim=1)[..., None]
        elif self.pooling in ["last", "eos"]:
            sequence_lengths = attention_mask.sum(dim=1) - 1
            batch_size = last_hidden_state.shape[0]
            reps = last_hidden_state[torch.arange(batch_size, device=last_hidden_state.device), sequence_lengths]
        else:
            raise ValueError(f"unknown pooling method: {self.pooling}")
        if self.normalize:
            reps = torch.nn.functional.normalize(reps, p=2, dim=-1)
        return reps


def main():
    tok = TinyTokenizer()
    cfg = BertConfig(
        vocab_size=tok.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, pad_token_id=0,
    )
    encoder = BertModel(cfg, add_pooling_layer=False)
    model = DenseModel(encoder, pooling="mean", normalize=True, temperature=0.05)
    optim = torch.optim.AdamW(model.parameters(), lr=5e-4)

    # (query, [positive, hard negative]) as tevatron's TrainDataset yields them (train_group_size=2)
    features = [
        ("what is the capital of france", ["paris is the capital and most populous city of france", "lyon"]),
        ("who wrote hamlet", ["hamlet", "macbeth is a tragedy by william shakespeare first performed in 1606"]),
        ("boiling point of water at sea level", ["water boils at one hundred degrees celsius", "ice melts at zero"]),
        ("largest planet", ["jupiter is the largest planet in the solar system by far", "mars"]),
    ]
    collator = TrainCollator(DataArguments(), tok)
    q, p = collator(features)
    print("query mask row lengths:", q["attention_mask"].sum(1).tolist(), "padded to", q["input_ids"].shape[1])
    print("passage mask row lengths:", p["attention_mask"].sum(1).tolist(), "padded to", p["input_ids"].shape[1])

    model.train()
    for step in range(3):
        out = model(query=q, passage=p)
        optim.zero_grad()
        out.loss.backward()
        optim.step()
        print(f"step {step}: loss = {out.loss.item():.6f}")

    model.eval()
    with torch.no_grad():
        out = model(query=q, passage=p)
    print("scores (queries x passages):")
    print(out.scores.round(decimals=4))
    print("top passage per query:", out.scores.argmax(dim=1).tolist())


if __name__ == "__main__":
    main()
